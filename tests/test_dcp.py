"""DCP merge: merge_states against an fp64 formula; merge/DcpMerger for every CPU backend on gloo
ranks (W = 1..4); the Triton combine kernels under the interpreter; bad inputs on every rank."""
from __future__ import annotations

import math
import os

import pytest
import torch

from attncomm import _triton, dcp
from attncomm.dcp.lse_merge import combine as combine_mod
from _reference import ref_merge

BACKENDS = ["reference", "ag_rs", "a2a", "auto"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def make_case(seed: int, W: int, T: int, H: int, D: int, dtype, spread: float = 4.0):
    """Every rank's partial output and LSE (same on every rank for the same seed), with empty
    shards holding NaN payloads and rows empty on every rank."""
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(W, T, H, D, generator=g).to(dtype)
    lses = torch.randn(W, T, H, generator=g) * spread
    if T:
        empty = torch.rand(W, T, H, generator=g) < 0.2
        lses[empty] = -math.inf
        outs[empty] = float("nan")
        all_empty = torch.rand(T, H, generator=g) < 0.1
        lses[:, all_empty] = -math.inf
        outs[:, all_empty] = float("nan")
        if W > 1:
            lses[0, 0, 0] = float("nan")  # a NaN LSE counts as an empty shard
            outs[0, 0, 0] = float("nan")
        if W > 1 and T > 1:
            lses[1, 1, 0] = math.inf  # so does +inf (FlashAttention's keyless row)
            outs[1, 1, 0] = float("nan")
    return outs, lses


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_close_to_ref(got_out, got_lse, ref_out, ref_lse, dtype, what):
    assert got_out.dtype == dtype, what
    assert got_lse.dtype == torch.float32, what
    assert not torch.isnan(got_out).any(), f"{what}: NaN leaked into the output"
    if ref_out.numel() == 0:
        assert got_out.shape == ref_out.shape and got_lse.shape == ref_lse.shape, what
        return
    scale = ref_out.abs().amax().clamp_min(1.0)
    err = (got_out.double() - ref_out).abs().max().item() if got_out.numel() else 0.0
    assert err <= TOL[dtype] * float(scale) * 4, f"{what}: max abs err {err}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(got_lse), torch.isneginf(ref_lse)), what
    if fin.any():
        lerr = (got_lse.double()[fin] - ref_lse[fin]).abs().max().item()
        assert lerr <= 1e-4 * max(1.0, ref_lse[fin].abs().max().item()), f"{what}: lse err {lerr}"
    zero_rows = torch.isneginf(ref_lse)
    assert bool((got_out[zero_rows] == 0).all()), f"{what}: all-empty rows must be exactly 0"


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spread", [1.0, 1e4])
def test_merge_states_matches_fp64(dtype, spread, seed):
    for N, T, H, D in [(1, 3, 2, 8), (3, 7, 4, 64), (4, 64, 3, 512), (2, 0, 2, 8)]:
        outs, lses = make_case(seed, N, T, H, D, dtype, spread)
        before = (bits(outs).clone(), bits(lses).clone())
        out, lse = dcp.merge_states(outs, lses, return_lse=True)
        ref_out, ref_lse = ref_merge(outs, lses)
        assert_close_to_ref(out, lse, ref_out, ref_lse, dtype, f"seed={seed} N={N} T={T}")
        assert torch.equal(bits(outs), before[0]) and torch.equal(bits(lses), before[1])


def test_merge_states_base2_and_lse_dtypes(seed):
    outs, lses = make_case(seed, 3, 9, 4, 16, torch.float32)
    ref_out, ref_lse = ref_merge(outs, lses)
    out2, lse2 = dcp.merge_states(outs, lses / math.log(2), lse_base="2", return_lse=True)
    assert_close_to_ref(out2, lse2 * math.log(2), ref_out, ref_lse, torch.float32, "base 2")
    out16 = dcp.merge_states(outs, lses.to(torch.bfloat16))
    ref16, _ = ref_merge(outs, lses.to(torch.bfloat16).float())
    assert (out16.double() - ref16).abs().max() < 1e-5


def test_merge_states_bad_input():
    with pytest.raises(ValueError, match="lses"):
        dcp.merge_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match="lse_base"):
        dcp.merge_states(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4), lse_base="10")
    with pytest.raises(ValueError, match="dtype"):
        dcp.merge_states(torch.zeros(2, 3, 4, 8, dtype=torch.int32), torch.zeros(2, 3, 4))


