"""The forward cases of the peers' own test suites, ported to gloo CPU ranks (our code, their
shapes, layouts and data types):

- ring-flash-attention ``test/test_ring_flash_attn_func.py``: B = 1, S = 3816, 5 heads, D = 128,
  bf16, causal, contiguous layout; ``test/test_zigzag_ring_flash_attn_func.py``: the same with
  S = 3824 and the zigzag layout. Both compare the output and the LSE with one-process
  attention (they print the differences; no tolerance). Their varlen and stripe cases have no
  counterpart here (no varlen or stripe layout).
- yunchang ``test/test_hybrid_attn.py`` (USP ``LongContextAttention``): B = 1, S = 1024,
  32 heads, D = 64, bf16, causal and not, ring "basic" (contiguous) and "zigzag", Ulysses degree
  W (default) or 2; ``test/test_hybrid_qkvpacked_attn.py``: B = 2, S = 1024, 8 heads, D = 32,
  bf16, causal, Ulysses degree 2, basic and zigzag. Their data: ``extract_local`` = our
  ``usp_shard``. Their tolerance is ``atol = 0.1, rtol = 0`` against flash-attn in bf16. Their
  ``test/test_ulysses_attn.py`` (B = 2, S = 3816, 8 heads, D = 128, Ulysses only) is left out:
  ~30 GFLOP per CPU rank, and Ulysses alone is tests/test_ulysses.py's; its ring counterpart is
  ring-flash-attention's shape above.

W = 4 here (the peers run 8 GPUs; every shape above splits over 4). The reference is fp64
attention over the whole sequence on the same bf16 values. The check is tighter than yunchang's:
each element within ``2⁻⁸·|ref| + 10⁻⁴`` (bf16 rounding of the output plus fp32 accumulation).
At these shapes the outputs are ~0.03 in size, so ``atol = 0.1`` would also accept an answer
with a whole rank's K/V block missing; each case checks that such an answer fails ours.
"""
from __future__ import annotations

import math

import pytest
import torch
from _ring_helpers import gen, rand

from attncomm.ring import positions, ring_attention
from attncomm.usp import USPAttention, make_groups, usp_positions

pytestmark = pytest.mark.slow

WORLD = 4
_GRIDS: dict = {}


def _grid(u, r):
    if (u, r) not in _GRIDS:
        _GRIDS[(u, r)] = make_groups(u, r)
    return _GRIDS[(u, r)]


def _tolerance_check(out, ref, dropped):
    """(max excess over the tolerance of ``out``, of ``dropped``): ≤ 0 passes."""
    tol = ref.abs() * 2.0 ** -8 + 1e-4
    return (((out.double() - ref).abs() - tol).max().item(),
            ((dropped - ref).abs() - tol).max().item())


def _case(rank, world, seed, b, s, hq, d, causal, layout, grid, rows_every=1):
    """One ported case on this rank: ``(excess of ours, excess of a dropped-block answer,
    max |ring lse − fp64 lse| or None)``."""
    g = gen(seed)
    q, k, v = (rand(g, (b, s, hq, d), torch.bfloat16) for _ in range(3))
    if grid is None:
        pos = positions(s, world, rank, layout)
        out, lse = ring_attention(q[:, pos], k[:, pos], v[:, pos], causal=causal,
                                  layout=layout, return_lse=True)
    else:
        u, r = grid
        ug, rg = _grid(u, r)
        pos = usp_positions(s, u, r, rank, layout)
        mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                           backend="all_to_all")
        out, lse = mod(q[:, pos], k[:, pos], v[:, pos], causal=causal), None
    rows = torch.arange(0, len(pos), rows_every)
    ref, ref_lse = _ref_rows(q, k, v, causal, pos[rows])
    # the same rows with the keys rank 0 holds left out
    valid = torch.ones(b, s, dtype=torch.bool)
    first = (positions(s, world, 0, layout) if grid is None
             else usp_positions(s, grid[0], grid[1], 0, layout))
    valid[:, first] = False
    dropped = _ref_rows(q, k, v, causal, pos[rows], valid)[0]
    dropped = torch.where(torch.isfinite(dropped), dropped, torch.zeros_like(dropped))
    ours, theirs = _tolerance_check(out[:, rows], ref, dropped)
    lse_err = None if lse is None else (lse[:, rows].double() - ref_lse).abs().max().item()
    return ours, theirs, lse_err


