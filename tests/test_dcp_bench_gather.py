"""``attncomm bench dcp --op gather|layer`` on gloo CPU ranks at small sizes: the records, the
speedups, the table, and the command end to end (JSON, Markdown, plot)."""
from __future__ import annotations

import json

import pytest

from attncomm.bench.dcp_gather import add_speedups, markdown_table, run_rank


def _cfg(op, **kw):
    cfg = dict(op=op, device="cpu", backends=["all_gather"] if op == "gather" else
               ["all_gather+ag_rs", "all_gather+a2a"], modes=["eager"], heads=4, head_dim=12,
               v_head_dim=8, rope_dim=4, dtype="bf16", tokens=[1, 3], warmup=1, iters=3,
               per_graph=2, progress=False)
    cfg.update(kw)
    return cfg


@pytest.mark.parametrize("op", ["gather", "layer"])
def test_bench_records_on_cpu_ranks(pools, op):
    res = pools.run(2, run_rank, _cfg(op))
    assert res[1] is None
    records = res[0]
    names = _cfg(op)["backends"]
    assert {(r["backend"], r["tokens"]) for r in records} == {(b, t) for b in names
                                                              for t in (1, 3)}
    assert all(r["latency_us"] > 0 and r["op"] == op for r in records)
    rows = add_speedups(records)
    assert all(r["speedup"] is not None and r["speedup"] <= 1.0 + 1e-9 for r in rows)
    table = markdown_table(records)
    assert "| eager | 3 |" in table and ("symm speedup" in table or "symm+symm_a2a" in table)


def test_bench_symm_skipped_on_cpu(pools):
    res = pools.run(2, run_rank, _cfg("gather", backends=["all_gather", "symm"], tokens=[2]))
    assert {r["backend"] for r in res[0]} == {"all_gather"}


def test_bench_command_layer(tmp_path, capsys):
    from attncomm.cli import main
    out = tmp_path / "layer.json"
    md = tmp_path / "layer.md"
    png = tmp_path / "layer.png"
    rc = main(["bench", "dcp", "--op", "layer", "--device", "cpu", "--world-size", "2",
               "--heads", "4", "--head-dim", "12", "--rope-dim", "4", "--v-head-dim", "8",
               "--tokens", "1", "2", "--warmup", "1", "--iters", "3", "--no-progress",
               "--json", str(out), "--markdown", str(md), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["op"] == "layer" and len(data["records"]) == 4
    assert "gather + merge" in md.read_text() and png.stat().st_size > 0
    assert "all_gather+a2a" in capsys.readouterr().out
    assert main(["bench", "dcp", "--op", "gather", "--device", "cpu", "--rope-dim", "3",
                 "--heads", "4", "--head-dim", "12", "--tokens", "1"]) == 2
