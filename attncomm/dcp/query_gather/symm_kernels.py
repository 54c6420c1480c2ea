"""Triton kernels of the ``symm`` query gather (host side: ``attncomm.dcp.query_gather.symm``).

One persistent kernel per gather. A "row" is one ``(token, local head)`` pair of this rank's
slice (``n_rows = T·H/W``, row ``t·H/W + j``); rows go in blocks of ``BR``, program ``p`` takes
blocks ``p, p+G, …`` (``G`` ≤ one program per SM, so every program is resident and spinning
programs never wait on one that cannot run). Each row is read once, rotated on its last ``R``
dims (``x·cos + (−x2, x1)·sin`` in fp32, no fused multiply-add: the host launches with
``enable_fp_fusion=False``, so the bits equal ``rotate_tail``'s), with FP8 output quantized
(``FP8``: the fp32 value, not rounded to q's dtype, divided by its head's scale with IEEE
division, then ``_e4m3``'s integer conversion: ``quantize_e4m3``'s bits), and stored:

- flag protocol (``gather_flag_kernel``): straight into every rank's ``OUT [max_tokens, H, D]``
  at heads ``[RANK·H/W, …)`` (each row in column blocks of ``BD``), then, after a block
  barrier, a release store of the epoch into each peer's flag ``F[slot, RANK, block]``; then
  every program waits (acquire, bounded) for every source's flag of its blocks. The data
  needs no copy: the result is ``OUT`` itself.
- LL protocol (``gather_ll_kernel``, small payloads): every 8-byte word sent is
  ``(epoch << 32) | 32 payload bits`` into the peer's ``LL[slot, RANK, row, word]``, so there
  is no fence and no flag; the receiver polls the words (bounded) and writes the payloads into
  its own ``OUT``.

Epoch, parity and wrap as ``symm_a2a`` (the same helpers, ``attncomm.symm_device``):
``state[0:2]`` is one 64-bit word ``(count << 32) | epoch``; every program adds ``1 << 32``
(counts in, reads the epoch ``e = epoch + 1``, skipping 0); the last to count in writes ``e``
back with count 0, so graph replays advance it on the device. ``slot = e & 1`` selects the
parity cells of ``F`` and ``LL``; flags and LL tags hold the full epoch; at epochs ≡ 0, 1
(mod 2**30) the kernel first zeroes the other slot's flags and LL words from every peer,
fences, and only then sends (no cell keeps a value for 2**32 calls).

Ordering (why a fast rank never overwrites what a slow rank still reads):

- LL cells: a rank can start call ``e+2`` (same slot as ``e``) only after every peer has sent
  its part of ``e+1``, which each peer does only after its call ``e`` finished (stream order).
  ``OUT`` is written by its own rank only, in stream order after the previous result's readers.
- ``OUT`` on the flag protocol is written by the peers directly and is single-buffered (a
  fixed address, so a captured graph's readers keep pointing at it). Program 0 of every call
  first stores ``e`` into ``READY[RANK]`` of every peer — this rank has started call ``e``, so
  every reader of its previous result, enqueued before, has finished — and every program waits
  (bounded) for ``READY[q] == e`` before its first store into peer ``q``'s ``OUT``. With
  ``ORDERED`` (the caller promises a cross-rank dependency between a result's readers and the
  next call, as the DCP merge after attention is) the wait is skipped; the store still happens.
- Timeouts: a wait past the descriptor's budget (``%globaltimer``) sets ``errors[q] = 1`` and
  the program skips what depended on it; the host turns that into ``PeerTimeoutError``.

Arguments: pointers (q, cos/sin, the FP8 scales, the slab, its descriptor, the epoch words, the
error words), the call's row count, constexprs (geometry, block shape, variant). The region
bases and cell strides (``symm_layout.GatherLayout``), the wait budget and the peer offsets come
from the descriptor (``attncomm.symm_regions``), built once per backend; the same region on peer
``q`` is ``peer_delta(desc, q, k, W)`` elements away (k = 0: output elements, 1: 4-byte, 2:
8-byte words).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ... import fp8_device as _e4
from ...fp8_device import fp8_magnitude
from ...symm import plan_blocks
from ...symm_device import (budget, count_in, epoch_of, ll_ready, ll_word, pack16, peer_delta,
                            record_timeout, region, scrub_due, scrub_fence, scrub_region,
                            timed_out, typed, wait_word)
from . import symm_layout as _lay

__all__ = ["MAX_BLOCK_ROWS", "e4m3_kernel", "gather_flag_kernel", "gather_ll_kernel",
           "plan_blocks"]

#: Rows per block at most (``plan_blocks``'s default bound).
MAX_BLOCK_ROWS = 64


@triton.jit
def _scrub(slab_w, desc, state64_ptr, e, pid, grid_size, RANK: tl.constexpr, W: tl.constexpr):
    # Epochs ≡ 0, 1 (mod 2**30): zero the other slot's flags and LL words from every peer
    # (slab_w: the slab as int32), then the fence (on the unused word state[2:4]) before
    # any store of this call can reach a peer.
    if scrub_due(e):
        scrub_region(slab_w, desc, _lay.R_F, tl.int32, e, pid, grid_size, RANK, W)
        scrub_region(slab_w, desc, _lay.R_LL, tl.int64, e, pid, grid_size, RANK, W)
        scrub_fence(state64_ptr + 1)


@triton.jit
def _announce(slab_w, desc, e, pid, ready_base, RANK: tl.constexpr, W: tl.constexpr):
    # Program 0: READY[RANK] := e in every peer's slab (this rank has started call e).
    if pid == 0:
        for q in tl.static_range(W):
            if q != RANK:
                p = slab_w + peer_delta(desc, q, 1, W) + ready_base + RANK
                tl.atomic_xchg(p, e, sem="relaxed", scope="sys")


@triton.jit
def _round(v, DTYPE: tl.constexpr):
    # fp32 → DTYPE, round to nearest even; NaN → the dtype's canonical quiet NaN (as
    # rotate_tail stores it). bf16 by integer arithmetic: the same bits on the GPU and
    # under the interpreter, whose own bf16 cast truncates.
    if DTYPE == tl.bfloat16:
        u = v.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(v != v, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        h = v.to(tl.float16).to(tl.uint16, bitcast=True)
        h = tl.where(v != v, 0x7E00, h)
        return h.to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        u = v.to(tl.uint32, bitcast=True)
        u = tl.where(v != v, 0x7FC00000, u)
        return u.to(tl.uint32).to(DTYPE, bitcast=True)


@triton.jit
def _e4m3(v):
    # fp32 → e4m3fn bytes (uint8) by integer arithmetic, the same bits on the GPU and under
    # the interpreter: saturate |v| > 448 (and ±inf) to ±448, round to nearest even
    # (subnormals: one fp32 add of 2**14 puts the rounding point at 2**-9, as torch's own
    # conversion does), NaN → 0x7F whatever its sign (quantize_e4m3 in gather.py).
    u = v.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    sign = (u >> 24) & 0x80
    a = tl.where((a > _e4.E4M3_MAX_BITS) & (a <= _e4.F32_INF_BITS), _e4.E4M3_MAX_BITS, a)
    r = fp8_magnitude(a) | sign  # NaN's byte (a > F32_INF_BITS) is replaced below
    r = tl.where(a > _e4.F32_INF_BITS, 0x7F, r)
    return r.to(tl.uint8)


@triton.jit
def _rot_tail(x, q_ptr, cos_ptr, sin_ptr, rows, m2, d, HS, D, R):
    # The rotated last R dims in fp32 (x·cos ∓ (x2 | x1)·sin, two products and a sum)
    # and the mask of the elements they apply to.
    half = R // 2
    tail = d >= D - R
    first = d < D - half
    partner = tl.where(first, d + half, d - half)
    mt = m2 & tail[None, :]
    xp = tl.load(q_ptr + rows[:, None] * D + partner[None, :], mask=mt, other=0.0)
    t = rows // HS
    k = d - (D - R)
    c = tl.load(cos_ptr + t[:, None] * R + k[None, :], mask=mt, other=0.0)
    s = tl.load(sin_ptr + t[:, None] * R + k[None, :], mask=mt, other=0.0)
    xc = x.to(tl.float32) * c
    ps = xp.to(tl.float32) * s
    # x·c − x2·s, not x·c + (−x2)·s: Triton negates as 0 − x, which turns −0 into +0; IEEE
    # gives a − b and a + (−b) the same bits, so this is torch's value for every input.
    return tl.where(first[None, :], xc - ps, xc + ps), mt


@triton.jit
def _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, d, dmask, HS, D, R,
              RANK: tl.constexpr, ROT: tl.constexpr, FP8: tl.constexpr):
    # This rank's output values at rows × element indices d ([BR, n]). Not FP8: q's
    # dtype, with ROT the last R dims rotated and rounded once. FP8: e4m3 bytes of the
    # fp32 value (rotated with ROT, not rounded) divided (IEEE) by its head's scale.
    m2 = rmask[:, None] & dmask[None, :]
    x = tl.load(q_ptr + rows[:, None] * D + d[None, :], mask=m2, other=0.0)
    if FP8:
        v = x.to(tl.float32)
        if ROT:
            rot, mt = _rot_tail(x, q_ptr, cos_ptr, sin_ptr, rows, m2, d, HS, D, R)
            v = tl.where(mt, rot, v)
        sc = tl.load(scale_ptr + RANK * HS + rows % HS, mask=rmask, other=1.0)
        return _e4m3(tl.div_rn(v, sc[:, None]))
    else:
        if ROT:
            rot, mt = _rot_tail(x, q_ptr, cos_ptr, sin_ptr, rows, m2, d, HS, D, R)
            x = tl.where(mt, _round(rot, x.dtype), x)
        return x


@triton.jit
def _words(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, w, wmask, HS, D, R,
           RANK: tl.constexpr, ROT: tl.constexpr, FP8: tl.constexpr, PACK: tl.constexpr):
    # The output rows as int32 words ([BR, BW]); PACK 2: two 16-bit values per word,
    # PACK 4: four bytes (FP8), the lowest address in the low byte.
    if PACK == 4:
        word = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, 4 * w, wmask, HS,
                         D, R, RANK, ROT, FP8).to(tl.int32)
        for k in tl.static_range(1, 4):
            b = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, 4 * w + k,
                          wmask, HS, D, R, RANK, ROT, FP8)
            word = word | (b.to(tl.int32) << (8 * k))
        return word
    elif PACK == 2:
        lo = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, 2 * w, wmask, HS,
                       D, R, RANK, ROT, FP8)
        hi = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, 2 * w + 1, wmask,
                       HS, D, R, RANK, ROT, FP8)
        return pack16(lo, hi)
    else:
        x = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, w, wmask, HS, D, R,
                      RANK, ROT, FP8)
        return x.to(tl.int32, bitcast=True)


@triton.jit
def e4m3_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """``out[i] = _e4m3(x[i])`` (fp32 → e4m3fn bytes): the kernels' conversion alone, for
    tests against torch's."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out_ptr + i, _e4m3(tl.load(x_ptr + i, mask=m, other=0.0)), mask=m)


