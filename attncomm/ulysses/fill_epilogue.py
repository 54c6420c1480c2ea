"""The FP8 epilogue of the Ulysses fill kernel (``fill_kernels``, constexpr ``FP8``), in Triton
and inline PTX: ``attncomm.ulysses.fp8``'s rule on the rows a program already holds.
``store_fp8`` rounds them to the parts' dtype (the bits the bf16 path stores), takes each row's
amax over its finite values, the scale ``amax / 448`` (IEEE division), and stores the e4m3 bytes
(``_e4m3``) and the scale as an fp32 word after them (a store per row, or per lane that holds
the row's scale when the bytes are stored from registers; not one per element).

On sm_89 and later (``HW_E4M3``, chosen by the host) the e4m3 bytes come from the hardware
conversion (``cvt.rn.satfinite.e4m3x2.f32``, what Triton emits for a cast to ``tl.float8e4nv``),
elsewhere (older GPUs, the interpreter) from the same rounding in integer arithmetic
(``attncomm.fp8_device``). The hardware conversion is round to nearest even into e4m3fn,
subnormals included, a finite value past ±448 saturated to ±448. That is the rule's
``e4m3fn(clamp(v, −448, 448))`` for every finite ``v``: inside the range both round the same
real number to nearest even on the same grid; past it, RNE of the clamped value is ±448 and
satfinite gives ±448 (a value between 448 and 464 also rounds to 448 before saturation).
Non-finite elements get the NaN byte by the rule's own select, so the conversion's NaN is never
stored. ``tests/test_ulysses_fp8.py`` checks the argument on every fp32 bit pattern
against torch's conversion; the interpreter converts as the hardware does through
``tests/_interp_rounding.py``; a device run checks the hardware on all 2³² patterns
(``scripts/floors_one_gpu.py``).

There too, the quotients ``x / scale`` come from the row's reciprocal (one IEEE division per
row) with one FMA correction (``_quotient``, whose docstring proves the bits equal to the
division's wherever e4m3 can tell), and the row's amax from ``max.f32`` alone (it skips
NaNs); a block holding a row with an infinity, only NaNs or a nonzero amax under 448·2⁻⁸⁰
(``_fast_block``) takes the amax over the finite elements and divides with ``div_rn``
instead. The interpreter rounds ``tl.fma`` once, and its ``tl.maximum`` skips NaNs as
``max.f32`` does, when ``tests/_interp_rounding.py`` is imported;
``scripts/fp8_quotient_gpu.py`` checks the GPU's bytes over every (element, amax) pair of bf16
and fp16 rows and fp32 rows with NaNs.

A fill with QK-norm or RoPE (its rows rounded to the parts' dtype before they are quantized) on
a GPU runs that common case as PTX (``PTX``): the rounding to bf16 beside the quotients (its
amax is the rounded amax of the unrounded rows: rounding is monotone and odd), and the bytes'
NaNs (and signs) fixed with one ``lop3`` per four bytes instead of a compare and a select per
byte. The quotients of 16-bit rows come from the row's reciprocal split in two fp32 terms, one
product and one FMA per element (``_ptx_split_bytes``: the division's e4m3 bytes, which a CPU
test enumerates over every pair of bf16 and fp16 significands), those of fp32 rows from
``_quotient``'s steps (``_ptx_bytes``). The interpreter runs no PTX;
``scripts/fp8_quotient_gpu.py`` also checks this path on every 16-bit (element, amax) pair,
which the host picks (``fill._fp8_epilogue``).
"""
from __future__ import annotations

import sys

import triton
import triton.language as tl

from .. import fp8_device as _e4
from ..fp8_device import fp8_magnitude

__all__ = ["store_fp8", "e4m3_kernel"]

_c = sys.modules[__name__]  # constants read as attributes (see attncomm.symm_device)
_F32_MAX = 3.4028234663852886e38    # the largest finite fp32
_DV_MIN = 2.0 ** -80               # the least divisor _quotient takes (its docstring)
_AMAX_MIN = 448.0 * _DV_MIN        # the least nonzero amax _fast_block lets through
_AMAX_MAX_SPLIT = 2.0 ** 64         # the largest amax _ptx_split_bytes takes (its docstring)


