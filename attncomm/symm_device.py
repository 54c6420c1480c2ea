"""The device half of the symmetric-memory substrate: Triton helpers every push kernel shares.

The DCP merge (``attncomm.dcp.lse_merge.symm_kernels``) and the DCP query gather
(``attncomm.dcp.query_gather.symm_kernels``) follow one protocol; its pieces live here, once:

- Epoch: ``state[0:2]`` is one 64-bit word ``(count << 32) | epoch``. ``count_in`` adds
  ``1 << 32`` (counts a program in and reads the epoch in one atomic); ``epoch_of`` turns the
  word it returned into this call's epoch ``e = epoch + 1`` (skipping 0, which would match
  never-written cells; the parity still alternates) and, in the last program to count in,
  writes ``e`` back with count 0, so graph replays advance it on the device.
- Scrub: at epochs with ``scrub_due(e)`` (``(e >> 1) % SCRUB_PERIOD == 0``, i.e. ≡ 0, 1 mod
  2**30) a kernel zeroes the other parity slot's flags and LL words from every peer
  (``scrub_region`` for each such region: ``zero``, split over the grid), then ``scrub_fence``
  before any store of the call reaches a peer, so no cell keeps a value for 2**32 calls, where
  it would match again.
- Bounded waits: ``timed_out`` against ``%globaltimer`` (the deadline starts at the first wait
  that has to spin; the budget, ``budget``, is the descriptor's ``DESC_TIMEOUT`` word, read as
  a wait starts, beside its first poll: read at the first spin it would hold up the next poll,
  held in a register through a whole kernel it costs the tiles registers); ``wait_word``
  spins until a word holds ``e``; past the deadline ``record_timeout`` stores 1 into the peer's
  error word with a system-scope store (the word may be mapped pinned host memory, read by the
  host without a CUDA call).
- The descriptor (``attncomm.symm_regions``): ``region`` reads a region's base and cell stride
  (multiples of 16 elements, which the compiler is told), ``peer_delta`` a peer's offset, and
  ``typed`` views the one slab pointer a kernel takes as another element type.
- LL words: ``ll_word`` tags 32 payload bits with the epoch (``(e << 32) | bits``, NCCL's LL
  idea: no fence, no flag); ``ll_ready`` says whether every word of a block carries ``e``;
  ``pack16`` puts two 16-bit values into one 32-bit word.

Importing this module needs Triton; its users import it through ``attncomm._triton``.

Constants are read through a module (``_c.NAME``, ``_r.NAME``), never as module-level values of
a kernel's own module: Triton re-checks each module-level value a kernel reads on every launch
(host time per launch), module attributes it does not.
"""
from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.language.extra import cuda as tl_cuda

from . import symm as _s
from . import symm_regions as _r

__all__ = [
    "budget",
    "count_in",
    "epoch_of",
    "ll_ready",
    "ll_word",
    "now_ns",
    "pack16",
    "peer_delta",
    "record_timeout",
    "region",
    "scrub_due",
    "scrub_fence",
    "scrub_region",
    "timed_out",
    "typed",
    "wait_word",
    "zero",
]

SCRUB_MASK = _s.SCRUB_PERIOD - 1
COUNT_ONE = 1 << 32    # one program's count-in, in the 64-bit epoch word
LOW32 = 0xFFFFFFFF
SCRUB_CHUNK = 1024     # words zeroed per program per step of a scrub
EPOCH_AFTER_ZERO = 2   # the epoch that replaces 0 (keeps the parity)
DELTA_UNIT = _s.DELTA_UNIT
_c = sys.modules[__name__]  # this module's constants, read as attributes (module docstring)


@triton.jit
def now_ns():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def budget(desc):
    # The waits' budget in ns (the descriptor's DESC_TIMEOUT word).
    return tl.load(desc + _r.DESC_TIMEOUT)


@triton.jit
def timed_out(deadline, timeout_ns):
    # (deadline, expired): the deadline is set on the first wait that has to spin.
    now = now_ns()
    if deadline == 0:
        deadline = now + timeout_ns.to(tl.int64)
    return deadline, now > deadline


@triton.jit
def region(desc, R: tl.constexpr):
    # (base, cell stride) of region R in elements of its unit: multiples of 16 (cells are
    # 128-byte aligned), so accesses stay vectorised as with pointer arguments.
    base = tl.multiple_of(tl.load(desc + _r.DESC_REGIONS + 2 * R), 16)
    cell = tl.multiple_of(tl.load(desc + _r.DESC_REGIONS + 2 * R + 1), 16)
    return base, cell


@triton.jit
def peer_delta(desc, q, K: tl.constexpr, W: tl.constexpr):
    # Peer q's slab minus this rank's in elements of peer table K's unit (K = 0: the
    # payload's, 1: 4-byte words, 2: 8-byte words).
    return tl.load(desc + _r.DESC_PEERS + K * W + q) * _c.DELTA_UNIT


