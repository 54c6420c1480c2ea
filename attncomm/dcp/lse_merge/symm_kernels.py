"""The ``symm_a2a`` merge kernels (Triton) and their protocol. Planning, launch and the backend
class are in ``symm_a2a`` beside it; the slab layout in ``symm_layout``.

Each rank stores, for every peer ``q``, the rows of its partial output and LSE that belong to
``q``'s head slice straight into ``q``'s slab (P2P stores over NVLink), then waits (bounded by
``%globaltimer``) for every source's rows of its own head slice and combines them by LSE with its
own rows, which it reads in place (never copied). Two protocols, chosen per call from the size:

- LL (small payloads, ``SymmConfig.ll_max_bytes`` per peer): every 8-byte word sent is
  ``(epoch << 32) | 32 payload bits`` (NCCL's LL idea), so there is no fence and no separate
  flag: the receiver polls the words themselves. Twice the bytes, one NVLink trip less.
- flag (larger): rows are sent in blocks, each published with a release store of the epoch
  into the peer's flag for that block; the receiver acquires the flag, then reads the rows. A
  program with several blocks sends block k+1 before it waits for and combines block k. From
  ``SymmConfig.stagger_min_bytes`` per peer, with one block per program, the sends are
  staggered: a later group of the grid starts sending only when its partner in the group
  before has issued its stores, so the first group's fences, flags and combines overlap the
  later group's transfer.

Shared rules (the helpers that implement epochs, scrub, bounded waits and LL words are the
substrate's, ``attncomm.symm_device``, shared with the query gather's kernels):

- Epoch: ``state[0]`` on the device, ``state[1]`` the count of programs in this call; read
  together as one 64-bit word. Every program adds ``1 << 32`` to it atomically, which both counts
  it in and reads the epoch (``e = state[0] + 1``); the last one to count in writes ``e`` back
  (count 0), so graph replays advance it without a host step. ``e & 1`` selects the parity slot;
  flags and LL words hold the full epoch (int32). A fast rank never overwrites what a slow rank
  reads: it can only start call ``e+2`` (same slot as ``e``) after every peer has sent its part
  of ``e+1``, which each peer does only after its call ``e`` finished (stream order).
- Programmatic dependent launch (PDL, capability ≥ 9.0): every program counts in, then
  ``gdc_wait()`` (the kernel before it on the stream has finished and its writes are visible),
  then the last one writes the epoch back, fenced, a block barrier, and every program calls
  ``gdc_launch_dependents()``. So the next merge starts while this one runs and takes its epoch
  there (off the critical path), but touches nothing else before this one has finished: stream
  order holds for everything but the epoch word, which only count-ins and the write-back touch.
  Hence the host may set ``state`` only with the stream synchronised before the next merge.
- Epoch wrap (int32): the epoch skips 0 (…, -1, 2, 3, …; the parity still alternates), so a
  never-written (zeroed) cell matches no call; and at epochs ≡ 0, 1 (mod 2**30) the kernel first
  zeroes the other slot's flags and LL words from every peer ("scrub"), then fences, then sends,
  so no cell keeps a value for 2**32 calls, where it would match again (scrubs of a slot are at
  most 2**31 calls apart: epochs 0 and 1 do not come round again). The peers write that
  slot next in call ``e+1``, after they have this call's data, so they never race the scrub.
- Each program folds its own rows (read in place) before it waits for a peer. Without PDL the
  LL kernel loads its first block's payload for peer ``(rank + 1) % W`` before the epoch atomic,
  so the two round trips overlap (with PDL the atomic comes first: inputs are read only after
  ``gdc_wait()``). The flag kernel does not load ahead (measured slower there).
- Deadlock freedom: the grid is at most one program per SM (persistent programs loop over row
  blocks), and every program sends its first block before it waits for a peer (a staggered
  program first waits for a local program of the group before it, and every such chain starts
  at a program that waits for nothing before it signals), so no spinning program waits on a
  program that cannot become resident. With PDL the next merge's programs are launched only
  once all of this merge's programs run, and they wait in ``gdc_wait()`` (no spinning).
- Timeouts: a wait past the descriptor's budget sets ``errors[src] = 1`` (a system-scope
  store: the word may live in mapped host memory, read by the host without a CUDA call) and the
  program skips that block; the workspace turns that into ``PeerTimeoutError`` naming ``src``.

Arguments: pointers (the inputs, the results, the slab, its descriptor, the epoch word, the
error words), the call's row count, constexprs. The kernel reads the slab's region bases and
cell strides (``SlabLayout``: regions ``O``, ``L``, ``F``, ``LLO``, ``LLL``), the wait budget and
the peer offsets from the descriptor (``attncomm.symm_regions``), built once per merger; the
same region on peer ``q`` is ``peer_delta(desc, q, k, W)`` elements away (k = 0: payload
elements, 1: 4-byte, 2: 8-byte words).

The merge rule is the one in ``combine`` beside it (a non-finite LSE — −inf, +inf, NaN — is
an empty source, ``m := 0`` when all are −inf, guarded divide, fp32 accumulation, one rounding;
docs/API.md "Special values"), folded source by source (online rescaling). A zero-weight
source's payload is loaded but never used (a select, not a multiply), so whatever an empty
source holds cannot leak; NaN/±inf in a contributing payload propagates.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from ...symm_device import (budget, count_in, epoch_of, ll_ready, ll_word, pack16, peer_delta,
                            record_timeout, region, scrub_due, scrub_fence, scrub_region,
                            timed_out, typed, wait_word)
from . import symm_layout as _lay

__all__ = ["merge_flag_kernel", "merge_ll_kernel"]


@triton.jit
def _scrub(slab, desc, state64_ptr, e, pid, grid_size, RANK: tl.constexpr, W: tl.constexpr):
    # Rare path (see the module docstring): zero the other slot's flag and LL cells from every
    # peer, split over the grid; then the fence (on the unused word state[2:4], which stays 0)
    # so that the zeros are in place before any store of this call reaches a peer.
    if scrub_due(e):
        scrub_region(slab, desc, _lay.R_F, tl.int32, e, pid, grid_size, RANK, W)
        scrub_region(slab, desc, _lay.R_LLO, tl.int64, e, pid, grid_size, RANK, W)
        scrub_region(slab, desc, _lay.R_LLL, tl.int64, e, pid, grid_size, RANK, W)
        scrub_fence(state64_ptr + 1)


@triton.jit
def _wait_go(ptr, e, deadline, desc):
    # Wait until a local cell holds e. Timing only (no data depends on it): past the timeout
    # the program just goes on.
    timeout_ns = budget(desc)
    v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
    while v != e:
        deadline, expired = timed_out(deadline, timeout_ns)
        if expired:
            v = e
        else:
            v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
    return deadline


@triton.jit
def _online(m, s, l):
    # Fold one source's LSE into the running max m and sum s (a non-finite LSE — −inf, +inf,
    # NaN — is an empty source: −inf; NaN < inf and inf < inf are False; m := 0 while every
    # LSE so far is −inf). Returns (m, s, scale of the old accumulator, weight).
    l = tl.where(l < float("inf"), l, float("-inf"))
    m_new = tl.maximum(m, l)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp(m - m_use)
    w = tl.exp(l - m_use)
    return m_new, s * scale + w, scale, w


@triton.jit
def _fold(acc, scale, w, o):
    # A zero-weight source's payload is never used (it may be NaN behind a −inf LSE).
    return acc * scale[:, None] + tl.where((w > 0)[:, None], w[:, None] * o.to(tl.float32),
                                           0.0)


@triton.jit
def _final(s, m):
    s_safe = tl.where(s > 0, s, 1.0)
    lse = tl.where(s > 0, tl.log(s_safe) + tl.where(m == float("-inf"), 0.0, m),
                   float("-inf"))
    return s_safe, lse


# -------------------------------------------------------------------- flag protocol (large T)

@triton.jit
def _own_rows(out_ptr, lse_ptr, rows, rmask, H, HS, D, RANK: tl.constexpr,
              BR: tl.constexpr, BD: tl.constexpr):
    # Start the fold with this rank's own rows (read in place): needs nothing from a peer,
    # so it runs before the wait and overlaps the transfer.
    d = tl.arange(0, BD)
    m2 = rmask[:, None] & (d < D)[None, :]
    own = (rows // HS) * H + RANK * HS + rows % HS
    l = tl.load(lse_ptr + own, mask=rmask, other=float("-inf"))
    o = tl.load(out_ptr + own[:, None] * D + d[None, :], mask=m2, other=0.0)
    m, s, scale, w = _online(tl.full([BR], float("-inf"), tl.float32),
                             tl.zeros([BR], tl.float32), l)
    return m, s, _fold(tl.zeros([BR, BD], tl.float32), scale, w, o)


@triton.jit
def _combine_rows(m, s, acc, res_ptr, res_lse_ptr, slab_o, slab_l, slot, rows, rmask, D,
                  o_cell, l_cell, RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                  BD: tl.constexpr):
    # Fold every peer's received rows into (m, s, acc) from _own_rows; store the result.
    d = tl.arange(0, BD)
    m2 = rmask[:, None] & (d < D)[None, :]
    for q in tl.static_range(W):
        if q != RANK:
            cell = slot * W + q
            l = tl.load(slab_l + cell * l_cell + rows, mask=rmask, other=float("-inf"),
                        cache_modifier=".cg")
            o = tl.load(slab_o + cell * o_cell + rows[:, None] * D + d[None, :], mask=m2,
                        other=0.0, cache_modifier=".cg")
            m, s, scale, w = _online(m, s, l)
            acc = _fold(acc, scale, w, o)
    s_safe, lse = _final(s, m)
    tl.store(res_ptr + rows[:, None] * D + d[None, :],
             (acc / s_safe[:, None]).to(res_ptr.dtype.element_ty), mask=m2)
    tl.store(res_lse_ptr + rows, lse, mask=rmask)


@triton.jit
def _peer_rows(x_ptr, lse_ptr, b, q, n_rows, H, HS, N, BR: tl.constexpr, BN: tl.constexpr,
               OTHER: tl.constexpr):
    # Block b of this rank's rows of peer q's head slice: ([BR, BN] of a row's N columns:
    # payload elements, or int32 words on the LL path; [BR] LSE). Masked lanes read OTHER
    # (None: left undefined, never stored).
    rows = b * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    c = tl.arange(0, BN)
    src = (rows // HS) * H + rows % HS + q * HS
    x = tl.load(x_ptr + src[:, None] * N + c[None, :], mask=rmask[:, None] & (c < N)[None, :],
                other=OTHER)
    return x, tl.load(lse_ptr + src, mask=rmask, other=OTHER)


@triton.jit
def _store_rows(vals, lv, reg_o, reg_l, slot, b, n_rows, D, o_cell, l_cell,
                RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                tag=None):
    # ... stored into cell (slot, RANK) of one peer's regions: reg_o and reg_l already point at
    # that peer's (the payload and the LSE words of its slab, or its LL regions), cells of
    # o_cell and l_cell elements, rows of D; with a tag (the LL protocol), each word as
    # (epoch << 32) | word.
    rows = b * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    d = tl.arange(0, BD)
    cell = slot * W + RANK
    tl.store(reg_o + cell * o_cell + rows[:, None] * D + d[None, :], _tagged(vals, tag),
             mask=rmask[:, None] & (d < D)[None, :])
    tl.store(reg_l + cell * l_cell + rows, _tagged(lv, tag), mask=rmask)


@triton.jit
def _tagged(v, tag):
    if tag is None:
        return v
    else:
        return ll_word(tag, v)


@triton.jit
def _send_block(out_ptr, lse_ptr, slab_o, slab_l, desc, slot, b, n_rows, H, HS, D, o_cell,
                l_cell, RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                BD: tl.constexpr, SKIP: tl.constexpr):
    # Store block b of this rank's rows for every peer's head slice (but SKIP) into that
    # peer's slab.
    for q in tl.static_range(W):
        if q != RANK and q != SKIP:
            vals, lv = _peer_rows(out_ptr, lse_ptr, b, q, n_rows, H, HS, D, BR, BD, None)
            _store_rows(vals, lv, slab_o + peer_delta(desc, q, 0, W),
                        slab_l + peer_delta(desc, q, 1, W), slot, b, n_rows, D, o_cell, l_cell,
                        RANK, W, BR, BD)


@triton.jit
def _publish(slab_f, desc, e, slot, b, f_cell, RANK: tl.constexpr, W: tl.constexpr):
    # Called after a block barrier: one release (fence + store) covers every thread's
    # earlier stores; the same thread's later flag stores are ordered after it.
    for q in tl.static_range(W):
        if q != RANK:
            pf = slab_f + peer_delta(desc, q, 1, W) + (slot * W + RANK) * f_cell + b
            if q == (RANK + 1) % W:
                tl.atomic_xchg(pf, e, sem="release", scope="sys")
            else:
                tl.atomic_xchg(pf, e, sem="relaxed", scope="sys")


@triton.jit
def _receive_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr,
                   e, slot, b, deadline, desc, bad, n_rows, H, HS, D, o_cell, l_cell,
                   f_cell, RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                   BD: tl.constexpr):
    # Fold this rank's own rows of block b, wait (acquire, bounded) for every source's flag
    # of block b, then fold the received rows and store.
    rows = b * BR + tl.arange(0, BR)
    rmask = rows < n_rows
    m, s, acc = _own_rows(out_ptr, lse_ptr, rows, rmask, H, HS, D, RANK, BR, BD)
    for q in tl.static_range(W):
        if q != RANK:
            deadline, bad = wait_word(slab_f + (slot * W + q) * f_cell + b, e, deadline,
                                      desc, err_ptr + q, bad, "acquire")
    tl.debug_barrier()
    if bad == 0:
        _combine_rows(m, s, acc, res_ptr, res_lse_ptr, slab_o, slab_l, slot, rows, rmask, D,
                      o_cell, l_cell, RANK, W, BR, BD)
    return deadline, bad


@triton.jit
def _flag_regions(slab, desc, out_ptr):
    # The flag protocol's regions of the slab (descriptor words, never written after the
    # merger is built): (payload cells, cell stride, LSE cells, stride, flag cells, stride).
    o_base, o_cell = region(desc, _lay.R_O)
    l_base, l_cell = region(desc, _lay.R_L)
    f_base, f_cell = region(desc, _lay.R_F)
    return (typed(slab, out_ptr.dtype.element_ty) + o_base, o_cell,
            typed(slab, tl.float32) + l_base, l_cell, typed(slab, tl.int32) + f_base, f_cell)


@triton.jit(do_not_specialize=["n_rows"])
def merge_flag_kernel(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab, desc, state_ptr, err_ptr,
                      n_rows, RANK: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                      HS: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr,
                      STAGGER: tl.constexpr, PDL: tl.constexpr):
    """One merge, flag protocol. ``out [T, H, D]``, ``lse [T, H]`` fp32 → ``res [T, HS, D]``,
    ``res_lse [T, HS]`` fp32; a row is a ``(t, h_local)`` pair, ``n_rows = T·HS``; ``slab``
    the slab's bytes, ``desc`` its descriptor, ``state_ptr`` the ``[4]`` int32 epoch words,
    ``err_ptr`` the ``[W]`` int32 error words.

    Program p handles blocks p, p+G, ... (G = grid size ≤ #SMs, so all are resident),
    software-pipelined: block k+1 is sent before block k is waited for and combined, and
    block k+1's flag is released only after that, so the combine of block k overlaps the
    transfer of block k+1 (a release fence waits for every earlier store). Every program
    publishes its first block before it waits for a peer, so no peer wait depends on a
    wait; with STAGGER > 0 a program of a later group first waits, locally and bounded,
    for its partner of the group before, so every chain of local waits starts at a program
    of the first group, which waits for nothing before it signals."""
    pid = tl.program_id(0)
    grid_size = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BR)
    state64 = typed(state_ptr, tl.int64)
    if PDL:  # the previous kernel's writes are complete and visible after gdc_wait
        old = count_in(state64)
        tl_cuda.gdc_wait()
        slab_o, o_cell, slab_l, l_cell, slab_f, f_cell = _flag_regions(slab, desc, out_ptr)
    else:  # the descriptor's loads overlap the epoch atomic's round trip
        slab_o, o_cell, slab_l, l_cell, slab_f, f_cell = _flag_regions(slab, desc, out_ptr)
        old = count_in(state64)
    e = epoch_of(old, state64, grid_size, PDL)
    _scrub(slab, desc, state64, e, pid, grid_size, RANK, W)
    slot = e & 1
    deadline = tl.zeros([], tl.int64)
    bad = tl.full([], 0, tl.int32)
    # STAGGER (percent of the grid per group, the last group takes the rest; one block per
    # program): this rank's own flag cell, unused by the peers, holds "program p has
    # issued its stores"; program p + first starts sending only then (below 50 %, chains:
    # p + first may itself have waited for p). The rows for peer (rank + 1) % W and its
    # offsets are loaded before that wait, so a waiting program stores the moment its
    # partner signals.
    go = slab_f + (slot * W + RANK) * f_cell
    first = tl.maximum((grid_size * STAGGER + 99) // 100, 1)
    Q0: tl.constexpr = (RANK + 1) % W
    if Q0 != RANK:
        vals, lv = _peer_rows(out_ptr, lse_ptr, pid, Q0, n_rows, H, HS, D, BR, BD, None)
        off_o0 = peer_delta(desc, Q0, 0, W)
        off_w0 = peer_delta(desc, Q0, 1, W)
    if STAGGER > 0:
        if pid >= first:  # its own deadline: a slow partner is no peer's timeout
            _wait_go(go + pid - first, e, deadline, desc)
    if Q0 != RANK:
        _store_rows(vals, lv, slab_o + off_o0, slab_l + off_w0, slot, pid, n_rows, D, o_cell,
                    l_cell, RANK, W, BR, BD)
    _send_block(out_ptr, lse_ptr, slab_o, slab_l, desc, slot, pid, n_rows, H, HS, D, o_cell,
                l_cell, RANK, W, BR, BD, Q0)
    tl.debug_barrier()
    if STAGGER > 0:
        if pid < grid_size - first:
            tl.atomic_xchg(go + pid, e, sem="relaxed", scope="gpu")
    _publish(slab_f, desc, e, slot, pid, f_cell, RANK, W)
    prev = pid
    b = pid + grid_size  # a while loop: the interpreter cannot range() over a program id
    while b < n_blocks:
        _send_block(out_ptr, lse_ptr, slab_o, slab_l, desc, slot, b, n_rows, H, HS, D, o_cell,
                    l_cell, RANK, W, BR, BD, RANK)
        deadline, bad = _receive_block(
            out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr, e, slot,
            prev, deadline, desc, bad, n_rows, H, HS, D, o_cell, l_cell, f_cell, RANK, W, BR,
            BD)
        tl.debug_barrier()
        _publish(slab_f, desc, e, slot, b, f_cell, RANK, W)
        prev = b
        b += grid_size
    _receive_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr, e,
                   slot, prev, deadline, desc, bad, n_rows, H, HS, D, o_cell, l_cell, f_cell,
                   RANK, W, BR, BD)


# -------------------------------------------------------------------- LL protocol (small T)

@triton.jit
def _unpack(x, PACK: tl.constexpr, DTYPE: tl.constexpr):
    # int32 words → (low, high) halves as fp32 (PACK 2: two 16-bit values per word).
    if PACK == 2:
        lo = (x & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
        hi = ((x >> 16) & 0xFFFF).to(tl.uint16).to(DTYPE, bitcast=True).to(tl.float32)
    else:
        lo = x.to(tl.float32, bitcast=True)
        hi = lo
    return lo, hi


@triton.jit
def _pack(lo, hi, PACK: tl.constexpr, DTYPE: tl.constexpr):
    if PACK == 2:
        return pack16(lo.to(DTYPE), hi.to(DTYPE))
    else:
        return lo.to(tl.int32, bitcast=True)


@triton.jit
def _ll_ready(y, yl, e):
    return ll_ready(y, e) & ll_ready(yl, e)


@triton.jit
def _ll_send(x0, xl0, dq0, out_w, lse_w, tag, slab_llo, slab_lll, desc, slot, pid, grid_size,
             n_rows, n_blocks, H, HS, DW, llo_cell, lll_cell, RANK: tl.constexpr,
             W: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr):
    # Every block of this program for every peer: the first block for (RANK + 1) % W from
    # the words and that peer's offset loaded ahead (x0, xl0, dq0), then the others.
    Q0: tl.constexpr = (RANK + 1) % W
    if Q0 != RANK:
        _store_rows(x0, xl0, slab_llo + dq0, slab_lll + dq0, slot, pid, n_rows, DW, llo_cell,
                    lll_cell, RANK, W, BR, BW, tag)
    for q in tl.static_range(W):
        if q != RANK and q != Q0:
            x, xl = _peer_rows(out_w, lse_w, pid, q, n_rows, H, HS, DW, BR, BW, 0)
            dq = peer_delta(desc, q, 2, W)
            _store_rows(x, xl, slab_llo + dq, slab_lll + dq, slot, pid, n_rows, DW, llo_cell,
                        lll_cell, RANK, W, BR, BW, tag)
    b = pid + grid_size
    while b < n_blocks:
        for q in tl.static_range(W):
            if q != RANK:
                x, xl = _peer_rows(out_w, lse_w, b, q, n_rows, H, HS, DW, BR, BW, 0)
                dqb = peer_delta(desc, q, 2, W)
                _store_rows(x, xl, slab_llo + dqb, slab_lll + dqb, slot, b, n_rows, DW,
                            llo_cell, lll_cell, RANK, W, BR, BW, tag)
        b += grid_size


@triton.jit
def _ll_regions(slab, desc, Q0: tl.constexpr, W: tl.constexpr):
    # The LL protocol's regions (as _flag_regions) and the first peer's offset in 8-byte words.
    llo_base, llo_cell = region(desc, _lay.R_LLO)
    lll_base, lll_cell = region(desc, _lay.R_LLL)
    return (typed(slab, tl.int64) + llo_base, llo_cell, typed(slab, tl.int64) + lll_base,
            lll_cell, peer_delta(desc, Q0, 2, W))


@triton.jit(do_not_specialize=["n_rows"])
def merge_ll_kernel(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab, desc, state_ptr, err_ptr,
                    n_rows, RANK: tl.constexpr, W: tl.constexpr, H: tl.constexpr,
                    HS: tl.constexpr, D: tl.constexpr, BR: tl.constexpr, BW: tl.constexpr,
                    PDL: tl.constexpr):
    """One merge, LL protocol: every 8-byte word sent is ``(epoch << 32) | 32 payload bits``,
    so no fence and no separate flag; the receiver polls the words themselves. Arguments as
    ``merge_flag_kernel``'s; the payloads are read and written as int32 words (``DW`` per row,
    ``BW`` its power-of-two cover)."""
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    PACK: tl.constexpr = 32 // DTYPE.primitive_bitwidth
    DW: tl.constexpr = D // PACK
    out_w = typed(out_ptr, tl.int32)
    lse_w = typed(lse_ptr, tl.int32)
    res_w = typed(res_ptr, tl.int32)
    pid = tl.program_id(0)
    grid_size = tl.num_programs(0)
    n_blocks = tl.cdiv(n_rows, BR)
    state64 = typed(state_ptr, tl.int64)
    r = tl.arange(0, BR)
    c = tl.arange(0, BW)
    # The first block's words for the next rank are loaded before the epoch is known: the
    # loads overlap the epoch atomic's round trip.
    Q0: tl.constexpr = (RANK + 1) % W
    # Without PDL so are the descriptor's words; with PDL every global access but the count-in
    # follows gdc_wait.
    if PDL:  # count in while the previous merge runs; read the inputs only after gdc_wait
        old = count_in(state64)
        tl_cuda.gdc_wait()
        slab_llo, llo_cell, slab_lll, lll_cell, dq0 = _ll_regions(slab, desc, Q0, W)
        x0, xl0 = _peer_rows(out_w, lse_w, pid, Q0, n_rows, H, HS, DW, BR, BW, 0)
    else:
        slab_llo, llo_cell, slab_lll, lll_cell, dq0 = _ll_regions(slab, desc, Q0, W)
        x0, xl0 = _peer_rows(out_w, lse_w, pid, Q0, n_rows, H, HS, DW, BR, BW, 0)
        old = count_in(state64)
    e = epoch_of(old, state64, grid_size, PDL)
    _scrub(slab, desc, state64, e, pid, grid_size, RANK, W)
    slot = e & 1
    tag = e.to(tl.int64) << 32
    cmask = c < DW
    _ll_send(x0, xl0, dq0, out_w, lse_w, tag, slab_llo, slab_lll, desc, slot, pid, grid_size,
             n_rows, n_blocks, H, HS, DW, llo_cell, lll_cell, RANK, W, BR, BW)
    deadline = tl.zeros([], tl.int64)
    bad = tl.full([], 0, tl.int32)
    b = pid
    while b < n_blocks:
        rows = b * BR + r
        rmask = rows < n_rows
        m2 = rmask[:, None] & cmask[None, :]
        own = (rows // HS) * H + RANK * HS + rows % HS
        m = tl.full([BR], float("-inf"), tl.float32)
        s = tl.zeros([BR], tl.float32)
        l = tl.load(lse_ptr + own, mask=rmask, other=float("-inf"))
        lo, hi = _unpack(tl.load(out_w + own[:, None] * DW + c[None, :], mask=m2, other=0),
                         PACK, DTYPE)
        m, s, scale, w = _online(m, s, l)
        acc_lo = _fold(tl.zeros([BR, BW], tl.float32), scale, w, lo)
        acc_hi = _fold(tl.zeros([BR, BW], tl.float32), scale, w, hi)
        for q in tl.static_range(W):
            if q != RANK:
                cell = slot * W + q
                po = slab_llo + cell * llo_cell + rows[:, None] * DW + c[None, :]
                pl = slab_lll + cell * lll_cell + rows
                timeout_ns = budget(desc)  # beside the first poll (symm_device)
                y = tl.load(po, mask=m2, other=tag, volatile=True)
                yl = tl.load(pl, mask=rmask, other=tag, volatile=True)
                ready = _ll_ready(y, yl, e)
                while ready == 0:
                    deadline, expired = timed_out(deadline, timeout_ns)
                    if expired:
                        record_timeout(err_ptr + q)
                        bad = bad | 1
                        ready = ready | 1
                    else:
                        y = tl.load(po, mask=m2, other=tag, volatile=True)
                        yl = tl.load(pl, mask=rmask, other=tag, volatile=True)
                        ready = _ll_ready(y, yl, e)
                # Reload once ready: a value replicated over threads was checked in one
                # thread's copy only; the words cannot change again before epoch e+2.
                y = tl.load(po, mask=m2, other=tag, volatile=True)
                yl = tl.load(pl, mask=rmask, other=tag, volatile=True)
                lq = yl.to(tl.int32).to(tl.float32, bitcast=True)
                lo, hi = _unpack(y.to(tl.int32), PACK, DTYPE)
                m, s, scale, w = _online(m, s, lq)
                acc_lo = _fold(acc_lo, scale, w, lo)
                acc_hi = _fold(acc_hi, scale, w, hi)
        if bad == 0:
            s_safe, lse = _final(s, m)
            words = _pack(acc_lo / s_safe[:, None], acc_hi / s_safe[:, None], PACK, DTYPE)
            tl.store(res_w + rows[:, None] * DW + c[None, :], words, mask=m2)
            tl.store(res_lse_ptr + rows, lse, mask=rmask)
        b += grid_size
