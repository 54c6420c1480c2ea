"""The Ulysses fill kernel (Triton); the host side, the torch reference and the rules it follows
are ``attncomm.ulysses.fill``'s.

One program per (block of ``BLOCK_S`` rows, entry, batch), on a grid of
``(row blocks · ENTRIES, batch)`` with the entry fastest: an entry is a run of up to ``HB``
consecutive heads of one part bound for one destination region. The kernel takes the parts'
pointers, the weights', cos/sin, the send buffer's, the descriptor and its constexprs. The
descriptor (int64, built once per layout by ``fill_descriptor.descriptor``, cached on the device)::

    [H_S]                 S_r, the shard's rows
    [H_EPS]               the RMSNorm epsilon's fp32 bits
    [H_FLAGS]             bit 2·i: part i has a norm weight; bit 2·i + 1: part i takes RoPE
    [H_COS_S .. H_SIN_D]  cos and sin strides (row, element)
    [HEADER + ENTRY·k + E_*]  entry k: part, first head, heads, base element, row pitch,
                          batch pitch, and the part's strides (batch, row, head, element)

``SPEC`` holds 2 bits per stride, what the launcher would have found for an integer argument:
1: the stride is 1 (a constant), 2: a multiple of 16 (the compiler is told), 0: neither; so the
loads vectorise as with strides as arguments. Bits 0-7: the parts' batch, row, head and element
strides (the code all parts share, else 0), bits 8-15: cos's and sin's row and element
strides.

``FP8`` (the FP8 payload): the output pointer is the uint8 send buffer, a row is ``2·HALF + 4``
bytes (the descriptor's bases and pitches count bytes), and ``fill_epilogue.store_fp8``
quantizes the rows the program holds. ``PTX_WIDEN`` (the host's, on a GPU, for fills that norm
or rotate): bf16 rows widened to fp32 by one instruction per element (``_PTX_WIDEN``).

``SHFL_NORM`` (the host's choice, ``fill._launch``): the norm's sum of squares, square root and
reciprocal in PTX (``_ptx_norm_inv``), the tree's cross-lane levels as warp shuffles rather
than the layout conversions through shared memory that Triton makes of ``_adjacent_sum``'s
reshapes. The same tree and roundings, so the same bits; the PTX is written for the register
layout of D = 128 rows of contiguous, 16-byte aligned 16-bit parts at the default launch shape
(a thread holds 8 consecutive elements, a half-row's 8 threads are consecutive lanes):
tests/test_ulysses_fill.py checks that layout in the compiled kernel (sm_80 to sm_100), and the
GPU tests hold the bits to the torch path's there. ``REG_STORE`` (the host's, with ``SHFL_NORM``
and the FP8 epilogue's PTX): the FP8 bytes and scales stored from the registers that hold them
(``fill_epilogue._store_words``), a 32-bit store per 4 bytes of a thread's run, with no
conversion to Triton's store layout.
"""
from __future__ import annotations

import struct
import sys

import triton
import triton.language as tl

from .fill_epilogue import store_fp8

__all__ = ["fill_kernel", "HEADER", "ENTRY", "H_S", "H_EPS", "H_FLAGS",
           "H_COS_S", "H_COS_D", "H_SIN_S", "H_SIN_D", "E_PART", "E_HEAD", "E_HEADS", "E_BASE",
           "E_PITCH", "E_BPITCH", "E_STRIDES"]

H_S, H_EPS, H_FLAGS, H_COS_S, H_COS_D, H_SIN_S, H_SIN_D = range(7)
#: Descriptor words before the first entry.
HEADER = 8
E_PART, E_HEAD, E_HEADS, E_BASE, E_PITCH, E_BPITCH, E_STRIDES = range(7)
#: Words per entry (the last four: the part's strides).
ENTRY = E_STRIDES + 4
_c = sys.modules[__name__]  # constants read as attributes (see attncomm.symm_device)


@triton.jit
def _stride(ptr, CODE: tl.constexpr):
    # A stride from the descriptor with what the host found about it (module docstring); the
    # hint must sit on the load itself (a hint on a function argument is lost when inlined).
    if CODE == 1:
        return 1
    else:
        v = tl.load(ptr)
        if CODE == 2:
            v = tl.multiple_of(v, 16)
        return v


#: bf16 → fp32, two elements of one 32-bit register: the low one shifted up, the high one
#: masked (the bits of ``.to(tl.float32)``, for which ptxas emits three or more per register).
_PTX_WIDEN = tl.constexpr("shl.b32 $0, $2, 16;\nand.b32 $1, $2, 0xFFFF0000;")


