"""The one decision layer (``attncomm.select``): each ``auto``'s pure ``decide`` on fabricated
facts (no GPU, no ranks), and on gloo ranks that the result and its reason are the same on every
rank and are what the pure function gives for the agreed facts."""
from __future__ import annotations

import math

import pytest
import torch

from attncomm import capability, select
from attncomm.select import (BackendFacts, Decision, DepthFacts, PipelineDecision, SyncFacts,
                             decide_backend, decide_depth, decide_sync_path, decide_transport)

_RULE = ("mid", "base", "fast")


def _facts(**kw) -> BackendFacts:
    base = dict(op="FakeOp", preferred="fast", rule_of_thumb=_RULE,
                reasons={"fast": None, "mid": None, "base": None}, measured=True)
    return BackendFacts(**{**base, **kw})


def test_decide_backend_without_timings_follows_the_rule_of_thumb():
    # CPU: the first of the rule of thumb, with the rule as the reason for not timing.
    assert decide_backend(_facts(measured=False, rule="CPU: not measured")) == Decision(
        "mid", None, rule="CPU: not measured")
    # its setup failed: the next one; the preferred's own reason is kept
    d = decide_backend(_facts(measured=False, reasons={"fast": "rank 1: no P2P", "mid": None,
                                                       "base": None},
                              setup={"mid": "rank 0: out of memory"}))
    assert d.backend == "base" and d.fallback_reason == "rank 1: no P2P"
    # one candidate left: taken without timing, even when measured
    d = decide_backend(_facts(reasons={"fast": "no P2P", "mid": "x", "base": None}))
    assert d == Decision("base", "no P2P")
    with pytest.raises(ValueError, match="FakeOp: no backend can run here"):
        decide_backend(_facts(measured=False, setup={n: "oom" for n in _RULE}))


def test_decide_backend_with_timings():
    built = {n: None for n in _RULE}
    d = decide_backend(_facts(setup=built, times={"fast": [1.0, 2.0], "mid": [3.0, 3.0],
                                                  "base": [9.0, 9.0]}))
    assert d.backend == "fast" and d.fallback_reason is None
    assert math.isclose(d.times_us["fast"], math.sqrt(2.0))
    d = decide_backend(_facts(setup=built, times={"fast": [5.0], "mid": [3.0], "base": [4.0]}))
    assert d.backend == "mid" and d.fallback_reason.startswith("measured slower (fast 5.0 µs")
    d = decide_backend(_facts(setup=built, times={"fast": [math.inf], "mid": [3.0],
                                                  "base": [2.0]}))
    assert d.backend == "base" and d.fallback_reason == "fast failed while timing on some rank"
    # every timing failed somewhere: the rule of thumb, never the preferred
    d = decide_backend(_facts(setup=built, times={n: [math.inf] for n in _RULE}))
    assert d.backend == "mid" and "every candidate failed" in d.fallback_reason
    # the preferred's setup failed and one candidate is left: that one, untimed
    d = decide_backend(_facts(setup={"fast": "rank 2: oom", "mid": "oom", "base": None}))
    assert d == Decision("base", "setup failed: rank 2: oom")
    with pytest.raises(ValueError, match="no backend could be set up"):
        decide_backend(_facts(setup={n: "oom" for n in _RULE}))


def test_decide_transport_facts():
    big, small = select.AUTO_CE_MIN_BYTES, select.AUTO_CE_MIN_BYTES - 1
    assert decide_transport("auto", None, big) == Decision("ce")
    assert decide_transport("auto", None, small) == Decision("all_to_all")
    assert decide_transport("auto", None, small, "shared GPU") == Decision("ce",
                                                                          rule="shared GPU")
    assert decide_transport("auto", "no P2P", big) == Decision("all_to_all",
                                                               "ce not used: no P2P")
    with pytest.raises(ValueError, match="backend='ce' cannot run here: no P2P"):
        decide_transport("ce", "no P2P", small)


def test_decide_depth_asks_for_each_trial_in_turn():
    assert decide_depth(DepthFacts(4, unmeasured="CPU: not measured")) == PipelineDecision(
        1, 4, fallback_reason="CPU: not measured")
    assert decide_depth(DepthFacts(1)).fallback_reason == "auto_groups found no split (G = 1)"
    assert "lacks memory for two of 4" in decide_depth(DepthFacts(4, fits=False)).fallback_reason
    assert decide_depth(DepthFacts(4)) is None  # compare the outputs first
    d = decide_depth(DepthFacts(4, compared=True, mismatch="rank 1: 3 of 64 bytes differ"))
    assert d.groups == 1 and d.fallback_reason.endswith("differ: rank 1: 3 of 64 bytes differ")
    assert decide_depth(DepthFacts(4, compared=True)) is None  # then time both
    t = DepthFacts(4, compared=True, sequential_us=10.0, pipelined_us=5.0)
    assert decide_depth(t) == PipelineDecision(4, 4, 10.0, 5.0)
    d = decide_depth(DepthFacts(4, compared=True, sequential_us=5.0, pipelined_us=5.0))
    assert d.groups == 1 and d.fallback_reason.startswith("measured slower or equal")
    d = decide_depth(DepthFacts(4, compared=True, sequential_us=5.0, pipelined_us=math.inf))
    assert d.groups == 1 and "failed while timing" in d.fallback_reason


