"""``attncomm bench ulysses`` on CPU ranks with tiny sizes (a smoke test of the plumbing)."""
from __future__ import annotations

import argparse
import json

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
