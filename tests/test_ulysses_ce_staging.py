"""ce transport host bookkeeping without CUDA: which staging entry an exchange takes (a held
slot is never handed out again), the event lists per capture mode, and whose name a copy-stream
timeout carries when several peers share a stream."""
from __future__ import annotations

import collections
import types

import pytest
import torch

from attncomm.watchdog import Watchdog
from attncomm.ulysses import ce


def _transport():
    t = object.__new__(ce.CopyEngineTransport)
    t.cache = collections.OrderedDict()
    return t


def _entry():
    return types.SimpleNamespace(held=[False, False], parity=0, pinned=False)


def _start(st):  # what start() and release() do to the host bookkeeping
    k = st.parity
    st.parity ^= 1
    st.held[k] = True
    return k


@pytest.mark.parametrize("recv", [1000, 5000])
def test_held_slot_is_never_handed_out_again(recv):
    """The pipeline with Dv != D: q/k and v of group g, then q/k and v of group g + 1 before
    group g is read, all in one size bucket: the third and fourth take a second entry."""
    t = _transport()
    plan = types.SimpleNamespace(tiled=True, recv_numel=(recv, 700))
    item = 2
    base = (True, ce._bucket(recv * item))
    assert ce._bucket(recv * item) == ce._bucket(700 * item * 2) == 1 << 16
    assert t._key(plan, torch.bfloat16) == base + (0,)
    t.cache[base + (0,)] = e0 = _entry()
    taken = []
    for _ in range(4):
        key = t._key(plan, torch.bfloat16)
        if key not in t.cache:
            t.cache[key] = _entry()
        taken.append((key[2], _start(t.cache[key])))
    assert taken == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({(n, k) for n, k in taken}) == 4  # four exchanges in flight, four slots
    e0.held[0] = False  # group g's q/k exchange released: its slot is free again
    assert t._key(plan, torch.bfloat16) == base + (0,)
    assert t._key(types.SimpleNamespace(tiled=False, recv_numel=(recv,)), torch.bfloat16) \
        == (False, base[1], 0)


def test_events_kept_per_capture_mode():
    st = object.__new__(ce._Staging)  # the bookkeeping only: no symmetric memory
    st.mode, st.send_done, st.released = None, [["eager"], []], ["r0", None]
    same = st.marks(None)
    assert same.send_done == [["eager"], []] and same.released == ["r0", None]
    cap = st.marks(("capture", 7))
    assert cap.send_done == [[], []] and cap.released == [None, None]
    cap.released[1] = "c1"
    assert st.marks(("capture", 7)).released == [None, "c1"]
    assert st.marks(("capture", 8)).released == [None, None]  # another capture
    assert st.marks(None).released == [None, None]  # eager again

    waited = []
    stream = types.SimpleNamespace(wait_event=waited.append)
    st.released[0] = "after-reads"
    st.await_slot(stream, 0, None)
    st.await_slot(stream, 1, None)  # never released: nothing to wait for
    st.await_slot(stream, 0, ("capture", 9))  # an eager event, not in capture
    assert waited == ["after-reads"]


class _Stream:
    """A stream of fake operations: records and flag waits, run in order as far as the flags
    allow (what a CUDA stream does)."""

    def __init__(self, flags):
        self.flags, self.ops, self.pos = flags, [], 0

    def advance(self):
        while self.pos < len(self.ops):
            op = self.ops[self.pos]
            if op[0] == "wait" and op[1] not in self.flags:
                return
            self.pos += 1


class _Event:
    def __init__(self, stream):
        self.stream, self.index = stream, len(stream.ops)
        stream.ops.append(("record",))

    def query(self):
        self.stream.advance()
        return self.stream.pos > self.index


class _Flags:
    unbounded = True

    def __init__(self):
        self.set = set()

    def wait(self, stream, addr, value, peer, bounded):
        stream.ops.append(("wait", addr))

    def write(self, stream, addr, value, kernel=False):
        self.set.add(addr)


class _Owner:
    rank, broken = 0, None

    def mark_broken(self, peers, what):
        if self.broken is None:
            self.broken = (list(peers), what)


def test_timeout_names_the_peer_that_did_not_answer(monkeypatch):
    """Peers 1 and 5 share a copy stream; 1 never answers, 5 does: only 1 is named, and the
    stream gets past both waits (the watchdog writes 1's flag, 5's wait then passes)."""
    now = [0.0]
    dog = Watchdog(start=False, clock=lambda: now[0])
    added = []
    monkeypatch.setattr(ce, "_record", _Event)
    monkeypatch.setattr(ce, "watchdog", lambda: types.SimpleNamespace(add=added.append))
    t = object.__new__(ce.CopyEngineTransport)
    t.flags, t.failures, t.timeout_s = _Flags(), _Owner(), 1.0
    t.side, t.device = "side", torch.device("cuda", 0)
    t.flags.set.add(105)  # peer 5 answered
    cs = _Stream(t.flags.set)
    waits = [t._bounded_wait(cs, 100 + p, p, False) for p in (1, 5)]
    t._watch(waits, False, lambda p: [(100 + p, 1)])
    assert len(added) == 2
    for w in added:
        w.device = None
        dog.add(w)
    dog.poll()
    now[0] = 0.5
    dog.poll()
    assert t.failures.broken is None and dog.pending() == 2
    now[0] = 2.0
    dog.poll()
    assert t.failures.broken is not None and t.failures.broken[0] == [1], t.failures.broken
    assert 101 in t.flags.set
    dog.poll()
    assert dog.pending() == 0 and cs.pos == len(cs.ops)
