"""Special values of the DCP merge: one answer on every CPU path (merge_states, the torch and the
Triton combine, and the reference / ag_rs / a2a backends on gloo ranks) for a table of LSEs
−inf / +inf / NaN / ±1e30 and payloads NaN / ±inf (attncomm.testing.special), against the fp64
reference under the rule of docs/API.md; bitwise where the arithmetic is the same."""
from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from attncomm import _triton, dcp
from attncomm.dcp.lse_merge import combine as combine_mod
from attncomm.testing.special import bitwise_equal, check_merge, special_table

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# The Triton interpreter runs the kernels in numpy, which warns where the table's ±inf meet in
# an add (inf + −inf); the kernels' rule for non-finite values covers those lanes and the results
# are checked, so here the warning is expected.
INTERPRETER_NAN = "ignore:invalid value encountered in add:RuntimeWarning"


def _without_interpreter_nan_warning(rank, W, fn, *args):
    """``fn(rank, W, *args)`` on a rank with the warning of ``INTERPRETER_NAN`` filtered."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "invalid value encountered in add", RuntimeWarning)
        return fn(rank, W, *args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 2, 3])
def test_merge_states_special_table(N, dtype, seed):
    outs, lses = special_table(N, dtype=dtype, seed=seed)
    out, lse = dcp.merge_states(outs, lses, return_lse=True)
    bad = check_merge(out, lse, outs, lses, what=f"merge_states N={N} seed={seed}")
    out2, lse2 = dcp.merge_states(outs, lses / math.log(2), lse_base="2", return_lse=True)
    bad += check_merge(out2, lse2 * math.log(2), outs, (lses / math.log(2)).double()
                       * math.log(2), what=f"merge_states base 2 N={N} seed={seed}")
    assert not bad, "\n".join(bad[:10])


def test_plus_inf_lse_is_an_empty_shard(seed):
    # The reported defect: LSE +inf (FlashAttention's keyless row) gave NaN on reference/a2a
    # and a finite wrong 0.0 on ag_rs. It is an empty shard: the other shard's row, exactly.
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(2, 48, 64, 16, generator=g).to(torch.bfloat16)
    lses = torch.randn(2, 48, 64, generator=g) * 3
    lses[0, :, ::2] = math.inf
    out, lse = dcp.merge_states(outs, lses, return_lse=True)
    assert bitwise_equal(out[:, ::2], outs[1, :, ::2])
    assert torch.equal(lse[:, ::2], lses[1, :, ::2])
    dest = torch.empty(2, 48, 32, 16)
    for r in range(2):
        combine_mod.scale_own_torch(outs[r], lses, r, dest)
        want = outs[1, :, ::2].float() if r == 1 else torch.zeros(48, 32, 16)
        assert torch.equal(dest.permute(1, 0, 2, 3).reshape(48, 64, 16)[:, ::2], want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_no_sources(dtype):
    out, lse = dcp.merge_states(torch.empty(0, 3, 4, 5, dtype=dtype), torch.empty(0, 3, 4),
                                return_lse=True)
    assert out.dtype == dtype and out.shape == (3, 4, 5) and bool((out == 0).all())
    assert lse.shape == (3, 4) and bool(torch.isneginf(lse).all())
    empty = dcp.merge_states(torch.empty(0, 0, 4, 5, dtype=dtype), torch.empty(0, 0, 4))
    assert empty.shape == (0, 4, 5)


@pytest.mark.filterwarnings(INTERPRETER_NAN)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_kernels_special_table(dtype, monkeypatch, seed):
    """Both Triton kernels (interpreted) on the table: combine and the ag_rs scale step."""
    if _triton.REASON:
        pytest.skip("triton is not installed")
    N = 2
    outs, lses = special_table(N, dtype=dtype, seed=seed, max_rows=48)
    monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "triton")
    bad = []
    k_out, k_lse = combine_mod.combine(outs, lses, dtype)
    bad += check_merge(k_out, k_lse, outs, lses, what=f"triton combine seed={seed}")
    z_out, z_lse = combine_mod.combine(outs[:0], lses[:0], dtype)
    assert bool((z_out == 0).all()) and bool(torch.isneginf(z_lse).all())
    T, H, D = outs.shape[1:]
    dest_k = torch.full((N, T, H // N, D), math.nan)
    dest_t = torch.full_like(dest_k, math.nan)
    for r in range(N):
        monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "triton")
        lse_k = combine_mod.scale_own(outs[r], lses, r, dest_k)
        monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "torch")
        lse_t = combine_mod.scale_own(outs[r], lses, r, dest_t)
        for name, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf),
                         ("-inf", torch.isneginf)):
            if not torch.equal(fn(dest_k), fn(dest_t)):
                bad.append(f"scale_own rank {r}: {name} placement differs (seed={seed})")
        fin = torch.isfinite(dest_t)
        if (dest_k[fin] - dest_t[fin]).abs().max() > 1e-6:
            bad.append(f"scale_own rank {r}: values differ (seed={seed})")
        if not torch.equal(torch.isneginf(lse_k), torch.isneginf(lse_t)) \
                or torch.isnan(lse_k).any():
            bad.append(f"scale_own rank {r}: merged LSE differs (seed={seed})")
    assert not bad, "\n".join(bad[:10])


def _special_on_ranks(rank, W, seed, impl, max_rows, dtypes=DTYPES, bases=("e", "2")):
    """Every CPU backend × dtype × base on the table; returns failure messages."""
    os.environ["ATTNCOMM_COMBINE_IMPL"] = impl
    bad = []
    try:
        for dtype in dtypes:
            outs, lses = special_table(W, dtype=dtype, seed=seed, max_rows=max_rows)
            H = outs.shape[2]
            hs = H // W
            heads = slice(rank * hs, (rank + 1) * hs)
            for base in bases:
                lse_in = lses[rank] if base == "e" else lses[rank] / math.log(2)
                lses_ref = lses if base == "e" else (lses / math.log(2)).double() * math.log(2)
                got = {}
                for backend in ("reference", "ag_rs", "a2a"):
                    o, l = dcp.merge(outs[rank], lse_in, backend=backend, lse_base=base,
                                     return_lse=True)
                    l = l if base == "e" else l * math.log(2)
                    what = f"W={W} rank={rank} {backend} {dtype} base {base} {impl} seed={seed}"
                    bad += check_merge(o, l, outs, lses_ref, heads, what)
                    got[backend] = o
                if impl == "torch" and base == "e":
                    # reference and a2a run the same combine on the same values: bitwise equal,
                    # and equal to merge_states' head slice.
                    local = dcp.merge_states(outs, lses)[:, heads]
                    for backend in ("reference", "a2a"):
                        if not bitwise_equal(got[backend], local):
                            bad.append(f"W={W} rank={rank} {backend} {dtype}: not bitwise "
                                       f"equal to merge_states (seed={seed})")
    finally:
        os.environ.pop("ATTNCOMM_COMBINE_IMPL", None)
    return bad


@pytest.mark.parametrize("W", [2, 3])
def test_every_backend_special_table(pools, W, seed):
    bad = [m for per_rank in pools.run(W, _special_on_ranks, seed, "torch", 1400)
           for m in per_rank]
    assert not bad, "\n".join(bad[:20])


def test_every_backend_special_table_triton(pools, seed):
    if _triton.REASON:
        pytest.skip("triton is not installed")
    # The interpreter runs each (token, head) program in Python: a sampled table, base e (the
    # base conversion happens before the kernels).
    per_rank = pools.run(2, _without_interpreter_nan_warning, _special_on_ranks, seed, "triton",
                         40, [torch.float32, torch.bfloat16], ("e",))
    bad = [m for msgs in per_rank for m in msgs]
    assert not bad, "\n".join(bad[:20])