def _ref_rows(q, k, v, causal, rows, key_valid=None):
    """fp64 attention of the query rows ``rows`` (global positions) over the whole sequence."""
    s = q.shape[1]
    keep = torch.ones(q.shape[0], s, dtype=torch.bool) if key_valid is None else key_valid
    qr = q[:, rows]
    out = torch.empty(q.shape[0], len(rows), q.shape[2], v.shape[3], dtype=torch.float64)
    lse = torch.empty(q.shape[0], len(rows), q.shape[2], dtype=torch.float64)
    for i0 in range(0, len(rows), 256):
        sel = rows[i0:i0 + 256]
        mask = keep[:, None, :].expand(q.shape[0], len(sel), s).clone()
        if causal:
            mask &= torch.arange(s)[None, None, :] <= sel[None, :, None]
        o, l = _masked(qr[:, i0:i0 + 256], k, v, mask)
        out[:, i0:i0 + 256], lse[:, i0:i0 + 256] = o, l
    return out, lse


def _masked(q, k, v, mask):
    """fp64 attention of ``q [B, n, H, D]`` over every key with ``mask [B, n, S]``."""
    qd, kd, vd = q.double(), k.double(), v.double()
    sc = torch.einsum("bshd,bthd->bhst", qd, kd) / math.sqrt(q.shape[-1])
    sc = sc.masked_fill(~mask[:, None], -math.inf)
    l = torch.logsumexp(sc, -1)
    p = torch.exp(sc - torch.where(torch.isfinite(l), l, 0.0).unsqueeze(-1))
    return torch.einsum("bhst,bthd->bshd", p, vd), l.transpose(1, 2)


_RFA = [  # (B, S, H, D, causal, layout)
    (1, 3816, 5, 128, True, "contiguous"),
    (1, 3824, 5, 128, True, "zigzag"),
]


def _rfa(rank, world, seed):
    return [_case(rank, world, seed + i, b, s, h, d, causal, layout, None, rows_every=8)
            for i, (b, s, h, d, causal, layout) in enumerate(_RFA)]


def test_ring_flash_attention_cases(pools, seed):
    res = pools.run(WORLD, _rfa, seed)
    for i, case in enumerate(_RFA):
        ours = max(r[i][0] for r in res)
        dropped = max(r[i][1] for r in res)
        lse = max(r[i][2] for r in res)
        assert ours <= 0, f"seed {seed}: {case}: over the tolerance by {ours}"
        assert dropped > 0, f"seed {seed}: {case}: the check would accept a dropped block"
        assert lse < 1e-4, f"seed {seed}: {case}: lse err {lse}"


_YUNCHANG = [  # (B, S, H, D, causal, layout, (U, R))
    (1, 1024, 32, 64, False, "contiguous", (4, 1)),  # their defaults: Ulysses degree W
    (1, 1024, 32, 64, False, "contiguous", (2, 2)),
    (1, 1024, 32, 64, True, "contiguous", (2, 2)),
    (1, 1024, 32, 64, False, "zigzag", (2, 2)),
    (1, 1024, 32, 64, True, "zigzag", (2, 2)),
    (2, 1024, 8, 32, True, "contiguous", (2, 2)),   # qkvpacked, basic
    (2, 1024, 8, 32, True, "zigzag", (2, 2)),       # qkvpacked, zigzag
]


def _yunchang(rank, world, seed):
    return [_case(rank, world, seed + i, b, s, h, d, causal, layout, grid, rows_every=2)
            for i, (b, s, h, d, causal, layout, grid) in enumerate(_YUNCHANG)]


@pytest.mark.slow
def test_yunchang_cases(pools, seed):
    res = pools.run(WORLD, _yunchang, seed)
    for i, case in enumerate(_YUNCHANG):
        ours = max(r[i][0] for r in res)
        dropped = max(r[i][1] for r in res)
        assert ours <= 0, f"seed {seed}: {case}: over the tolerance by {ours}"
        assert dropped > 0, f"seed {seed}: {case}: the check would accept a dropped block"
