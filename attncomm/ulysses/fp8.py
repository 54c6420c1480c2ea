"""The FP8 payload of the Ulysses q/k/v exchange: quantization per (token, head) row and its wire
layout.

**Rule.** A row is the ``D`` values of one (token, head); it travels as ``D`` e4m3fn values
(``torch.float8_e4m3fn``, OCP FP8: 4 exponent bits, 3 mantissa bits, no infinities, largest
finite 448) and one fp32 scale:

- ``amax = max |x|`` over the row's *finite* elements (0 when there are none), exact;
- ``scale = amax / 448`` (one IEEE fp32 division, round to nearest even); ``scale`` is finite and
  ≥ 0 on every row;
- ``q = e4m3fn(clamp(x / d, −448, 448))`` with ``d = scale`` (``d = 1`` when ``scale == 0``):
  one IEEE fp32 division, saturation to the largest finite value, then round to nearest even
  into e4m3fn, subnormals included (what ``Tensor.to(torch.float8_e4m3fn)`` does in range);
- a non-finite element (NaN, ±inf) becomes the NaN byte ``0x7F`` whatever its sign: e4m3fn has
  no infinity, and saturating ±inf to ±448·scale would be silently wrong. So NaN and inf
  positions arrive as NaN, every finite element of the same row keeps its value (within the
  bound below) and the scale comes from the finite ones.
- dequantization on arrival: ``x̂ = dtype(float32(q) · scale)`` (one fp32 product, rounded once
  to the input dtype). A zero row (``scale == 0``) round-trips exactly, signed zeros included
  (``±0 / 1 = ±0``, ``±0 · 0 = ±0``).

**Error bound** (derived from the steps above; ``tests/test_ulysses_fp8.py`` checks it in fp64
on random rows from fixed seeds, tiny and huge rows and special values). For a finite element
``x`` of a row with ``amax = a`` and scale ``s``, in the output dtype with unit roundoff ``u``
(bf16 2⁻⁸, fp16 2⁻¹¹, fp32 2⁻²⁴) and half its smallest subnormal ``t`` (bf16 2⁻¹³⁴, fp16 2⁻²⁵,
fp32 2⁻¹⁵⁰)::

    |x̂ − x| ≤ (2⁻⁴ + 2⁻²³)·|x| + 2⁻¹⁰·s + u·|x̂| + 2⁻²²·a + t + 2⁻¹⁴⁰

2⁻⁴|x|: half an e4m3 ulp relative to the value (3 mantissa bits) in e4m3's normal range;
2⁻¹⁰·s: half the subnormal spacing 2⁻⁹ below 2⁻⁶; u·|x̂|: the rounding to the output dtype;
2⁻²²·a: the fp32 division and product and the saturation of the amax element; 2⁻¹⁴⁰: a row
whose scale is subnormal or 0 in fp32 (``a < 448·2⁻¹²⁶``: tiny fp32 or bf16 rows only), where
the scale's absolute rounding (2⁻¹⁵⁰ × 448) dominates. Relative to the row's amax, the largest
e4m3 half-ulp (16, at 448) gives ``|x̂ − x| ≤ a/28 + u·a`` up to those fp32 terms: about 3.6 %
of the amax, under the 2⁻⁴ one might expect. ``roundtrip_bound`` computes the element-wise bound.
Dequantization never overflows: ``|float(q)·scale| ≤ 448·scale ≤ amax·(1 + 2⁻²⁴)``, which
could round past the largest fp32 only for ``amax`` = the largest fp32 itself, and that row
comes back finite (tested).

**Wire layout** ("row-appended scales"). Each row's scale travels next to its values: a row is
``D + 4`` bytes, the ``D`` e4m3 bytes then the scale's 4 bytes (fp32, the machine's byte order,
little-endian on every platform torch and CUDA run on). A send buffer is then the bf16 path's
destination-major layout with uint8 elements and ``row_bytes(D) = D + 4`` in place of ``D``
(region ``p``: ``[S_r, B, htot_p, D + 4]`` bytes), so the exchange is one plan over bytes
(``payload_plan``: ``seq_to_head_plan`` with head_dim ``D + 4``), tiled as before, and every
transport moves it unchanged; the receiver's final buffer is ``[S, B, htot, D + 4]`` bytes and
``dequantize_packed`` turns it into ``[S, B, htot, D]`` of the input dtype in one op (a strided
fp32 view reads the scales with no copy when ``D % 4 == 0``, which the Triton fill needs).
The rejected alternative, scales as a second part of the plan, splits every source's region in
two blocks: the receiver would dequantize per source, and ``all_to_all_single`` could no longer
land the payload as ``[S, B, htot, D]`` in one tiled block. Wire bytes for bf16 inputs:
``(D + 4) / 2D`` of the bf16 exchange (0.516 at D = 128).

The rule matches the DCP query gather's ``quantize_e4m3`` (``dcp/query_gather/query_math.py``)
where both are defined (saturation, round to nearest even, the NaN byte); the scale there is
the caller's per-head value, here the row's amax / 448. OCP 8-bit floating point specification
(OFP8), 2023; per-token scaling as in SGLang's ``per_token_quant_fp8``.
"""
from __future__ import annotations

