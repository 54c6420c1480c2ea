"""The Ulysses fill's parts, its send buffer's layout and checks, and its torch reference
(``fill_torch``): the rules are ``attncomm.ulysses.fill``'s module docstring, which the kernel's
host side (``fill``) follows bit for bit."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from . import fp8 as _fp8

__all__ = ["FillPart", "rms_norm_rope", "send_layout", "fill_torch"]


@dataclasses.dataclass(frozen=True)
class FillPart:
    """One tensor of an exchange and what the fill does to it.

    Attributes:
        x: ``[B, S_r, H, D]`` this rank's sequence shard (any strides), fp16/bf16/fp32.
        ranges: ``ranges[p] = (lo, hi)``: the heads destination rank ``p`` takes (ranges of
            different ranks may overlap: shared KV heads).
        weight: RMSNorm weight ``[D]`` or None (no norm).
        rope: whether RoPE applies (``cos``/``sin`` given to the fill).
    """

    x: torch.Tensor
    ranges: tuple
    weight: torch.Tensor | None = None
    rope: bool = False


def _tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in a fixed pairwise order (adjacent elements added: ``t[2i] +
    t[2i+1]``, recursively; an odd last element is carried): the same bits for any layout or
    device, and the order whose first levels stay inside a GPU thread's registers (a thread
    holds adjacent elements). ``[..., n] → [..., 1]``."""
    n = t.shape[-1]
    while n > 1:
        half = n // 2
        head = t[..., 0:2 * half:2] + t[..., 1:2 * half:2]
        t = torch.cat((head, t[..., 2 * half:]), dim=-1) if n % 2 else head
        n = half + n % 2
    return t


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm over ``D`` then rotate-half (NeoX) RoPE, in fp32, rounded once to ``x.dtype``.

    Arguments:
        x: ``[B, S, H, D]`` (any strides), fp16/bf16/fp32.
        weight: ``[D]`` RMSNorm weight or None (no norm); ``eps`` its epsilon (> 0).
        cos, sin: ``[S, D]`` for the positions of ``x``'s sequence axis, or None (no RoPE).

    Returns ``[B, S, H, D]`` contiguous, ``x.dtype``. Elementwise ops and a fixed-order sum
    only, so the bits do not depend on the layout or the device, and the fill kernel computes
    the same bits.
    """
    xf = x.to(torch.float32).contiguous()
    d = xf.shape[-1]
    if weight is not None:
        t = _tree_sum(xf * xf)
        ms = t / torch.full((), d, dtype=t.dtype, device=t.device)  # see fp8.quantize_rows
        # fp32 sqrt correctly rounded on every device: torch's CPU fp32 sqrt is not (its
        # vector path differs in the last bit); an fp64 sqrt rounded once to fp32 is.
        inv = torch.reciprocal(torch.sqrt((ms + eps).double()).float())
        xf = xf * inv * weight.to(torch.float32)
    if cos is not None:
        c = cos.to(torch.float32)[:, None, :]
        s = sin.to(torch.float32)[:, None, :]
        half = d // 2
        rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
        xf = xf * c + rot * s
    return xf.to(x.dtype)


def send_layout(batch: int, s_r: int, head_dim: int, ranges: Sequence[tuple]):
    """``(htot, starts)`` of a send buffer: ``htot[p]`` heads in region ``p`` (the parts'
    ranges for ``p`` summed), ``starts[p]`` its first element; ``starts[-1]`` extra entry =
    total elements."""
    world = len(ranges[0])
    htot = [sum(r[p][1] - r[p][0] for r in ranges) for p in range(world)]
    starts, acc = [], 0
    for p in range(world):
        starts.append(acc)
        acc += s_r * batch * htot[p] * head_dim
    return htot, starts + [acc]


def _validate_parts(parts: Sequence[FillPart], out, payload_dtype=None):
    """``((B, S_r, row), htot, starts, regions or None, fp8)``; ``out`` is None, a flat send
    buffer or one flat tensor per destination region; ``row``: elements per (token, head) in
    the send buffer (``D``, or ``D + 4`` bytes for the FP8 payload)."""
    x0 = parts[0].x
    b, s_r, _, d = x0.shape
    for p in parts:
        if p.x.dim() != 4 or p.x.shape[0] != b or p.x.shape[1] != s_r or p.x.shape[3] != d:
            raise ValueError(f"fill: parts disagree on [B, S_r, *, D]: {list(p.x.shape)} vs "
                             f"{list(x0.shape)}")
        if p.x.dtype != x0.dtype:
            raise ValueError(f"fill: parts disagree on dtype: {p.x.dtype} vs {x0.dtype}")
    fp8 = _fp8.is_fp8_payload(payload_dtype, x0.dtype)
    row, wire = (_fp8.row_bytes(d), _fp8.WIRE_DTYPE) if fp8 else (d, x0.dtype)
    htot, starts = send_layout(b, s_r, row, [p.ranges for p in parts])
    regions = None if out is None else _validate_out(out, starts, len(htot), wire)
    return (b, s_r, row), htot, starts, regions, fp8


def _validate_out(out, starts, n: int, wire: torch.dtype):
    """None for a flat send buffer of ``starts[-1]`` elements of ``wire``, the list of regions
    for ``n`` flat ones of the regions' sizes; ``ValueError`` for anything else."""
    if isinstance(out, torch.Tensor):
        if out.dim() != 1 or out.numel() != starts[-1] or out.dtype != wire \
                or not out.is_contiguous():
            raise ValueError(f"fill: out must be a contiguous flat {wire} tensor of "
                             f"{starts[-1]} elements, got {list(out.shape)} {out.dtype}")
        return None
    sizes = [starts[p + 1] - starts[p] for p in range(n)]
    got = [(tuple(r.shape), r.dtype, r.is_contiguous()) for r in out]
    if got != [((k,), wire, True) for k in sizes]:
        raise ValueError(f"fill: regions must be contiguous flat {wire} tensors of "
                         f"{sizes} elements, got {got}")
    return list(out)


