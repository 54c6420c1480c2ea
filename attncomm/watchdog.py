"""The substrate's watchdog: one daemon thread per process (as NCCL's), started on first use,
that polls every live ``PeerErrors`` and every ``PendingWait`` (a wait the host enqueued
without waiting for it, e.g. ``cuStreamWaitValue32``, which has no device deadline). A pending
wait past its budget is released by its ``on_timeout`` (writes the awaited flag locally, so no
stream stays blocked) and marks its owner broken; the next call or ``check()`` raises. Budgets
start when the stream reaches the wait (its ``started`` event completed), not when the host
enqueued it: a host that runs far ahead is no timeout.

The thread's own CUDA calls (event queries, flag writes) run in relaxed stream-capture mode
(``relax_capture_mode``), so they never invalidate a graph another thread captures in torch's
default global mode. The logic takes any objects with ``query()`` for events, so it is tested
without a GPU (``Watchdog(start=False)``, ``poll()``).
"""
from __future__ import annotations

import dataclasses
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import torch

from . import capability
from ._wait import poll_until
from .errors import ranks_text

__all__ = ["PendingWait", "Watchdog", "watchdog", "relax_capture_mode", "WATCHDOG_INTERVAL_S"]

#: Seconds between two watchdog passes.
WATCHDOG_INTERVAL_S = 0.005


@dataclasses.dataclass(eq=False)
class PendingWait:
    """A wait the host enqueued and did not wait for.

    Attributes:
        owner: the ``PeerErrors`` a timeout marks broken.
        started: an event (anything with ``query()``) recorded where the wait begins; the
            budget runs from when the watchdog first sees it complete.
        events: ``{peer: event recorded after the wait for that peer}``; the wait is over when
            all are complete, and the incomplete ones name the peers on a timeout.
        timeout_s: the budget.
        on_timeout: called once with the blocked peers, on the watchdog thread: it must
            release the waiting streams (e.g. write the awaited flags locally).
        device: the CUDA device index the events belong to (None: none to select).
    """

    owner: object  # the PeerErrors a timeout marks broken
    started: object
    events: dict
    timeout_s: float
    on_timeout: Callable[[list], None] | None = None
    device: int | None = None
    t0: float | None = None


class Watchdog:
    """Polls error words and pending waits (see the module docstring). ``poll()`` is one pass;
    the thread calls it every ``interval_s`` while anything is watched (tests call it
    directly, with ``start=False``)."""

    def __init__(self, interval_s: float = WATCHDOG_INTERVAL_S, *, start: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self._errors: weakref.WeakSet = weakref.WeakSet()
        self._waits: list[PendingWait] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._start = start
        self._thread: threading.Thread | None = None
        self._relaxed = False

    def watch(self, errors) -> None:
        with self._lock:
            self._errors.add(errors)
        self._ensure_thread()

    def add(self, wait: PendingWait) -> None:
        """Watch ``wait`` until its events complete or its budget runs out."""
        with self._lock:
            self._waits.append(wait)
        self._ensure_thread()

    def pending(self) -> int:
        with self._lock:
            return len(self._waits)

    def poll(self) -> None:
        """One pass over every pending wait and error word. A wait whose look raises (its
        events, its release) is finished with — its owner is marked broken — and the pass goes
        on, so one bad wait never stops the others from being watched; the first such error
        is raised after the pass."""
        with self._lock:
            waits, errors = list(self._waits), list(self._errors)
        done, now, failure = [], self.clock(), None
        for w in waits:
            try:
                finished = self._step(w, now)
            except Exception as exc:  # noqa: BLE001 - raised after the pass
                finished, failure = True, failure or exc
                w.owner.mark_broken(sorted(w.events), f"the watchdog could not check or release "
                                                      f"a wait ({type(exc).__name__}: {exc})")
            if finished:
                done.append(w)
        if done:
            with self._lock:
                self._waits = [w for w in self._waits if w not in done]
        for e in errors:
            e.poll()
        if failure is not None:
            raise failure

    def _step(self, w: PendingWait, now: float) -> bool:
        """One look at a pending wait; True when it is finished with (done or timed out)."""
        with _on_device(w.device):
            if w.owner.broken is not None and w.on_timeout is None:
                return True
            if all(ev.query() for ev in w.events.values()):
                return True
            if w.t0 is None:
                if w.started.query():
                    w.t0 = now
                return False
            if now - w.t0 <= w.timeout_s:
                return False
            blocked = sorted(p for p, ev in w.events.items() if not ev.query())
            if not blocked:
                return True
            try:
                if w.on_timeout is not None:  # on the wait's device (its context current)
                    w.on_timeout(blocked)
            finally:
                w.owner.mark_broken(blocked, f"rank {w.owner.rank} got no answer from "
                                             f"{ranks_text(blocked)} within {w.timeout_s:g} s")
        return True

    def _ensure_thread(self) -> None:
        if not self._start or (self._thread is not None and self._thread.is_alive()):
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="attncomm-watchdog",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        poll_until(self._pass, None, interval_s=self.interval_s)  # for the process's life

    def _pass(self) -> bool:
        if not self._relaxed and torch.cuda.is_initialized():
            # The thread's own CUDA calls (event queries, flag writes) must not break a graph
            # another thread captures in torch's default global mode: relaxed mode for this
            # thread only (CUDA's cudaThreadExchangeStreamCaptureMode). Tried once.
            self._relaxed = True
            if not relax_capture_mode():
                warnings.warn("attncomm watchdog: could not set its thread's stream capture "
                              "mode to relaxed (cuda.bindings missing?): a CUDA graph "
                              "captured in global mode while a wait is watched may fail; "
                              "capture with capture_error_mode='thread_local'", stacklevel=1)
        try:
            self.poll()
        except Exception as exc:  # noqa: BLE001 - a watchdog must not die; say why
            warnings.warn(f"attncomm watchdog: {type(exc).__name__}: {exc}", stacklevel=1)
        return False


def relax_capture_mode() -> bool:
    """Set the calling thread's stream capture mode to relaxed (the driver's
    ``cuThreadExchangeStreamCaptureMode``): its CUDA calls are then allowed while another
    thread captures a graph in global mode, and they do not invalidate that capture. For the
    watchdog thread only, which never captures. True when set."""
    driver = capability.cuda_driver()
    if driver is None:
        return False
    try:
        return capability.cuda_ok(driver.cuThreadExchangeStreamCaptureMode(
            driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))
    except Exception:  # noqa: BLE001 - an older binding: not relaxed
        return False


class _on_device:
    """``torch.cuda.device(index)`` when there is an index (the watchdog thread's current
    device is its own)."""

    def __init__(self, index):
        self.ctx = torch.cuda.device(index) if index is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


_WATCHDOG: Watchdog | None = None
_WATCHDOG_LOCK = threading.Lock()


def watchdog() -> Watchdog:
    """The process's watchdog (started on first use)."""
    global _WATCHDOG
    if _WATCHDOG is None:
        with _WATCHDOG_LOCK:
            if _WATCHDOG is None:
                _WATCHDOG = Watchdog()
    return _WATCHDOG


