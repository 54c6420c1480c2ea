"""Host shared-memory exchange of one small int64 row per rank per step (the ``shm`` sync path).

The ranks of a group that all live on one host meet in one shared-memory segment: a file in
``/dev/shm`` created by group rank 0, mapped by every rank, whose name is shared once through the
group's gloo twin. The creator removes the name as soon as every rank has mapped it, so nothing is
left behind even if a rank dies later; before that, a finaliser (also run at exit) removes it.

Segment layout (int64 words)::

    header  [8]                 magic, world size, row length, 0...
    slots   [2, W, SLOT]        parity p = step & 1, rank r: [seq, row[0..L), padding]

``SLOT = 8`` words (64 bytes, one cache line) so that ranks never write to the same line.

Protocol for step ``s`` (``s`` counts from 1 on every rank):
1. rank r writes its row into slot ``(s & 1, r)``, then writes ``seq = s`` into the same slot;
2. it waits, bounded by time, until every awaited rank's slot ``(s & 1, q)`` holds ``seq == s``,
   then copies the rows, then re-reads the sequence numbers (they must still read ``s``).

Why the parity double buffer is enough: rank r writes slot ``(s & 1, r)`` again only at step
``s + 2``, and it reaches step ``s + 2`` only after it saw every rank's step-``s + 1`` row; a rank
writes its step-``s + 1`` row only after it finished reading the step-``s`` rows. So no row is
overwritten while a slower rank may still read it. The full step number (not a flag) is stored,
so a stale row never matches.

Memory ordering: the row stores happen-before the ``seq`` store in program order (separate
interpreter operations: the C compiler cannot move stores across them), and on x86-64 the
hardware keeps stores in program order and loads in program order (TSO), and an aligned 8-byte
store or load is a single access (no torn words). That is exactly the release/acquire pairing the
protocol needs, with no fences. On other architectures (ARM, POWER) plain stores may be reordered,
so ``shm_supported()`` says no there and ``sync="auto"`` takes the gloo path.

Waiting: spin for 20 µs (the common case on a host with a core per rank), then
``sched_yield`` for up to 10 ms (it returns at once on an idle core, so latency stays low, and
gives the core away on a busy one), then sleep from 20 µs doubling to 1 ms, so that W ranks on
fewer than W cores do not starve the rank they wait for. A rank whose row does not arrive in
``timeout_s`` is named in ``PeerTimeoutError``. After a timeout the channel is out of step with
the silent rank; ``close_shm_channels()`` on every rank starts a fresh one.
"""
from __future__ import annotations

import mmap
import operator
import os
import platform
import struct
import tempfile
import uuid
import weakref
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import collectives, config
from .._dist import guard_timeout, wait
from .._wait import poll_until
from ..errors import PeerTimeoutError

__all__ = ["ShmRowExchange", "shm_supported", "bad_value_message", "SLOT_WORDS"]

SLOT_WORDS = 8
_HEADER_WORDS = 8
_MAGIC = 0x41_54_54_4E_43_4F_4D_4D  # "ATTNCOMM"
_SPIN_S = 20e-6
_YIELD_S = 10e-3
_MAX_SLEEP_S = 1e-3
_NAME_BYTES = 256


def shm_supported() -> tuple[bool, str | None]:
    """Whether this machine can run the shm protocol: ``(ok, reason_if_not)``."""
    arch = platform.machine().lower()
    if arch not in ("x86_64", "amd64"):
        return False, (f"the shm sync relies on x86-64 store ordering (TSO); this machine is "
                       f"{platform.machine()!r}")
    return True, None


_I64 = (-(1 << 63), (1 << 63) - 1)


