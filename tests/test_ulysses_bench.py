"""``attncomm bench ulysses`` on CPU ranks with tiny sizes (a smoke test of the plumbing)."""
from __future__ import annotations

import argparse
import json
import math

from attncomm.ulysses import bench


def _args(tmp_path, **over):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    argv = ["--device", "cpu", "--min-bytes", "4096", "--max-bytes", "16384", "--dit-seq", "16",
            "--iters", "2", "--no-progress", "--json", str(tmp_path / "u.json"),
            "--plot", str(tmp_path / "u.png"), "--markdown", str(tmp_path / "u.md")]
    return p.parse_args(argv)


def _run_rank(rank, world, opts):
    opts = dict(opts, one_thread=False)  # leave the shared test pool's threads alone
    return bench.run_rank(rank, world, opts)


def test_bench_ulysses_cpu_smoke(pools, tmp_path, capsys):
    args = _args(tmp_path)
    opts = bench._defaults(args)
    result = pools.run(2, _run_rank, opts)[0]
    assert bench.report(result["records"], result["skipped"], args, opts) == 0
    data = json.loads((tmp_path / "u.json").read_text())
    recs = data["records"]
    assert {r["geometry"] for r in recs} == {"sweep", "dit"}
    sweep = [r for r in recs if r["geometry"] == "sweep"]
    assert [r["bytes_per_rank"] for r in sweep] == sorted(r["bytes_per_rank"] for r in sweep)
    for r in recs:
        assert set(r) >= {"transport", "mode", "world_size", "geometry", "bytes_per_rank",
                          "time_us", "busbw_gbps"}
        assert r["time_us"] > 0 and r["bytes_per_rank"] > 0 and r["world_size"] == 2
        assert abs(r["busbw_gbps"] - r["bytes_per_rank"] / r["time_us"] / 1e3) < 1e-9
    assert "ce" in data["meta"]["skipped"]
    assert (tmp_path / "u.png").stat().st_size > 0
    md = (tmp_path / "u.md").read_text()
    assert md.startswith("# Ulysses all-to-all") and md.count("\n| sweep |") == len(sweep)
    assert "Ulysses exchange" in capsys.readouterr().out


def test_bench_ulysses_layer_cpu_smoke(pools, tmp_path, capsys):
    """--layer-only on 2 CPU ranks: exchange, attention, sequential and pipelined (automatic
    groups, and 2 forced groups) per transport, one summary each with a finite hidden fraction,
    outputs bitwise equal; no exchange records; table and Markdown section."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    results = {}
    for groups in ("-1", "2"):
        out = tmp_path / groups
        args = p.parse_args(["--device", "cpu", "--layer-only", "--layer-seq", "24",
                             "--layer-heads", "6", "--layer-groups", groups, "--iters", "2",
                             "--no-progress", "--json", str(out / "l.json"),
                             "--markdown", str(out / "l.md")])
        opts = bench._defaults(args)
        assert opts["layer_only"] and opts["layer_seq"] == 24 and opts["layer_heads"] == 6
        result = pools.run(2, _run_rank, opts)[0]
        assert bench.report(result["records"], result["skipped"], args, opts) == 0
        results[groups] = (json.loads((out / "l.json").read_text()), (out / "l.md").read_text())
    for groups, (data, md) in results.items():
        recs = data["records"]
        assert {r["geometry"] for r in recs} == {"layer"}
        transports = {r["transport"] for r in recs}
        assert transports == {"all_to_all"} and "ce" in data["meta"]["skipped"]
        timed = [r for r in recs if r["variant"] != "summary"]
        assert [r["variant"] for r in timed] == ["exchange", "attention", "sequential",
                                                 "pipelined"]
        for r in timed:
            assert set(r) >= {"transport", "mode", "world_size", "geometry", "variant",
                              "time_us", "pipeline_groups"}
            assert r["world_size"] == 2 and r["mode"] == "eager" and r["time_us"] > 0
        by = {r["variant"]: r for r in recs}
        assert by["exchange"]["pipeline_groups"] is None
        assert by["sequential"]["pipeline_groups"] == 1
        # CPU: automatic grouping stays sequential; a forced 2 splits each rank's 3 heads.
        assert by["pipelined"]["pipeline_groups"] == (1 if groups == "-1" else 2)
        s = by["summary"]
        hf, sp = s["hidden_fraction"], s["speedup"]
        assert isinstance(hf, float) and math.isfinite(hf)
        seq_us, pipe_us = by["sequential"]["time_us"], by["pipelined"]["time_us"]
        want = (seq_us - pipe_us) / by["exchange"]["time_us"]
        assert abs(hf - want) < 1e-9 * max(1.0, abs(want))
        assert abs(sp - seq_us / pipe_us) < 1e-9
        assert s["bitwise_equal"] is True
        assert s["pipeline_groups"] == by["pipelined"]["pipeline_groups"]
        assert "## DiT layer" in md and md.count("\n| all_to_all |") == 1
        assert "| sweep |" not in md
    out = capsys.readouterr().out
    assert "Ulysses DiT layer pipelining" in out and "Ulysses exchange" not in out


def test_bench_ulysses_layer_rows_clamp():
    """The printed hidden fraction is clamped to [0, 1]; the JSON keeps the raw value."""
    base = {"transport": "ce", "mode": "eager", "world_size": 2, "geometry": "layer",
            "seq": 8, "heads": 2}
    for raw, shown in ((-0.5, 0.0), (1.7, 1.0), (0.25, 0.25)):
        recs = [dict(base, variant="exchange", time_us=10.0, pipeline_groups=None),
                dict(base, variant="summary", hidden_fraction=raw, speedup=1.1,
                     pipeline_groups=4, bitwise_equal=True)]
        row, = bench._layer_rows(recs)
        assert row["hidden"] == shown and row["exchange_us"] == 10.0 and row["groups"] == 4
        assert recs[1]["hidden_fraction"] == raw
