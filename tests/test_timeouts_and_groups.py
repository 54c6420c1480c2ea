"""Waits bounded by the per-call ``timeout_s`` (not the process group's), a dead peer reported as
``PeerTimeoutError``, per-group merger caches with subgroups, and env overrides under "auto"."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm import PeerTimeoutError, dcp


def _rank1_absent_from_merge(rank, world_size, budget):
    # The process group's own timeout is 60 s (conftest); the call's budget is much smaller.
    if rank == 1:
        time.sleep(budget + 6)
        return None
    t0 = time.monotonic()
    try:
        dcp.merge(torch.randn(3, 2 * world_size, 8), torch.randn(3, 2 * world_size),
                  timeout_s=budget)
    except PeerTimeoutError as exc:
        return ("PeerTimeoutError", exc.peer_ranks, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (type(exc).__name__, str(exc), time.monotonic() - t0)
    return ("no error", None, time.monotonic() - t0)


@pytest.mark.slow
def test_call_timeout_bounds_the_argument_check():
    budget = 2.0
    kind, peers, waited = attncomm.launch(_rank1_absent_from_merge, 2, args=(budget,),
                                          timeout_s=120)[0]
    assert kind == "PeerTimeoutError", (kind, peers)
    assert peers == [1]
    assert waited < budget + 3, f"waited {waited:.1f} s for a {budget} s budget"


def _rank1_dies(rank, world_size):
    if rank == 1:
        dist.destroy_process_group()  # its connections close: a dead peer, seen from rank 0
        # Past rank 0's budget: launch stops a rank that still waits on a peer whose function
        # returned, and this test is about rank 0's own error.
        time.sleep(12)
        return None
    time.sleep(0.5)
    try:
        dcp.merge(torch.randn(3, 2 * world_size, 8), torch.randn(3, 2 * world_size),
                  validate=False, backend="ag_rs", timeout_s=4)
    except PeerTimeoutError as exc:
        return ("PeerTimeoutError", exc.peer_ranks)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return (type(exc).__name__, str(exc))
    return ("no error", None)


@pytest.mark.slow
def test_dead_peer_raises_peer_timeout_error():
    kind, detail = attncomm.launch(_rank1_dies, 2, timeout_s=120)[0]
    assert kind == "PeerTimeoutError", (kind, detail)
    assert detail == [1]


def _subgroup_merges(rank, world_size, seed):
    """World merges around many subgroup merges: each group's merger cache must evict alike on
    its own members, whatever the other groups do."""
    g01 = dist.new_group([0, 1], backend="gloo")
    g23 = dist.new_group([2, 3], backend="gloo")
    torch.manual_seed(seed + rank)
    H, D = 4, 8
    dcp.merge(torch.randn(5, H, D), torch.randn(5, H), backend="auto")
    mine = g01 if rank < 2 else g23
    shapes = 11 if rank < 2 else 2  # 11 distinct entries > the 8 a group's cache holds
    for i in range(shapes):
        T = 16 * (2 ** (i % 6))
        Hx = 2 * (1 + i // 6)
        dcp.merge(torch.randn(T, Hx, D), torch.randn(T, Hx), group=mine, backend="auto")
    outs = torch.randn(world_size, 5, H, D, generator=torch.Generator().manual_seed(seed))
    lses = torch.randn(world_size, 5, H, generator=torch.Generator().manual_seed(seed + 1))
    got = dcp.merge(outs[rank], lses[rank], backend="auto")
    ref = dcp.merge_states(outs, lses)[:, rank * (H // world_size):(rank + 1) * (H // world_size)]
    return float((got - ref).abs().max())


def test_merger_cache_is_per_group(pools, seed):
    errs = pools.run(4, _subgroup_merges, seed)
    assert max(errs) < 1e-5


def _env_override_under_auto(rank, world_size):
    os.environ["ATTNCOMM_DCP_BACKEND"] = "symm_a2a"
    try:
        merger = dcp.DcpMerger(max_tokens=4, num_heads=2 * world_size, head_dim=8,
                               dtype=torch.float32, backend="auto")
        chosen, reason = merger.backend, merger.fallback_reason
        try:
            dcp.DcpMerger(max_tokens=4, num_heads=2 * world_size, head_dim=8,
                          dtype=torch.float32, backend="symm_a2a")
            explicit = "no error"
        except ValueError as exc:
            explicit = str(exc)
        os.environ["ATTNCOMM_DCP_BACKEND"] = "ag_rs"
        forced = dcp.DcpMerger(max_tokens=4, num_heads=2 * world_size, head_dim=8,
                               dtype=torch.float32, backend="auto").backend
    finally:
        os.environ.pop("ATTNCOMM_DCP_BACKEND", None)
    return chosen, reason, explicit, forced


def test_env_override_under_auto_never_fails(pools):
    for chosen, reason, explicit, forced in pools.run(2, _env_override_under_auto):
        assert chosen in ("ag_rs", "a2a", "reference")
        assert reason and "CUDA" in reason
        assert "cannot run here" in explicit
        assert forced == "ag_rs"


def test_agree_signature_length_is_checked():
    from attncomm._agree import agree
    with pytest.raises(ValueError, match="signature too long"):
        agree(None, "op", list(range(31)), [])


def _twin_layouts(rank, world_size):
    """Gloo twins of "NCCL" subgroups (get_backend patched to say nccl for them)."""
    from attncomm import cpu_group
    from attncomm._dist import clear_cpu_groups
    from attncomm._agree import agree

    full = dist.new_group([0, 1, 2, 3], backend="gloo")
    pair = dist.new_group([0, 1], backend="gloo")
    fake = {full, pair}
    real_get_backend = dist.get_backend
    dist.get_backend = lambda g=None: "nccl" if g in fake else real_get_backend(g)
    out = {}
    try:
        try:  # members 0,1 belong to one more group than 2,3: lazy creation must refuse
            cpu_group(full)
            out["lazy"] = "no error"
        except ValueError as exc:
            out["lazy"] = str(exc)
        twin = cpu_group(full, world_collective=True)
        pair_twin = cpu_group(pair, world_collective=True)
        out["pair twin"] = pair_twin is not None
        agree(full, "test", [7, 8], ["a", "b"], timeout_s=20)
        t = torch.tensor([rank])
        dist.all_reduce(t, group=twin)
        out["sum"] = int(t.item())
    finally:
        dist.get_backend = real_get_backend
        clear_cpu_groups()
    return out


@pytest.mark.slow
def test_gloo_twin_of_asymmetric_subgroups():
    res = attncomm.launch(_twin_layouts, 4, timeout_s=180)
    for rank, out in enumerate(res):
        assert "world_collective=True" in out["lazy"], out
        assert out["sum"] == 6
        assert out["pair twin"] == (rank < 2)
