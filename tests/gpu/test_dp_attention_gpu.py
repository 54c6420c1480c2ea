"""DP attention on CUDA ranks (``cuda_pools``: a GPU each over NCCL where there are enough, else
W processes sharing one GPU over gloo, where the "device" sync and the gathers run staged
through the host): every sync path, a slot the gather left unwritten (the last of W ranks),
gather / scatter / reduce_scatter in bf16 against fp64 references, and the simulation on
CUDA."""
from __future__ import annotations

import random

import pytest
import torch

import attncomm
from attncomm.dp_attention import (BatchView, DpPaddingMode, ForwardMode, dp_gather,
                                   dp_reduce_scatter, dp_scatter, prepare_mlp_sync_batch)
from attncomm.demo.dp_simulate import SimConfig, simulate_rank, summarize

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]


def _nccl_checks(rank, world, seed):
    rng = random.Random(seed)
    dev = torch.device("cuda", torch.cuda.current_device())
    out = {}
    for sync in ("device", "cpu", "shm", "auto"):
        for _ in range(20):
            counts = [rng.randint(0, 5) for _ in range(world)]
            b = BatchView(ForwardMode.DECODE, batch_size=counts[rank]) if counts[rank] else None
            got, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                               get_idle_batch=lambda: BatchView(ForwardMode.IDLE),
                                               sync=sync, device=dev)
            assert info.global_num_tokens == counts and (got is None) == (max(counts) == 0)
        out[sync] = info.sync
        # the last rank inactive, its mask on the device (fetched with the rows in one copy)
        act = torch.tensor([1] * (world - 1) + [0], device=dev)
        _, info = prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 2),
                                         dp_size=world, attn_tp_size=1, group=None,
                                         get_idle_batch=lambda: BatchView(ForwardMode.IDLE),
                                         sync=sync, device=dev, active_ranks=act)
        assert info.global_num_tokens == [r + 2 for r in range(world - 1)] + [0], info
    out["unsent"] = _unsent_on_device(rank, world, dev)
    for _ in range(10):
        n = [rng.choice([0, rng.randint(1, 300)]) for _ in range(world)]
        cs = rng.randrange(1 << 20)
        rows = [torch.randn(k, 7168, generator=torch.Generator().manual_seed(cs + q))
                for q, k in enumerate(n)]
        for mode in DpPaddingMode:
            local = rows[rank].to(dev, torch.bfloat16)
            buf = dp_gather(local, n, None, mode=mode)
            for q in range(world):
                assert torch.equal(dp_scatter(buf, n, q, mode=mode).cpu(),
                                   rows[q].to(torch.bfloat16))
            total = buf.shape[0]
            parts = [torch.randn(total, 7168, generator=torch.Generator().manual_seed(cs + 99 + r))
                     for r in range(world)]
            red = dp_reduce_scatter(parts[rank].to(dev, torch.bfloat16), n, None, mode=mode)
            ref = dp_scatter(sum(p.to(torch.bfloat16).double() for p in parts), n, rank,
                             mode=mode)
            # The collective sums W bf16 values in bf16, in an order of its own: W - 1
            # roundings, each within 2^-8 of a partial sum, itself at most sum |p| (the exact
            # bound; a fixed tolerance fails at W = 3 where a sum cancels).
            bound = dp_scatter(sum(p.to(torch.bfloat16).double().abs() for p in parts), n,
                               rank, mode=mode) * (world - 1) * 2.0 ** -8
            assert red.shape == ref.shape
            err = (red.double().cpu() - ref).abs()
            assert bool((err <= bound).all()), (seed, mode, float((err - bound).max()))
    return out


class _Done:
    def wait(self, *args, **kwargs):
        return True


def _unsent_on_device(rank, world, dev):
    """The device gather returns with the last rank's slot unwritten (as an aborted NCCL
    exchange can): every rank raises PeerTimeoutError naming it, never reads a stale row. The
    gather is ``attncomm.collectives.all_gather_tensor`` as ``rows`` imported it (NCCL, or gloo
    staged through the host)."""
    from attncomm.dp_attention import rows as sync_mod  # where the gather is called

    real = sync_mod.all_gather_tensor

    def partial(output, input, group=None, async_op=False):
        full = torch.empty_like(output)
        real(full, input, group)
        output.view(world, -1)[:world - 1] = full.view(world, -1)[:world - 1]
        return _Done()

    sync_mod.all_gather_tensor = partial
    try:
        prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=1), dp_size=world,
                               attn_tp_size=1, group=None, sync="device", device=dev,
                               get_idle_batch=lambda: BatchView(ForwardMode.IDLE))
        return "no error"
    except attncomm.PeerTimeoutError as exc:
        return exc.peer_ranks
    finally:
        sync_mod.all_gather_tensor = real


@pytest.mark.parametrize("world", [2, 3])
def test_nccl_sync_and_gathers(cuda_pools, world, seed):
    res = cuda_pools.run(world, _nccl_checks, seed, timeout_s=240)
    assert [r.pop("unsent") for r in res] == [[world - 1]] * world
    assert all(r == res[0] for r in res), res
    assert res[0] == {"device": "device", "cpu": "cpu", "shm": "shm", "auto": "shm"}


@pytest.mark.parametrize("sync,dtype", [("device", "bf16"), ("auto", "fp32")])
def test_simulation_on_cuda(sync, dtype, seed):
    # fresh ranks (a GPU each, or two processes sharing one), as the demo launches them
    cfg = SimConfig(steps=300, sync=sync, dtype=dtype, device="cuda", hidden=256, ffn=1024,
                    seed=seed)
    s = summarize(attncomm.launch(simulate_rank, 2, device="cuda", args=(cfg,), timeout_s=240))
    assert s["counts"]["steps_run"] > 0 and s["counts"]["all_idle"] > 0
    assert s["min_cosine"] > (0.999 if dtype == "bf16" else 0.99999), s
