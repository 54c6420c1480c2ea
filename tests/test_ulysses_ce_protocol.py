"""The ``ce`` transport's flag protocol over eager forwards, a CUDA graph capture and its
replays, run on the CPU: W simulated ranks, each with its caller stream and one copy stream per
peer, execute the flag operations of a pipelined ``UlyssesAttention`` forward in an arbitrary
interleaving (a seeded random scheduler). The slots are chosen by the transport's own host
bookkeeping (``_key``, ``take``, ``put``) on the eager forwards and the capture, and reused as
captured on the replays (which run no host code); the flag words and peer orders are the
transport's (``ce_flags``). Checked: no deadlock; a sender writes a slot only when its last
data there was read and released; a flag is never set while it is still set (no signal lost);
and after the run every flags block is back to ``initial_flags`` — what lets a replay start
with no host step."""
from __future__ import annotations

import collections
import random
import types

import pytest
import torch

from attncomm.ulysses import ce
from attncomm.ulysses.ce_flags import a_word, f_word, initial_flags, recv_order, send_order

_IN = types.SimpleNamespace(tiled=True, recv_numel=(4096, 4096, 4096))
_OUT = types.SimpleNamespace(tiled=False, recv_numel=(4096, 4096, 4096))


def _forward_calls(groups: int) -> list:
    """The transport calls of one pipelined forward (``ForwardPlan.run``'s order) with one input
    exchange per head group: ``(call, exchange)`` with ``call`` in start/wait/release; an output
    exchange's wait releases it (``out=`` given)."""
    calls = [("start", ("in", 0))]
    pending = []
    for g in range(groups):
        if g + 1 < groups:
            calls.append(("start", ("in", g + 1)))
        calls += [("wait", ("in", g)), ("release", ("in", g)), ("start", ("out", g))]
        pending.append(("out", g))
        if len(pending) > 1:
            x = pending.pop(0)
            calls += [("wait", x), ("release", x)]
    for x in pending:
        calls += [("wait", x), ("release", x)]
    return calls


class _Host:
    """One rank's host side: the transport's entry and slot choice."""

    def __init__(self):
        self.t = object.__new__(ce.CopyEngineTransport)
        self.t.cache = collections.OrderedDict()

    def issue(self, calls, tag) -> list:
        """Device operations of ``calls`` as the transport would enqueue them: ``(call,
        exchange id, entry key, slot)``."""
        taken, ops = {}, []
        for call, x in calls:
            if call == "start":
                key = self.t._key(_IN if x[0] == "in" else _OUT, torch.bfloat16)
                if key not in self.t.cache:
                    st = object.__new__(ce._Staging)
                    st.parity, st.held = 0, [False, False]
                    self.t.cache[key] = st
                taken[x] = (key, self.t.cache[key].take())
            elif call == "release":
                self.t.cache[taken[x][0]].put(taken[x][1])
            ops.append((call, (tag, x)) + taken[x])
        return ops


def _programs(world, groups, replays):
    """Per rank: eager forward, captured forward, ``replays`` replays of the capture (its
    device operations again, no host code), an eager forward."""
    progs = []
    for _ in range(world):
        host = _Host()
        calls = _forward_calls(groups)
        ops = host.issue(calls, "eager0")
        captured = host.issue(calls, "capture")
        ops += captured
        for i in range(replays):
            ops += [(c, (f"replay{i}", x[1]), key, k) for c, x, key, k in captured]
        ops += host.issue(calls, "eager1")
        progs.append(ops)
    return progs