@triton.jit
def _widen(v, PTX_WIDEN: tl.constexpr):
    """``v.to(tl.float32)``; bf16 ``v`` with ``PTX_WIDEN`` (a GPU): by ``_PTX_WIDEN``."""
    if PTX_WIDEN and v.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(_PTX_WIDEN, "=r,=r,r", [v], dtype=tl.float32,
                                         is_pure=True, pack=2)
    else:
        return v.to(tl.float32)


@triton.jit
def _halves(x, b, h0, rows, hh, cols, sb, ss, sh, sd, mask, HALF: tl.constexpr,
            PTX_WIDEN: tl.constexpr):
    """Rows ``[BLOCK_S, HB, D]`` of heads ``h0 + hh`` as two fp32 halves (one load site per
    part)."""
    src = (x + b * sb + rows[:, None, None] * ss + (h0 + hh)[None, :, None] * sh
           + cols[None, None, :] * sd)
    f1 = _widen(tl.load(src, mask=mask), PTX_WIDEN)
    f2 = _widen(tl.load(src + HALF * sd, mask=mask), PTX_WIDEN)
    return f1, f2


@triton.jit
def _adjacent_sum(t, BLOCK_S: tl.constexpr, HB: tl.constexpr, HALF: tl.constexpr,
                  LEVELS: tl.constexpr):
    """``fill_reference._tree_sum``'s order over the last dim (adjacent pairs, recursively) →
    ``[BLOCK_S, HB]``; the first levels are register-local (a thread holds adjacent
    elements)."""
    for j in tl.static_range(LEVELS):
        ta, tb = tl.split(tl.reshape(t, (BLOCK_S, HB, HALF >> (j + 1), 2)))
        t = ta + tb
    return tl.reshape(t, (BLOCK_S, HB))


def _norm_ptx(half: int) -> str:
    """PTX of ``_ptx_norm_inv`` for rows of ``2·half`` elements held 8 consecutive elements to
    a thread, the ``half // 8`` threads of a half-row in consecutive lanes (lane bit ``j`` is
    bit ``j`` of the chunk's index): operands ``$8..$15`` a thread's chunk of the first half,
    ``$16..$23`` the same chunk of the second, ``$24`` the epsilon (``$25..$31`` its copies);
    outputs ``$0..$7`` the row's ``1 / sqrt(mean(x²) + eps)``, the same word in each. Every
    step rounds once as its Triton counterpart does (``mul``/``add.rn``, ``sqrt.rn``, and
    ``rcp.rn``: IEEE ``1 / x``, ``div_rn``'s bits); a sum's two lanes add the same pair (IEEE
    addition commutes)."""
    p = _NORM_PACK
    lines = ["{", f".reg .f32 a<{p}>, b<{p}>, s;"]
    for r, first in (("a", p), ("b", 2 * p)):
        lines += [f"mul.rn.f32 {r}{i}, ${first + i}, ${first + i};" for i in range(p)]
        step = 1
        while step < p:  # the thread's elements: adjacent pairs, then pairs of pairs
            lines += [f"add.rn.f32 {r}{i}, {r}{i}, {r}{i + step};" for i in range(0, p, 2 * step)]
            step *= 2
        lane = 1
        while lane < half // p:  # then its lanes': lane j with j ^ 1, then j ^ 2, ...
            lines += [f"shfl.sync.bfly.b32 s, {r}0, {lane}, 0x1f, 0xffffffff;",
                      f"add.rn.f32 {r}0, {r}0, s;"]
            lane *= 2
    inv_d = struct.unpack("<I", struct.pack("<f", 1.0 / (2 * half)))[0]
    lines += ["add.rn.f32 a0, a0, b0;", f"mul.rn.f32 a0, a0, 0f{inv_d:08X};",
              f"add.rn.f32 a0, a0, ${3 * p};", "sqrt.rn.f32 a0, a0;", "rcp.rn.f32 a0, a0;"]
    lines += [f"mov.b32 ${i}, a0;" for i in range(p)] + ["}"]
    return "\n".join(lines)


#: Elements of a half-row a thread holds in ``SHFL_NORM``'s layout: ``_ptx_norm_inv``'s pack.
_NORM_PACK = 8
_PTX_NORM_64 = tl.constexpr(_norm_ptx(64))
_PTX_NORM_OPERANDS = tl.constexpr(",".join(["=r"] * _NORM_PACK + ["r"] * 3 * _NORM_PACK))


