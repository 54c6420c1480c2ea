"""The single-process definitions of the DCP query gather: the RoPE every backend applies and
the FP8 quantization, each computed bit for bit by every backend (``attncomm.dcp.query_gather``, the
``symm`` kernels in ``attncomm.dcp.query_gather.symm_kernels``)."""
from __future__ import annotations

import math

import torch

__all__ = ["rotate_tail", "quantize_e4m3", "FP8_DTYPE", "FP8_MAX"]

#: The FP8 query output format (OCP e4m3, no infinities: FlashInfer/FlashMLA/FA3 FP8 inputs).
FP8_DTYPE = torch.float8_e4m3fn
#: Its largest finite value; quantization saturates to ±FP8_MAX.
FP8_MAX = 448.0
_FP8_NAN = 0x7F  # the one NaN byte every backend writes (positive; e4m3fn NaN is S.1111.111)
# The canonical quiet NaN of each query dtype, as the integer view that holds its bits.
_CANONICAL_NAN = {torch.bfloat16: (torch.int16, 0x7FC0), torch.float16: (torch.int16, 0x7E00),
                  torch.float32: (torch.int32, 0x7FC00000)}


def rotate_tail(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half (NeoX) RoPE on the last ``R`` dims of every head, in fp32, rounded once.

    Arguments:
        q: ``[T, h, D]`` fp16/bf16/fp32.
        cos, sin: ``[T, R]`` (any float dtype, converted to fp32 exactly), ``R`` even, ``R ≤ D``.
        out: optional ``[T, h, D]`` tensor of ``q``'s dtype to write into (may be ``q``).

    Returns:
        ``[T, h, D]`` in ``q.dtype``: dims ``[0, D−R)`` copied, and with ``x`` the last ``R``
        dims in fp32, ``x1, x2`` its halves: ``x·cos + (−x2, x1)·sin``, two products and one
        sum per value, no fused multiply-add (the ``symm`` kernel computes the same bits). A
        NaN there is stored as the dtype's canonical quiet NaN (bf16 ``0x7FC0``, fp16
        ``0x7E00``, fp32 ``0x7FC00000``): the bits of a NaN from fp32 arithmetic and rounding
        differ between CPU, GPU and kernels, the canonical one does not.
    """
    D = q.shape[-1]
    R = cos.shape[-1]
    half = R // 2
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if out.data_ptr() != q.data_ptr():
        out[..., :D - R].copy_(q[..., :D - R])
    if R == 0:
        return out
    x = q[..., D - R:].to(torch.float32)
    c = cos.to(torch.float32)[:, None, :]
    s = sin.to(torch.float32)[:, None, :]
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    y = x * c + rot * s
    tail = out[..., D - R:]
    tail.copy_(y)
    bits, nan = _CANONICAL_NAN[out.dtype]
    tail.view(bits).masked_fill_(torch.isnan(y), nan)
    return out



def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 (e4m3fn) quantization with a per-head dequantization scale: the definition every
    backend of ``DcpQueryGather(out_dtype=torch.float8_e4m3fn)`` computes bit for bit.

    Arguments:
        x: ``[T, h, D]`` fp32 (the query after RoPE, not rounded to the query dtype).
        scale: ``[h]`` fp32, finite and > 0: head ``j``'s scale ``s_j``.
        out: optional ``[T, h, D]`` ``float8_e4m3fn`` (or uint8) tensor to write into.

    Returns:
        ``[T, h, D]`` ``float8_e4m3fn``: ``e4m3fn(clamp(x / s_j, −448, 448))``: one IEEE fp32
        division (round to nearest even), saturation to the largest finite e4m3 value (±inf
        and finite overflow → ±448, e4m3fn having no infinity), then round to nearest even
        into e4m3fn (subnormals included; what ``Tensor.to(torch.float8_e4m3fn)`` does in
        range). NaN → the byte ``0x7F`` whatever its sign. So ``x ≈ float(q) · s_j``: the
        scale is what the attention kernel multiplies back (a "descale").
    """
    v = x / scale.to(torch.float32)[None, :, None]
    v.clamp_(-FP8_MAX, FP8_MAX)  # NaN stays NaN
    if out is None:
        out = torch.empty(v.shape, dtype=FP8_DTYPE, device=v.device)
    b = out.view(torch.uint8)
    b.view(FP8_DTYPE).copy_(v)
    b.masked_fill_(torch.isnan(v), _FP8_NAN)
    return out


def _scale_error(q_scale, num_heads: int) -> str | None:
    """Why ``q_scale`` is not a valid per-head scale (None if it is); host reads only."""
    if q_scale is None:
        return "out_dtype=torch.float8_e4m3fn needs q_scale ([H] fp32 or a float)"
    if isinstance(q_scale, torch.Tensor):
        if q_scale.dim() != 1 or q_scale.numel() != num_heads or \
                not q_scale.is_floating_point():
            return (f"q_scale must be a float or a [H={num_heads}] float tensor, got "
                    f"{tuple(q_scale.shape)} {q_scale.dtype}")
        vals = q_scale.detach().to("cpu", torch.float32)
    elif isinstance(q_scale, (int, float)) and not isinstance(q_scale, bool):
        vals = torch.full((num_heads,), float(q_scale), dtype=torch.float32)
    else:
        return f"q_scale must be a float or a [H] tensor, got {type(q_scale).__name__}"
    bad = [i for i, v in enumerate(vals.tolist()) if not (math.isfinite(v) and v > 0)]
    if bad:
        return f"q_scale must be finite and > 0 (as fp32); heads {bad[:8]} are not"
    return None


def _scale_f32(q_scale, num_heads: int) -> torch.Tensor:
    if isinstance(q_scale, torch.Tensor):
        return q_scale.detach().to("cpu", torch.float32).clone()
    return torch.full((num_heads,), float(q_scale), dtype=torch.float32)