def test_shard_kv_interleaved():
    assert dcp.shard_kv_interleaved(10, 3, 1).tolist() == [1, 4, 7]
    assert dcp.shard_kv_interleaved(2, 4, 3).tolist() == []
    allpos = torch.cat([dcp.shard_kv_interleaved(37, 5, r) for r in range(5)]).sort().values
    assert allpos.tolist() == list(range(37))
    for bad in [(-1, 2, 0), (4, 0, 0), (4, 2, 2)]:
        with pytest.raises(ValueError, match="rank"):
            dcp.shard_kv_interleaved(*bad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_combine_kernels_match_torch_path(dtype, monkeypatch, seed):
    """The Triton kernels (interpreted on CPU) against the torch path and the fp64 formula."""
    if _triton.REASON:
        pytest.skip("triton is not installed")
    for N, T, H, D in [(2, 5, 4, 8), (3, 3, 2, 40)]:
        outs, lses = make_case(seed, N, T, H, D, dtype, 8.0)
        monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "torch")
        t_out, t_lse = combine_mod.combine(outs, lses, dtype)
        dest_t = torch.full((N, T, H // N if H % N == 0 else 1, D), float("nan"))
        monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "triton")
        k_out, k_lse = combine_mod.combine(outs, lses, dtype)
        ref_out, ref_lse = ref_merge(outs, lses)
        assert_close_to_ref(k_out, k_lse, ref_out, ref_lse, dtype, f"triton seed={seed}")
        assert (k_out.double() - t_out.double()).abs().max() <= TOL[dtype] * 4
        if H % N == 0:
            for r in range(N):
                dest_k = torch.full_like(dest_t, float("nan"))
                lse_k = combine_mod.scale_own(outs[r], lses, r, dest_k)
                monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "torch")
                lse_t = combine_mod.scale_own(outs[r], lses, r, dest_t)
                monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "triton")
                assert not torch.isnan(dest_k).any()
                assert (dest_k - dest_t).abs().max() <= 1e-6
                assert torch.equal(torch.isneginf(lse_k), torch.isneginf(lse_t))


# ---------------------------------------------------------------------------------------------
# on gloo ranks
# ---------------------------------------------------------------------------------------------

def _merge_sweep(rank, W, seed, impl):
    """Every backend × dtype × T × H × D on this world; returns a list of failures (strings)."""
    if impl:
        os.environ["ATTNCOMM_COMBINE_IMPL"] = impl
    failures = []
    sizes = [(T, H, D) for T in (0, 1, 7, 64) for H in (W, 3 * W) for D in (8, 512)]
    if impl == "triton":  # the interpreter is slow: a representative subset
        sizes = [(0, W, 8), (1, W, 8), (7, 3 * W, 8)]
    case = 0
    for dtype in DTYPES:
        for T, H, D in sizes:
            case += 1
            spread = 1e4 if case % 5 == 0 else 4.0
            outs, lses = make_case(seed + case, W, T, H, D, dtype, spread)
            hs = H // W
            # Base 2 at ordinary magnitudes only: at |LSE| ~ 1e4 an fp32 LSE's ulp (~1e-3) bounds
            # any base conversion's weights, far above the fp32 tolerance. The reference sees
            # the LSE the ranks pass (rounded to fp32 in base 2).
            base2 = case % 3 == 0 and spread < 1e3
            lses_in = (lses / math.log(2)).double() * math.log(2) if base2 else lses
            ref_out, ref_lse = ref_merge(outs, lses_in)
            ref_out, ref_lse = ref_out[:, rank * hs:(rank + 1) * hs], ref_lse[:, rank * hs:
                                                                             (rank + 1) * hs]
            mine_out, mine_lse = outs[rank].clone(), lses[rank].clone()
            before = (bits(mine_out).clone(), bits(mine_lse).clone())
            results = {}
            for backend in BACKENDS:
                lse_in = mine_lse / math.log(2) if base2 else mine_lse
                try:
                    o, l = dcp.merge(mine_out, lse_in, backend=backend, return_lse=True,
                                     lse_base="2" if base2 else "e")
                    if base2:
                        l = l * math.log(2)
                    assert o.shape == (T, hs, D) and l.shape == (T, hs)
                    assert_close_to_ref(o, l, ref_out, ref_lse, dtype, "")
                    assert torch.equal(bits(mine_out), before[0]), "out was modified"
                    assert torch.equal(bits(mine_lse), before[1]), "lse was modified"
                    results[backend] = o
                except AssertionError as exc:
                    failures.append(f"W={W} rank={rank} {backend} {dtype} T={T} H={H} D={D} "
                                    f"seed={seed + case}: {exc}")
            vals = list(results.values())
            for other in vals[1:]:  # every backend agrees with every other
                if other.numel() and (other.double() - vals[0].double()).abs().max() > \
                        4 * TOL[dtype] * max(1.0, float(ref_out.abs().amax())) * 2:
                    failures.append(f"W={W} backends disagree at {dtype} T={T} H={H} D={D}")
    os.environ.pop("ATTNCOMM_COMBINE_IMPL", None)
    return failures


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_merge_every_backend(pools, W, seed):
    failures = sum(pools.run(W, _merge_sweep, seed, "torch"), [])
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("W", [2])
def test_merge_triton_path_on_ranks(pools, W, seed):
    if _triton.REASON:
        pytest.skip("triton is not installed")
    failures = sum(pools.run(W, _merge_sweep, seed, "triton"), [])
    assert not failures, "\n".join(failures[:20])