@triton.jit
def _ptx_norm_inv(f1, f2, eps):
    """The norm's ``1 / sqrt_rn(t / D + eps)`` with ``t`` the adjacent-pair tree of the row's
    squares (``_adjacent_sum``'s order, bit for bit), in every element of ``f1``'s shape,
    through warp shuffles instead of Triton's layout conversions. Only for the layout Triton
    gives the kernel's ``[16, 2, 64]`` rows with 4 warps when the parts are contiguous, 16-byte
    aligned and 16-bit (8 elements a thread, a half-row's 8 threads in consecutive lanes):
    the host's ``SHFL_NORM``, whose layout tests/test_ulysses_fill.py checks in the kernel
    compiled for sm_80, sm_90 and sm_100. Every lane must run it (its
    shuffles' mask is the full warp): the branches around it are the same for a whole
    program."""
    return tl.inline_asm_elementwise(_PTX_NORM_64, _PTX_NORM_OPERANDS,
                                     [f1, f2, tl.broadcast_to(eps, f1.shape)],
                                     dtype=tl.float32, is_pure=True, pack=_c._NORM_PACK)


@triton.jit
def fill_kernel(x0, x1, x2, out_ptr, desc, w0, w1, w2, cos_ptr, sin_ptr,
                HALF: tl.constexpr, LEVELS: tl.constexpr, BLOCK_S: tl.constexpr,
                HB: tl.constexpr, ANY_NORM: tl.constexpr, ANY_ROPE: tl.constexpr,
                ALIGNED: tl.constexpr, ROPE_BCAST: tl.constexpr, SPEC: tl.constexpr,
                ENTRIES: tl.constexpr, FULL: tl.constexpr = False, FP8: tl.constexpr = False,
                HW_E4M3: tl.constexpr = False,
                PTX: tl.constexpr = False, EXACT: tl.constexpr = False,
                SHFL_NORM: tl.constexpr = False, PTX_WIDEN: tl.constexpr = False,
                REG_STORE: tl.constexpr = False):
    # Entries run fastest along the grid: the programs in flight together cover every head of
    # the same rows, whose bytes are contiguous in the sources and the regions, rather than
    # one head's rows a row pitch apart.
    pid = tl.program_id(0)
    pid_s = pid // ENTRIES
    ent = desc + _c.HEADER + (pid % ENTRIES) * _c.ENTRY
    b = tl.program_id(1).to(tl.int64)
    S = tl.load(desc + _c.H_S)
    flags = tl.load(desc + _c.H_FLAGS)
    part = tl.load(ent + _c.E_PART)
    h0 = tl.load(ent + _c.E_HEAD)
    nh = tl.load(ent + _c.E_HEADS)
    base = tl.load(ent + _c.E_BASE)
    pitch = tl.load(ent + _c.E_PITCH)
    bpitch = tl.load(ent + _c.E_BPITCH)
    # Every word a program reads is loaded here, up front (no load waits on another); a
    # stride SPEC makes constant is never read.
    sb = _stride(ent + _c.E_STRIDES, SPEC & 3)
    ss = _stride(ent + _c.E_STRIDES + 1, (SPEC >> 2) & 3)
    sh = _stride(ent + _c.E_STRIDES + 2, (SPEC >> 4) & 3)
    sd = _stride(ent + _c.E_STRIDES + 3, (SPEC >> 6) & 3)
    if ANY_NORM:
        eps = tl.load(desc + _c.H_EPS).to(tl.int32).to(tl.float32, bitcast=True)
    if ANY_ROPE:
        scs = _stride(desc + _c.H_COS_S, (SPEC >> 8) & 3)
        scd = _stride(desc + _c.H_COS_D, (SPEC >> 10) & 3)
        sss = _stride(desc + _c.H_SIN_S, (SPEC >> 12) & 3)
        ssd = _stride(desc + _c.H_SIN_D, (SPEC >> 14) & 3)
    if ALIGNED:  # the host checked: every base and pitch a multiple of 16 elements
        base = tl.multiple_of(base, 16)
        pitch = tl.multiple_of(pitch, 16)
        bpitch = tl.multiple_of(bpitch, 16)
    elif FP8:  # always so: rows of D + 4 bytes with D % 4 == 0, regions 4-byte aligned
        base = tl.multiple_of(base, 4)
        pitch = tl.multiple_of(pitch, 4)
        bpitch = tl.multiple_of(bpitch, 4)
    rows = (pid_s * BLOCK_S + tl.arange(0, BLOCK_S)).to(tl.int64)
    hh = tl.arange(0, HB)
    cols = tl.arange(0, HALF)
    # FULL (the host checked: S_r a multiple of BLOCK_S, every entry HB heads): no program
    # has a row or head to skip, so nothing is masked here or below (a masked load zeroes its
    # registers first, an instruction per load that the unmasked one does without).
    mask = None if FULL else (rows[:, None, None] < S) & (hh[None, :, None] < nh)
    if part == 0:
        f1, f2 = _halves(x0, b, h0, rows, hh, cols, sb, ss, sh, sd, mask, HALF,
                        PTX_WIDEN)
    elif part == 1:
        f1, f2 = _halves(x1, b, h0, rows, hh, cols, sb, ss, sh, sd, mask, HALF,
                        PTX_WIDEN)
    else:
        f1, f2 = _halves(x2, b, h0, rows, hh, cols, sb, ss, sh, sd, mask, HALF,
                        PTX_WIDEN)
    if ANY_NORM:  # rms_norm_rope's order: the adjacent-pair tree, sqrt, reciprocal
        if (flags >> (2 * part)) & 1:
            wp = w0
            if part == 1:
                wp = w1
            elif part == 2:
                wp = w2
            if SHFL_NORM:
                inv = _ptx_norm_inv(f1, f2, eps)
            else:
                t = (_adjacent_sum(f1 * f1, BLOCK_S, HB, HALF, LEVELS)
                     + _adjacent_sum(f2 * f2, BLOCK_S, HB, HALF, LEVELS))
                # t / D as the reference divides, by its exact reciprocal: D is a power of
                # two, so the product is the same real number, rounded once (no division's
                # checks)
                ms = t * (1.0 / (2 * HALF))
                inv = tl.div_rn(tl.full((BLOCK_S, HB), 1.0, tl.float32),
                                tl.sqrt_rn(ms + eps))[:, :, None]
            if ROPE_BCAST:  # as cos/sin below: loaded in the rows' layout
                wo = rows[:, None, None] * 0 + hh[None, :, None] * 0 + cols[None, None, :]
                wa = tl.load(wp + wo).to(tl.float32)
                wb = tl.load(wp + HALF + wo).to(tl.float32)
            else:
                wa = tl.load(wp + cols).to(tl.float32)[None, None, :]
                wb = tl.load(wp + HALF + cols).to(tl.float32)[None, None, :]
            f1 = f1 * inv * wa
            f2 = f2 * inv * wb
    if ANY_ROPE:  # cos/sin of the block's rows: loaded once for the program's HB heads
        if (flags >> (2 * part + 1)) & 1:
            if ROPE_BCAST:  # pointers broadcast over the heads: f1's layout, no shuffle
                rmask = None if FULL else (rows[:, None, None] < S) & (hh[None, :, None] >= 0)
                cr = (cos_ptr + rows[:, None, None] * scs + hh[None, :, None] * 0
                      + cols[None, None, :] * scd)
                sr = (sin_ptr + rows[:, None, None] * sss + hh[None, :, None] * 0
                      + cols[None, None, :] * ssd)
                c1 = tl.load(cr, mask=rmask).to(tl.float32)
                c2 = tl.load(cr + HALF * scd, mask=rmask).to(tl.float32)
                s1 = tl.load(sr, mask=rmask).to(tl.float32)
                s2 = tl.load(sr + HALF * ssd, mask=rmask).to(tl.float32)
            else:
                rmask = None if FULL else rows[:, None] < S
                cr = cos_ptr + rows[:, None] * scs + cols[None, :] * scd
                sr = sin_ptr + rows[:, None] * sss + cols[None, :] * ssd
                c1 = tl.load(cr, mask=rmask).to(tl.float32)[:, None, :]
                c2 = tl.load(cr + HALF * scd, mask=rmask).to(tl.float32)[:, None, :]
                s1 = tl.load(sr, mask=rmask).to(tl.float32)[:, None, :]
                s2 = tl.load(sr + HALF * ssd, mask=rmask).to(tl.float32)[:, None, :]
            # x1·c − x2·s is torch's x1·c + (−x2)·s bit for bit (IEEE a − b ≡ a + (−b));
            # Triton's unary minus is 0 − x, which turns +0 into +0, not −0
            g1 = f1 * c1 - f2 * s1
            g2 = f2 * c2 + f1 * s2
            f1 = g1
            f2 = g2
    if FP8:
        rofs = base + b * bpitch + rows[:, None] * pitch + hh[None, :] * (2 * HALF + 4)
        rmask = None if FULL else (rows[:, None] < S) & (hh[None, :] < nh)
        store_fp8(out_ptr, rofs, cols, f1, f2, rmask, x0.dtype.element_ty, HALF, HW_E4M3, PTX,
                  EXACT, REG_STORE)
    else:
        dst = (out_ptr + base + b * bpitch + rows[:, None, None] * pitch
               + hh[None, :, None] * (2 * HALF) + cols[None, None, :])
        tl.store(dst, f1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, f2.to(out_ptr.dtype.element_ty), mask=mask)
