"""``pipeline_groups=-1`` decided by measurement (ulysses/pipeline_choice.py) on gloo CPU ranks
with injected timers: the faster variant is kept, the slowest rank's figures decide the same on
every rank, one measurement per signature, a bitwise mismatch keeps sequential, CPU without
measuring, failures while timing."""
from __future__ import annotations

import itertools

import torch

from attncomm import release
from attncomm.ulysses import pipeline_choice as pc

_SIG = itertools.count()


def _sig(name: str) -> tuple:
    """A signature no earlier test in the (reused) rank pool has seen."""
    return (name, next(_SIG), __name__)


class _Fake:
    """The two forwards and a timer that says, per rank, how long each one takes; counts the
    forwards and the timer's calls."""

    def __init__(self, rank, times, out=None, fail_timing=None):
        self.rank, self.times = rank, times
        self.out = out if out is not None else torch.arange(6.0).view(2, 3) + rank
        self.fail_timing = fail_timing
        self.calls = {"sequential": 0, "pipelined": 0, "timer": 0}

    def sequential(self):
        self.calls["sequential"] += 1
        return self.out.clone()

    def pipelined(self):
        self.calls["pipelined"] += 1
        if self.fail_timing == self.rank and self.calls["pipelined"] > 1:
            raise RuntimeError("pipelined forward failed")
        return self.out.clone()

    def timer(self, fn):
        self.calls["timer"] += 1
        fn()
        name = "pipelined" if fn == self.pipelined else "sequential"
        return self.times[self.rank][name]


def _decide(fake, sig, groups=4, **kw):
    return pc.decide_pipeline(None, sig, fake.sequential, fake.pipelined, groups,
                              timer=fake.timer, measured=True, **kw)


def _rank_choices(rank, world, sig):
    fast_pipe = [{"sequential": 10.0, "pipelined": 5.0}] * world
    slow_pipe = [{"sequential": 10.0, "pipelined": 12.0}] * world
    a = _decide(_Fake(rank, fast_pipe), sig + ("a",))
    b = _decide(_Fake(rank, slow_pipe), sig + ("b",))
    return a, b


def test_picks_the_faster(pools):
    sig = _sig("faster")
    for a, b in pools.run(2, _rank_choices, sig):
        assert a == pc.PipelineDecision(4, 4, 10.0, 5.0, None) and a.pipelined
        assert b.groups == 1 and (b.sequential_us, b.pipelined_us) == (10.0, 12.0)
        assert b.fallback_reason.startswith("measured slower") and "12.0 µs" in b.fallback_reason


def _rank_disagree(rank, world, sig):
    # rank 0 alone would pipeline; rank 1's pipelined forward is slower than its sequential
    lone = [{"sequential": 10.0, "pipelined": 5.0}, {"sequential": 10.0, "pipelined": 20.0}]
    # rank 1 is slower at both, but its figures favour pipelining: every rank pipelines
    slow = [{"sequential": 10.0, "pipelined": 5.0}, {"sequential": 30.0, "pipelined": 8.0}]
    return _decide(_Fake(rank, lone), sig + ("lone",)), _decide(_Fake(rank, slow),
                                                                sig + ("slow",))


def test_slowest_rank_decides_everywhere(pools):
    res = pools.run(2, _rank_disagree, _sig("slowest"))
    assert res[0] == res[1]
    lone, slow = res[0]
    assert lone.groups == 1 and (lone.sequential_us, lone.pipelined_us) == (10.0, 20.0)
    assert slow.groups == 4 and (slow.sequential_us, slow.pipelined_us) == (30.0, 8.0)


def _rank_cache(rank, world, sig):
    times = [{"sequential": 10.0, "pipelined": 5.0}] * world
    fake = _Fake(rank, times)
    first = _decide(fake, sig + ("x",))
    after_first = dict(fake.calls)
    again = _decide(fake, sig + ("x",))
    after_again = dict(fake.calls)
    other = _decide(fake, sig + ("y",))
    after_other = dict(fake.calls)
    cached = pc.cached_decision(None, sig + ("x",))
    release()  # drops the group's decisions: measured anew
    gone = pc.cached_decision(None, sig + ("x",))
    _decide(fake, sig + ("x",))
    return first, again, other, cached, gone, after_first, after_again, after_other, fake.calls


def test_cached_per_signature(pools):
    for res in pools.run(2, _rank_cache, _sig("cache")):
        first, again, other, cached, gone, c1, c2, c3, c4 = res
        assert first == again == other == cached and gone is None
        assert c1["timer"] == 2 and c1["sequential"] >= 1 and c1["pipelined"] >= 1
        assert c2 == c1, "a cached signature ran something"
        assert c3["timer"] == 4, "a new signature was not measured"
        assert c4["timer"] == 6, "release() did not drop the decision"


def _rank_mismatch(rank, world, sig):
    fake = _Fake(rank, [{"sequential": 10.0, "pipelined": 1.0}] * world)
    if rank == 1:  # rank 1's pipelined output differs in one element's bits
        out = fake.out.clone()
        out.view(-1)[4] = torch.nextafter(out.view(-1)[4], torch.tensor(1e9))

        def pipelined():
            fake.calls["pipelined"] += 1
            return out.clone()
        fake.pipelined = pipelined
    return _decide(fake, sig), fake.calls


def test_bitwise_mismatch_keeps_sequential(pools):
    res = pools.run(2, _rank_mismatch, _sig("mismatch"))
    assert res[0][0] == res[1][0]
    dec, calls = res[0]
    assert dec.groups == 1 and dec.sequential_us is None and dec.pipelined_us is None
    assert "outputs differ" in dec.fallback_reason and "rank 1: 1 of 24 bytes differ" in \
        dec.fallback_reason and "rank 0" not in dec.fallback_reason, dec.fallback_reason
    assert calls["timer"] == 0


def _rank_cpu(rank, world, sig):
    fake = _Fake(rank, [{"sequential": 10.0, "pipelined": 1.0}] * world)
    cpu = pc.decide_pipeline(None, sig, fake.sequential, fake.pipelined, 4, timer=fake.timer)
    one = _decide(fake, sig + ("one",), groups=1)
    fail = _Fake(rank, [{"sequential": 10.0, "pipelined": 1.0}] * world, fail_timing=1)
    failed = _decide(fail, sig + ("fail",))
    return cpu, one, failed, fake.calls


def test_cpu_no_split_and_failure(pools):
    res = pools.run(2, _rank_cpu, _sig("cpu"))
    assert res[0][:3] == res[1][:3]
    cpu, one, failed, calls = res[0]
    assert cpu == pc.PipelineDecision(1, 4, fallback_reason=pc.NOT_MEASURED)
    assert one.groups == 1 and "no split" in one.fallback_reason
    assert calls == {"sequential": 0, "pipelined": 0, "timer": 0}
    # rank 1's pipelined forward raised while timing: inf on every rank, sequential
    assert failed.groups == 1 and failed.pipelined_us == float("inf")
    assert failed.sequential_us == 10.0 and "failed while timing" in failed.fallback_reason


def test_bits_differ_structures():
    a = torch.tensor([1.0, float("nan")])
    assert pc._bits_differ(a, a.clone()) is None  # NaN bits equal: equal
    assert pc._bits_differ((a, a), [a, a]) is None
    assert "structures" in pc._bits_differ((a,), a)
    assert "output 1" in pc._bits_differ((a, a), (a, -a))
    assert "vs" in pc._bits_differ(a, a.double())
    assert pc._bits_differ(torch.tensor(0.0), torch.tensor(-0.0)) == "1 of 4 bytes differ"
