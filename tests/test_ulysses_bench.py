"""``attncomm bench ulysses`` on CPU ranks with tiny sizes (a smoke test of the plumbing)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from attncomm.bench import ulysses as bench


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_bench_ulysses_layer_cpu_smoke(pools, tmp_path, capsys):
    """--layer-only on 2 CPU ranks: every variant that runs on all_to_all, with and without
    qk_norm + RoPE, the issue's record fields, groups as the module ran them, one summary per
    (seq, qk_norm) with every output bitwise equal; table and Markdown section."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--layer-only", "--layer-seq", "24",
                         "--layer-heads", "6", "--layer-kv-heads", "2", "--iters", "2",
                         "--no-progress", "--json", str(tmp_path / "l.json"),
                         "--markdown", str(tmp_path / "l.md")])
    opts = bench._defaults(args)
    assert opts["layer_only"] and opts["layer_seqs"] == [24] and opts["layer_heads"] == 6
    result = pools.run(2, _run_rank, opts)[0]
    assert bench.report(result["records"], result["skipped"], args, opts) == 0
    data = json.loads((tmp_path / "l.json").read_text())
    recs = data["records"]
    assert {r["geometry"] for r in recs} == {"layer"} and "ce" in data["meta"]["skipped"]
    timed = [r for r in recs if r["variant"] != "summary"]
    want = ["attention_only", "sequential_all_to_all", "pipelined_auto", "pipelined_g2",
            "pipelined_g4", "pipelined_g7", "pipelined_g8", "pipelined_fused"]
    assert [r["variant"] for r in timed] == want * 2
    for r in timed:
        assert set(r) >= {"variant", "transport", "seq", "heads", "groups", "qk_norm",
                          "time_us"}
        assert r["time_us"] > 0 and r["seq"] == 24 and r["heads"] == 6
    by = {(r["variant"], r["qk_norm"]): r for r in timed}
    for norm in (True, False):
        assert by[("attention_only", norm)]["transport"] == "none"
        assert by[("sequential_all_to_all", norm)]["groups"] == 1
        assert by[("pipelined_auto", norm)]["groups"] == 1       # -1 is sequential
        assert by[("pipelined_g2", norm)]["groups"] == 2
        assert by[("pipelined_g8", norm)]["groups"] == 8         # more groups than heads
        assert by[("pipelined_fused", norm)]["fused_fill"] is True
    summaries = [r for r in recs if r["variant"] == "summary"]
    assert len(summaries) == 2 and all(s["bitwise_equal"] for s in summaries)
    for s in summaries:
        assert set(s["hidden_vs_sequential_all_to_all"]) <= {"all_to_all"}
    md = (tmp_path / "l.md").read_text()
    assert "## Attention layer" in md and md.count("| pipelined_g2 |") == 2
    assert "Ulysses attention layer" in capsys.readouterr().out


def test_bench_ulysses_layer_dit_options_cpu_smoke(pools, tmp_path, capsys):
    """--joint and --payload none fp8: every variant with each payload, joint rows in every
    forward, summaries bitwise equal within each payload, the FP8 error records (a tiny case)
    within the payload's row bound, and their Markdown section."""
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--layer-only", "--layer-seq", "24",
                         "--layer-heads", "6", "--layer-kv-heads", "2", "--iters", "2",
                         "--joint", "5", "--payload", "none", "fp8", "--layer-qk-norm", "on",
                         "--layer-variants", "attention_only,sequential_all_to_all,pipelined_g2",
                         "--no-progress", "--json", str(tmp_path / "d.json"),
                         "--markdown", str(tmp_path / "d.md")])
    opts = bench._defaults(args)
    assert opts["joint"] == 5 and opts["payloads"] == ["none", "fp8"]
    opts.update(fp8_cases=[(32, 4, 2, 16)], fp8_seeds=(0,))
    result = pools.run(2, _run_rank, opts)[0]
    assert bench.report(result["records"], result["skipped"], args, opts) == 0
    recs = json.loads((tmp_path / "d.json").read_text())["records"]
    timed = [r for r in recs if r["geometry"] == "layer" and r["variant"] != "summary"]
    assert [(r["variant"], r["payload"]) for r in timed] == [
        ("attention_only", "none"), ("sequential_all_to_all", "none"), ("pipelined_g2", "none"),
        ("sequential_all_to_all", "fp8"), ("pipelined_g2", "fp8")]
    assert all(r["joint"] == 5 and r["time_us"] > 0 for r in timed)
    summaries = [r for r in recs if r.get("variant") == "summary"]
    assert [s["payload"] for s in summaries] == ["none", "fp8"]
    assert all(s["bitwise_equal"] for s in summaries)
    errs = [r for r in recs if r["geometry"] == "fp8_error"]
    assert [r["kind"] for r in errs] == ["normal", "outliers"]
    for r in errs:
        assert 0 < r["payload_rel_max"] <= 1 / 28 + 2 ** -8  # fp8.py's per-row bound (bf16)
        assert r["fp8_vs_plain"]["max_abs"] > 0 and 0.5 < r["fp8_vs_fp64"]["min_cos"] <= 1
    md = (tmp_path / "d.md").read_text()
    assert "## FP8 payload error" in md and md.count("| 32 | 4 | 2 | 16 |") == 2
    assert "| 24 | 5 | 1 | fp8 | pipelined_g2 |" in md