def bad_value_message(row: Sequence[int]) -> str:
    """The message for a row that could not be packed as int64: its first field that is not an
    int in the int64 range (the sync's cpu/device paths use it too)."""
    for i, v in enumerate(row):
        try:
            ok = _I64[0] <= operator.index(v) <= _I64[1]
        except TypeError:
            ok = False
        if not ok:
            return (f"dp_attention sync: row field {i} = {v!r} is not an int in the int64 range "
                    f"[{_I64[0]}, {_I64[1]}]")
    return f"dp_attention sync: row {list(row)!r} cannot be packed as int64"


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _cleanup(path: str | None, mm: mmap.mmap | None, views: list) -> None:
    for v in views:
        try:
            v.release()
        except Exception:  # noqa: BLE001 - already released
            pass
    if mm is not None:
        try:
            mm.close()
        except Exception:  # noqa: BLE001
            pass
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class ShmRowExchange:
    """Exchange one int64 row of ``row_len`` values per rank per step through host shared memory.

    Arguments:
        group: a gloo process group whose ranks all run on this host (the name of the segment is
            shared through it once; construction is collective over it).
        row_len: values per row, 1..7.
        timeout_s: bound for the setup collectives (None → ``ATTNCOMM_TIMEOUT_S``).

    Raises:
        RuntimeError on every rank when some rank could not map the segment (the message names
        the ranks and their errors).
    """

    def __init__(self, group, row_len: int = 6, *, timeout_s: float | None = None):
        if not 1 <= row_len < SLOT_WORDS:
            raise ValueError(f"row_len must be in 1..{SLOT_WORDS - 1}, got {row_len}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.row_len = row_len
        self.step = 0
        self._views: list = []
        self._mm: mmap.mmap | None = None
        self._finalizer = None
        try:
            self._setup(config.timeout_s(timeout_s))
        except BaseException:
            self.close()  # unmaps, and removes the name if this rank created it
            raise
        self._words = memoryview(self._mm).cast("q")
        self._views.append(self._words)
        self._prepare_step_path()

    def _segment_words(self) -> int:
        """The segment's size in int64 words (a subclass may add an area after the slots)."""
        return _HEADER_WORDS + 2 * self.world_size * SLOT_WORDS

    def _setup(self, timeout_s: float) -> None:
        nbytes = 8 * self._segment_words()
        path, err = None, None
        if self.rank == 0:
            path = os.path.join(_shm_dir(), f"attncomm-dp-{os.getpid()}-{uuid.uuid4().hex}")
            try:
                self._mm = self._create(path, nbytes)
                # until every rank has mapped it, the name must go away on any failure or exit
                self._finalizer = weakref.finalize(self, _cleanup, path, self._mm, self._views)
            except OSError as exc:
                err, path = f"could not create {path}: {exc}", None
        path = self._share_name(path, timeout_s)
        if self.rank != 0 and path is not None:
            try:
                self._mm = self._attach(path, nbytes)
            except (OSError, ValueError) as exc:
                err = f"could not map {path}: {exc}"
        flags = torch.zeros(self.world_size, dtype=torch.int64)
        flags[self.rank] = 1 if err else 0
        wait(collectives.all_reduce(flags, group=self.group, async_op=True), self.group,
             "shm sync setup", timeout_s)
        if self._finalizer is not None:
            self._finalizer.detach()
            os.unlink(path)  # every rank has mapped it or given up: the name is not needed
        self._finalizer = weakref.finalize(self, _cleanup, None, self._mm, self._views)
        if path is None or bool(flags.any()):
            errors: list = [None] * self.world_size
            with guard_timeout(self.group, "shm sync setup", timeout_s):
                dist.all_gather_object(errors, err, group=self.group)
            bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
            raise RuntimeError("shm sync setup failed — " + ("; ".join(bad) or "no segment"))

    def _share_name(self, path: str | None, timeout_s: float) -> str | None:
        """Broadcast the segment's path from group rank 0 (bounded by ``timeout_s``)."""
        buf = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        if path is not None:
            raw = path.encode()
            buf[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        work = collectives.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group,
                              async_op=True)
        wait(work, self.group, "shm sync setup", timeout_s)
        raw = bytes(buf.tolist()).rstrip(b"\0")
        return raw.decode() if raw else None

    def _create(self, path: str, nbytes: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled: every seq starts at 0 (never a valid step)
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        head = memoryview(mm).cast("q")
        head[0], head[1], head[2] = _MAGIC, self.world_size, self.row_len
        head.release()
        return mm

    def _attach(self, path: str, nbytes: int) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise ValueError(f"segment has {size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        head = memoryview(mm).cast("q")
        found = (head[0], head[1], head[2])
        head.release()
        if found != (_MAGIC, self.world_size, self.row_len):
            mm.close()
            raise ValueError(f"segment header {found} does not match (magic, world size "
                             f"{self.world_size}, row length {self.row_len})")
        return mm

    def _slot(self, parity: int, rank: int) -> int:
        return _HEADER_WORDS + (parity * self.world_size + rank) * SLOT_WORDS

    def _prepare_step_path(self) -> None:
        """Precompute what every step needs, so ``exchange_flat`` does no layout arithmetic.

        The reads use precompiled ``struct`` formats on the mapping: one ``unpack_from`` reads
        every rank's sequence word (``q`` then 56 pad bytes per 64-byte slot), another every
        rank's row (8 pad bytes for the seq, ``L`` values, the slot's tail padding). Native
        mode ("@", the default) on purpose: its 8-byte integer fields are read and written with
        one 8-byte copy each, like the memoryview, and the slots are 8-byte aligned so native
        alignment adds no padding (checked below).
        """
        w, n = self.world_size, self.row_len
        tail = 8 * (SLOT_WORDS - 1 - n)
        self._seq_fmt = struct.Struct("q56x" * w)
        self._rows_fmt = struct.Struct(f"8x{n}q{tail}x" * w)
        self._row_fmt = struct.Struct(f"{n}q")
        slot_bytes = 8 * SLOT_WORDS
        assert self._seq_fmt.size == self._rows_fmt.size == w * slot_bytes
        # per parity: the byte offset of slot (parity, 0) and the word index of this rank's seq
        self._base = tuple(8 * self._slot(p, 0) for p in (0, 1))
        self._mine = tuple(self._slot(p, self.rank) for p in (0, 1))

    def exchange(self, row: Sequence[int], *, timeout_s: float | None = None) -> list[list[int]]:
        """Publish this rank's ``row`` for the next step and return every rank's row.

        Arguments:
            row: ``row_len`` ints (int64 range).
            timeout_s: wait bound in seconds (None → ``ATTNCOMM_TIMEOUT_S``).

        Returns:
            ``W`` lists of ``row_len`` ints, in group rank order.

        Raises:
            ValueError naming the field and value when a value is not an int in the int64 range
            (raised on this rank only, before anything is published: the channel stays in step
            when every rank refuses, as at W = 1; the sync's own rows are always in range);
            PeerTimeoutError naming the ranks whose row of this step did not arrive in time.
        """
        flat, n = self.exchange_flat(row, timeout_s=timeout_s), self.row_len
        return [list(flat[i:i + n]) for i in range(0, len(flat), n)]

    def exchange_flat(self, row: Sequence[int], *,
                      timeout_s: float | None = None) -> tuple[int, ...]:
        """``exchange`` without the per-rank lists: every rank's row back to back, a tuple of
        ``W · row_len`` ints in group rank order (rank r's field f at ``r · row_len + f``)."""
        if len(row) != self.row_len:
            raise ValueError(f"row has {len(row)} values, expected {self.row_len}")
        mm, w = self._mm, self.world_size
        step = self.step + 1
        parity = step & 1
        base, mine = self._base[parity], self._mine[parity]
        try:
            self._row_fmt.pack_into(mm, 8 * mine + 8, *row)
        except struct.error:  # the error path only: the step path pays nothing for the check
            raise ValueError(bad_value_message(row)) from None
        self.step = step  # only once the row is written: a refused row leaves the channel in step
        self._words[mine] = step  # publish last (see the module docstring on ordering)
        if self._seq_fmt.unpack_from(mm, base).count(step) != w:
            self._wait(base, step, timeout_s)
        rows = self._rows_fmt.unpack_from(mm, base)  # a separate pass: after the seq loads
        # impossible by the parity argument (no row is rewritten before every rank read it);
        # one more cheap read of the seqs so that a broken caller fails loudly, not silently
        if self._seq_fmt.unpack_from(mm, base).count(step) != w:
            raise RuntimeError(f"shm sync: a step-{step} row changed while read (seqs now "
                               f"{list(self._seq_fmt.unpack_from(mm, base))}); are the ranks' "
                               f"calls out of step?")
        return rows

    def _wait(self, base: int, step: int, timeout_s: float | None) -> None:
        # one read of every rank's seq word per poll (a single unpack_from); the budget is
        # read after the spin phase (reading the env costs polls)
        mm, w, seqs = self._mm, self.world_size, self._seq_fmt.unpack_from
        if poll_until(lambda: seqs(mm, base).count(step) == w,
                      lambda: config.timeout_s(timeout_s), interval_s=20e-6,
                      max_interval_s=_MAX_SLEEP_S, spin_s=_SPIN_S, yield_s=_YIELD_S):
            return
        t = config.timeout_s(timeout_s)
        missing = [r for r, q in enumerate(seqs(mm, base)) if q != step]
        if not missing:  # the last row arrived just now
            return
        raise PeerTimeoutError(
            f"dp_attention sync (shm): no step-{step} row from rank(s) {missing} within "
            f"{t:g} s", peer_ranks=missing, timeout_s=t, op="dp_attention sync (shm)")

    def close(self) -> None:
        """Unmap the segment (idempotent). Calls after this raise."""
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()
            self._finalizer = None

