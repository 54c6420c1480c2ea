"""The ring's online LSE merge: fold one block's partial output into the running state.

The state of a ring forward is ``acc [B, S_r, H, Dv]`` fp32 and ``acc_lse [B, S_r, H]`` fp32,
starting empty (``acc_lse = −inf``; ``acc`` is then never read). Each computed block's
``(out, lse)`` is merged into the rows it covers with the DCP merge's math and special-value rule
(``attncomm/dcp/lse_merge/combine.py``, docs/API.md "Special values"): the state and the block
are two sources of one ``combine`` with N = 2, so a non-finite LSE (−inf, +inf, NaN: a fully
masked block) is an empty source whose payload is never read, and a row empty in every block ends
as exactly 0 with LSE −inf. The torch path *is* ``combine_torch`` on the pair; the Triton kernel
below runs the same fp32 operations in the same order (``combine``'s ``_live_lse`` rule, weights
``exp(L − m)`` with ``m := 0`` for an all-empty row, ``0 + w0·acc + w1·out``, one guarded divide)
in place, reading each operand once (the state fp32, the block in its own dtype), which is what
keeps the per-step merge a small fraction of the attention it follows.

Which path: ``combine.use_triton`` (CUDA tensors, or ``ATTNCOMM_COMBINE_IMPL=triton`` for the
interpreter tests on CPU).
"""
from __future__ import annotations

import torch

from ..dcp.lse_merge import combine as _combine

__all__ = ["merge_block", "merge_block_torch", "merge_block_triton", "new_state"]

try:  # Triton is optional on CPU machines
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001
    triton = None
    tl = None


def new_state(b: int, s: int, h: int, dv: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty state: ``acc [B, S, H, Dv]`` fp32 (uninitialised: an empty source is never
    read) and ``acc_lse [B, S, H]`` fp32 filled with −inf."""
    acc = torch.empty(b, s, h, dv, dtype=torch.float32, device=device)
    acc_lse = torch.full((b, s, h), float("-inf"), dtype=torch.float32, device=device)
    return acc, acc_lse


def merge_block_torch(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
    """The torch path of ``merge_block``: ``combine_torch`` on the (state, block) pair."""
    b, s, h, dv = acc.shape
    outs = torch.stack([acc.reshape(b * s, h, dv), out.reshape(b * s, h, dv).float()])
    lses = torch.stack([acc_lse.reshape(b * s, h), lse.reshape(b * s, h).float()])
    res, res_lse = _combine.combine_torch(outs, lses, torch.float32)
    acc.copy_(res.view(b, s, h, dv))
    acc_lse.copy_(res_lse.view(b, s, h))


if triton is not None:
    from ..dcp.lse_merge.combine import _live_lse  # the rule: a non-finite LSE is empty

    @triton.jit
    def _merge_step_kernel(acc_ptr, acc_lse_ptr, o_ptr, lse_ptr, S,
                           sa_b, sa_s, sa_h, sla_b, sla_s, sla_h,
                           so_b, so_s, so_h, sl_b, sl_s, sl_h,
                           DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
        # One program: BLOCK_S consecutive tokens of one (batch, head), every column (in BLOCK_D
        # chunks, so the program that reads a row's LSE is the only one that rewrites it). The
        # grid carries (token block, head, batch): no per-row integer division, and with DV a
        # compile-time constant the column mask folds away, so the row loads vectorise.
        s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        smask = s < S
        s = s.to(tl.int64)  # offsets in int64: a state may exceed 2³¹ elements
        h = tl.program_id(1).to(tl.int64)
        b = tl.program_id(2).to(tl.int64)
        la_off = b * sla_b + h * sla_h + s * sla_s
        l0 = _live_lse(tl.load(acc_lse_ptr + la_off, mask=smask, other=float("-inf")))
        l1 = _live_lse(tl.load(lse_ptr + b * sl_b + h * sl_h + s * sl_s, mask=smask,
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


def merge_block_triton(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor) -> None:
    """The Triton path of ``merge_block`` (one launch, in place)."""
    b, s, h, dv = acc.shape
    if b * s * h == 0 or dv == 0:
        return
    if out.stride(3) != 1:
        out = out.contiguous()
    block_d = min(128, triton.next_power_of_2(max(dv, 16)))
    block_s = max(1, 2048 // block_d)
    grid = (triton.cdiv(s, block_s), h, b)
    _merge_step_kernel[grid](acc, acc_lse, out, lse, s,
                             acc.stride(0), acc.stride(1), acc.stride(2),
                             acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
                             out.stride(0), out.stride(1), out.stride(2),
                             lse.stride(0), lse.stride(1), lse.stride(2),
                             DV=dv, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)


def merge_block(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                lse: torch.Tensor) -> None:
    """Merge one block into the state, in place.

    Arguments:
        acc: ``[B, s, H, Dv]`` fp32, unit stride on Dv (a row slice of the state is fine).
        acc_lse: ``[B, s, H]`` fp32, the state's LSE (base e) for the same rows.
        out: ``[B, s, H, Dv]`` fp16/bf16/fp32, the block's partial output.
        lse: ``[B, s, H]`` fp32 base e; a non-finite value marks a row of the block as empty.
    """
    if _combine.use_triton(acc):
        merge_block_triton(acc, acc_lse, out, lse)
    else:
        merge_block_torch(acc, acc_lse, out, lse)
