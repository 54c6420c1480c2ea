"""The one bounded poll for host-side waits: call a check until it passes or the time is up.

Used wherever the host waits on something it cannot block on (a shared-memory word, a parent
process, a directory another process may still write, the watchdog's pass): a busy phase, then
``sched_yield`` between checks, then sleeps that double up to a cap, and a bound on the whole
wait, so no loop of the package can hang.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["poll_until"]

T = TypeVar("T")


def poll_until(ready: Callable[[], T], timeout_s: float | Callable[[], float] | None, *,
               interval_s: float, max_interval_s: float | None = None, spin_s: float = 0.0,
               yield_s: float = 0.0, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], object] = time.sleep) -> T | None:
    """Call ``ready()`` until it returns something truthy, and return that; return None once
    ``timeout_s`` seconds have passed since the call with ``ready()`` still falsy (it is
    checked once more at the end, so a wait that ends just at the bound is not lost).

    Arguments:
        ready: the check (cheap; called as often as the phases allow).
        timeout_s: the bound in seconds; None: no bound (a watch for the life of the
            process); a callable: read once, when the busy phase ends (for a bound that is
            costly to look up on a path that usually ends within the busy phase).
        interval_s: the first sleep between checks, once the busy and yield phases are over.
        max_interval_s: each sleep doubles the one before, up to this (None: no doubling).
        spin_s: seconds of checks back to back first.
        yield_s: until this many seconds, ``os.sched_yield()`` between checks (returns at
            once on an idle core, gives the core away on a busy one).
        clock, sleep: time sources (tests pass fakes).
    """
    start = clock()
    deadline = None if timeout_s is None or callable(timeout_s) else start + timeout_s
    bound = timeout_s
    pause = interval_s
    while True:
        got = ready()
        if got:
            return got
        now = clock()
        waited = now - start
        if waited < spin_s:
            continue
        if callable(bound):
            deadline, bound = start + bound(), None
        if deadline is not None and now > deadline:
            return ready() or None
        if waited < yield_s:
            os.sched_yield()
            continue
        sleep(pause)
        if max_interval_s is not None:
            pause = min(pause * 2, max_interval_s)
