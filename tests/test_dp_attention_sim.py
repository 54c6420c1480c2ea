"""The DP-attention scheduler simulation (200 steps), its checks failing loudly, the dp-sync
bench on CPU ranks, and the demo mode's registration."""
from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from attncomm.dp_attention import DpPaddingMode
from attncomm.dp_attention.sync import BatchView, ForwardMode
from attncomm.demo.dp_simulate import (SimConfig, SimulationError, _verify_decisions,
                                            _verify_slots, default_tokens, simulate_rank,
                                            summarize)


def _opening(dp: int) -> list[list[BatchView | None]]:
    """Four steps that exercise every rule: all idle; one extend beside empty ranks (SUM_LEN,
    idle batches, TBO); decode everywhere (MAX_LEN, a graph size, TBO); a prebuilt batch beside
    decodes (its inner idle batch)."""
    extend = BatchView(ForwardMode.EXTEND, batch_size=2, extend_num_tokens=8,
                       extend_lens=[3, 5], extend_logprob_start_lens=None, return_logprob=False)
    return [[None] * dp,
            [extend] + [None] * (dp - 1),
            [BatchView(ForwardMode.DECODE, batch_size=2 + d) for d in range(dp)],
            [BatchView(ForwardMode.PREBUILT, batch_size=1)]
            + [BatchView(ForwardMode.DECODE, batch_size=1)] * (dp - 1)]


@pytest.mark.parametrize("world,atp,sync", [(2, 1, "cpu"), (4, 2, "shm"), (3, 1, "device")])
def test_simulation_200_steps(pools, world, atp, sync, seed):
    cfg = SimConfig(steps=200, attn_tp_size=atp, sync=sync, seed=seed, hidden=32, ffn=64,
                    timeout_s=60)
    res = pools.run(world, simulate_rank, cfg, opening=_opening(world // atp))
    s = summarize(res)
    counts = s["counts"]
    assert counts["steps_run"] + counts["all_idle"] == 200
    # the run exercised every rule (the opening makes sure): idle steps, extends (SUM_LEN),
    # decode-only steps (MAX_LEN), graph steps, TBO, idle batches for empty ranks, prebuilt
    for key in ("all_idle", "extend", "sum_len", "max_len", "graph", "tbo", "idle_batches"):
        assert counts[key] > 0, (key, counts)
    assert sum(r["stats"]["prebuilt"] for r in res) > 0
    assert all(r["stats"]["steps_run"] == counts["steps_run"] for r in res)
    assert s["sync"] == sync
    assert s["min_cosine"] > 0.99999 and s["max_abs_err"] < 1e-4, s


def test_opening_alone_exercises_every_rule(pools):
    # The four steps on their own, without the seeded scheduler: each rule counted on rank 0.
    cfg = SimConfig(steps=4, sync="cpu", hidden=16, ffn=32, timeout_s=60)
    counts = summarize(pools.run(2, simulate_rank, cfg, opening=_opening(2)))["counts"]
    # step 3: rank 1 decodes one request, so no TBO; counts [0, 1] pad to MAX_LEN
    assert counts == dict(steps_run=3, all_idle=1, extend=1, sum_len=1, max_len=2, graph=2,
                          tbo=2, idle_batches=1, prebuilt=1), counts


def test_checks_fail_loudly():
    good = [[0, 1, 0, 1, 1, 8, 3, 0, 3, 5], [0, 1, 0, 1, 1, 8, 5, 0, 3, 5]]
    _verify_decisions(good, 7, 1)
    bad = [list(good[0]), list(good[1])]
    bad[1][5] = 16                                     # a different graph size on rank 1
    with pytest.raises(SimulationError, match="step 7: ranks decided differently"):
        _verify_decisions(bad, 7, 1)
    bad = [list(good[0]), list(good[1])]
    bad[1][6] = 4                                      # rank 1 really had 4 tokens
    with pytest.raises(SimulationError, match=r"counts \[3, 5\] != .* \[3, 4\]"):
        _verify_decisions(bad, 7, 1)
    tokens = default_tokens(3, 8, torch.float32, "cpu")
    gnt = [2, 0, 3]
    buf = torch.cat([tokens(5, q, n) for q, n in enumerate(gnt)])
    _verify_slots(buf, gnt, DpPaddingMode.SUM_LEN, tokens, 5)
    buf[3, 1] += 1e-6
    with pytest.raises(SimulationError, match="slot of DP rank 2"):
        _verify_slots(buf, gnt, DpPaddingMode.SUM_LEN, tokens, 5)


def test_bench_dp_sync_smoke(tmp_path):
    from attncomm.bench import dp_sync as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "dp.json"
    args = p.parse_args(["--device", "cpu", "--world-size", "2", "--steps", "60", "--block",
                         "20", "--hidden", "64", "--tokens", "1", "3", "--iters", "2",
                         "--warmup", "1", "--json", str(out), "--no-progress",
                         "--markdown", str(tmp_path / "dp.md"), "--plot", str(tmp_path / "dp.png")])
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    syncs = [r for r in doc["records"] if "sync" in r]
    ops = [r for r in doc["records"] if "op" in r]
    assert sorted(r["sync"] for r in syncs) == ["cpu", "device", "shm"]
    assert len(ops) == 2 * 2 * 3
    assert {(r["op"], r["mode"], r["tokens"]) for r in ops} == {
        (o, m, t) for o in ("dp_gather", "dp_scatter", "dp_reduce_scatter")
        for m in ("MAX_LEN", "SUM_LEN") for t in (1, 3)}
    for r in syncs:
        assert r["world_size"] == 2 and math.isfinite(r["sync_us"]) and r["sync_us"] > 0
        assert math.isfinite(r["exchange_us"]) and r["exchange_us"] > 0
    for r in ops:
        assert math.isfinite(r["time_us"]) and r["time_us"] > 0
    assert doc["meta"]["bench"] == "dp-sync" and doc["meta"]["hidden"] == 64
    md = (tmp_path / "dp.md").read_text()
    assert "| shm |" in md and "| dp_reduce_scatter | 3 |" in md
    assert (tmp_path / "dp.png").stat().st_size > 1000
    bad = p.parse_args(["--device", "cpu", "--steps", "0"])
    assert bench.main(bad) == 2


def test_demo_mode_registered():
    from attncomm.demo import MODES, plan_modes
    from attncomm.demo.base import DemoConfig
    from attncomm.demo import dp_attention

    assert MODES["dp_attention"] == "attncomm.demo.dp_attention"
    assert dp_attention.backends(DemoConfig()) == ["auto"]
    assert dp_attention.skip_reason(DemoConfig(world_size=3), None) is None
    plan, skipped = plan_modes(DemoConfig(world_size=3, modes=("dp_attention",)), None)
    assert plan == [("dp_attention", ["auto"])] and skipped == []
