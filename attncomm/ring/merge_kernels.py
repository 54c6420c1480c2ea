"""The ring's online-merge Triton kernel (host side, rule and torch path: ``merge`` beside it).

Importing this module needs Triton (``attncomm._triton``).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..dcp.lse_merge.combine_kernels import live_lse  # the rule: a non-finite LSE is empty

__all__ = ["merge_step_kernel"]


@triton.jit
def merge_step_kernel(acc_ptr, acc_lse_ptr, o_ptr, lse_ptr, S, H,
                       sa_b, sa_s, sa_h, sla_b, sla_s, sla_h,
                       so_b, so_s, so_h, sl_b, sl_s, sl_h,
                       DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # One program: BLOCK_S consecutive tokens of one (batch, head), every column (in BLOCK_D
    # chunks, so the program that reads a row's LSE is the only one that rewrites it). The
    # grid is (token block × head, batch), the head fastest: programs that run at the same
    # time cover whole token rows of the state and the block (H·Dv contiguous elements), not
    # one head's rows H·Dv apart (measured: benchmarks/results/ring-merge-grid-*.md). One
    # integer division per program, none per row; with DV a compile-time constant the column
    # mask folds away, so the row loads vectorise.
    pid = tl.program_id(0)
    s = (pid // H) * BLOCK_S + tl.arange(0, BLOCK_S)
    smask = s < S
    s = s.to(tl.int64)  # offsets in int64: a state may exceed 2³¹ elements
    h = (pid % H).to(tl.int64)
    b = tl.program_id(1).to(tl.int64)
    la_off = b * sla_b + h * sla_h + s * sla_s
    l0 = live_lse(tl.load(acc_lse_ptr + la_off, mask=smask, other=float("-inf")))
    l1 = live_lse(tl.load(lse_ptr + b * sl_b + h * sl_h + s * sl_s, mask=smask,
                           other=float("-inf")))
    m = tl.maximum(l0, l1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w0 = tl.exp(l0 - m)
    w1 = tl.exp(l1 - m)
    tot = w0 + w1
    s_safe = tl.where(tot > 0, tot, 1.0)
    a_row = acc_ptr + b * sa_b + h * sa_h + s * sa_s
    o_row = o_ptr + b * so_b + h * so_h + s * so_s
    live0 = smask & (w0 > 0)  # a zero-weight source is never read
    live1 = smask & (w1 > 0)
    for c in tl.static_range(0, DV, BLOCK_D):
        cols = c + tl.arange(0, BLOCK_D)
        cm = cols < DV  # all true when BLOCK_D divides DV (folded at compile time)
        a = tl.load(a_row[:, None] + cols[None, :], mask=live0[:, None] & cm[None, :],
                    other=0.0)
        o = tl.load(o_row[:, None] + cols[None, :], mask=live1[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
        acc += w0[:, None] * a
        acc += w1[:, None] * o
        tl.store(a_row[:, None] + cols[None, :], acc / s_safe[:, None],
                 mask=smask[:, None] & cm[None, :])
    tl.store(acc_lse_ptr + la_off, tl.where(tot > 0, tl.log(s_safe) + m, float("-inf")),
             mask=smask)