@triton.jit
def _prologue(slab, desc, state_ptr, RANK: tl.constexpr, W: tl.constexpr):
    # Both protocols: the epoch (count in, read, the last program writes it back), the
    # scrub, READY[RANK] := e in every peer. Returns (e, slab as int32, READY's base).
    pid = tl.program_id(0)
    grid_size = tl.num_programs(0)
    state64 = typed(state_ptr, tl.int64)
    slab_w = typed(slab, tl.int32)
    ready_base, _ = region(desc, _lay.R_READY)
    e = epoch_of(count_in(state64), state64, grid_size, False)
    _scrub(slab_w, desc, state64, e, pid, grid_size, RANK, W)
    _announce(slab_w, desc, e, pid, ready_base, RANK, W)
    return e, slab_w, ready_base


@triton.jit(do_not_specialize=["n_rows"])
def gather_flag_kernel(q_ptr, cos_ptr, sin_ptr, scale_ptr, slab, desc, state_ptr, err_ptr,
                       n_rows, RANK: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                       HS: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
                       BD: tl.constexpr, ORDERED: tl.constexpr, FP8: tl.constexpr):
    """One gather, flag protocol. ``q [T, HS, D]`` → ``OUT[t, RANK·HS + j]`` of every rank
    (``slab``: the slab's bytes, OUT at offset 0 in the output dtype; ``desc`` its descriptor;
    ``state_ptr`` the ``[4]`` int32 epoch words; ``err_ptr`` the ``[W]`` int32 error words;
    ``scale_ptr``: the ``[H]`` fp32 scales, read with FP8 only; ``cos_ptr``/``sin_ptr``
    ``[T, R]`` fp32, read with ``R > 0`` only)."""
    ROT: tl.constexpr = R > 0
    pid = tl.program_id(0)
    grid_size = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BR)
    if FP8:
        slab_o = slab
    else:
        slab_o = typed(slab, q_ptr.dtype.element_ty)
    e, slab_w, ready_base = _prologue(slab, desc, state_ptr, RANK, W)
    f_base, f_cell = region(desc, _lay.R_F)
    slot = e & 1
    deadline = tl.zeros([], tl.int64)
    bad = tl.full([], 0, tl.int32)  # bit q: a wait for peer q timed out
    b = pid
    first = tl.full([], 1, tl.int32)
    while b < n_blocks:
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        if not ORDERED:
            if first == 1:  # before the first store into each peer's OUT
                for q in tl.static_range(W):
                    if q != RANK:
                        deadline, bq = wait_word(slab_w + ready_base + q, e, deadline, desc,
                                                 err_ptr + q, (bad >> q) & 1, "relaxed")
                        bad = bad | (bq << q)
        row0 = ((rows // HS) * H + RANK * HS + rows % HS) * D
        # A row's D elements in column blocks of BD (symm.column_block): the [BR, BD] tile
        # must stay in registers, a whole-row tile of many rows spills.
        c = tl.zeros([], tl.int32)
        while c < D:  # a while loop, as the block loop (the interpreter runs it alike)
            d = c + tl.arange(0, BD)
            dmask = d < D
            x = _load_out(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, d, dmask, HS, D, R,
                          RANK, ROT, FP8)
            dst = row0[:, None] + d[None, :]
            m2 = rmask[:, None] & dmask[None, :]
            tl.store(slab_o + dst, x, mask=m2)
            for q in tl.static_range(W):
                if q != RANK:
                    if ((bad >> q) & 1) == 0:
                        tl.store(slab_o + peer_delta(desc, q, 0, W) + dst, x, mask=m2)
            c += BD
        first = first * 0
        tl.debug_barrier()
        for q in tl.static_range(W):
            if q != RANK:
                if ((bad >> q) & 1) == 0:  # never a flag without its rows
                    pf = (slab_w + peer_delta(desc, q, 1, W) + f_base
                          + (slot * W + RANK) * f_cell + b)
                    tl.atomic_xchg(pf, e, sem="release", scope="sys")
        b += grid_size
    b = pid
    while b < n_blocks:
        for q in tl.static_range(W):
            if q != RANK:
                deadline, bq = wait_word(slab_w + f_base + (slot * W + q) * f_cell + b, e,
                                         deadline, desc, err_ptr + q, (bad >> q) & 1,
                                         "acquire")
                bad = bad | (bq << q)
        b += grid_size


@triton.jit(do_not_specialize=["n_rows"])
def gather_ll_kernel(q_ptr, cos_ptr, sin_ptr, scale_ptr, slab, desc, state_ptr, err_ptr,
                     n_rows, RANK: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                     HS: tl.constexpr, D: tl.constexpr, R: tl.constexpr, BR: tl.constexpr,
                     BW: tl.constexpr, PACK: tl.constexpr, FP8: tl.constexpr):
    """One gather, LL protocol: ``(epoch << 32) | word`` into every peer's
    ``LL[slot, RANK]``; the receiver polls its ``LL[slot, q]`` and writes ``OUT`` (at the
    slab's start, as ``[max_tokens, H, DW]`` int32 words, ``DW = D / PACK``). Arguments as
    ``gather_flag_kernel``'s; ``PACK`` output values per 32-bit word."""
    ROT: tl.constexpr = R > 0
    DW: tl.constexpr = D // PACK
    pid = tl.program_id(0)
    grid_size = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BR)
    e, slab_w, ready_base = _prologue(slab, desc, state_ptr, RANK, W)
    slab_q = typed(slab, tl.int64)
    ll_base, ll_cell = region(desc, _lay.R_LL)
    slot = e & 1
    tag = e.to(tl.int64) << 32
    w = tl.arange(0, BW)
    wmask = w < DW
    b = pid
    while b < n_blocks:
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        m2 = rmask[:, None] & wmask[None, :]
        x = _words(q_ptr, cos_ptr, sin_ptr, scale_ptr, rows, rmask, w, wmask, HS, D, R, RANK,
                   ROT, FP8, PACK)
        tagged = ll_word(tag, x)
        for q in tl.static_range(W):
            if q != RANK:
                cell = ll_base + (slot * W + RANK) * ll_cell
                tl.store(slab_q + peer_delta(desc, q, 2, W) + cell + rows[:, None] * DW
                         + w[None, :], tagged, mask=m2)
        dst = ((rows // HS) * H + RANK * HS + rows % HS)[:, None] * DW + w[None, :]
        tl.store(slab_w + dst, x, mask=m2)
        b += grid_size
    deadline = tl.zeros([], tl.int64)
    b = pid
    while b < n_blocks:
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        m2 = rmask[:, None] & wmask[None, :]
        for q in tl.static_range(W):
            if q != RANK:
                p = slab_q + ll_base + (slot * W + q) * ll_cell + rows[:, None] * DW \
                    + w[None, :]
                timeout_ns = budget(desc)  # beside the first poll (symm_device)
                y = tl.load(p, mask=m2, other=tag, volatile=True)
                ready = ll_ready(y, e)
                ok = tl.full([], 1, tl.int32)
                while ready == 0:
                    deadline, expired = timed_out(deadline, timeout_ns)
                    if expired:
                        record_timeout(err_ptr + q)
                        ok = ok * 0
                        ready = ready | 1
                    else:
                        y = tl.load(p, mask=m2, other=tag, volatile=True)
                        ready = ll_ready(y, e)
                if ok == 1:
                    # Reload once ready: the check ran on one thread's copy of a value
                    # replicated over threads; the words cannot change before epoch e+2.
                    y = tl.load(p, mask=m2, other=tag, volatile=True)
                    dst = ((rows // HS) * H + q * HS + rows % HS)[:, None] * DW + w[None, :]
                    tl.store(slab_w + dst, y.to(tl.int32), mask=m2)
        b += grid_size