def _regions(out, starts, htot, b, s_r, row):
    if not isinstance(out, torch.Tensor):
        return [r.view(s_r, b, htot[p], row) for p, r in enumerate(out)]
    return [out[starts[p]:starts[p + 1]].view(s_r, b, htot[p], row) for p in range(len(htot))]


def fill_torch(parts: Sequence[FillPart], eps: float = 0.0, cos: torch.Tensor | None = None,
               sin: torch.Tensor | None = None, out: torch.Tensor | None = None, *,
               payload_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The fill in torch ops (the reference; see the module docstring).

    Arguments:
        parts: the exchange's tensors (same ``B``, ``S_r``, ``D``, dtype).
        eps: RMSNorm epsilon for the parts with a weight.
        cos, sin: ``[S_r, D]`` rows of this shard's global positions (needed when a part has
            ``rope``).
        out: where to write: a flat destination-major send buffer (``send_layout(...)[1][-1]``
            elements, the parts' dtype), or one flat tensor per destination region (e.g. a
            transport's ``SendBuffer.regions``, which may lie in different allocations), or
            None (a new flat buffer).
        payload_dtype: None (or the parts' dtype): the parts' values; ``torch.float8_e4m3fn``:
            the FP8 payload (``fp8``'s rule and wire layout; ``out`` and the regions are then
            uint8, ``D + 4`` bytes per (token, head)).

    Returns ``out`` (the new flat buffer when None). Raises ``ValueError`` for inconsistent
    parts, ``out`` or ``payload_dtype``.
    """
    (b, s_r, row), htot, starts, _, fp8 = _validate_parts(parts, out, payload_dtype)
    out = _new_send_buffer(parts, starts, fp8) if out is None else out
    _torch_fill(parts, [p.x for p in parts], eps, cos, sin,
                _regions(out, starts, htot, b, s_r, row), fp8)
    return out


def _new_send_buffer(parts, starts, fp8: bool) -> torch.Tensor:
    """A flat send buffer for ``parts`` laid out by ``starts`` (uint8 for the FP8 payload)."""
    x = parts[0].x
    return torch.empty(starts[-1], dtype=_fp8.WIRE_DTYPE if fp8 else x.dtype, device=x.device)


def _torch_fill(parts, xs, eps, cos, sin, regions, fp8: bool) -> None:
    """``fill_torch``'s work into ``regions`` (``[S_r, B, htot_p, row]`` views), checked:
    ``parts`` say what to do (their ranges, weights, RoPE), ``xs`` are their tensors."""
    cols = [0] * len(regions)
    for part, y in zip(parts, xs):
        if part.weight is not None or part.rope:
            y = rms_norm_rope(y, part.weight, eps, cos if part.rope else None,
                              sin if part.rope else None)
        if fp8:  # every row once, then its bytes copied to each destination that takes it
            y = _fp8.quantize_pack(y)
        for p, (lo, hi) in enumerate(part.ranges):
            if hi > lo:
                regions[p][:, :, cols[p]:cols[p] + hi - lo].copy_(y[:, :, lo:hi].transpose(0, 1))
                cols[p] += hi - lo
