"""fp32 → e4m3fn rounding on the device (Triton) in integer arithmetic, for the kernels that write
FP8 and must give the same bits on any GPU and under the interpreter: the DCP query gather's
symm kernels (``dcp/query_gather/symm_kernels.py``) and the Ulysses fill's FP8 epilogue where
the hardware has no e4m3 conversion (before sm_89) and under the interpreter
(``ulysses/fill_epilogue.py``, which uses the hardware's on sm_89 and later: the same rounding).
Each caller keeps its own rule for what lies outside e4m3's range (saturate or NaN byte); the
rounding of what lies inside is this one.

Integer arithmetic on the fp32 bits, so the GPU and the Triton interpreter give the same bits:
round to nearest even into e4m3fn (4 exponent bits, bias 7, 3 mantissa bits), subnormals below
2⁻⁶ as torch's conversion rounds them (one fp32 add of 2¹⁴ puts the rounding point at 2⁻⁹,
e4m3's subnormal step).

Importing this module needs Triton; its users import it through ``attncomm._triton``.
Constants are read through the module (``_c.NAME``), as in ``attncomm.symm_device``.
"""
from __future__ import annotations

import sys

import triton
import triton.language as tl

__all__ = ["E4M3_MAX_BITS", "F32_INF_BITS", "fp8_magnitude"]

E4M3_MAX_BITS = 0x43E00000          # 448.0, the largest finite e4m3fn, as fp32 bits
F32_INF_BITS = 0x7F800000
_E4M3_MIN_NORMAL_BITS = 121 << 23   # 2**-6
_SUB_MAGIC_BITS = 141 << 23         # 2**14: its fp32 ulp is 2**-9, e4m3's subnormal step
_REBIAS = 120 << 23                 # fp32 exponent bias 127 → e4m3's 7
_c = sys.modules[__name__]


@triton.jit
def fp8_magnitude(a):
    """The e4m3fn byte (int32, sign bit clear) of ``|x|`` given as its fp32 bits ``a``
    (``0 ≤ a ≤ E4M3_MAX_BITS``: the caller saturates larger values or replaces their byte)."""
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) \
        - _c._SUB_MAGIC_BITS
    nrm = (a - _c._REBIAS + 0x7FFFF + ((a >> 20) & 1)) >> 20
    return tl.where(a < _c._E4M3_MIN_NORMAL_BITS, sub, nrm)
