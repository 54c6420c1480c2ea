"""The ring merge kernel as measured in the first device call (before the grid carried (token
block, head, batch) and DV became a compile-time constant), verbatim, for the A/B in
scripts/ring_one_gpu.py. Not part of the package."""
from __future__ import annotations

import torch

from attncomm.dcp.lse_merge import combine as _combine

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
    from attncomm.dcp.lse_merge.combine import _live_lse  # the rule: a non-finite LSE is empty

    @triton.jit
    def _merge_step_kernel(acc_ptr, acc_lse_ptr, o_ptr, lse_ptr, n_rows, S, H, DV,
                           sa_b, sa_s, sa_h, sla_b, sla_s, sla_h,
                           so_b, so_s, so_h, sl_b, sl_s, sl_h,
                           BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                           D_CHUNKS: tl.constexpr):
        # One program: BLOCK_R (batch, token, head) rows, every column of each (in BLOCK_D
        # chunks, so the program that reads a row's LSE is the only one that rewrites it).
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        rmask = rows < n_rows
        h = rows % H
        t = rows // H
        s = t % S
        b = t // S
        la_off = b * sla_b + s * sla_s + h * sla_h
        l0 = _live_lse(tl.load(acc_lse_ptr + la_off, mask=rmask, other=float("-inf")))
        l1 = _live_lse(tl.load(lse_ptr + b * sl_b + s * sl_s + h * sl_h, mask=rmask,
                               other=float("-inf")))
        m = tl.maximum(l0, l1)
        m = tl.where(m == float("-inf"), 0.0, m)
        w0 = tl.exp(l0 - m)
        w1 = tl.exp(l1 - m)
        tot = w0 + w1
        s_safe = tl.where(tot > 0, tot, 1.0)
        a_row = b * sa_b + s * sa_s + h * sa_h
        o_row = b * so_b + s * so_s + h * so_h
        live0 = rmask & (w0 > 0)  # a zero-weight source is never read
        live1 = rmask & (w1 > 0)
        for c in range(D_CHUNKS):
            cols = c * BLOCK_D + tl.arange(0, BLOCK_D)
            cmask = cols < DV
            a_ptrs = acc_ptr + a_row[:, None] + cols[None, :]
            a = tl.load(a_ptrs, mask=live0[:, None] & cmask[None, :], other=0.0)
            o = tl.load(o_ptr + o_row[:, None] + cols[None, :],
                        mask=live1[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
            acc += w0[:, None] * a
            acc += w1[:, None] * o
            tl.store(a_ptrs, acc / s_safe[:, None], mask=rmask[:, None] & cmask[None, :])
        tl.store(acc_lse_ptr + la_off, tl.where(tot > 0, tl.log(s_safe) + m, float("-inf")),
                 mask=rmask)


def merge_block_triton(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor) -> None:
    """The Triton path of ``merge_block`` (one launch, in place)."""
    b, s, h, dv = acc.shape
    n_rows = b * s * h
    if n_rows == 0 or dv == 0:
        return
    if out.stride(3) != 1:
        out = out.contiguous()
    block_d = min(256, triton.next_power_of_2(max(dv, 16)))
    block_r = max(1, 2048 // block_d)
    grid = (triton.cdiv(n_rows, block_r),)
    _merge_step_kernel[grid](acc, acc_lse, out, lse, n_rows, s, h, dv,
                             acc.stride(0), acc.stride(1), acc.stride(2),
                             acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
                             out.stride(0), out.stride(1), out.stride(2),
                             lse.stride(0), lse.stride(1), lse.stride(2),
                             BLOCK_R=block_r, BLOCK_D=block_d,
                             D_CHUNKS=triton.cdiv(dv, block_d), num_warps=4)


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
