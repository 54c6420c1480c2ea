"""The symmetric-memory substrate without a GPU: error words in plain host memory, the broken
state, and the watchdog's logic (fake events and a fake clock, and the real thread)."""
from __future__ import annotations

import time

import pytest
import torch

from attncomm import PeerTimeoutError
from attncomm.symm import PeerErrors
from attncomm.watchdog import PendingWait, Watchdog


class FakeEvent:
    def __init__(self, done=False):
        self.done = done

    def query(self):
        return self.done


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _errors(world=4, **kw):
    return PeerErrors(world, torch.device("cpu"), op="test op", rank=1, timeout_s=2.0,
                      watch=False, **kw)


def test_error_words_raise_naming_the_peer_and_stay_broken():
    e = _errors()
    e.check()
    e.ensure_usable()
    assert e.peers() == [] and not e.poll() and not e.failed()
    e.words[3] = 1  # as a kernel's timed-out wait for rank 3 leaves it
    e.ensure_usable()  # does not read the words
    assert e.failed() and e.broken is None  # reads them, changes nothing
    for _ in range(3):  # broken for good, the same error every time
        with pytest.raises(PeerTimeoutError) as info:
            e.check()
        assert info.value.peer_ranks == [3] and info.value.op == "test op"
        assert "rank 3" in str(info.value) and "2 s" in str(info.value)
        assert "unusable" in str(info.value)
    e.words.zero_()  # clearing the word does not make it usable again
    assert e.failed()
    with pytest.raises(PeerTimeoutError):
        e.ensure_usable()
    e2 = _errors()
    e2.words[0] = e2.words[2] = 1
    assert e2.poll() and e2.broken.peer_ranks == [0, 2]
    e2.mark_broken([1], "later reason")  # the first reason wins
    assert e2.broken.peer_ranks == [0, 2]


def test_watchdog_budget_starts_when_the_stream_reaches_the_wait():
    clock = Clock()
    dog = Watchdog(start=False, clock=clock)
    owner = _errors()
    released = []
    started, ev0, ev2 = FakeEvent(), FakeEvent(), FakeEvent()
    dog.add(PendingWait(owner, started, {0: ev0, 2: ev2}, 2.0, released.append))
    clock.t += 50  # the host ran far ahead: the stream has not reached the wait
    dog.poll()
    assert owner.broken is None and dog.pending() == 1
    started.done = True
    dog.poll()  # the budget starts now
    clock.t += 1.9
    ev0.done = True
    dog.poll()
    assert owner.broken is None and dog.pending() == 1
    clock.t += 0.2
    dog.poll()
    assert released == [[2]] and dog.pending() == 0  # only the still blocked peer
    with pytest.raises(PeerTimeoutError) as info:
        owner.check()
    assert info.value.peer_ranks == [2] and "rank 1 got no answer from rank 2" in str(
        info.value)
    dog.poll()
    assert released == [[2]], "released twice"


def test_watchdog_drops_finished_waits_and_polls_error_words():
    clock = Clock()
    dog = Watchdog(start=False, clock=clock)
    owner = _errors()
    for _ in range(3):
        dog.add(PendingWait(owner, FakeEvent(True), {1: FakeEvent(True)}, 1.0, None))
    dog.poll()
    assert dog.pending() == 0 and owner.broken is None
    watched = _errors()
    dog.watch(watched)
    watched.words[0] = 1
    dog.poll()
    assert watched.broken is not None and watched.broken.peer_ranks == [0]
    failing = _errors()

    def boom(blocked):
        raise RuntimeError("release failed")

    dog.add(PendingWait(failing, FakeEvent(True), {3: FakeEvent()}, 0.5, boom))
    dog.poll()
    clock.t += 1
    with pytest.raises(RuntimeError):
        dog.poll()
    assert failing.broken is not None and failing.broken.peer_ranks == [3]
    assert dog.pending() == 0  # finished with: not retried on every later pass


class RaisingEvent:
    def query(self):
        raise RuntimeError("event of a torn-down stream")


def test_one_bad_wait_does_not_stop_the_watchdog_watching_the_others():
    clock = Clock()
    dog = Watchdog(start=False, clock=clock)
    bad_owner, owner, watched = _errors(), _errors(), _errors()
    released = []
    dog.add(PendingWait(bad_owner, FakeEvent(True), {0: RaisingEvent()}, 0.5, released.append))
    dog.add(PendingWait(owner, FakeEvent(True), {2: FakeEvent()}, 0.5, released.append))
    dog.watch(watched)
    watched.words[3] = 1
    with pytest.raises(RuntimeError, match="torn-down"):
        dog.poll()  # the bad wait raises; the good one starts its budget, the words are read
    assert bad_owner.broken is not None and bad_owner.broken.peer_ranks == [0]
    assert "could not check" in str(bad_owner.broken)
    assert watched.broken is not None and watched.broken.peer_ranks == [3]
    assert dog.pending() == 1
    clock.t += 1
    dog.poll()  # no error left: the good wait times out and is released
    assert released == [[2]] and owner.broken.peer_ranks == [2] and dog.pending() == 0


def test_watchdog_thread_marks_broken_without_any_call():
    dog = Watchdog(interval_s=0.001)
    owner = _errors()
    dog.watch(owner)
    started, blocked = FakeEvent(True), FakeEvent()
    hits = []
    dog.add(PendingWait(owner, started, {0: blocked}, 0.05, hits.append))
    deadline = time.monotonic() + 10
    while owner.broken is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert hits == [[0]] and owner.broken.peer_ranks == [0]
    other = _errors()
    dog.watch(other)
    other.words[1] = 1
    deadline = time.monotonic() + 10
    while other.broken is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert other.broken is not None and other.broken.peer_ranks == [1]
