"""``attncomm bench ring`` on CPU ranks with tiny sizes (a smoke test of the plumbing): every
variant's record, the ring's per-step split, the kernel section's ratios, JSON/Markdown/PNG."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from attncomm.bench import ring as bench
from attncomm.bench.ring_kernels import kernel_records


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(["--device", "cpu", "--world-size", "4", "--seq", "32", "--iters", "2",
                         "--heads", "4", "--kv-heads", "2", "--head-dim", "8", "--no-progress",
                         "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png"),
                         "--markdown", str(tmp_path / "r.md"), "--causal", "on", *extra])


@pytest.mark.slow
def test_bench_ring_cpu_smoke(pools, tmp_path, capsys):
    args = _args(tmp_path)
    opts = bench._defaults(args)
    assert bench._error(opts, 4) is None
    records = pools.run(4, bench.run_rank, opts)[0]["records"]
    assert bench.report(records, args, opts) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    recs = data["records"]
    want = {"ring contiguous", "ring zigzag", "ulysses", "usp 2x2 contiguous", "usp 2x2 zigzag"}
    assert {r["variant"] for r in recs} == want
    assert {(r["variant"], r["causal"]) for r in recs} == {(v, True) for v in want}
    for r in recs:
        assert r["time_us"] > 0 and r["world_size"] == 4 and r["seq"] == 32
        if r["variant"].startswith("ring"):
            assert r["compute_us"] > 0 and r["transfer_us"] > 0
            assert abs(r["per_step_compute_us"] - r["compute_us"] / 4) < 1e-9
            assert abs(r["per_step_transfer_us"] - r["transfer_us"] / 3) < 1e-9
    assert (tmp_path / "r.png").stat().st_size > 0
    md = (tmp_path / "r.md").read_text()
    assert md.startswith("# Ring attention, Ulysses, USP") and md.count("| 32 |") == len(recs)
    assert "ring / Ulysses / USP, W=4" in capsys.readouterr().out


def test_bench_ring_varlen_cpu_smoke(pools, tmp_path):
    """``--varlen``: packed against padded for both layouts, and the default attn_fn's rows."""
    args = _args(tmp_path, "--varlen")
    opts = bench._defaults(args)
    records = pools.run(4, bench.run_rank, opts)[0]["records"]
    assert bench.report(records, args, opts) == 0
    ring = [r for r in records if "packed_us" in r]
    assert {r["variant"] for r in ring} == {"ring contiguous", "ring zigzag"}
    assert all(r["packed_us"] > 0 and r["padded_us"] > 0 and r["ratio"] > 0 for r in ring)
    fn = [r for r in records if "dense_us" in r]
    assert {r["variant"].split(" ", 1)[1] for r in fn} >= {"mask (all True)", "one segment"}


def test_bench_ring_rejects_bad_sizes(tmp_path, capsys):
    args = _args(tmp_path)
    args.seq = "30"
    assert bench.main(args) == 2
    assert "multiple of 8" in capsys.readouterr().err
    assert bench.grids(4) == [(2, 2)] and bench.grids(8) == [(2, 4), (4, 2)]
    assert bench.grids(2) == [] and bench.grids(3) == []


def test_kernel_records_cpu():
    recs = kernel_records(torch.device("cpu"), 16, 2, 8, torch.float32, iters=2)
    ops = [(r["op"], r["causal"]) for r in recs]
    assert ops == [(op, c) for c in (False, True) for op in (
        "attention_with_lse", "sdpa", "merge_step", "merge_vs_attention", "attn_lse_vs_sdpa")]
    for r in recs:
        assert r["kernel"] == "math" and r["seq"] == 16
        if "ratio" in r:
            assert r["ratio"] > 0
        else:
            assert r["gpu_us"] > 0 and r["host_us"] > 0
