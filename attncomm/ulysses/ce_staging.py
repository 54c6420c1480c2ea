"""One staging entry of the ``ce`` transport (``ulysses/ce.py``): a ``SymmWorkspace`` holding
the flags block and the two receive slots, the local send staging per parity, and the host
bookkeeping of which slot an exchange takes."""
from __future__ import annotations

import torch

from ..symm import SymmWorkspace
from .ce_flags import a_word, f_word, initial_flags

__all__ = ["Staging", "align"]

_ALIGN = 256


def align(n: int) -> int:
    """``n`` rounded up to a multiple of 256 bytes."""
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Staging:
    """One staging entry: a ``SymmWorkspace`` of flags + two slots of ``cap`` bytes, and (for
    ``send_buffer``) a local send staging per parity.

    Built in two collective steps, each agreed across ranks by the caller: the constructor
    allocates and initialises (local; may fail, e.g. OOM), ``rendezvous()`` exchanges handles
    (every rank must reach it, so it runs only once every rank has allocated)."""

    def __init__(self, group, rank, world, cap: int, device, *, failures=None, mapping=None):
        self.world = world
        self.cap = cap
        self.device = device
        self.flags_bytes = align(16 * world)
        self.ws = SymmWorkspace(group, self.flags_bytes + 2 * cap, device, op="ulysses ce",
                                rendezvous=False, errors=failures, mapping=mapping)
        self.buf = self.ws.slab
        self.buf[:16 * world].view(torch.int32).copy_(
            torch.tensor(initial_flags(rank, world), dtype=torch.int32))
        self.ptrs: list = []
        self.parity = 0
        self.pinned = False
        self.send_bufs = [None, None]  # local send staging per parity (send_buffer), lazily
        # Host bookkeeping of slot k: held from start() to release(); a held slot is never
        # handed out again (the transport takes another entry), because this rank's own
        # region is written on the caller's stream, which no flag orders.
        self.held = [False, False]
        # Events, all of one capture mode (``_mode``): after the copies that last read send
        # staging k, and at the last release of slot k (its readers are done).
        self.mode = None
        self.send_done: list = [[], []]
        self.released: list = [None, None]

    def take(self) -> int:
        """A start's host bookkeeping: its slot (the parity), held until ``put``."""
        k = self.parity
        self.parity ^= 1
        self.held[k] = True
        return k

    def put(self, k: int) -> None:
        self.held[k] = False

    def marks(self, mode) -> Staging:
        """The event lists for ``mode``, emptied when the mode changed: an event recorded
        eagerly must not be waited inside a capture, nor one of a capture outside it or in
        another; across a mode change the work is stream-ordered anyway (capture starts after
        a synchronize, replays run on the caller's stream)."""
        if mode != self.mode:
            self.mode = mode
            self.send_done = [[], []]
            self.released = [None, None]
        return self

    def await_slot(self, stream, k: int, mode) -> None:
        """Order ``stream`` after the last release of slot ``k`` (device-side)."""
        ev = self.marks(mode).released[k]
        if ev is not None:
            stream.wait_event(ev)

    def rendezvous(self) -> None:
        """Collective: exchange buffer handles with every rank (host-blocking)."""
        self.ws.rendezvous()
        self.ptrs = self.ws.peer_ptrs

    def release(self) -> None:
        """Drop the buffers (every rank at the same call, after a barrier: an eviction)."""
        self.ws.release()
        self.buf = None

    def close(self) -> None:
        """Collective end of life (``SymmWorkspace.close``)."""
        self.ws.close()
        self.buf = None

    def f_addr(self, owner: int, k: int, src: int) -> int:
        return self.ptrs[owner] + 4 * f_word(k, src, self.world)

    def a_addr(self, owner: int, k: int, dst: int) -> int:
        return self.ptrs[owner] + 4 * a_word(k, dst, self.world)

    def slot_addr(self, owner: int, k: int) -> int:
        return self.ptrs[owner] + self.flags_bytes + k * self.cap

    def slot_view(self, k: int, numel: int, dtype) -> torch.Tensor:
        start = self.flags_bytes + k * self.cap
        item = dtype.itemsize
        return self.buf[start:start + numel * item].view(dtype)
