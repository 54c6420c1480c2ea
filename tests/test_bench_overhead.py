"""``attncomm bench overhead``: the CPU smoke run (gloo ranks, host µs only) writes every target
row with the JSON schema and judges none against the GPU targets, a figure below zero is a
failed measurement, every row without a figure says why, a CUDA-only row says so on CPU,
``--device cuda`` without a GPU is a clear usage error, and the units, targets and Markdown come
from the records."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from attncomm import _timing, cli
from attncomm.bench import overhead

SCHEMA = ("op", "host_us", "gpu_us", "baseline_host_us", "unit_host_us", "world_size", "shape")


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path, capsys):
    path, md = tmp_path / "o.json", tmp_path / "o.md"
    rc = cli.main(["bench", "overhead", "--device", "cpu", "--small", "--repeats", "3",
                   "--warmup", "1", "--extra", "--rev-label", "after", "--json", str(path),
                   "--markdown", str(md)])
    data = json.loads(path.read_text())
    rows = {r["op"]: r for r in data["records"]}
    assert rc == 0, capsys.readouterr()
    assert set(rows) == set(overhead.OPS + overhead.EXTRA_OPS)
    assert data["meta"]["rev_label"] == "after" and data["meta"]["unit_host_us"] > 0
    for op, r in rows.items():
        assert all(k in r for k in SCHEMA) and r["rev"] == "after", r
        if op in ("DcpMerger.symm_a2a", "UlyssesAttention.graph") or "graph replay" in op:
            assert r["note"] == "CUDA only" and r["host_us"] is None, r
            continue
        assert r["error"] is None and r["host_us"] > 0 and r["gpu_us"] is None, r
        assert r["world_size"] == 1 and r["shape"] and r["device"] == "cpu", r
        # A figure, or none with the reason (an attention row can time below its baseline).
        assert (r["units"] is not None and r["units"] >= 0) or \
            r["why"].startswith("failed measurement"), r
        assert r["met"] is None, r  # the targets are GPU figures
        if r["target_units"] is not None and r["units"] is not None:
            assert r["why"] == overhead.GPU_TARGETS, r
    assert rows["UlyssesAttention.sequential"]["baseline_host_us"] > 0
    assert "| dcp.merge | out [4, 8, 16] fp32 |" in md.read_text()
    assert overhead.GPU_TARGETS in md.read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
def test_cuda_without_a_gpu_is_a_usage_error(capsys):
    assert cli.main(["bench", "overhead"]) == 2
    assert "no CUDA device here (use --device cpu" in capsys.readouterr().err


def test_unknown_rows_are_a_usage_error(capsys):
    assert cli.main(["bench", "overhead", "--device", "cpu", "--ops", "dcp.nothing"]) == 2
    assert "unknown rows ['dcp.nothing']" in capsys.readouterr().err


def test_units_targets_and_markdown():
    recs = [{"op": "dcp.merge", "host_us": 30.0, "unit_host_us": 12.0, "baseline_host_us": None,
             "gpu_us": 40.0, "shape": "s", "note": None, "error": None},
            {"op": "UlyssesAttention.sequential", "host_us": 130.0, "unit_host_us": 12.0,
             "baseline_host_us": 40.0, "gpu_us": 400.0, "shape": "s", "note": None,
             "error": None},
            {"op": "DcpMerger.symm_a2a", "host_us": None, "unit_host_us": 12.0,
             "baseline_host_us": None, "gpu_us": None, "shape": None, "note": None,
             "error": "ValueError: x | y"}]
    rows = {r["op"]: r for r in overhead.with_units(recs)}
    assert rows["dcp.merge"]["units"] == 2.5 and rows["dcp.merge"]["met"] is True
    assert rows["UlyssesAttention.sequential"]["units"] == 7.5  # above the bare attn_fn
    assert rows["UlyssesAttention.sequential"]["met"] is False
    assert rows["DcpMerger.symm_a2a"]["units"] is None and rows["DcpMerger.symm_a2a"]["met"] is None
    table = overhead.markdown_table(recs)
    assert "| dcp.merge | s | 30.0 | 2.50 | ≤ 3 ✓ | 40.0 | - |" in table
    assert "7.50 above | ≤ 6 ✗" in table and "ValueError: x / y" in table


def test_every_option_has_help():
    p = argparse.ArgumentParser()
    overhead.add_arguments(p)
    assert all(a.help for a in p._actions if a.option_strings and a.dest != "help")


def _row(op, host, baseline=None, device=None, **kw):
    r = {"op": op, "host_us": host, "unit_host_us": 10.0, "baseline_host_us": baseline,
         "gpu_us": None, "shape": "s", "note": None, "error": None}
    if device is not None:
        r["device"] = device
    return {**r, **kw}


def test_a_figure_below_zero_is_a_failed_measurement_never_met():
    # The bare attn_fn, timed apart from the call, came out slower than the call: no figure.
    rows = overhead.with_units([_row("UlyssesAttention.sequential", 100.0, baseline=292086.0)])
    r = rows[0]
    assert r["units"] is None and r["met"] is None, r
    assert r["why"].startswith("failed measurement: the call timed below its baseline "
                               "(medians 100.0 and 292086.0 µs)"), r
    table = overhead.markdown_table([_row("UlyssesAttention.sequential", 100.0,
                                          baseline=292086.0)])
    assert "| - | ≤ 6 |" in table and "failed measurement" in table and "-19" not in table


def test_cpu_rows_are_not_judged_against_gpu_targets():
    rows = {r["op"]: r for r in overhead.with_units([
        _row("dcp.merge", 20.0, device="cpu"), _row("dcp.merge[output]", 20.0, device="cpu"),
        _row("ulysses.seq_to_head", 20.0, device="cuda")])}
    assert rows["dcp.merge"]["units"] == 2.0 and rows["dcp.merge"]["met"] is None
    assert rows["dcp.merge"]["why"] == overhead.GPU_TARGETS
    assert rows["dcp.merge[output]"]["met"] is None and rows["dcp.merge[output]"]["why"] is None
    assert rows["ulysses.seq_to_head"]["met"] is True and rows["ulysses.seq_to_head"]["why"] is None
    table = overhead.markdown_table([_row("dcp.merge", 20.0, device="cpu")])
    assert "| 2.00 | ≤ 3 |" in table and overhead.GPU_TARGETS in table


def test_every_row_without_a_figure_says_why():
    rows = {r["op"]: r for r in overhead.with_units([
        _row("DcpMerger.symm_a2a", None, note="CUDA only"),
        _row("dcp.merge", None, note="skipped: past the time budget of 60 s"),
        _row("dcp.gather_heads", None, error="RuntimeError: boom"),
        _row("UlyssesAttention.pipelined_g4", 50.0),  # no baseline timed
        _row("ulysses.seq_to_head", 50.0, unit_host_us=None)])}
    assert all(r["units"] is None and r["met"] is None and r["why"] for r in rows.values())
    assert rows["DcpMerger.symm_a2a"]["why"] == "CUDA only"
    assert rows["dcp.gather_heads"]["why"] == "the row failed (see error)"
    assert rows["UlyssesAttention.pipelined_g4"]["why"].startswith("no baseline")
    assert rows["ulysses.seq_to_head"]["why"].startswith("no unit")


def test_rounds_interleave_every_call_and_rotate_the_order():
    order = []
    fns = [lambda i=i: order.append(i) for i in range(3)]
    times = _timing.time_host(fns, repeats=8, rounds=4, warmup=1)
    assert [len(t) for t in times] == [4, 4, 4] and all(len(r) == 2 for t in times for r in t)
    assert all(x >= 0 for t in times for r in t for x in r)
    timed = order[3:]  # after one warm-up call of each
    rounds = [timed[6 * r:6 * r + 6] for r in range(4)]
    assert rounds == [[(k + r) % 3 for k in range(3) for _ in range(2)] for r in range(4)]
    assert [len(r) for r in _timing.time_host(fns, repeats=3, rounds=10, warmup=0)[0]] == [1] * 3
    with pytest.raises(ValueError, match="repeats and rounds must be ≥ 1, got 8, 0"):
        _timing.time_host(fns, repeats=8, rounds=0)


def test_paired_units_cancel_a_drift_that_unpaired_medians_do_not():
    # The machine slows from round to round; each round the call costs its baseline plus two
    # units. Round by round that is 2.0 exactly; medians taken over the rounds of each side
    # apart (the call's from other moments than the baseline's) are not.
    speed = [1.0, 1.3, 2.0, 0.8, 1.1]
    unit = [10.0 * f for f in speed]
    base = [50.0 * f for f in speed]
    call = [b + 2 * u for b, u in zip(base, unit)]
    assert _timing.paired(call, unit, base) == 2.0
    assert _timing.paired([c / 2 for c in call], unit) == 3.5
    late = [50.0 * f for f in (2.0, 2.0, 2.0, 1.3, 1.1)]  # the same baseline, timed later
    assert _timing.paired(call, unit, late) != 2.0
    row = _row("UlyssesAttention.sequential", 77.0, baseline=55.0, host_rounds=call,
               unit_rounds=unit, baseline_rounds=base)
    assert overhead.with_units([row])[0]["units"] == 2.0
    with pytest.raises(ValueError, match="rounds differ: call 5, unit 4"):
        _timing.paired(call, unit[:4])


def test_grouped_row_splits_its_cost_at_the_groups_bare_calls():
    # Per round: one bare call 40 µs, the four groups' bare calls 100 µs, the forward 130 µs,
    # the unit 10 µs (the machine slows in round 3: every time doubles there).
    speed = [1.0, 1.0, 2.0]
    unit = [10.0 * f for f in speed]
    base, calls, host = ([x * f for f in speed] for x in (40.0, 100.0, 130.0))
    row = _row("UlyssesAttention.pipelined_g4", 130.0, baseline=40.0, host_rounds=host,
               unit_rounds=unit, baseline_rounds=base)
    plain = overhead.with_units([row])[0]
    assert plain["units"] == 9.0 and plain["group_calls_units"] is None
    assert plain["units_above_group_calls"] is None
    got = overhead.with_units([dict(row, group_calls_rounds=calls,
                                    group_calls_host_us=100.0)])[0]
    assert (got["units"], got["group_calls_units"], got["units_above_group_calls"]) == \
        (9.0, 6.0, 3.0)
    table = overhead.markdown_table([dict(row, group_calls_rounds=calls)])
    assert "the groups' bare attn_fn calls: 6.00 units above the one call; the forward " \
        "above them: 3.00" in table


def test_grouped_row_times_the_groups_bare_calls_on_cpu():
    cfg = dict(device="cpu", ops=["UlyssesAttention.pipelined_g4"], repeats=2, rounds=2,
               warmup=1, small=True, profile=0, rev_label=None, time_budget=600)
    (rec,) = overhead.run_ranks(overhead.run_rank, 1, "cpu", (cfg,))[0]["records"]
    assert rec["error"] is None and len(rec["group_calls_rounds"]) == 2, rec
    assert rec["group_calls_host_us"] > 0


def test_grouped_figures_below_zero_are_failed_measurements():
    # The groups' calls timed below the one bare call: no figure for them, never a negative one.
    row = _row("UlyssesAttention.pipelined_g4", 130.0, baseline=40.0, host_rounds=[130.0],
               unit_rounds=[10.0], baseline_rounds=[40.0], group_calls_rounds=[30.0])
    got = overhead.with_units([row])[0]
    assert got["group_calls_units"] is None and got["units_above_group_calls"] == 10.0
    assert "the groups' bare attn_fn calls: - units above the one call; the forward above " \
        "them: 10.00" in overhead.markdown_table([row])
