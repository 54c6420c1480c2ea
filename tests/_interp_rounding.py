"""Make the Triton interpreter convert between fp32 and bf16 as the GPU does.

Triton 3.6's interpreter truncates fp32 → bf16 (``cast_impl`` passes no rounding mode, and its
RTNE branch rounds ties up), and widens a subnormal bf16 to the wrong fp32 (its normalisation
loop is off for two formats with one exponent range), so a kernel that is bitwise equal to torch
on the GPU would differ under ``TRITON_INTERPRET=1``. Here fp32 → bf16 rounds to nearest even
(torch's conversion) and bf16 → fp32 is the exact widening (the 16 bits shifted up). fp32 → e4m3fn
(``tl.float8e4nv``) converts as sm_89+'s ``cvt.rn.satfinite.e4m3x2.f32``: round to nearest even,
subnormals included, finite values past ±448 saturated (the interpreter's own rounds ties up and
does not saturate); NaN → 0x7F. ``tl.fma`` on fp32 rounds once, as the GPU's ``fma.rn.f32``
(the interpreter's multiplies, rounds, adds and rounds again). ``tl.maximum`` and
``tl.minimum`` (``propagate_nan`` NONE: LLVM's ``maxnum``/``minnum``, the GPU's
``max.f32``/``min.f32``) return the other operand where one is NaN, as IEEE 754-2008's
maxNum does (the interpreter's propagate the NaN, while its ``tl.max`` reduction skips NaNs:
``tl.max(tl.maximum(a, b))`` there loses an ``a`` paired with a NaN ``b``). Import this before
launching kernels there.
"""
from __future__ import annotations

import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter


def e4m3_satfinite(x: np.ndarray) -> np.ndarray:
    """fp32 → e4m3fn bytes as ``cvt.rn.satfinite``: RNE, ±448 past the range, NaN → 0x7F."""
    t = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    q = t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(t.isnan(), 0x7F, q)
    return q.numpy().astype(np.uint8).reshape(np.shape(x))


def fma_f32(a, b, c) -> np.ndarray:
    """``RN(a·b + c)`` in fp32, rounded once (the GPU's ``fma.rn.f32``), for fp32 arrays.

    In fp64 the product is exact (48 bits) and TwoSum gives the sum's rounding error; moving an
    inexact sum with an even last bit one step toward the error rounds it to odd, and a
    round-to-odd result of ≥ 24 + 2 bits rounds to fp32 as the exact value would (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding
    to odd", IEEE Trans. Computers 2008). Subnormal and overflowing results included."""
    a, b, c = (np.asarray(v, dtype=np.float32).astype(np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        p = a * b
        s = p + c
        bv = s - p
        err = (p - (s - bv)) + (c - bv)
        bits = s.view(np.int64)
        odd = (err != 0) & ((bits & 1) == 0) & np.isfinite(s)
        bits = np.where(odd, bits + np.where((err > 0) == (s > 0), 1, -1), bits)
        return bits.view(np.float64).astype(np.float32)


def _patch() -> None:
    builder = interpreter.InterpreterBuilder
    orig = builder.cast_impl
    if getattr(orig, "_attncomm_rtne", False):
        return

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            bits = t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
            return interpreter.TensorHandle(bits.reshape(src.data.shape), dst_type.scalar)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            bits = np.ascontiguousarray(src.data).view(np.uint16).astype(np.uint32) << 16
            return interpreter.TensorHandle(bits.view(np.float32), dst_type.scalar)
        return orig(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if {src.dtype.scalar, dst_type.scalar} == {tl.float32, tl.bfloat16}:
            return cast_impl(self, src, dst_type)
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return interpreter.TensorHandle(e4m3_satfinite(src.data), dst_type.scalar)
        return orig_fp(self, src, dst_type, rounding_mode)

    def create_fma(self, x, y, z):
        if z.dtype.scalar == tl.float32:
            return interpreter.TensorHandle(fma_f32(x.data, y.data, z.data), tl.float32)
        return orig_fma(self, x, y, z)

    def create_maxnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmax)

    def create_minnumf(self, lhs, rhs):
        return self.binary_op(lhs, rhs, np.fmin)

    orig_fp = builder.create_fp_to_fp
    orig_fma = builder.create_fma
    cast_impl._attncomm_rtne = True
    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp
    builder.create_fma = create_fma
    builder.create_maxnumf = create_maxnumf
    builder.create_minnumf = create_minnumf
    for name in ("create_fp_trunc",):
        setattr(builder, name, cast_impl)


_patch()
