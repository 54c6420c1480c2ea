# The symm_a2a merge as of commit a91b3cd (before the kernel/planning split), kept for the
# one-GPU A/B (scripts/dcp_one_gpu.py --ab). Verbatim but for its imports, made absolute (it is
# loaded from this directory, not from the package; cpu_group from where it lives now); the
# kernels are unchanged.
"""``symm_a2a``: the DCP merge over torch SymmetricMemory, one persistent Triton kernel per call.

Each rank stores, for every peer ``q``, the rows of its partial output and LSE that belong to
``q``'s head slice straight into ``q``'s slab (P2P stores over NVLink), then waits (bounded by
``%globaltimer``) for every source's rows of its own head slice and combines them by LSE with its
own rows, which it reads in place (never copied). Two protocols, chosen per call from the size:

- LL (payload per peer ≤ 256 KiB, i.e. ≤ 8 tokens at 64 heads × 512): every 8-byte word sent is
  ``(epoch << 32) | 32 payload bits`` (NCCL's LL idea), so there is no fence and no separate
  flag: the receiver polls the words themselves. Twice the bytes, one NVLink trip less.
- flag (larger): rows are sent in blocks of ≤ 64 rows, each published with a release store of the
  epoch into the peer's flag for that block; the receiver acquires the flag, then reads the rows.
  A program with several blocks sends block k+1 before it waits for and combines block k. From
  1 MiB per peer, with one block per program, the sends are staggered: the second half of the
  grid starts sending only when its partner in the first half has issued its stores, so the
  first half's fences, flags and combines overlap the second half's transfer (18.47 → 18.23 µs
  at 128 tokens in one A/B, with an earlier form of PDL in both).

Shared rules:

- Epoch: ``state[0]`` on the device, ``state[1]`` the count of programs in this call; read
  together as one 64-bit word. Every program adds ``1 << 32`` to it atomically, which both counts
  it in and reads the epoch (``e = state[0] + 1``); the last one to count in writes ``e`` back
  (count 0), so graph replays advance it without a host step. ``e & 1`` selects the parity slot;
  flags and LL words hold the full epoch (int32). A fast rank never overwrites what a slow rank
  reads: it can only start call ``e+2`` (same slot as ``e``) after every peer has sent its part
  of ``e+1``, which each peer does only after its call ``e`` finished (stream order).
- Programmatic dependent launch (PDL; capability ≥ 9.0, ``ATTNCOMM_SYMM_PDL=0`` turns it off):
  every program counts in, then ``gdc_wait()`` (the kernel before it on the stream has finished
  and its writes are visible), then the last one writes the epoch back, fenced, a block
  barrier, and every program calls ``gdc_launch_dependents()``. So the next merge starts while
  this one runs and takes its epoch there (off the critical path), but touches nothing else
  before this one has finished: stream order holds for everything but the epoch word, which
  only count-ins and the write-back touch. Hence the host may set ``state`` only with the
  stream synchronised before the next merge (tests do; a merger never needs to).
- Epoch wrap (int32): the epoch skips 0 (…, -1, 2, 3, …; the parity still alternates), so a
  never-written (zeroed) cell matches no call; and at epochs ≡ 0, 1 (mod 2**30) the kernel first
  zeroes the other slot's flags and LL words from every peer ("scrub"), then fences, then sends,
  so no cell keeps a value for 2**32 calls, where it would match again (scrubs of a slot are at
  most 2**31 calls apart: epochs 0 and 1 do not come round again). The peers write that
  slot next in call ``e+1``, after they have this call's data, so they never race the scrub.
- Each program folds its own rows (read in place) before it waits for a peer. Without PDL the
  LL kernel loads its first block's payload for peer ``(rank + 1) % W`` before the epoch atomic,
  so the two round trips overlap (with PDL the atomic comes first: inputs are read only after
  ``gdc_wait()``).
- Deadlock freedom: the grid is at most one program per SM (persistent programs loop over row
  blocks), and every program sends its first block before it waits for a peer (a staggered
  program first waits for a local program of the group before it, and every such chain starts
  at a program that waits for nothing before it signals), so no spinning program waits on a
  program that cannot become resident. With PDL the next merge's programs are launched only
  once all of this merge's programs run, and they wait in ``gdc_wait()`` (no spinning).
- Timeouts: a wait past ``timeout_s`` sets ``errors[src] = 1`` and the program skips that block;
  the host reads the word after every eager call and in ``check()`` (after graph replays), and
  raises ``PeerTimeoutError`` naming ``src``.

The merge rule is the one in ``attncomm.dcp.combine`` (NaN LSE → −inf, ``m := 0`` when all are
−inf, guarded divide, fp32 accumulation, one rounding), folded source by source (online
rescaling). A zero-weight source's payload is loaded but never used (a select, not a multiply),
so a NaN behind a −inf LSE cannot leak.

Measured on 2× H200 (W=2, 64 heads, D=512, bf16, CUDA graphs of 10 merges back to back): 3.1 /
4.5 / 6.2 / 7.8 / 11.1 / 18.0 µs at 1 / 8 / 16 / 32 / 64 / 128 tokens (17.95–18.05 over 13
runs); without PDL 3.8 / 5.4 /
7.0 / 8.6 / 11.9 / 18.6 (``benchmarks/results/dcp-2026-11-30-*.md``; the kernel's history and
the NVLink ceilings under it: ``dcp-kernel-2026-11-30-*.md``). With a kernel between merges
that does not trigger early (a producer that does not use PDL), PDL gains nothing and costs up
to 0.24 µs (1 token): ``attncomm bench dcp --modes graph-interleaved``.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from attncomm import capability
from symm_a91b3cd import SlabLayout, SymmWorkspace
from attncomm.dcp.backend import DcpBackend

try:
    import triton
    import triton.language as tl
    from triton.language.extra import cuda as tl_cuda
except Exception:  # noqa: BLE001 - the backend reports itself unavailable
    triton = None
    tl = None
    tl_cuda = None

__all__ = ["SymmA2ABackend", "plan_blocks", "use_ll", "ll_rows_for", "launch_merge"]

# Private tuning knobs (the same on every rank: read from the environment at import). Defaults
# from scripts/tune_dcp_gpu.sh on 2× H200 (64 heads × 512, bf16): 64- and 32-row blocks with one
# program per SM measure the same at 128 tokens (within 0.1 µs in every sweep); capping the grid
# (several pipelined blocks per program) is slower (benchmarks/results/dcp-sweep-2026-11-30-*).
_MAX_BLOCK_ROWS = int(os.environ.get("ATTNCOMM_SYMM_MAX_BLOCK_ROWS", "64"))
_PROGRAMS_PER_SM = int(os.environ.get("ATTNCOMM_SYMM_PROGRAMS_PER_SM", "1"))
_MAX_WARPS = int(os.environ.get("ATTNCOMM_SYMM_MAX_WARPS", "16"))
# Warps for blocks of ≥ 32 KiB, not capped by _MAX_WARPS (0: no exception): 32-row blocks of
# 512 bf16 (128 tokens) measure 18.08 → 18.00 µs with 32 warps, 16 KiB blocks (64 tokens)
# 11.10 → 11.40. (LL blocks stay far below 32 KiB at the default _LL_MAX_BYTES.)
_WIDE_WARPS = int(os.environ.get("ATTNCOMM_SYMM_WIDE_WARPS", "32"))
# Cap on the grid (0: none): fewer programs, each looping over several pipelined blocks.
_MAX_PROGRAMS = int(os.environ.get("ATTNCOMM_SYMM_MAX_PROGRAMS", "0"))
# Payload per peer up to which the LL protocol (flag inside every 8-byte word) is used.
_LL_MAX_BYTES = int(os.environ.get("ATTNCOMM_SYMM_LL_MAX_BYTES", str(256 * 1024)))
# Payload per peer from which the flag protocol staggers its sends (0: never): with one block per
# program, the last programs of the grid start sending only when a program of the first group
# has issued its stores, so the first group's fences, flags and combines overlap the second
# group's transfer. _STAGGER_SPLIT: percent of the grid in the first group; below 50, the grid
# is cut into groups of that size, each waiting for the one before (100 or more: off). Measured
# best (A/Bs with PDL on): from 1 MiB, 50 % (from 256 KiB slower at 16 tokens; 67 % and 75 %
# slower at 128 tokens; groups of 34 % or 25 % faster at 32 tokens, 7.90 → 7.73 µs, but slower
# at 128, 18.08 → 18.21 / 18.36).
_STAGGER_MIN_BYTES = int(os.environ.get("ATTNCOMM_SYMM_STAGGER_MIN_BYTES", str(1 << 20)))
_STAGGER_SPLIT = int(os.environ.get("ATTNCOMM_SYMM_STAGGER_SPLIT", "50"))
# Programmatic dependent launch (capability ≥ 9.0; "0" turns it off): a merge launches while the
# previous kernel on the stream runs, counts itself into the epoch there, and waits
# (gdc_wait) for that kernel to finish before it reads anything else. It saves the launch gap
# and the epoch atomic when merges follow merges (or any kernel that calls
# gdc_launch_dependents early): 0.6–0.9 µs per merge. After a kernel that does not, it starts
# as without PDL, and the LL kernel loses its load-ahead: up to 0.24 µs slower (1 token).
_PDL = os.environ.get("ATTNCOMM_SYMM_PDL", "1") != "0"
_DELTA_UNIT = 16  # peer offsets are passed in units of 16 elements (keeps stores vectorised)


if triton is not None:

    @triton.jit
    def _now_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _count_in(state64_ptr):
        # The first half of the epoch step: one atomic on the 64-bit word (count << 32) | epoch
        # adds 1 << 32 (counts this program in) and returns the previous word.
        return tl.atomic_add(state64_ptr, 1 << 32, sem="relaxed", scope="gpu")

    @triton.jit
    def _epoch_of(old, state64_ptr, grid_size, PDL: tl.constexpr):
        # The second half: this call's epoch from the word _count_in returned. No program can
        # read after the write-back (every count-in precedes the last one); the last program to
        # count in stores (0 << 32) | e for the next call. Epoch 0 is skipped (it would match
        # never-written, zeroed cells; 2 keeps the parity).
        # With PDL, then gdc_launch_dependents: the next merge counts in (before its gdc_wait)
        # once every program here has called it. In the last program, thread 0 writes back,
        # its fence waits until the write has reached L2 (where every count-in's atomic runs),
        # and a block barrier (the branch is the same for the whole block) keeps the other
        # warps from triggering before that: the first trigger of a block counts for the whole
        # block. (A practical guarantee: PTX gives launch_dependents no memory ordering; only
        # gdc_wait makes a grid's writes visible.)
        e = (old & 0xFFFFFFFF).to(tl.int32) + 1
        e = tl.where(e == 0, 2, e)
        if (old >> 32) == grid_size - 1:
            tl.atomic_xchg(state64_ptr, e.to(tl.int64) & 0xFFFFFFFF, sem="relaxed", scope="gpu")
            if PDL:
                tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [],
                                          dtype=tl.int32, is_pure=False, pack=1)
                tl.debug_barrier()
        if PDL:
            tl_cuda.gdc_launch_dependents()
        return e

    @triton.jit
    def _scrub(slab_w, err_ptr, e, pid, grid_size, f_base, f_cell, llo_base, llo_cell, lll_base,
               lll_cell, RANK: tl.constexpr, W: tl.constexpr):
        # Rare path (epochs ≡ 0, 1 mod 2**30): zero the other slot's flag and LL cells from
        # every peer (slab_w: the slab as int32; LL offsets count 8-byte words), split over the
        # grid; then a block barrier and a release (sys) so that the zeros are in place before
        # any store of this call reaches a peer.
        if ((e >> 1) & 0x1FFFFFFF) == 0:
            i = tl.arange(0, 1024)
            for q in tl.static_range(W):
                if q != RANK:
                    cell = (1 - (e & 1)) * W + q
                    for region in tl.static_range(3):
                        if region == 0:
                            base, n = f_base + cell * f_cell, f_cell
                        elif region == 1:
                            base, n = 2 * (llo_base + cell * llo_cell), 2 * llo_cell
                        else:
                            base, n = 2 * (lll_base + cell * lll_cell), 2 * lll_cell
                        k = pid * 1024
                        while k < n:
                            tl.store(slab_w + base + k + i, 0, mask=k + i < n)
                            k += grid_size * 1024
            tl.debug_barrier()
            tl.atomic_add(err_ptr + RANK, 0, sem="release", scope="sys")  # errors[RANK] stays 0
            tl.debug_barrier()

    @triton.jit
    def _timed_out(deadline, timeout_ns):
        # (deadline, expired): the deadline is set on the first wait that has to spin.
        now = _now_ns()
        if deadline == 0:
            deadline = now + timeout_ns.to(tl.int64)
        return deadline, now > deadline

    @triton.jit
    def _wait_flag(ptr, e, deadline, timeout_ns, err_ptr, bad):
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        while v != e:
            deadline, expired = _timed_out(deadline, timeout_ns)
            if expired:
                tl.atomic_xchg(err_ptr, 1)
                bad = bad | 1
                v = e
            else:
                v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
        return deadline, bad

    @triton.jit
    def _wait_go(ptr, e, deadline, timeout_ns):
        # Wait until a local cell holds e. Timing only (no data depends on it): past the timeout
        # the program just goes on.
        v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
        while v != e:
            deadline, expired = _timed_out(deadline, timeout_ns)
            if expired:
                v = e
            else:
                v = tl.atomic_add(ptr, 0, sem="relaxed", scope="gpu")
        return deadline

    @triton.jit
    def _online(m, s, l):
        # Fold one source's LSE into the running max m and sum s (NaN counts as −inf, m := 0
        # while every LSE so far is −inf). Returns (m, s, scale of the old accumulator, weight).
        l = tl.where(l == l, l, float("-inf"))
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

    # ---------------------------------------------------------------- flag protocol (large T)

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
                      o_cell, l_base, l_cell, RANK: tl.constexpr, W: tl.constexpr,
                      BR: tl.constexpr, BD: tl.constexpr):
        # Fold every peer's received rows into (m, s, acc) from _own_rows; store the result.
        d = tl.arange(0, BD)
        m2 = rmask[:, None] & (d < D)[None, :]
        for q in tl.static_range(W):
            if q != RANK:
                cell = slot * W + q
                l = tl.load(slab_l + l_base + cell * l_cell + rows, mask=rmask,
                            other=float("-inf"), cache_modifier=".cg")
                o = tl.load(slab_o + cell * o_cell + rows[:, None] * D + d[None, :], mask=m2,
                            other=0.0, cache_modifier=".cg")
                m, s, scale, w = _online(m, s, l)
                acc = _fold(acc, scale, w, o)
        s_safe, lse = _final(s, m)
        tl.store(res_ptr + rows[:, None] * D + d[None, :],
                 (acc / s_safe[:, None]).to(res_ptr.dtype.element_ty), mask=m2)
        tl.store(res_lse_ptr + rows, lse, mask=rmask)

    @triton.jit
    def _load_rows(out_ptr, lse_ptr, b, q, n_rows, H, HS, D, BR: tl.constexpr,
                   BD: tl.constexpr):
        # Block b of this rank's rows of peer q's head slice: ([BR, BD] payload, [BR] LSE).
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        d = tl.arange(0, BD)
        src = (rows // HS) * H + rows % HS + q * HS
        vals = tl.load(out_ptr + src[:, None] * D + d[None, :],
                       mask=rmask[:, None] & (d < D)[None, :])
        return vals, tl.load(lse_ptr + src, mask=rmask)

    @triton.jit
    def _store_rows(vals, lv, slab_o, slab_l, delta_oq, delta_wq, slot, b, n_rows, D, o_cell,
                    l_base, l_cell, RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                    BD: tl.constexpr):
        # ... stored into cell (slot, RANK) of peer q's slab (delta_oq, delta_wq: q's offsets).
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        d = tl.arange(0, BD)
        cell = slot * W + RANK
        po = slab_o + delta_oq * 16 + cell * o_cell
        tl.store(po + rows[:, None] * D + d[None, :], vals,
                 mask=rmask[:, None] & (d < D)[None, :])
        pl = slab_l + delta_wq * 16 + l_base + cell * l_cell
        tl.store(pl + rows, lv, mask=rmask)

    @triton.jit
    def _send_block(out_ptr, lse_ptr, slab_o, slab_l, delta_o, delta_w, slot, b, n_rows, H, HS,
                    D, o_cell, l_base, l_cell, RANK: tl.constexpr, W: tl.constexpr,
                    BR: tl.constexpr, BD: tl.constexpr, SKIP: tl.constexpr):
        # Store block b of this rank's rows for every peer's head slice (but SKIP) into that
        # peer's slab.
        for q in tl.static_range(W):
            if q != RANK and q != SKIP:
                vals, lv = _load_rows(out_ptr, lse_ptr, b, q, n_rows, H, HS, D, BR, BD)
                _store_rows(vals, lv, slab_o, slab_l, tl.load(delta_o + q), tl.load(delta_w + q),
                            slot, b, n_rows, D, o_cell, l_base, l_cell, RANK, W, BR, BD)

    @triton.jit
    def _publish(slab_f, delta_w, e, slot, b, f_base, f_cell, RANK: tl.constexpr,
                 W: tl.constexpr):
        # Called after a block barrier: one release (fence + store) covers every thread's
        # earlier stores; the same thread's later flag stores are ordered after it.
        for q in tl.static_range(W):
            if q != RANK:
                pf = (slab_f + tl.load(delta_w + q) * 16 + f_base + (slot * W + RANK) * f_cell
                      + b)
                if q == (RANK + 1) % W:
                    tl.atomic_xchg(pf, e, sem="release", scope="sys")
                else:
                    tl.atomic_xchg(pf, e, sem="relaxed", scope="sys")

    @triton.jit
    def _receive_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr,
                       e, slot, b, deadline, timeout_ns, bad, n_rows, H, HS, D, o_cell, l_base,
                       l_cell, f_base, f_cell, RANK: tl.constexpr, W: tl.constexpr,
                       BR: tl.constexpr, BD: tl.constexpr):
        # Fold this rank's own rows of block b, wait (acquire, bounded) for every source's flag
        # of block b, then fold the received rows and store.
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        m, s, acc = _own_rows(out_ptr, lse_ptr, rows, rmask, H, HS, D, RANK, BR, BD)
        for q in tl.static_range(W):
            if q != RANK:
                deadline, bad = _wait_flag(slab_f + f_base + (slot * W + q) * f_cell + b, e,
                                           deadline, timeout_ns, err_ptr + q, bad)
        tl.debug_barrier()
        if bad == 0:
            _combine_rows(m, s, acc, res_ptr, res_lse_ptr, slab_o, slab_l, slot, rows, rmask, D,
                          o_cell, l_base, l_cell, RANK, W, BR, BD)
        return deadline, bad

    @triton.jit(do_not_specialize=["n_rows", "n_blocks", "grid_size", "timeout_ns"])
    def _merge_flag_kernel(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f,
                           delta_o, delta_w, state_ptr, err_ptr,
                           n_rows, n_blocks, grid_size, timeout_ns,
                           H, HS, D, o_cell, l_base, l_cell, f_base, f_cell,
                           llo_base, llo_cell, lll_base, lll_cell,
                           RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                           BD: tl.constexpr, STAGGER: tl.constexpr, PDL: tl.constexpr):
        """One merge, flag protocol. ``out [T, H, D]``, ``lse [T, H]`` fp32 → ``res [T, HS,
        D]``, ``res_lse [T, HS]`` fp32; a row is a ``(t, h_local)`` pair, ``n_rows = T·HS``.

        Program p handles blocks p, p+G, ... (G = grid size ≤ #SMs, so all are resident),
        software-pipelined: block k+1 is sent before block k is waited for and combined, and
        block k+1's flag is released only after that, so the combine of block k overlaps the
        transfer of block k+1 (a release fence waits for every earlier store). Every program
        publishes its first block before it waits for a peer, so no peer wait depends on a
        wait; with STAGGER > 0 a program of a later group first waits, locally and bounded,
        for its partner of the group before, so every chain of local waits starts at a program
        of the first group, which waits for nothing before it signals."""
        pid = tl.program_id(0)
        # (Loading the first block before the epoch atomic, as the LL kernel does, was 0.3 µs
        # slower here at 64-128 tokens.)
        old = _count_in(state_ptr)
        if PDL:  # the previous kernel's writes are complete and visible from here on
            tl_cuda.gdc_wait()
        e = _epoch_of(old, state_ptr, grid_size, PDL)
        _scrub(slab_f, err_ptr, e, pid, grid_size, f_base, f_cell, llo_base, llo_cell, lll_base,
               lll_cell, RANK, W)
        slot = e & 1
        deadline = timeout_ns.to(tl.int64) * 0
        bad = tl.full([], 0, tl.int32)
        # STAGGER (percent of the grid per group, the last group takes the rest; one block per
        # program): this rank's own flag cell, unused by the peers, holds "program p has
        # issued its stores"; program p + first starts sending only then (below 50 %, chains:
        # p + first may itself have waited for p). The rows for peer (rank + 1) % W and its
        # offsets are loaded before that wait, so a waiting program stores the moment its
        # partner signals.
        go = slab_f + f_base + (slot * W + RANK) * f_cell
        first = tl.maximum((grid_size * STAGGER + 99) // 100, 1)
        Q0: tl.constexpr = (RANK + 1) % W
        if Q0 != RANK:
            vals, lv = _load_rows(out_ptr, lse_ptr, pid, Q0, n_rows, H, HS, D, BR, BD)
            delta_o0 = tl.load(delta_o + Q0)
            delta_w0 = tl.load(delta_w + Q0)
        if STAGGER > 0:
            if pid >= first:  # its own deadline: a slow partner is no peer's timeout
                _wait_go(go + pid - first, e, deadline, timeout_ns)
        if Q0 != RANK:
            _store_rows(vals, lv, slab_o, slab_l, delta_o0, delta_w0, slot, pid, n_rows, D,
                        o_cell, l_base, l_cell, RANK, W, BR, BD)
        _send_block(out_ptr, lse_ptr, slab_o, slab_l, delta_o, delta_w, slot, pid, n_rows, H,
                    HS, D, o_cell, l_base, l_cell, RANK, W, BR, BD, Q0)
        tl.debug_barrier()
        if STAGGER > 0:
            if pid < grid_size - first:
                tl.atomic_xchg(go + pid, e, sem="relaxed", scope="gpu")
        _publish(slab_f, delta_w, e, slot, pid, f_base, f_cell, RANK, W)
        prev = pid
        b = pid + grid_size  # a while loop: the interpreter cannot range() over a program id
        while b < n_blocks:
            _send_block(out_ptr, lse_ptr, slab_o, slab_l, delta_o, delta_w, slot, b, n_rows, H,
                        HS, D, o_cell, l_base, l_cell, RANK, W, BR, BD, RANK)
            deadline, bad = _receive_block(
                out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr, e,
                slot, prev, deadline, timeout_ns, bad, n_rows, H, HS, D, o_cell, l_base, l_cell,
                f_base, f_cell, RANK, W, BR, BD)
            tl.debug_barrier()
            _publish(slab_f, delta_w, e, slot, b, f_base, f_cell, RANK, W)
            prev = b
            b += grid_size
        _receive_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f, err_ptr,
                       e, slot, prev, deadline, timeout_ns, bad, n_rows, H, HS, D, o_cell,
                       l_base, l_cell, f_base, f_cell, RANK, W, BR, BD)

    # ---------------------------------------------------------------- LL protocol (small T)

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
            a = lo.to(DTYPE).to(tl.uint16, bitcast=True).to(tl.int32)
            b = hi.to(DTYPE).to(tl.uint16, bitcast=True).to(tl.int32)
            return a | (b << 16)
        else:
            return lo.to(tl.int32, bitcast=True)

    @triton.jit
    def _ll_ready(y, yl, e):
        ok = tl.min(((y >> 32).to(tl.int32) == e).to(tl.int32))
        return ok & tl.min(((yl >> 32).to(tl.int32) == e).to(tl.int32))

    @triton.jit
    def _ll_load(out_w, lse_w, b, q, n_rows, H, HS, DW, BR: tl.constexpr, BW: tl.constexpr):
        # Block b of this rank's rows of peer q's head slice as int32 words ([BR, BW], [BR]).
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        c = tl.arange(0, BW)
        src = (rows // HS) * H + rows % HS + q * HS
        x = tl.load(out_w + src[:, None] * DW + c[None, :],
                    mask=rmask[:, None] & (c < DW)[None, :], other=0)
        return x, tl.load(lse_w + src, mask=rmask, other=0)

    @triton.jit
    def _ll_store(x, xl, tag, slab_q, delta_q, slot, b, q, n_rows, DW, llo_base, llo_cell,
                  lll_base, lll_cell, RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                  BW: tl.constexpr):
        # ... stored as (epoch << 32) | word into cell (slot, RANK) of peer q's LL regions.
        rows = b * BR + tl.arange(0, BR)
        rmask = rows < n_rows
        c = tl.arange(0, BW)
        base = slab_q + tl.load(delta_q + q) * 16
        cell = slot * W + RANK
        tl.store(base + llo_base + cell * llo_cell + rows[:, None] * DW + c[None, :],
                 tag | (x.to(tl.int64) & 0xFFFFFFFF), mask=rmask[:, None] & (c < DW)[None, :])
        tl.store(base + lll_base + cell * lll_cell + rows, tag | (xl.to(tl.int64) & 0xFFFFFFFF),
                 mask=rmask)

    @triton.jit(do_not_specialize=["n_rows", "n_blocks", "grid_size", "timeout_ns"])
    def _merge_ll_kernel(out_w, lse_ptr, lse_w, res_w, res_lse_ptr, slab_q, slab_w, delta_q,
                         state_ptr, err_ptr, n_rows, n_blocks, grid_size, timeout_ns, H, HS, DW,
                         f_base, f_cell, llo_base, llo_cell, lll_base, lll_cell,
                         RANK: tl.constexpr, W: tl.constexpr, BR: tl.constexpr,
                         BW: tl.constexpr, PACK: tl.constexpr, DTYPE: tl.constexpr,
                         PDL: tl.constexpr):
        """One merge, LL protocol: every 8-byte word sent is ``(epoch << 32) | 32 payload
        bits``, so no fence and no separate flag; the receiver polls the words themselves.
        ``out_w [T, H, DW]`` / ``res_w [T, HS, DW]`` are the payloads viewed as int32."""
        pid = tl.program_id(0)
        r = tl.arange(0, BR)
        c = tl.arange(0, BW)
        # The first block's words for the next rank are loaded before the epoch is known: the
        # loads overlap the epoch atomic's round trip.
        Q0: tl.constexpr = (RANK + 1) % W
        if PDL:  # count in while the previous merge runs; read the inputs only after gdc_wait
            old = _count_in(state_ptr)
            tl_cuda.gdc_wait()
            x0, xl0 = _ll_load(out_w, lse_w, pid, Q0, n_rows, H, HS, DW, BR, BW)
        else:
            x0, xl0 = _ll_load(out_w, lse_w, pid, Q0, n_rows, H, HS, DW, BR, BW)
            old = _count_in(state_ptr)
        e = _epoch_of(old, state_ptr, grid_size, PDL)
        _scrub(slab_w, err_ptr, e, pid, grid_size, f_base, f_cell, llo_base, llo_cell, lll_base,
               lll_cell, RANK, W)
        slot = e & 1
        tag = e.to(tl.int64) << 32
        cmask = c < DW
        if Q0 != RANK:
            _ll_store(x0, xl0, tag, slab_q, delta_q, slot, pid, Q0, n_rows, DW, llo_base,
                      llo_cell, lll_base, lll_cell, RANK, W, BR, BW)
        for q in tl.static_range(W):
            if q != RANK and q != Q0:
                x, xl = _ll_load(out_w, lse_w, pid, q, n_rows, H, HS, DW, BR, BW)
                _ll_store(x, xl, tag, slab_q, delta_q, slot, pid, q, n_rows, DW, llo_base,
                          llo_cell, lll_base, lll_cell, RANK, W, BR, BW)
        b = pid + grid_size
        while b < n_blocks:
            for q in tl.static_range(W):
                if q != RANK:
                    x, xl = _ll_load(out_w, lse_w, b, q, n_rows, H, HS, DW, BR, BW)
                    _ll_store(x, xl, tag, slab_q, delta_q, slot, b, q, n_rows, DW, llo_base,
                              llo_cell, lll_base, lll_cell, RANK, W, BR, BW)
            b += grid_size
        deadline = timeout_ns.to(tl.int64) * 0
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
                    po = slab_q + llo_base + cell * llo_cell + rows[:, None] * DW + c[None, :]
                    pl = slab_q + lll_base + cell * lll_cell + rows
                    y = tl.load(po, mask=m2, other=tag, volatile=True)
                    yl = tl.load(pl, mask=rmask, other=tag, volatile=True)
                    ready = _ll_ready(y, yl, e)
                    while ready == 0:
                        deadline, expired = _timed_out(deadline, timeout_ns)
                        if expired:
                            tl.atomic_xchg(err_ptr + q, 1)
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


def plan_blocks(n_rows: int, n_programs_max: int, max_block_rows: int = _MAX_BLOCK_ROWS):
    """Rows per block (a power of two ≤ ``max_block_rows``) and grid size for ``n_rows`` rows:
    enough rows per block that the blocks roughly fill ``n_programs_max`` programs.

    Returns ``(block_rows, n_blocks, grid)``; the same on every rank for the same inputs."""
    if n_rows <= 0:
        return 1, 0, 0
    per = -(-n_rows // max(n_programs_max, 1))
    br = 1
    while br < per and br < max_block_rows:
        br *= 2
    n_blocks = -(-n_rows // br)
    return br, n_blocks, min(n_blocks, n_programs_max)


def use_ll(n_rows: int, layout: SlabLayout) -> bool:
    """Whether a merge of ``n_rows`` rows per peer takes the LL protocol."""
    return 0 < n_rows <= layout.ll_rows


def ll_rows_for(max_rows: int, head_dim: int, itemsize: int,
                ll_max_bytes: int = _LL_MAX_BYTES) -> int:
    """Rows per cell of the LL regions: rows whose payload per peer fits ``ll_max_bytes``."""
    if (head_dim * itemsize) % 4:
        return 0
    return min(max_rows, ll_max_bytes // (head_dim * itemsize))


def _num_warps(nbytes: int) -> int:
    # about one 16-byte vector per thread and row chunk
    if _WIDE_WARPS > 0 and nbytes >= 32 * 1024:
        return _WIDE_WARPS
    return max(1, min(_MAX_WARPS, nbytes // (32 * 16)))


_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                  torch.float32: tl.float32}


def launch_merge(out, lse, res, res_lse, *, slab, delta_o, delta_w, delta_q, state, errors,
                 rank: int, world_size: int, num_heads: int, layout: SlabLayout,
                 n_programs_max: int, timeout_ns: int, pdl: bool = False) -> None:
    """Launch one merge (no host sync). ``out [T, H, D]`` and ``lse [T, H]`` fp32 contiguous;
    ``res``/``res_lse`` contiguous, at least ``[T, H/W, D]``/``[T, H/W]``; ``slab`` the local
    symmetric uint8 slab; ``delta_*`` the ``[W]`` int64 peer offsets in 16-element units of
    the payload dtype, 4-byte and 8-byte words; ``state`` the ``[4]`` int32 ``[epoch, count, 0,
    0]`` (its first 8 bytes are used as one int64 word). ``pdl``: launch with programmatic
    dependent launch (capability ≥ 9.0 only; see ``_PDL``)."""
    T, H, D = out.shape
    hs = num_heads // world_size
    n_rows = T * hs
    br, n_blocks, grid = plan_blocks(n_rows, n_programs_max)
    if grid == 0:
        return
    st = layout.kernel_strides()
    scrub_strides = [st[k] for k in ("f_base", "f_cell", "llo_base", "llo_cell", "lll_base",
                                     "lll_cell")]
    if use_ll(n_rows, layout):
        dw = layout.row_words
        bw = triton.next_power_of_2(dw)
        _merge_ll_kernel[(grid,)](
            out.view(torch.int32), lse, lse.view(torch.int32), res.view(torch.int32), res_lse,
            slab.view(torch.int64), slab.view(torch.int32), delta_q, state.view(torch.int64),
            errors, n_rows, n_blocks, grid, timeout_ns, H, hs, dw, *scrub_strides,
            RANK=rank, W=world_size, BR=br, BW=bw, PACK=4 // out.element_size(),
            DTYPE=_TL_DTYPES[out.dtype], PDL=pdl, num_warps=_num_warps(br * bw * 8),
            launch_pdl=pdl)
        return
    bd = triton.next_power_of_2(D)
    _merge_flag_kernel[(grid,)](
        out, lse, res, res_lse, slab.view(out.dtype), slab.view(torch.float32),
        slab.view(torch.int32), delta_o, delta_w, state.view(torch.int64), errors,
        n_rows, n_blocks, grid, timeout_ns,
        H, hs, D, st["o_cell"], st["l_base"], st["l_cell"], *scrub_strides,
        RANK=rank, W=world_size, BR=br, BD=bd,
        STAGGER=_stagger(n_rows, n_blocks, grid, D, out.element_size()), PDL=pdl,
        num_warps=_num_warps(br * bd * out.element_size()), launch_pdl=pdl)


def _stagger(n_rows: int, n_blocks: int, grid: int, head_dim: int, itemsize: int) -> int:
    """The flag kernel's STAGGER: the percent of the grid in the first group, or 0 (off)."""
    payload = n_rows * head_dim * itemsize
    return _STAGGER_SPLIT if 0 < _STAGGER_MIN_BYTES <= payload and n_blocks == grid >= 2 else 0


def _n_programs_max(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    n = max(1, props.multi_processor_count * max(1, _PROGRAMS_PER_SM))
    return min(n, _MAX_PROGRAMS) if _MAX_PROGRAMS > 0 else n


class SymmA2ABackend(DcpBackend):
    """The symmetric-memory DCP merge (see the module docstring).

    Construction is collective and host-blocking (allocation, then rendezvous, each agreed across
    ranks; then one warm-up merge per kernel variant so that JIT compilation and the first P2P
    stores happen here, before any capture). Calls are graph-capturable; outside capture every
    call reads the device error word (a host sync) and raises ``PeerTimeoutError`` at once; inside
    graphs call ``check()`` after replays.

    Returns views of internal buffers (``[T, H/W, D]`` in ``dtype``, ``[T, H/W]`` fp32), valid
    until the next call.

    Constraints: CUDA tensors, every rank on one host with P2P between every pair of GPUs, torch
    SymmetricMemory (CUDA backend), Triton. Two mergers whose calls run concurrently on
    different streams can starve each other of SMs (each spins until its peer arrives); issue
    merges of one group on one stream.
    """

    name = "symm_a2a"
    returns_views = True

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float):
        super().__init__(group, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim,
                         dtype=dtype, device=device, timeout_s=timeout_s)
        if triton is None:
            raise RuntimeError("symm_a2a needs Triton")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.hs = num_heads // self.world_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_rows = max_tokens * self.hs
        self.layout = SlabLayout(self.world_size, max_rows, head_dim, itemsize,
                                 ll_rows_for(max_rows, head_dim, itemsize))
        if self.layout.total_bytes >= 2 ** 31:
            raise RuntimeError(f"symm_a2a: slab of {self.layout.total_bytes} bytes exceeds the "
                               f"kernel's 32-bit offsets; lower max_tokens")
        self.timeout_ns = int(timeout_s * 1e9)
        self.pdl = (_PDL and device.type == "cuda"
                    and torch.cuda.get_device_capability(device)[0] >= 9)
        ws, reason = capability.collective_try(
            group, lambda: SymmWorkspace(group, self.layout, device, op="dcp.merge[symm_a2a]",
                                         timeout_s=timeout_s, rendezvous=False),
            "symm_a2a allocation")
        if reason:
            raise RuntimeError(f"symm_a2a: allocation failed: {reason}")
        _, reason = capability.collective_try(group, ws.rendezvous, "symm_a2a rendezvous")
        if reason:
            raise RuntimeError(f"symm_a2a: rendezvous failed: {reason}")
        self.ws = ws
        self._setup_tables(itemsize)
        self.res = torch.empty((max_tokens, self.hs, head_dim), dtype=dtype, device=device)
        self.res_lse = torch.empty((max_tokens, self.hs), dtype=torch.float32, device=device)
        self._warm_up()

    @classmethod
    def local_unavailable_reason(cls, group, device: torch.device) -> str | None:
        reason = capability.symm_unavailable_reason(group, device)  # collective: always call
        if reason is None and triton is None:
            return "Triton is not importable"
        return reason

    def _setup_tables(self, itemsize: int) -> None:
        ptrs = [int(p) for p in self.ws.handle.buffer_ptrs]
        me = ptrs[self.rank]
        units = (_DELTA_UNIT * itemsize, _DELTA_UNIT * 4, _DELTA_UNIT * 8)
        deltas = [p - me for p in ptrs]
        if any(dl % u for dl in deltas for u in units):
            raise RuntimeError(f"symm_a2a: peer slabs are not {max(units)}-byte aligned "
                               f"relative to each other: {deltas}")
        self.delta_o, self.delta_w, self.delta_q = (
            torch.tensor([dl // u for dl in deltas], dtype=torch.int64, device=self.device)
            for u in units)
        # Grid bound agreed across ranks: block plans must match everywhere.
        n = torch.tensor([_n_programs_max(self.device)], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=_cpu_group(self.group))
        self.n_programs_max = int(n.item())

    def _warm_up(self) -> None:
        # One merge per kernel variant (block size, protocol, staggering) up to max_tokens:
        # compiles before any capture and proves the P2P path; a timeout here raises on
        # construction.
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        seen = set()
        for t in range(1, self.max_tokens + 1):
            n = t * self.hs
            br, n_blocks, grid = plan_blocks(n, self.n_programs_max)
            ll = use_ll(n, self.layout)
            key = (br, ll, 0 if ll else _stagger(n, n_blocks, grid, self.head_dim, itemsize))
            if key in seen:
                continue
            seen.add(key)
            out = torch.zeros((t, self.num_heads, self.head_dim), dtype=self.dtype,
                              device=self.device)
            lse = torch.zeros((t, self.num_heads), dtype=torch.float32, device=self.device)
            self(out, lse)

    def _launch(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        launch_merge(out, lse, self.res, self.res_lse, slab=self.ws.slab, delta_o=self.delta_o,
                     delta_w=self.delta_w, delta_q=self.delta_q,
                     state=self.ws.state, errors=self.ws.errors, rank=self.rank,
                     world_size=self.world_size, num_heads=self.num_heads, layout=self.layout,
                     n_programs_max=self.n_programs_max, timeout_ns=self.timeout_ns,
                     pdl=self.pdl)

    def __call__(self, out: torch.Tensor, lse: torch.Tensor):
        """``out [T, H, D]`` (``dtype``, contiguous, CUDA), ``lse [T, H]`` fp32 base e →
        (``[T, H/W, D]``, ``[T, H/W]`` fp32) views, valid until the next call."""
        self.ws.ensure_usable()
        T = out.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"symm_a2a: T={T} exceeds max_tokens={self.max_tokens}")
        if lse.dtype != torch.float32 or not lse.is_contiguous():
            lse = lse.float().contiguous()
        self._launch(out.contiguous(), lse)
        if not torch.cuda.is_current_stream_capturing():
            self.ws.check()
        return self.res[:T], self.res_lse[:T]

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for a wait that timed out since the last check (host
        sync)."""
        self.ws.check()


def _cpu_group(group):
    from attncomm._dist import cpu_group
    return cpu_group(group)