def test_decide_sync_path_facts():
    one = capability.HostLayout.from_identities(["m/1"] * 3)
    two = capability.HostLayout.from_identities(["a", "b", "a", "b"])
    alone = capability.HostLayout.from_identities(["a", "b"])
    assert decide_sync_path(SyncFacts(one)) == Decision("shm")
    assert decide_sync_path(SyncFacts(one, "not x86")) == Decision("cpu", "not x86")
    assert decide_sync_path(SyncFacts(two)) == Decision("hier", two.reason())
    d = decide_sync_path(SyncFacts(two, hier_failed="rank 3: no gloo group"))
    assert d.backend == "cpu" and d.fallback_reason.startswith(two.reason())
    assert d.fallback_reason.endswith("could not be set up: rank 3: no gloo group")
    assert "every host holds one rank" in decide_sync_path(SyncFacts(alone)).fallback_reason


def _every_auto(rank, world):
    """Each ``auto`` on this rank: (result, reason) of the DCP merger, the Ulysses transport at
    two sizes, the pipeline depth (timings that differ per rank) and the DP sync path, with
    each of them checked against the pure decision over this rank's copy of the agreed
    facts."""
    from attncomm.dcp import DcpMerger
    from attncomm.dp_attention.rows import sync_decision
    from attncomm.ulysses import pipeline_choice as pc
    from attncomm.ulysses import policy

    cpu = torch.device("cpu")
    m = DcpMerger(None, max_tokens=4, num_heads=2, head_dim=8, dtype=torch.float32,
                  device=cpu)
    dcp = (m.decision.backend, m.decision.fallback_reason, m.decision.rule)
    m.close()
    facts = policy.transport_facts(None, "auto", cpu)
    ulysses = [policy.get_transport(None, "auto", cpu, 5.0, None, None, "t", facts)[1]
               for _ in range(2)]
    assert ulysses[0] == decide_transport("auto", facts.ce_reason, select.AUTO_CE_MIN_BYTES,
                                          facts.shared_gpu)
    out = torch.arange(4.0)
    depth = pc.decide_pipeline(None, ("decide-test", rank * 0), lambda: out, lambda: out, 2,
                               timer=lambda fn: 10.0 + 5.0 * rank, measured=True)
    sync = sync_decision("auto")
    return dcp, ulysses[0], depth, sync


def test_every_auto_is_the_same_on_every_rank(pools):
    res = pools.run(2, _every_auto)
    assert res[0] == res[1]
    dcp, ulysses, depth, sync = res[0]
    assert dcp[0] == "a2a" and dcp[2] == "CPU: not measured"
    assert ulysses.backend == "all_to_all" and ulysses.fallback_reason.startswith("ce not used")
    # the slowest rank's figures on both: sequential 15 µs vs pipelined 15 µs: a tie
    assert depth == PipelineDecision(1, 2, 15.0, 15.0, depth.fallback_reason)
    assert depth.fallback_reason.startswith("measured slower or equal")
    assert sync == Decision("shm") or sync.backend == "cpu" and sync.fallback_reason


def _transport_probes(rank, world):
    """Where ``UlyssesAttention``'s first forward of a shape probes the transport facts: for
    each probe, whether it ran inside a ``ForwardPlan`` constructor."""
    from attncomm.ulysses import UlyssesAttention, forward_plan, policy

    inside, seen = [False], []
    real_init, real_ce = forward_plan.ForwardPlan.__init__, policy.ce_reason

    def init(self, *args, **kwargs):
        inside[0] = True
        try:
            real_init(self, *args, **kwargs)
        finally:
            inside[0] = False

    def ce_reason(*args, **kwargs):
        seen.append(inside[0])
        return real_ce(*args, **kwargs)

    forward_plan.ForwardPlan.__init__, policy.ce_reason = init, ce_reason
    try:
        gen = torch.Generator().manual_seed(11 + rank)
        q, k, v = (torch.randn(1, 3, 2 * world, 8, generator=gen) for _ in range(3))
        with UlyssesAttention(backend="auto", pipeline_groups=2) as attn:
            attn(q, k, v)
            backends = attn.last_backends
    finally:
        forward_plan.ForwardPlan.__init__, policy.ce_reason = real_init, real_ce
    return seen, backends


def test_ulysses_transport_facts_are_probed_before_any_plan(pools):
    for seen, backends in pools.run(2, _transport_probes):
        assert seen and not any(seen), seen  # probed, never inside a plan's constructor
        assert backends == {"in": "all_to_all", "out": "all_to_all"}