import torch

from .layout import ExchangePlan, seq_to_head_plan

__all__ = ["FP8_DTYPE", "FP8_MAX", "SCALE_BYTES", "WIRE_DTYPE", "is_fp8_payload", "row_bytes",
           "quantize_rows", "dequantize_rows", "pack_rows", "unpack_rows", "quantize_pack",
           "dequantize_packed", "payload_plan", "roundtrip_bound"]

#: The payload format (OCP e4m3, no infinities).
FP8_DTYPE = torch.float8_e4m3fn
#: Its largest finite value: ``scale = amax / FP8_MAX``.
FP8_MAX = 448.0
#: Bytes of one row's scale (fp32) appended to its ``D`` payload bytes.
SCALE_BYTES = 4
#: The element type the transports move for an FP8 payload.
WIRE_DTYPE = torch.uint8
_NAN_BYTE = 0x7F  # the one NaN byte written (positive; e4m3fn NaN is S.1111.111)
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                  torch.float32: 2.0 ** -24}
_HALF_TINY = {torch.bfloat16: 2.0 ** -134, torch.float16: 2.0 ** -25, torch.float32: 2.0 ** -150}


def is_fp8_payload(payload_dtype, dtype: torch.dtype) -> bool:
    """Whether ``payload_dtype`` asks for the FP8 payload for inputs of ``dtype``: None or
    ``dtype`` itself → False (the exchange moves ``dtype``), ``torch.float8_e4m3fn`` → True.

    Raises ``ValueError`` for any other value, or FP8 with inputs not fp16/bf16/fp32."""
    if payload_dtype is None or payload_dtype == dtype:
        return False
    if payload_dtype != FP8_DTYPE:
        raise ValueError(f"payload_dtype must be None, the input dtype {dtype} or "
                         f"torch.float8_e4m3fn, got {payload_dtype!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"payload_dtype=torch.float8_e4m3fn needs fp16/bf16/fp32 inputs, "
                         f"got {dtype}")
    return True


def row_bytes(head_dim: int) -> int:
    """Bytes of one row on the wire: ``head_dim`` e4m3 values + the 4-byte scale."""
    return head_dim + SCALE_BYTES


def _validate_x(x: torch.Tensor, what: str) -> None:
    if x.dtype not in _DTYPES or x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{what}: x must be fp16/bf16/fp32 with a last dim ≥ 1, got "
                         f"{list(x.shape)} {x.dtype}")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize every row (last dim) of ``x`` by the module's rule.

    Arguments:
        x: ``[..., D]`` fp16/bf16/fp32, any strides.

    Returns:
        ``(q, scale)``: ``q [..., D]`` ``torch.float8_e4m3fn`` (contiguous) and ``scale [...]``
        fp32 (finite, ≥ 0), with ``x ≈ float(q) · scale`` within ``roundtrip_bound``.

    Raises ``ValueError`` for another dtype or an empty last dim.
    """
    _validate_x(x, "quantize_rows")
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf)
    amax = torch.where(finite, xf.abs(), 0.0).amax(dim=-1)
    # A 0-dim tensor divisor on amax's device: torch's CUDA division by a Python scalar (a CPU
    # scalar) multiplies by its reciprocal (amax · fl(1/448) is not amax / 448 rounded once);
    # by a device tensor it divides, on every device, in eager mode (inductor may turn a
    # division by a constant back into a product).
    scale = amax / torch.full((), FP8_MAX, dtype=torch.float32, device=amax.device)
    div = torch.where(scale > 0, scale, 1.0)
    v = (xf / div.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    q = v.to(FP8_DTYPE)
    q.view(torch.uint8).masked_fill_(~finite, _NAN_BYTE)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``dtype(float32(q) · scale)``, one fp32 product rounded once.

    Arguments:
        q: ``[..., D]`` ``torch.float8_e4m3fn`` (any strides). scale: ``[...]`` fp32.
        dtype: the result's dtype (the input dtype of the exchange: fp16/bf16/fp32).
        out: optional ``[..., D]`` tensor of ``dtype`` to write into.

    Returns ``[..., D]`` of ``dtype`` (NaN bytes → NaN). Raises ``ValueError`` for shapes or
    dtypes that do not fit.
    """
    if q.dtype != FP8_DTYPE or scale.dtype != torch.float32 or \
            tuple(q.shape[:-1]) != tuple(scale.shape) or dtype not in _DTYPES:
        raise ValueError(f"dequantize_rows: q [..., D] float8_e4m3fn and scale [...] fp32 to "
                         f"fp16/bf16/fp32, got q {list(q.shape)} {q.dtype}, scale "
                         f"{list(scale.shape)} {scale.dtype}, dtype {dtype}")
    y = q.to(torch.float32) * scale.unsqueeze(-1)
    if out is None:
        return y.to(dtype)
    return out.copy_(y)