def _merger_calls(rank, W, seed):
    H, D = 2 * W, 16
    failures = []
    for backend in ("ag_rs", "a2a", "reference", "auto"):
        merger = dcp.DcpMerger(max_tokens=20, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                               backend=backend, lse_base="2")
        if merger.backend == "symm_a2a" or (backend != "auto" and merger.backend != backend):
            failures.append(f"{backend}: merger.backend={merger.backend}")
        if merger.fallback_reason is None and backend == "auto":
            failures.append("auto on CPU must say why symm_a2a was not taken")
        for i, T in enumerate((20, 1, 13, 0, 20)):
            outs, lses = make_case(seed + i, W, T, H, D, torch.bfloat16)
            ref_out, _ = ref_merge(outs, lses)
            hs = H // W
            o = merger(outs[rank], lses[rank] / math.log(2))
            err = (o.double() - ref_out[:, rank * hs:(rank + 1) * hs]).abs().max().item() \
                if T else 0.0
            if o.shape != (T, hs, D) or err > 0.05:
                failures.append(f"{backend} T={T}: shape {tuple(o.shape)} err {err}")
        try:
            merger(torch.zeros(21, H, D, dtype=torch.bfloat16), torch.zeros(21, H))
            failures.append("T > max_tokens did not raise")
        except ValueError as exc:
            if "max_tokens" not in str(exc) and "T ≤" not in str(exc):
                failures.append(f"unclear error: {exc}")
        merger.check()
    return failures


@pytest.mark.parametrize("W", [1, 3])
def test_dcp_merger(pools, W, seed):
    failures = sum(pools.run(W, _merger_calls, seed), [])
    assert not failures, "\n".join(failures)


def _bad_inputs(rank, W):
    """Each bad call must raise ValueError on every rank; returns (label, raised, message)."""
    T, H, D = 4, 2 * W, 8
    good = (torch.randn(T, H, D), torch.randn(T, H))
    cases = {
        "H not divisible": lambda: dcp.merge(torch.randn(T, 2 * W + 1, D),
                                             torch.randn(T, 2 * W + 1)),
        "lse shape on rank 0 only": lambda: dcp.merge(
            good[0], torch.randn(T + (rank == 0), H)),
        "int dtype": lambda: dcp.merge(good[0].to(torch.int32), good[1]),
        "unknown backend": lambda: dcp.merge(*good, backend="nope"),
        "bad base": lambda: dcp.merge(*good, lse_base="10"),
        "T differs across ranks": lambda: dcp.merge(torch.randn(T + rank, H, D),
                                                    torch.randn(T + rank, H)),
        "symm_a2a on CPU": lambda: dcp.merge(*good, backend="symm_a2a"),
        "merger H not divisible": lambda: dcp.DcpMerger(max_tokens=4, num_heads=2 * W + 1,
                                                        head_dim=8, dtype=torch.float32),
        "merger max_tokens=0": lambda: dcp.DcpMerger(max_tokens=0, num_heads=H, head_dim=8,
                                                     dtype=torch.float32),
    }
    if W == 1:  # these are errors only across several ranks
        for k in ("H not divisible", "T differs across ranks", "merger H not divisible"):
            cases.pop(k)
    out = []
    for label, call in cases.items():
        try:
            call()
            out.append((label, False, ""))
        except ValueError as exc:
            out.append((label, True, str(exc)))
    # validation off: a local error still raises (locally) and a good call still works
    try:
        dcp.merge(torch.randn(T, H, D), torch.randn(T + 1, H), validate=False)
        out.append(("validate=False local error", False, ""))
    except ValueError as exc:
        out.append(("validate=False local error", True, str(exc)))
    return out


@pytest.mark.parametrize("W", [1, 2, 3])
def test_bad_inputs_raise_on_every_rank(pools, W):
    per_rank = pools.run(W, _bad_inputs)
    for rank, results in enumerate(per_rank):
        for label, raised, _msg in results:
            assert raised, f"rank {rank}: {label} did not raise ValueError"
    msgs = {label: msg for label, _, msg in per_rank[0]}
    if W > 1:
        assert "divisible" in msgs["H not divisible"]
        assert "rank 0" in msgs["lse shape on rank 0 only"]
        assert "T (tokens)" in msgs["T differs across ranks"]
        assert "CUDA" in msgs["symm_a2a on CPU"] or "cuda" in msgs["symm_a2a on CPU"]
