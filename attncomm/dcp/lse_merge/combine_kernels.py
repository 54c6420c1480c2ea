"""The LSE combine's Triton kernels (host side, rules and the torch path: ``combine`` beside it).

``combine_kernel`` merges ``N`` partial results row by row; ``scale_own_kernel`` is the ag_rs
correction (this rank's output times its normalised weight, laid out by destination head
slice). Importing this module needs Triton (``attncomm._triton``).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["combine_kernel", "scale_own_kernel", "live_lse"]


@triton.jit
def live_lse(l):
    # A non-finite LSE (−inf, +inf, NaN) marks an empty source: −inf. NaN < inf and
    # inf < inf are False.
    return tl.where(l < float("inf"), l, float("-inf"))


@triton.jit
def _row_stats(lse_ptr, stride_ln, row_off, N: tl.constexpr):
    # max over sources (non-finite → −inf), then the sum of exp(L − m); m := 0 if all are
    # −inf.
    m = float("-inf")
    for n in range(N):
        l = live_lse(tl.load(lse_ptr + n * stride_ln + row_off))
        m = tl.maximum(m, l)
    m = tl.where(m == float("-inf"), 0.0, m)
    s = 0.0
    for n in range(N):
        l = live_lse(tl.load(lse_ptr + n * stride_ln + row_off))
        s += tl.exp(l - m)
    return m, s


@triton.jit
def combine_kernel(o_ptr, lse_ptr, out_ptr, lse_out_ptr, N: tl.constexpr, H, D,
                   s_on, s_ot, s_oh, s_ln, s_lt, s_lh, s_dt, s_dh,
                   BLOCK_D: tl.constexpr):
    row = tl.program_id(0)  # one (token, head) row
    t = row // H
    h = row % H
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    m, s = _row_stats(lse_ptr, s_ln, t * s_lt + h * s_lh, N)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for n in range(N):
        l = live_lse(tl.load(lse_ptr + n * s_ln + t * s_lt + h * s_lh))
        w = tl.exp(l - m)
        # A zero-weight source is never read: its payload may be garbage or NaN.
        live = dmask & ((tl.zeros([BLOCK_D], dtype=tl.float32) + w) > 0)
        o = tl.load(o_ptr + n * s_on + t * s_ot + h * s_oh + offs, mask=live, other=0.0)
        acc += w * o.to(tl.float32)
    s_safe = tl.where(s > 0, s, 1.0)
    res = acc / s_safe
    tl.store(out_ptr + t * s_dt + h * s_dh + offs, res.to(out_ptr.dtype.element_ty),
             mask=dmask)
    if tl.program_id(1) == 0:
        lse = tl.where(s > 0, tl.log(s_safe) + m, float("-inf"))
        tl.store(lse_out_ptr + row, lse)


@triton.jit
def scale_own_kernel(o_ptr, lse_ptr, dest_ptr, lse_out_ptr, rank, N: tl.constexpr, H, HS, D,
                     s_ot, s_oh, s_ln, s_lt, s_lh, s_dw, s_dt, s_dh,
                     BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    t = row // H
    h = row % H
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = offs < D
    m, s = _row_stats(lse_ptr, s_ln, t * s_lt + h * s_lh, N)
    l = live_lse(tl.load(lse_ptr + rank * s_ln + t * s_lt + h * s_lh))
    s_safe = tl.where(s > 0, s, 1.0)
    w = tl.exp(l - m) / s_safe
    live = dmask & ((tl.zeros([BLOCK_D], dtype=tl.float32) + w) > 0)
    o = tl.load(o_ptr + t * s_ot + h * s_oh + offs, mask=live, other=0.0)
    dst = dest_ptr + (h // HS) * s_dw + t * s_dt + (h % HS) * s_dh + offs
    tl.store(dst, w * o.to(tl.float32), mask=dmask)
    if tl.program_id(1) == 0:
        tl.store(lse_out_ptr + row, tl.where(s > 0, tl.log(s_safe) + m, float("-inf")))