def pack_rows(q: torch.Tensor, scale: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The wire layout of quantized rows: ``[..., D + 4]`` bytes, each row's ``D`` e4m3 bytes
    then its fp32 scale's 4 bytes (bit-exact: ``unpack_rows`` gives back the same bits).

    Arguments:
        q: ``[..., D]`` ``torch.float8_e4m3fn``. scale: ``[...]`` fp32.
        out: optional ``[..., D + 4]`` uint8 tensor (any strides with a dense last dim, e.g. a
            region of a send buffer) to write into.
    """
    if q.dtype != FP8_DTYPE or scale.dtype != torch.float32 or \
            tuple(q.shape[:-1]) != tuple(scale.shape):
        raise ValueError(f"pack_rows: q [..., D] float8_e4m3fn and scale [...] fp32, got "
                         f"{list(q.shape)} {q.dtype} and {list(scale.shape)} {scale.dtype}")
    d = q.shape[-1]
    shape = (*q.shape[:-1], row_bytes(d))
    if out is None:
        out = torch.empty(shape, dtype=WIRE_DTYPE, device=q.device)
    elif tuple(out.shape) != shape or out.dtype != WIRE_DTYPE:
        raise ValueError(f"pack_rows: out must be uint8 {list(shape)}, got {list(out.shape)} "
                         f"{out.dtype}")
    out[..., :d].copy_(q.view(torch.uint8))
    out[..., d:].copy_(scale.contiguous().unsqueeze(-1).view(torch.uint8))
    return out


def unpack_rows(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [..., D] float8_e4m3fn, scale [...] fp32)`` of a ``[..., D + 4]`` uint8 wire buffer
    (``pack_rows``' layout): views of ``buf`` (no copy) when ``D % 4 == 0`` and the buffer's
    strides and offset are multiples of 4 bytes, else the scale is a copy. Bit-exact."""
    if buf.dtype != WIRE_DTYPE or buf.dim() < 1 or buf.shape[-1] <= SCALE_BYTES:
        raise ValueError(f"unpack_rows: buf must be uint8 [..., D + 4] with D ≥ 1, got "
                         f"{list(buf.shape)} {buf.dtype}")
    d = buf.shape[-1] - SCALE_BYTES
    q = buf[..., :d].view(FP8_DTYPE)
    tail = buf[..., d:]
    try:
        scale = tail.view(torch.float32)
    except RuntimeError:  # unaligned: the 4 bytes are not an fp32 element of the storage
        scale = tail.contiguous().view(torch.float32)
    return q, scale.squeeze(-1)


def quantize_pack(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pack_rows(*quantize_rows(x), out)``: ``x [..., D]`` → ``[..., D + 4]`` uint8."""
    q, scale = quantize_rows(x)
    return pack_rows(q, scale, out)


def dequantize_packed(buf: torch.Tensor, dtype: torch.dtype,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The receiver's step: ``[..., D + 4]`` uint8 (e.g. a final buffer viewed as
    ``[S, B, htot, D + 4]``) → ``[..., D]`` of ``dtype`` (``dequantize_rows``)."""
    q, scale = unpack_rows(buf)
    return dequantize_rows(q, scale, dtype, out)


def payload_plan(batch: int, seq_lens: tuple, head_dim: int,
                 part_ranges: tuple) -> ExchangePlan:
    """The FP8 exchange's plan: ``seq_to_head_plan`` over bytes with ``row_bytes(head_dim)``
    per (token, head); final buffer on rank ``p``: ``[S, B, htot_p, D + 4]`` uint8. Moved with
    ``dtype=WIRE_DTYPE``."""
    return seq_to_head_plan(batch, tuple(seq_lens), row_bytes(head_dim), tuple(part_ranges))


def roundtrip_bound(x: torch.Tensor, scale: torch.Tensor, x_hat: torch.Tensor) -> torch.Tensor:
    """The module docstring's element-wise bound on ``|x̂ − x|`` as an fp64 ``[..., D]`` tensor
    (for finite ``x``; the caller compares there).

    Arguments:
        x: ``[..., D]`` the rows quantized (fp16/bf16/fp32). scale: ``[...]`` their scales.
        x_hat: ``[..., D]`` the dequantized rows (``x.dtype``).
    """
    _validate_x(x, "roundtrip_bound")
    x64 = x.to(torch.float64)
    a = torch.where(torch.isfinite(x64), x64.abs(), 0.0).amax(dim=-1, keepdim=True)
    s = scale.to(torch.float64).unsqueeze(-1)
    u, t = _UNIT_ROUNDOFF[x.dtype], _HALF_TINY[x.dtype]
    return ((2.0 ** -4 + 2.0 ** -23) * x64.abs() + 2.0 ** -10 * s
            + u * x_hat.to(torch.float64).abs() + 2.0 ** -22 * a + t + 2.0 ** -140)