@triton.jit
def typed(ptr, DTYPE: tl.constexpr):
    # ptr viewed as a pointer to DTYPE (a bitcast: the alignment the launcher found stays).
    return ptr.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def count_in(state64_ptr):
    # The first half of the epoch step: one atomic on the 64-bit word (count << 32) | epoch
    # counts this program in and returns the previous word.
    return tl.atomic_add(state64_ptr, _c.COUNT_ONE, sem="relaxed", scope="gpu")


@triton.jit
def epoch_of(old, state64_ptr, grid_size, PDL: tl.constexpr):
    # The second half: this call's epoch from the word count_in returned. No program can
    # read after the write-back (every count-in precedes the last one); the last program to
    # count in stores (0 << 32) | e for the next call. Epoch 0 is skipped (it would match
    # never-written, zeroed cells).
    # With PDL, then gdc_launch_dependents: the next kernel counts in (before its gdc_wait)
    # once every program here has called it. In the last program, thread 0 writes back,
    # its fence waits until the write has reached L2 (where every count-in's atomic runs),
    # and a block barrier (the branch is the same for the whole block) keeps the other
    # warps from triggering before that: the first trigger of a block counts for the whole
    # block. (A practical guarantee: PTX gives launch_dependents no memory ordering; only
    # gdc_wait makes a grid's writes visible.)
    e = (old & _c.LOW32).to(tl.int32) + 1
    e = tl.where(e == 0, _c.EPOCH_AFTER_ZERO, e)
    if (old >> 32) == grid_size - 1:
        tl.atomic_xchg(state64_ptr, e.to(tl.int64) & _c.LOW32, sem="relaxed", scope="gpu")
        if PDL:
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [],
                                      dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
    if PDL:
        tl_cuda.gdc_launch_dependents()
    return e


@triton.jit
def scrub_due(e):
    # Whether call e first zeroes the other slot's cells (epochs ≡ 0, 1 mod 2 · SCRUB_PERIOD).
    return ((e >> 1) & _c.SCRUB_MASK) == 0


@triton.jit
def zero(ptr, n, pid, grid_size):
    # ptr[0:n] = 0, split over the grid.
    i = tl.arange(0, _c.SCRUB_CHUNK)
    k = pid * _c.SCRUB_CHUNK
    while k < n:
        tl.store(ptr + k + i, 0, mask=k + i < n)
        k += grid_size * _c.SCRUB_CHUNK


@triton.jit
def scrub_region(slab, desc, R: tl.constexpr, UNIT: tl.constexpr, e, pid, grid_size,
                 RANK: tl.constexpr, W: tl.constexpr):
    # A scrub's zeroing of region R (elements of dtype UNIT): the cell (other slot, q) of
    # every peer q, split over the grid. The caller checks scrub_due(e) before and calls
    # scrub_fence after its regions.
    base, cell = region(desc, R)
    p = typed(slab, UNIT) + base
    for q in tl.static_range(W):
        if q != RANK:
            zero(p + ((1 - (e & 1)) * W + q) * cell, cell, pid, grid_size)


@triton.jit
def scrub_fence(word_ptr):
    # After a scrub's zeroing: a block barrier and a release at system scope (an atomic add
    # of 0 on a word nobody else writes, which so stays unchanged) put the zeros in place
    # before any later store of this program reaches a peer.
    tl.debug_barrier()
    tl.atomic_add(word_ptr, 0, sem="release", scope="sys")
    tl.debug_barrier()


@triton.jit
def record_timeout(err_ptr):
    # errors[src] = 1, visible to the host (the word may be mapped host memory).
    tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="sys")


@triton.jit
def wait_word(ptr, e, deadline, desc, err_ptr, bad, SEM: tl.constexpr):
    # Bounded wait until *ptr == e (loads with SEM at system scope); past the deadline:
    # record_timeout(err_ptr) and bad |= 1. Returns (deadline, bad).
    timeout_ns = budget(desc)
    v = tl.atomic_add(ptr, 0, sem=SEM, scope="sys")
    while v != e:
        deadline, expired = timed_out(deadline, timeout_ns)
        if expired:
            record_timeout(err_ptr)
            bad = bad | 1
            v = e
        else:
            v = tl.atomic_add(ptr, 0, sem=SEM, scope="sys")
    return deadline, bad


@triton.jit
def ll_word(tag, x):
    # An LL word: the epoch tag (e << 32) and the 32 payload bits of int32 x.
    return tag | (x.to(tl.int64) & _c.LOW32)


@triton.jit
def ll_ready(y, e):
    # 1 when every LL word of y carries epoch e (y's masked-off lanes hold the tag).
    return tl.min(((y >> 32).to(tl.int32) == e).to(tl.int32))


@triton.jit
def pack16(lo, hi):
    # Two 16-bit values (any 16-bit dtype) as one int32 word: lo in the low half.
    a = lo.to(tl.uint16, bitcast=True).to(tl.int32)
    b = hi.to(tl.uint16, bitcast=True).to(tl.int32)
    return a | (b << 16)