class _Sim:
    """The device side of W ranks running their programs."""

    def __init__(self, world, progs):
        self.w, self.progs = world, progs
        self.flags: dict = {}     # (rank, entry) → flags block
        self.slot: dict = {}      # (dst, entry, k, src) → "empty" | "full" | "reading"
        self.held: dict = {}      # (rank, entry, k) → own slot between start and release
        # streams: (rank, "caller") and (rank, peer) copy streams, each an op cursor
        self.pos = {(r, s): 0 for r in range(world)
                    for s in ["caller"] + send_order(r, world)}
        self.starts = [[op for op in p if op[0] == "start"] for p in progs]
        self.started = [set() for _ in range(world)]   # exchanges the caller has started
        self.sent = [collections.Counter() for _ in range(world)]  # exchange → peers sent

    def block(self, r, key):
        return self.flags.setdefault((r, key), list(initial_flags(r, self.w)))

    def _caller(self, r, op, run):
        call, x, key, k = op
        if call == "start":
            if run:
                assert not self.held.get((r, key, k)), f"rank {r} reuses held slot {k}: {x}"
                self.held[(r, key, k)] = True
                self.started[r].add(x)
            return True
        if call == "wait":  # own copies done, then every source's F
            if self.sent[r][x] < self.w - 1:
                return False
            fl = self.block(r, key)
            if any(fl[f_word(k, s, self.w)] != 1 for s in recv_order(r, self.w)):
                return False
            if run:
                for s in recv_order(r, self.w):
                    fl[f_word(k, s, self.w)] = 0
                    assert self.slot[(r, key, k, s)] == "full"
                    self.slot[(r, key, k, s)] = "reading"
            return True
        if run:  # release: done reading; A[k][r] into every source's block
            self.held[(r, key, k)] = False
            for s in recv_order(r, self.w):
                assert self.slot[(r, key, k, s)] == "reading"
                self.slot[(r, key, k, s)] = "empty"
                fs = self.block(s, key)
                assert fs[a_word(k, r, self.w)] == 0, f"A[{k}][{r}] set twice at {s}: {x}"
                fs[a_word(k, r, self.w)] = 1
        return True

    def _copy(self, r, p, op, run):
        _, x, key, k = op
        fl = self.block(r, key)
        if x not in self.started[r] or fl[a_word(k, p, self.w)] != 1:
            return False
        if run:
            fl[a_word(k, p, self.w)] = 0
            state = self.slot.get((p, key, k, r), "empty")
            assert state == "empty", f"rank {r} overwrites {p}'s slot {k} ({state}): {x}"
            self.slot[(p, key, k, r)] = "full"
            fp = self.block(p, key)
            assert fp[f_word(k, r, self.w)] == 0, f"F[{k}][{r}] set twice at {p}: {x}"
            fp[f_word(k, r, self.w)] = 1
            self.sent[r][x] += 1
        return True

    def _head(self, stream):
        r, s = stream
        ops = self.progs[r] if s == "caller" else self.starts[r]
        i = self.pos[stream]
        return ops[i] if i < len(ops) else None

    def step(self, rng) -> bool:
        ready = []
        for stream in self.pos:
            op = self._head(stream)
            if op is None:
                continue
            r, s = stream
            ok = (self._caller(r, op, False) if s == "caller" else self._copy(r, s, op, False))
            if ok:
                ready.append(stream)
        if not ready:
            return False
        stream = rng.choice(ready)
        r, s = stream
        op = self._head(stream)
        self._caller(r, op, True) if s == "caller" else self._copy(r, s, op, True)
        self.pos[stream] += 1
        return True

    def done(self) -> bool:
        return all(self._head(s) is None for s in self.pos)


@pytest.mark.parametrize("world,groups", [(2, 1), (2, 4), (3, 4), (3, 7)])
def test_flags_return_to_their_initial_values_across_replays(world, groups, seed):
    progs = _programs(world, groups, replays=3)
    for trial in range(20):
        rng = random.Random(seed + trial)
        sim = _Sim(world, progs)
        while sim.step(rng):
            pass
        assert sim.done(), f"seed {seed + trial}: deadlock at {sim.pos}"
        for (r, key), block in sim.flags.items():
            assert block == initial_flags(r, world), f"seed {seed + trial}: rank {r} {key}"
        assert set(sim.slot.values()) <= {"empty"}
    # the capture's slots are what every replay uses, and every rank chose the same ones
    assert len({tuple((c, k, key) for c, _, key, k in p) for p in progs}) == 1


def test_flag_words_and_peer_orders():
    """The layout ``_Staging`` addresses (F rows 0, 1; A rows 2, 3), the initial block, and
    the orders: every peer once, senders going up from the rank, receivers down."""
    w = 4
    words = {f_word(k, s, w) for k in (0, 1) for s in range(w)}
    words |= {a_word(k, s, w) for k in (0, 1) for s in range(w)}
    assert words == set(range(4 * w))
    assert initial_flags(1, 3) == [0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 0, 1]
    assert send_order(1, 4) == [2, 3, 0] and recv_order(1, 4) == [0, 3, 2]
