"""The backend-selection layer (``attncomm.select``): the pure choice, and the whole flow on gloo
ranks with fake backends that count their constructions (a real backend's construction is its
allocation: ``symm_a2a`` allocates and rendezvouses its symmetric slab there)."""
from __future__ import annotations

import math

import pytest
import torch

from attncomm import select


def test_fastest_is_the_lowest_geometric_mean():
    name, means = select.fastest({"a": [1.0, 100.0], "b": [10.0, 10.0], "c": [2.0, math.inf]})
    assert name == "a" or name == "b"  # both have mean 10: the earlier wins
    assert name == "a" and math.isclose(means["a"], 10.0) and math.isinf(means["c"])
    assert select.fastest({"a": [math.inf], "b": [1.0, math.inf]})[0] is None
    assert select.fastest({})[0] is None


def test_token_buckets():
    assert select.token_buckets(1) == [1]
    assert select.token_buckets(8) == [1, 8]
    assert select.token_buckets(100) == [1, 8, 64, 100]


class _Fake:
    """A backend stand-in: ``built`` counts constructions per name (the allocation)."""

    built: dict = {}
    closed: dict = {}

    def __init__(self, name):
        self.name = name
        _Fake.built[name] = _Fake.built.get(name, 0) + 1

    def __call__(self):
        return self.name

    def close(self):
        _Fake.closed[self.name] = _Fake.closed.get(self.name, 0) + 1


def _flow(rank, world, *, slow_on=None, fail_build=None, ineligible=None, requested="auto",
          measured=True, env=None):
    """Run ``select.resolve`` over three fake candidates; ``slow_on=(name, rank)`` makes ``name``
    slow on that rank only, ``fail_build=(name, rank)`` fails its setup there, ``ineligible``
    maps a name to the ranks that cannot run it."""
    from attncomm import config
    _Fake.built, _Fake.closed = {}, {}
    timed = []

    def timer(fn):
        name = fn()
        timed.append(name)
        slow = slow_on is not None and name == slow_on[0] and rank == slow_on[1]
        return {"fast": 5.0, "mid": 7.0, "base": 9.0}[name] * (100 if slow else 1)

    def build(name):
        if fail_build is not None and (name, rank) == fail_build:
            raise RuntimeError("out of memory (fake)")
        return _Fake(name)

    def local_reason(name):
        return "fake: no P2P" if ineligible and rank in ineligible.get(name, ()) else None

    with config.setting(**({"ATTNCOMM_DCP_BACKEND": env} if env else {})):
        try:
            decision, impl = select.resolve(
                None, op="FakeOp", requested=requested, names=("fast", "mid", "base"),
                preferred="fast", rule_of_thumb=("mid", "base", "fast"),
                local_reason=local_reason, build=build, measured=measured, cases=(1, 8),
                prepare=lambda impl, case: impl, timer=timer,
                env_var="ATTNCOMM_DCP_BACKEND" if env else None)
        except ValueError as exc:
            return "ValueError", str(exc)
    return (decision.backend, decision.fallback_reason, impl.name, dict(_Fake.built),
            dict(_Fake.closed), sorted(set(timed)))


def test_measured_choice_builds_each_candidate_once_and_returns_the_timed_instance(pools):
    for backend, why, impl, built, closed, timed in pools.run(2, _flow):
        assert backend == impl == "fast" and why is None
        assert built == {"fast": 1, "mid": 1, "base": 1}  # nothing built twice
        assert closed == {"mid": 1, "base": 1} and "fast" not in closed
        assert timed == ["base", "fast", "mid"]


def test_the_slowest_rank_decides_for_every_rank(pools):
    res = pools.run(2, _flow, slow_on=("fast", 1))
    assert len(set(r[:3] for r in res)) == 1
    backend, why = res[0][:2]
    assert backend == "mid" and why.startswith("measured slower") and "fast" in why


def test_a_setup_failure_on_one_rank_drops_the_candidate_everywhere(pools):
    res = pools.run(3, _flow, fail_build=("fast", 2))
    assert len(set(r[:3] for r in res)) == 1
    backend, why = res[0][:2]
    assert backend == "mid" and "setup failed" in why and "rank 2" in why


def test_an_ineligible_rank_decides_for_every_rank(pools):
    res = pools.run(3, _flow, ineligible={"fast": [1]})
    for backend, why, _, built, _, _ in res:
        assert backend == "mid" and "rank 1: fake: no P2P" in why
        assert "fast" not in built  # never allocated


def test_unmeasured_takes_the_rule_of_thumb(pools):
    for backend, why, impl, built, _, timed in pools.run(2, _flow, measured=False):
        assert backend == impl == "mid" and built == {"mid": 1} and not timed
        assert why is None  # "fast" could run; the rule of thumb chose otherwise


def test_explicit_backend_that_cannot_run_raises_on_every_rank(pools):
    res = pools.run(2, _flow, requested="fast", ineligible={"fast": [0]})
    assert all(r[0] == "ValueError" and "'fast' cannot run here" in r[1] for r in res)
    assert "rank 0: fake: no P2P" in res[1][1]  # rank 1 names rank 0's reason
    res = pools.run(2, _flow, requested="fast", fail_build=("fast", 1))
    assert all(r[0] == "ValueError" and "failed to set up" in r[1] for r in res)


def test_env_preference_under_auto(pools):
    for backend, _, _, built, _, timed in pools.run(2, _flow, env="base"):
        assert backend == "base" and built == {"base": 1} and not timed
    # a preference that cannot run here: auto chooses, it never fails
    for backend, _, _, _, _, _ in pools.run(2, _flow, env="base", ineligible={"base": [1]}):
        assert backend == "fast"


def _merger_allocations(rank, world):
    """``DcpMerger(backend="auto")`` on a group where a counting stand-in for ``symm_a2a`` can
    run and is measured: it is constructed (allocated) exactly once and is the instance used."""
    from attncomm.dcp.lse_merge import api
    from attncomm.dcp.lse_merge.collective import A2ABackend

    class CountingSymm(A2ABackend):
        name = "symm_a2a"
        count = 0

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            CountingSymm.count += 1

    registry = api.DcpMerger.registry
    real_cls, real_select = registry.backend_class, select.resolve

    def fake_class(name):
        return CountingSymm if name == "symm_a2a" else real_cls(name)

    def measured_resolve(*a, **kw):
        kw.update(measured=True, timer=lambda fn: (fn(), 1.0)[1])
        return real_select(*a, **kw)

    registry.backend_class, select.resolve = fake_class, measured_resolve
    try:
        m = api.DcpMerger(max_tokens=8, num_heads=2 * world, head_dim=4, dtype=torch.float32)
    finally:
        del registry.backend_class
        select.resolve = real_select
    out, lse = torch.randn(3, 2 * world, 4), torch.randn(3, 2 * world)
    return m.backend, CountingSymm.count, type(m._impl).__name__, m(out, lse).shape


def test_dcp_merger_auto_allocates_the_winner_once(pools):
    for backend, count, impl, shape in pools.run(2, _merger_allocations):
        assert backend == "symm_a2a" and impl == "CountingSymm" and count == 1
        assert shape == (3, 2, 4)


@pytest.mark.parametrize("world", [1, 2])
def test_no_candidate_raises(pools, world):
    res = pools.run(world, _flow, ineligible={"fast": range(3), "mid": range(3),
                                              "base": range(3)})
    assert all(r[0] == "ValueError" and "no backend" in r[1] for r in res)