@triton.jit
def _e4m3(v, HW_E4M3: tl.constexpr):
    # e4m3fn bytes of clamp(v, -448, 448), round to nearest even, subnormals included (module
    # docstring); 0x7F where v is not finite: a quotient is so exactly where its element is
    # (|g / d| < 2^10 in a row). HW_E4M3: the hardware conversion (sm_89 and later), else the
    # same rounding in integer arithmetic (older GPUs, the interpreter).
    if HW_E4M3:
        r = v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        u = v.to(tl.int32, bitcast=True)
        r = fp8_magnitude(tl.minimum(u & 0x7FFFFFFF, _e4.E4M3_MAX_BITS)) | ((u >> 24) & 0x80)
    return tl.where(tl.abs(v) <= _c._F32_MAX, r, 0x7F).to(tl.uint8)


@triton.jit
def _quotient(g, y, ndv):
    """``g / d`` as IEEE fp32 division rounds it (to nearest even), as far as its e4m3 byte
    can tell, with no division: ``y = RN(1/d)`` and ``ndv = −d`` are the row's, computed once.

    ``q0 = RN(g·y)``; ``r = RN(g − d·q0)`` (an FMA); ``q1 = RN(q0 + r·y)`` (an FMA); the
    result is ``|q1|`` with ``g``'s sign. For finite ``g`` with ``|g/d| < 2¹⁰`` (an
    element of a row whose amax is about ``448·d``) and ``2⁻⁸⁰ ≤ d ≤ 2¹²⁰`` (``_DV_MIN``;
    the caller divides with ``div_rn`` otherwise); a non-finite g gives NaN:

    - ``|g/d| ≥ 2⁻¹¹``: ``q1 = RN(g/d)``. Powers of two in g and d change nothing (every
      step stays normal; ``r`` is a multiple of 2⁻¹³⁸, so exact where it would be
      subnormal), so take significands ``a, b ∈ [1, 2)``, ``x = a/b``, ``u`` its ulp (2⁻²³
      if ``a ≥ b``, else 2⁻²⁴), ``m`` the fp32 rounding boundary (midpoint) nearest x,
      ``t = x − m``. With ``|y − 1/b| ≤ 2⁻²⁵`` and ``δ = b·y − 1``, the last FMA rounds
      ``v = x − (q0 − x)·δ + ρ·y`` (ρ: r's own rounding, if any), and ``|t| ≥ u·2⁻²⁴/b``
      (``a − b·m`` is a non-zero multiple of ``u·2⁻²⁴``). If q0 is a grid point next to m
      (so it is when ``a ≥ b``, but for q0 just under 1), r is exact and
      ``|v − x| ≤ (u/2 + |t|)·b·2⁻²⁵ < |t|`` as ``b² < 4``: v rounds as x does. Else q0
      is farther from m: either ``a < b`` and ``|t| ≥ u − a·2⁻²⁵`` while
      ``|v − x| < 3.5·2⁻⁴⁸`` (``|q0 − x| < 1.5u``, ``|ρ| ≤ 2⁻⁴⁷``), or x lies next to 1/2
      or 1 with ``|t| > u/4``, far above ``|v − x|``: v rounds as x does, except maybe for
      ``a ≥ 2 − 3·2⁻²³ < b``, three pairs, checked one by one
      (tests/test_ulysses_fp8_quotient.py, which also runs these steps on millions of
      pairs). This is Markstein's correction (Markstein, IBM J. Res. Dev. 1990; Muller et
      al., Handbook of Floating-Point Arithmetic, FMA-based division) with ``y = RN(1/d)``,
      whose q0 can be 1.5 ulp off, past the theorem's one ulp: hence the argument above.
    - ``|g/d| < 2⁻¹¹``: ``|q1| ≤ 2⁻¹⁰`` (errors of 2⁻²³ relative and 2⁻¹⁵⁰·y ≤ 2⁻⁷⁰), so
      the byte is e4m3's zero with g's sign, as for ``RN(g/d)``; the sign is forced
      because ``q0 + r·y`` turns −0 into +0.
    """
    q0 = g * y
    r = tl.fma(q0, ndv, g)
    q1 = tl.fma(r, y, q0)
    bits = ((q1.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
            | (g.to(tl.uint32, bitcast=True) & 0x80000000))
    return bits.to(tl.float32, bitcast=True)


#: Four fp32 elements $1-$4 rounded to bf16 (``cvt.rn.bf16x2.f32``: the bits of
#: ``.to(bfloat16)``) and widened back, the 16 bits placed high in a 32-bit word: g0-g3.
_BF16_ROUNDING = (".reg .b32 g<4>, p<2>;", "cvt.rn.bf16x2.f32 p0, $2, $1;",
                  "cvt.rn.bf16x2.f32 p1, $4, $3;", "shl.b32 g0, p0, 16;",
                  "and.b32 g1, p0, 0xFFFF0000;", "shl.b32 g2, p1, 16;",
                  "and.b32 g3, p1, 0xFFFF0000;")


def _bytes_ptx(steps: tuple, regs: str, lut: int, round_bf16: bool) -> str:
    """PTX of four elements' e4m3 bytes ($0, element i in byte i; an asm of
    ``_PTX_OPERANDS``): the elements $1-$4 (rounded to bf16 first with ``round_bf16``), then
    ``steps``, each a line for every element i (``{i}``; ``{g}`` the element, ``{a}`` and
    ``{b}`` its operands $5+i and $9+i; registers ``regs`` besides q0-q3), which leave the
    quotients in q0-q3; then the saturating conversion, and one ``lop3`` with truth table
    ``lut`` over the bytes, ``t = (bytes & 0x7F7F7F7F) + 0x01010101`` (bit 7 of a byte set
    exactly where its low 7 bits are all ones: a NaN) and 0x80808080."""
    g = ("g0", "g1", "g2", "g3") if round_bf16 else ("$1", "$2", "$3", "$4")
    lines = ["{", f".reg .b32 q<4>, {regs}, w, t;", ".reg .b16 h<2>;",
             *(_BF16_ROUNDING if round_bf16 else ())]
    lines += [step.format(i=i, g=g[i], a=f"${5 + i}", b=f"${9 + i}")
              for step in steps for i in range(4)]
    lines += ["cvt.rn.satfinite.e4m3x2.f32 h0, q1, q0;",
              "cvt.rn.satfinite.e4m3x2.f32 h1, q3, q2;", "mov.b32 w, {h0, h1};",
              "and.b32 t, w, 0x7F7F7F7F;", "add.u32 t, t, 0x01010101;",
              f"lop3.b32 $0, w, t, 0x80808080, {lut:#04x};", "}"]
    return "\n".join(lines)


#: ``_quotient``'s steps per element ``{g}`` in negated form, for the e4m3 conversion of four
#: elements in PTX (``_ptx_bytes``, ``_bytes_ptx``): operands $1-$4 the elements, $5-$8 ``−y``,
#: $9-$12 ``d``; $0 their four bytes, element i in byte i.
#: ``q = RN(g·(−y))`` is ``−q0``; ``r = fma(q, d, g)`` is ``_quotient``'s r; ``fma(r, −y, q)``
#: is ``−q1`` (RN is odd: ``RN(−x) = −RN(x)``), and it keeps the sign of a zero that ``q1``
#: loses (``g = −0``: ``q = +0``, ``r = +0``, ``−q1 = −0 + +0 = +0``, the byte 0x00 flipped to
#: 0x80). The bytes of ``−q1`` (satfinite: never 0x7F/0xFF from a finite value) get their sign
#: bits flipped (e4m3 of ``−v`` is that of ``v`` with the sign flipped) except where a byte is
#: NaN (its low 7 bits 0x7F): those become the rule's 0x7F. One ``lop3`` does both:
#: ``(w ^ 0x80808080) & ~(t & 0x80808080)`` with ``t = (w & 0x7F7F7F7F) + 0x01010101``, whose
#: bit 7 of a byte is set exactly where that byte's low 7 bits are all ones (LUT 0x52).
_MARKSTEIN = ("mul.rn.f32 q{i}, {g}, {a};", "fma.rn.f32 r{i}, q{i}, {b}, {g};",
              "fma.rn.f32 q{i}, r{i}, {a}, q{i};")
#: The elements as given ($1-$4 used as they are).
_PTX_PLAIN = tl.constexpr(_bytes_ptx(_MARKSTEIN, "r<4>", 0x52, round_bf16=False))
#: The elements rounded to bf16 first (``_BF16_ROUNDING``).
_PTX_BF16 = tl.constexpr(_bytes_ptx(_MARKSTEIN, "r<4>", 0x52, round_bf16=True))
_PTX_OPERANDS = tl.constexpr("=r," + ",".join(["r"] * 12))

#: The steps of the e4m3 conversion of four quotients of 16-bit elements by the split
#: reciprocal (``_ptx_split_bytes``, ``_bytes_ptx``): operands $1-$4 the elements, $5-$8
#: ``y_hi``, $9-$12 ``y_lo``; $0 their four bytes, element i in byte i.
#: ``q = RN(g·y_hi + RN(g·y_lo))`` (a product, an FMA).
#: ``y_lo ≥ 0``, so ``RN(g·y_lo)`` has g's sign and q keeps the sign of a zero g. A NaN byte
#: (low 7 bits 0x7F, from a NaN g: satfinite never gives it from a finite value) becomes the
#: rule's 0x7F, other bytes stay: ``w & ~(t & 0x80808080)`` with
#: ``t = (w & 0x7F7F7F7F) + 0x01010101`` (LUT 0x70; see ``_MARKSTEIN``).
_SPLIT = ("mul.rn.f32 m{i}, {g}, {b};", "fma.rn.f32 q{i}, {g}, {a}, m{i};")
#: fp16 elements (given as their fp32 values).
_PTX_SPLIT_PLAIN = tl.constexpr(_bytes_ptx(_SPLIT, "m<4>", 0x70, round_bf16=False))
#: fp32 elements rounded to bf16 first (``_BF16_ROUNDING``).
_PTX_SPLIT_BF16 = tl.constexpr(_bytes_ptx(_SPLIT, "m<4>", 0x70, round_bf16=True))


@triton.jit
def _ptx_bytes(f, ny, dv, ROUND_BF16: tl.constexpr):
    """e4m3 bytes of ``f / d`` as ``_e4m3(_quotient(f, y, −d))`` gives them, in PTX (sm_89+):
    ``ny = −y`` and ``dv = d`` broadcast over ``f``'s rows; ``ROUND_BF16``: ``f`` is rounded to
    bf16 first. For finite ``f`` or NaN (0x7F), under ``_quotient``'s conditions."""
    return tl.inline_asm_elementwise(_PTX_BF16 if ROUND_BF16 else _PTX_PLAIN, _PTX_OPERANDS,
                                     [f, ny, dv], dtype=tl.uint8, is_pure=True, pack=4)


@triton.jit
def _split_reciprocal(dv):
    """``y_hi = RD(1/d)`` (``rcp.rm``: IEEE, rounded toward −∞) and
    ``y_lo = RN((1 − d·y_hi)·y_hi)`` of divisors ``d`` (``dv``), for ``_ptx_split_bytes`` (a
    GPU: PTX): ``1 − d·y_hi`` is exact in fp32 (an FMA; y_hi is within an ulp of
    1/d) and ≥ 0 (y_hi rounds down), so ``y_hi + y_lo`` is 1/d within 2⁻⁴⁵ relative and
    ``y_lo ≥ 0``. Both normal (y_lo, or zero) for ``2⁻⁸⁰ ≤ d < 2⁵⁶``: ``1 − d·y_hi`` is a
    multiple of 2⁻⁴⁸ (``_fast_block``'s SPLIT bounds)."""
    yh = tl.inline_asm_elementwise("rcp.rm.f32 $0, $1;", "=r,r", [dv], dtype=tl.float32,
                                   is_pure=True, pack=1)
    yl = tl.fma(-dv, yh, 1.0) * yh
    return yh, yl


@triton.jit
def _ptx_split_bytes(f, yh, yl, ROUND_BF16: tl.constexpr):
    """e4m3 bytes of ``f / d`` for rows of 16-bit values (bf16: ``f`` rounded to it first,
    ``ROUND_BF16``; fp16: ``f`` holds fp16 values) as the rule's IEEE division gives them, in
    PTX (sm_89+): ``q = RN(g·y_hi + RN(g·y_lo))`` with ``_split_reciprocal``'s ``yh``, ``yl``
    broadcast over ``f``'s rows, one product and one FMA per element where ``_quotient`` takes
    three. Not the division's fp32 bits, but its e4m3 bytes: y_hi + y_lo is 1/d within about
    2⁻⁴⁵ relative, and the bytes are the same on every pair of 16-bit element and amax
    significands at every exponent offset down past e4m3's zero, which
    tests/test_ulysses_fp8_quotient.py enumerates (and scripts/fp8_quotient_gpu.py on the GPU).
    For ``448·2⁻⁸⁰ ≤ amax ≤ 2⁶⁴`` (``_fast_block(SPLIT)``) d, y_hi and y_lo are normal (y_lo
    or zero), and so are the products wherever the byte can be non-zero (|g/d| ≥ 2⁻¹¹;
    below, a subnormal or zero step still gives e4m3's zero with g's sign), so a power of two
    on a row changes no byte. For finite ``f`` or NaN (0x7F)."""
    return tl.inline_asm_elementwise(_PTX_SPLIT_BF16 if ROUND_BF16 else _PTX_SPLIT_PLAIN,
                                     _PTX_OPERANDS, [f, yh, yl], dtype=tl.uint8, is_pure=True,
                                     pack=4)


@triton.jit
def _fast_block(amax, live, SPLIT: tl.constexpr = False):
    """Whether every live row of the program (``live``, ``amax``: ``[BLOCK_S, HB]``) may take
    the fast path: a finite amax that is 0 (its divisor is 1) or at least ``_AMAX_MIN`` (its
    scale ``RN(amax / 448)`` then at least ``RN(2⁻⁸⁰) = _DV_MIN``: rounding is monotone);
    ``SPLIT`` (``_ptx_split_bytes``): also at most ``_AMAX_MAX_SPLIT``. Tested on the amax
    alone, with no division (a row with ``0 < amax < _AMAX_MIN``, whose divisor may still be
    ≥ ``_DV_MIN``, takes the general path, which gives the same bytes)."""
    top: tl.constexpr = _c._AMAX_MAX_SPLIT if SPLIT else _c._F32_MAX
    good = (amax <= top) & ((amax >= _c._AMAX_MIN) | (amax == 0))
    return tl.min(tl.where(live & ~good, 0, 1)) == 1


def _word_store(pack: int, masked: bool) -> tuple:
    """PTX and operand constraints of an asm (``tl.inline_asm_elementwise``, ``pack`` elements
    of 32 bits together) that stores a 32-bit word: $1 the word (``pack`` 4: four bytes), $2
    its byte address ($3 to $(1 + pack): the other elements', unused), with ``masked`` only
    where $(2 + pack) is nonzero; $0 is the word (unused)."""
    st = "st.global.b32 [$2], $1;"
    if masked:
        st = f"{{\n.reg .pred live;\nsetp.ne.b32 live, ${2 + pack}, 0;\n@live {st}"
    ptx = f"{st}\nmov.b32 $0, $1;" + ("\n}" if masked else "")
    return ptx, "=r,r," + ",".join(["l"] * pack + (["r"] * pack if masked else []))


_PTX_STORE4, _PTX_STORE4_OPS = (tl.constexpr(v) for v in _word_store(4, False))
_PTX_STORE4_MASKED, _PTX_STORE4_MASKED_OPS = (tl.constexpr(v) for v in _word_store(4, True))
_PTX_STORE1, _PTX_STORE1_OPS = (tl.constexpr(v) for v in _word_store(1, False))
_PTX_STORE1_MASKED, _PTX_STORE1_MASKED_OPS = (tl.constexpr(v) for v in _word_store(1, True))


@triton.jit
def _store_words(dst, v, mask, REG_STORE: tl.constexpr, PACK: tl.constexpr = 4):
    """``tl.store(dst, v, mask)``; with ``REG_STORE`` (a GPU) from the registers that hold
    ``v``, one 32-bit store per ``PACK`` elements (``_word_store``): uint8 rows with ``PACK`` 4,
    where each thread holds runs of 4 consecutive bytes of a row starting on a 4-byte boundary
    (the register layout ``fill_kernels._ptx_norm_inv`` is written for; rows of ``D + 4``
    bytes start on 4-byte boundaries), or 32-bit values with ``PACK`` 1. ``mask`` must be the
    same for the ``PACK`` elements of a word (a row's mask: the first element's decides).
    Triton stores the same words, but converts ``v`` to its store layout first (through
    shared memory, with a barrier)."""
    if REG_STORE:
        ptr = dst.to(tl.int64, bitcast=True)
        if mask is None:
            tl.inline_asm_elementwise(_PTX_STORE4 if PACK == 4 else _PTX_STORE1,
                                      _PTX_STORE4_OPS if PACK == 4 else _PTX_STORE1_OPS,
                                      [v, ptr], dtype=v.dtype, is_pure=False, pack=PACK)
        else:
            tl.inline_asm_elementwise(_PTX_STORE4_MASKED if PACK == 4 else _PTX_STORE1_MASKED,
                                      _PTX_STORE4_MASKED_OPS if PACK == 4
                                      else _PTX_STORE1_MASKED_OPS,
                                      [v, ptr, mask.to(tl.int32)], dtype=v.dtype,
                                      is_pure=False, pack=PACK)
    else:
        tl.store(dst, v, mask=mask)


@triton.jit
def _row_scale(amax):
    """The rows' scales ``amax / 448`` (IEEE division, the rule's) and their divisors: the
    scale, or 1 for a row whose amax is 0."""
    scale = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    return scale, tl.where(scale > 0, scale, 1.0)


@triton.jit
def _divided_bytes(dst, f1, f2, mask, DTYPE: tl.constexpr, HALF: tl.constexpr,
                   HW_E4M3: tl.constexpr, REG_STORE: tl.constexpr = False):
    """The rule step by step (any row): the elements rounded to ``DTYPE`` (the bits the
    unquantized fill stores), the amax over the finite ones, IEEE divisions; stores the bytes
    at ``dst`` and returns the rows' scales."""
    g1 = f1.to(DTYPE).to(tl.float32)
    g2 = f2.to(DTYPE).to(tl.float32)
    ok1 = tl.abs(g1) <= _c._F32_MAX  # NaN compares false
    ok2 = tl.abs(g2) <= _c._F32_MAX
    amax = tl.max(tl.maximum(tl.where(ok1, tl.abs(g1), 0.0), tl.where(ok2, tl.abs(g2), 0.0)),
                  axis=2)
    scale, dv = _row_scale(amax)
    _store_words(dst, _e4m3(tl.div_rn(g1, dv[:, :, None]), HW_E4M3), mask, REG_STORE)
    _store_words(dst + HALF, _e4m3(tl.div_rn(g2, dv[:, :, None]), HW_E4M3), mask, REG_STORE)
    return scale


@triton.jit
def store_fp8(out_ptr, rofs, cols, f1, f2, rmask, DTYPE: tl.constexpr, HALF: tl.constexpr,
               HW_E4M3: tl.constexpr, PTX: tl.constexpr = False, EXACT: tl.constexpr = False,
               REG_STORE: tl.constexpr = False):
    """The FP8 epilogue: rows ``[BLOCK_S, HB, D]`` (two fp32 halves) → e4m3 bytes at byte
    offsets ``rofs [BLOCK_S, HB]`` (``rmask``: the live rows, None when all are) and each
    row's fp32 scale after its ``2·HALF`` bytes. ``EXACT``: the halves already hold values of
    ``DTYPE`` (rounding them to it changes nothing); ``PTX``: the sm_89+ path's quotients and
    bytes come from ``_ptx_split_bytes`` (16-bit ``DTYPE``) or ``_ptx_bytes`` (fp32) (a GPU:
    the interpreter runs no PTX); ``REG_STORE`` (with ``PTX``): the bytes and scales stored
    from the registers that hold them (``_store_words``)."""
    dst = out_ptr + rofs[:, :, None] + cols[None, None, :]
    if rmask is None:  # every row live
        mask = None
        live = tl.full(rofs.shape, 1, tl.int1)
    else:
        mask = rmask[:, :, None] & (cols[None, None, :] >= 0)
        live = rmask
    if PTX:  # (HW_E4M3 holds)
        # The amax of the rounded elements is the rounded amax of the elements (rounding to
        # DTYPE is monotone and odd; a value that rounds to inf still makes the amax inf), so
        # the elements are rounded once, in the PTX, next to their quotients.
        # The halves' maxima elementwise, then one reduction per row (max is exact: any order
        # gives the same bits).
        m = tl.max(tl.maximum(tl.abs(f1), tl.abs(f2)), axis=2)
        amax = m if EXACT else m.to(DTYPE).to(tl.float32)
        scale, dv = _row_scale(amax)
        split: tl.constexpr = DTYPE != tl.float32  # 16-bit values: _ptx_split_bytes
        if _fast_block(amax, live, split):
            rb: tl.constexpr = (not EXACT) and DTYPE == tl.bfloat16
            if rb or EXACT or DTYPE == tl.float32:
                h1 = f1
                h2 = f2
            else:
                h1 = f1.to(DTYPE).to(tl.float32)
                h2 = f2.to(DTYPE).to(tl.float32)
            if split:
                yh, yl = _split_reciprocal(dv)
                _store_words(dst, _ptx_split_bytes(h1, yh[:, :, None], yl[:, :, None], rb),
                             mask, REG_STORE)
                _store_words(dst + HALF,
                             _ptx_split_bytes(h2, yh[:, :, None], yl[:, :, None], rb), mask,
                             REG_STORE)
            else:
                ny = -tl.div_rn(tl.full(dv.shape, 1.0, tl.float32), dv)[:, :, None]
                _store_words(dst, _ptx_bytes(h1, ny, dv[:, :, None], rb), mask, REG_STORE)
                _store_words(dst + HALF, _ptx_bytes(h2, ny, dv[:, :, None], rb), mask,
                             REG_STORE)
        else:
            scale = _divided_bytes(dst, f1, f2, mask, DTYPE, HALF, HW_E4M3, REG_STORE)
    else:
        g1 = f1.to(DTYPE).to(tl.float32)  # the bits the unquantized fill stores
        g2 = f2.to(DTYPE).to(tl.float32)
        if HW_E4M3:
            # sm_89+: the amax by max.f32 alone, which skips NaNs (it returns the other
            # operand), and the quotients by the row's reciprocal and one correction
            # (_quotient), for a block whose live rows all have a finite amax (no ±inf, not
            # all NaN), 0 or ≥ 448·2⁻⁸⁰ (_fast_block); else the path below. A
            # non-finite element gives a NaN quotient on both (inf·y, then inf − inf; inf / d).
            amax = tl.max(tl.maximum(tl.abs(g1), tl.abs(g2)), axis=2)
            scale, dv = _row_scale(amax)
            # Each branch stores its own bytes: a branch that yields the byte tensors
            # miscompiles with Triton 3.6 on sm_90 (every eighth byte of the second half
            # stored as 0).
            if _fast_block(amax, live):
                y = tl.div_rn(tl.full(dv.shape, 1.0, tl.float32), dv)[:, :, None]
                ndv = -dv[:, :, None]  # 0 − dv: exact, dv > 0
                tl.store(dst, _e4m3(_quotient(g1, y, ndv), HW_E4M3), mask=mask)
                tl.store(dst + HALF, _e4m3(_quotient(g2, y, ndv), HW_E4M3), mask=mask)
            else:
                scale = _divided_bytes(dst, f1, f2, mask, DTYPE, HALF, HW_E4M3)
        else:
            scale = _divided_bytes(dst, f1, f2, mask, DTYPE, HALF, HW_E4M3)
    sp = (out_ptr + rofs + 2 * HALF).to(tl.pointer_type(tl.float32), bitcast=True)
    # every lane that holds a row's scale stores it with REG_STORE (the same word to the same
    # address); Triton's store keeps the reduced rows' layout: one store per row
    _store_words(sp, scale, rmask, REG_STORE, 1)


@triton.jit
def e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, HW_E4M3: tl.constexpr = True):
    """``out[i] = _e4m3(x[i])`` (fp32 → e4m3fn bytes, 0x7F for non-finite values): the
    epilogue's conversion alone (either way, ``HW_E4M3``), for tests against torch's."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    tl.store(out_ptr + i, _e4m3(x, HW_E4M3), mask=m)
