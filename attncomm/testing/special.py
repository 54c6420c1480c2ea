"""The DCP merge's table of special inputs, and the check every backend must pass on it.

Each (token, head) row of the table is one combination of per-source (LSE, payload) values:
LSEs −inf, +inf, NaN and finite values from ordinary to ±1e30, payloads ordinary, all NaN, all
+inf, all −inf or one NaN element. The expected result is the fp64 reference
(``attncomm.testing.reference.ref_merge``) under the rule of docs/API.md ("Special values"): a
non-finite LSE is an empty source, a row empty everywhere is exactly 0 with LSE −inf, NaN/±inf in
a contributing payload propagates. Finite LSEs of one row are either within 2.5 of each other or
~1e30 apart, never in the band where an fp32 weight underflows on one backend and not another.
"""
from __future__ import annotations

import itertools
import math
import random

import torch

from .reference import ref_merge

__all__ = ["LSE_VALUES", "PAYLOADS", "TOL", "bitwise_equal", "check_merge", "special_table"]

LSE_VALUES = (-math.inf, math.inf, math.nan, 0.0, 2.5, -1e30, 1e30)
PAYLOADS = ("rand", "nan", "inf", "-inf", "one_nan")
# Allowed error of a finite output element, relative to max(1, |reference|) over the tensor.
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _combos(world_size: int, max_rows: int, seed: int) -> list:
    per_source = list(itertools.product(range(len(LSE_VALUES)), range(len(PAYLOADS))))
    if len(per_source) ** world_size <= max_rows:
        return list(itertools.product(per_source, repeat=world_size))
    rng = random.Random(seed)
    rows = [tuple(rng.choice(per_source) for _ in range(world_size)) for _ in range(max_rows)]
    # Rows every world size must see: each non-finite LSE on every source, and all mixed.
    for i in range(3):
        rows.append(tuple((i, p % len(PAYLOADS)) for p in range(world_size)))
    rows.append(tuple((q % 3, 1) for q in range(world_size)))
    return rows


def special_table(world_size: int, *, head_dim: int = 3, dtype=torch.float32,
                  max_rows: int = 1400, seed: int = 0):
    """Every rank's inputs for one table: ``(outs [W, T, H, D] dtype, lses [W, T, H] fp32)``
    with ``H = W`` (one head per rank's slice) and ``T = ceil(rows / W)``; the same on every
    rank for the same arguments. All combinations when there are at most ``max_rows``, else
    ``max_rows`` drawn with ``seed`` plus the all-empty rows."""
    combos = _combos(world_size, max_rows, seed)
    H = world_size
    T = -(-len(combos) // H)
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(world_size, T * H, head_dim, generator=g)
    lses = torch.randn(world_size, T * H, generator=g)
    for row, combo in enumerate(combos):
        for src, (li, pi) in enumerate(combo):
            lses[src, row] = LSE_VALUES[li]
            kind = PAYLOADS[pi]
            if kind in ("nan", "inf", "-inf"):
                outs[src, row] = float(kind)
            elif kind == "one_nan":
                outs[src, row, row % head_dim] = math.nan
    return outs.view(world_size, T, H, head_dim).to(dtype), lses.view(world_size, T, H)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bytes, NaN in the same places (a NaN's payload bits depend on the
    vector path that made it, so NaNs are compared as NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return False
    zero = torch.zeros((), dtype=a.dtype)
    return torch.equal(_bits(torch.where(nan_a, zero, a)), _bits(torch.where(nan_b, zero, b)))


def check_merge(got_out: torch.Tensor, got_lse: torch.Tensor, outs: torch.Tensor,
                lses: torch.Tensor, heads: slice | None = None, what: str = "") -> list[str]:
    """Compare a merge result against the fp64 reference of ``outs [N, T, H, D]``,
    ``lses [N, T, H]`` (base e) restricted to ``heads``; returns failure messages (empty: pass).

    Checked: dtype (``outs``'s) and shapes; NaN, +inf and −inf in exactly the reference's places;
    finite values within ``TOL``; the LSE never NaN, −inf exactly where the reference's is, else
    within 1e-5 relative; rows empty everywhere exactly 0.
    """
    ref_out, ref_lse = ref_merge(outs, lses)
    if heads is not None:
        ref_out, ref_lse = ref_out[:, heads], ref_lse[:, heads]
    dtype = outs.dtype
    if got_out.dtype != dtype or got_lse.dtype != torch.float32:
        return [f"{what}: dtypes {got_out.dtype}, {got_lse.dtype}; expected {dtype}, fp32"]
    if got_out.shape != ref_out.shape or got_lse.shape != ref_lse.shape:
        return [(f"{what}: shapes {tuple(got_out.shape)}, {tuple(got_lse.shape)}; expected "
                 f"{tuple(ref_out.shape)}, {tuple(ref_lse.shape)}")]
    bad = []
    g = got_out.double()
    for name, fn in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        diff = fn(g) != fn(ref_out)
        if diff.any():
            idx = diff.nonzero()[0].tolist()
            bad.append(f"{what}: {name} placement differs at {idx} (got {g[tuple(idx)].item()}, "
                       f"reference {ref_out[tuple(idx)].item()})")
    fin = torch.isfinite(ref_out) & torch.isfinite(g)
    if fin.any():
        scale = max(1.0, ref_out[fin].abs().max().item())
        err = (g[fin] - ref_out[fin]).abs().max().item()
        if err > TOL[dtype] * scale:
            bad.append(f"{what}: max abs error {err:.3g} > {TOL[dtype] * scale:.3g}")
    gl = got_lse.double()
    if torch.isnan(gl).any():
        bad.append(f"{what}: NaN in the merged LSE")
    if not (torch.equal(torch.isneginf(gl), torch.isneginf(ref_lse))
            and torch.equal(torch.isfinite(gl), torch.isfinite(ref_lse))):
        bad.append(f"{what}: merged LSE non-finite in other places than the reference's")
    lfin = torch.isfinite(ref_lse) & torch.isfinite(gl)
    if lfin.any():
        lerr = ((gl[lfin] - ref_lse[lfin]).abs() / ref_lse[lfin].abs().clamp_min(1.0)).max()
        if lerr.item() > 1e-5:
            bad.append(f"{what}: merged LSE relative error {lerr.item():.3g}")
    empty = torch.isneginf(ref_lse)
    if empty.any() and not bool((got_out[empty] == 0).all()):
        bad.append(f"{what}: rows empty on every source are not exactly 0")
    return bad
