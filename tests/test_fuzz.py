"""The seeded fuzz (attncomm.testing.fuzz): a fixed subset on the session's rank pools, every
kind of case at every W = 1..4, every failure printed with the command that replays it. Random
exploration is the full run (≥ 2000 cases, W = 1..8), `python -m attncomm.testing.fuzz --cases
2400 --seed 1`; its summary is in benchmarks/results/."""
from __future__ import annotations

import collections

import pytest

from attncomm.testing import cases, fuzz

WORLDS = range(1, 5)
PER_CELL = 15  # cases per (kind, W): 420 in all, about as many as a 600-case draw holds


def subset(seed: int) -> list[int]:
    """The first ``PER_CELL`` cases of fuzz run ``seed`` for each (kind, W in ``WORLDS``)."""
    picked, count, i = [], collections.Counter(), 0
    while len(picked) < PER_CELL * len(cases.KINDS) * len(WORLDS):
        s = fuzz.case_seed(seed, i)
        i += 1
        sp = cases.spec(s)
        if sp["W"] in WORLDS and count[sp["kind"], sp["W"]] < PER_CELL:
            count[sp["kind"], sp["W"]] += 1
            picked.append(s)
    return picked


@pytest.mark.slow
def test_fuzz_subset(pools, seed):
    picked = subset(seed)
    summary = fuzz.run(0, seed, case_seeds=picked, pool_for=pools.get, log=print)
    assert summary["cases_run"] == len(picked), summary
    lines = [f"case {f['seed']} ({f['kind']}, W={f['W']}): {f['messages'][0]}\n"
             f"  replay: {f['replay']}" for f in summary["failures"]]
    assert not lines, f"fuzz seed {seed}:\n" + "\n".join(lines)


def test_cases_replay_from_their_seed():
    # A case is a function of its seed alone (what --replay relies on), and seeds spread
    # over every kind and world size.
    seeds = [fuzz.case_seed(7, i) for i in range(400)]
    assert [cases.spec(s) for s in seeds[:50]] == [cases.spec(s) for s in seeds[:50]]
    assert {cases.spec(s)["kind"] for s in seeds} == set(cases.KINDS)
    assert {cases.spec(s)["W"] for s in seeds} == set(range(1, 9))
    assert len(set(seeds)) == len(seeds)


def test_merge_counts_cases_up_to_the_first_that_raised():
    per_rank = [[(1, None, False), (2, "rank 0: boom", True)],
                [(1, None, False), (2, None, False), (3, None, False)]]
    done, rerun, raised = fuzz._merge(per_rank, [1, 2, 3])
    assert done == {1: [], 2: ["rank 0: boom"]} and rerun == [3] and raised


def _broken_runs(rank, world):
    """On the ranks: break each exchange a little and count the cases that notice."""
    import torch

    from attncomm.dcp.lse_merge import combine as comb
    from attncomm.ulysses import attention as uatt
    caught = {}
    seeds = [fuzz.case_seed(11, i) for i in range(3000)]
    by_kind = {}
    for s in seeds:
        sp = cases.spec(s)
        if sp["W"] == world and len(by_kind.setdefault(sp["kind"], [])) < 6:
            by_kind[sp["kind"]].append(sp)
    real_combine, real_sdpa = comb.combine_torch, uatt.sdpa_attention
    comb.combine_torch = lambda o, l, dt: (real_combine(o, l, dt)[0] * 1.1,
                                           real_combine(o, l, dt)[1])
    uatt.sdpa_attention = lambda q, k, v, c: real_sdpa(q, k, v, c) * 1.1
    try:
        for kind in ("dcp_merge", "ulysses_attention"):
            caught[kind] = sum(cases.run_case(rank, world, sp) is not None
                               for sp in by_kind[kind] if sp.get("backend") != "ag_rs"
                               and sp.get("T", 1) > 0 and sp.get("impl") != "triton")
    finally:
        comb.combine_torch, uatt.sdpa_attention = real_combine, real_sdpa
    import attncomm.dp_attention as dpa
    real_gather = dpa.dp_gather
    dpa.dp_gather = lambda *a, **k: real_gather(*a, **k) + 1
    try:
        caught["dp_gather_scatter"] = sum(
            cases.run_case(rank, world, sp) is not None for sp in by_kind["dp_gather_scatter"]
            if sum(sp["n"]) > 0)
    finally:
        dpa.dp_gather = real_gather
    return caught, torch.__version__


def test_fuzz_checks_can_fail(pools):
    # Mutations: merged outputs and attention 10 % off, gathered DP rows off by one.
    caught, _ = pools.run(1, _broken_runs)[0]
    assert all(v > 0 for v in caught.values()), caught
