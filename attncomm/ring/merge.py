"""The ring's online LSE merge: fold one block's partial output into the running state.

The state of a ring forward is ``acc [B, S_r, H, Dv]`` fp32 and ``acc_lse [B, S_r, H]`` fp32,
starting empty (``acc_lse = −inf``; ``acc`` is then never read). Each computed block's
``(out, lse)`` is merged into the rows it covers with the DCP merge's math and special-value rule
(``attncomm/dcp/lse_merge/combine.py``, docs/API.md "Special values"): the state and the block
are two sources of one ``combine`` with N = 2, so a non-finite LSE (−inf, +inf, NaN: a fully
masked block) is an empty source whose payload is never read, and a row empty in every block ends
as exactly 0 with LSE −inf. The torch path *is* ``combine_torch`` on the pair; the Triton kernel
in ``merge_kernels`` runs the same fp32 operations in the same order (``combine_kernels.live_lse``,
weights ``exp(L − m)`` with ``m := 0`` for an all-empty row, ``0 + w0·acc + w1·out``, one guarded
divide) in place, reading each operand once (the state fp32, the block in its own dtype), which
is what keeps the per-step merge a small fraction of the attention it follows.

Which path: ``combine.use_triton`` (CUDA tensors, or ``ATTNCOMM_COMBINE_IMPL=triton`` for the
interpreter tests on CPU). A ring forward merges once per step with the same shapes and strides:
after the first launch of a key (shapes, strides, dtype, alignment) the kernel is launched
again through the compiled kernel (``compiled_launch.LaunchCache``), so the host's share of a
step is the launch itself, not Triton's argument binding.
"""
from __future__ import annotations

import torch

from .. import _triton
from ..compiled_launch import LaunchCache, alignment_key
from ..dcp.lse_merge import combine as _combine

__all__ = ["merge_block", "merge_block_torch", "merge_block_triton", "new_state"]

if _triton.REASON is None:
    from . import merge_kernels as _k
else:
    _k = None
_LAUNCHES = LaunchCache((_k.merge_step_kernel,) if _k is not None else ())


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


def merge_block_triton(acc: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor) -> None:
    """The Triton path of ``merge_block`` (one launch, in place)."""
    b, s, h, dv = acc.shape
    if b * s * h == 0 or dv == 0:
        return
    if out.stride(3) != 1:
        out = out.contiguous()
    block_d = min(128, 1 << (max(dv, 16) - 1).bit_length())
    block_s = max(1, 2048 // block_d)
    grid = (-(-s // block_s) * h, b)
    args = (acc, acc_lse, out, lse, s, h, acc.stride(0), acc.stride(1), acc.stride(2),
            acc_lse.stride(0), acc_lse.stride(1), acc_lse.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            lse.stride(0), lse.stride(1), lse.stride(2))

    def launch() -> None:
        _k.merge_step_kernel[grid](*args, DV=dv, BLOCK_S=block_s, BLOCK_D=block_d,
                                   num_warps=4)

    key = (acc.device, tuple(acc.shape), args[4:], acc.dtype, acc_lse.dtype, out.dtype,
           lse.dtype, alignment_key(args[:4]))
    _LAUNCHES.launch(key, launch, args[:4])


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
