"""``attncomm bench overhead``: the CPU smoke run (gloo ranks, host µs only) writes every row of
issue 20 with the JSON schema, a CUDA-only row says so on CPU, ``--device cuda`` without a GPU
is a clear usage error, and the units, targets and Markdown come from the records."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from attncomm import cli
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
        assert r["world_size"] == 1 and r["shape"] and r["units"] > 0, r
    assert rows["UlyssesAttention.sequential"]["baseline_host_us"] > 0
    assert "| dcp.merge | out [4, 8, 16] fp32 |" in md.read_text()


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