def test_bench_fill_records_cpu_smoke():
    """``bench ulysses --fill``'s records on CPU: the torch rows of the bf16 and the FP8
    payload per (seq, qk_norm), each against its own floor (the FP8 send buffer is D + 4
    bytes per row where bf16's is 2·D), the kernel rows skipped with the reason."""
    from attncomm.bench.ulysses_fill import fill_records

    records, extra = fill_records(seqs=(16,), heads=4, head_dim=16, world=2, iters=2,
                                  device="cpu")
    assert {(r["impl"], r["qk_norm"]) for r in records} == {
        (impl, norm) for impl in ("torch", "torch-fp8") for norm in (True, False)}
    for r in records:
        assert r["time_us"] > 0 and r["floor_us"] > 0
        assert r["payload"] == ("fp8" if r["impl"].endswith("fp8") else "bf16")
    by = {(r["payload"], r["qk_norm"]): r for r in records}
    x_bytes = 3 * 8 * 4 * 16 * 2  # q, k, v [1, 8, 4, 16] bf16
    assert by[("bf16", False)]["bytes_moved"] == 2 * x_bytes
    assert by[("fp8", False)]["bytes_moved"] == x_bytes + 3 * 8 * 4 * (16 + 4)
    assert "triton" in extra["skipped"] and extra["copy_bandwidth_gbps"] > 0


def test_bench_fill_writes_json_and_markdown(tmp_path, monkeypatch):
    """``bench ulysses --fill --json P --markdown Q`` writes both (the records, and a table row
    per record with its floor ratio), as every other mode does. The kernel rows need a GPU, so
    the CPU's torch rows stand in for the run's records."""
    from attncomm.bench import ulysses_fill
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--fill", "--fill-seq", "16", "--fill-heads", "4", "--iters", "2",
                         "--json", str(tmp_path / "f.json"), "--markdown",
                         str(tmp_path / "f.md")])
    opts = dict(bench._defaults(args), device="cuda")
    monkeypatch.setattr(bench, "fill_records", lambda seqs, heads, d, world, iters:
                        ulysses_fill.fill_records(seqs, heads, 16, world, iters, device="cpu"))
    assert bench._fill_main(args, opts) == 0
    records = json.loads((tmp_path / "f.json").read_text())["records"]
    md = (tmp_path / "f.md").read_text()
    assert len(records) == 4 and md.startswith("# Ulysses fill")
    for r in records:
        row = f"| {r['impl']} | 16 | {r['qk_norm']} |"
        assert md.count(row) == 1, (row, md)
    assert md.count("| – |") == 4  # no kernel row: no bit comparison to report


@pytest.mark.slow
def test_bench_dit_model_cpu(pools, tmp_path):
    """--dit-model on 2 CPU ranks (a tiny Flux): attncomm's sharded forward equals the one
    process bit for bit (fp32 on CPU), its FP8 row close, diffusers' context parallelism run
    on the same model and checked, and why enable_parallelism itself could not run here."""
    pytest.importorskip("diffusers")
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--device", "cpu", "--layer-only", "--layer-variants",
                         "attention_only", "--dit-model", "--iters", "1", "--no-progress",
                         "--markdown", str(tmp_path / "m.md")])
    opts = bench._defaults(args)
    opts["dit_geometry"] = (4, 4, 4, 1, 1, 2, 16, (4, 6, 6))
    result = pools.run(2, _run_rank, opts)[0]
    opts["diffusers_cp_note"] = result["diffusers_cp_note"]
    assert bench.report(result["records"], result["skipped"], args, opts) == 0
    recs = {r["impl"]: r for r in result["records"] if r["geometry"] == "dit_model"}
    assert list(recs) == ["one_process", "attncomm", "attncomm fp8", "diffusers_cp"]
    assert recs["attncomm"]["max_abs_err"] == 0.0
    assert 0.995 <= recs["attncomm fp8"]["min_cos"] < 1
    assert recs["diffusers_cp"]["min_cos"] > 0.99999
    assert all(r["time_us"] > 0 for r in recs.values())
    if not torch.cuda.is_available():
        assert "ZeroDivisionError" in result["diffusers_cp_note"]
    md = (tmp_path / "m.md").read_text()
    assert "attncomm vs diffusers' context parallelism" in md and "| diffusers_cp |" in md
