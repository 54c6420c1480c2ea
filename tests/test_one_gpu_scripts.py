"""The one-GPU simulators (scripts/dcp_one_gpu.py, scripts/dcp_gather_one_gpu.py) run end to end
as a dry run on CPU under the Triton interpreter (one rank, so no rank waits for another):
their harness, the kernels' launch through the wrappers, the checks, the records and the dumps
(a device call should not be the first run of a changed script)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # interpreter runs in subprocesses

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, args: list[str], tmp_path) -> tuple[dict, dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    js, dump = tmp_path / f"{script}.json", tmp_path / f"{script}.pt"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args,
                           "--json", str(js), "--dump", str(dump)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(js.read_text()), torch.load(dump)


def test_merge_simulator_dry_run(tmp_path):
    out, dump = _run("dcp_one_gpu.py", ["--world-size", "1", "--heads", "2", "--head-dim",
                                        "16", "--tokens", "1", "3"], tmp_path)
    assert [r["tokens"] for r in out["records"]] == [1, 3]
    assert all(r["max_err"] == 0 and r["host_us"] > 0 for r in out["records"])
    assert sorted(dump) == sorted(f"T{t}/{m}/r0/{k}" for t in (1, 3)
                                  for m in ("eager", "graph") for k in ("res", "lse"))


def test_gather_simulator_dry_run(tmp_path):
    out, dump = _run("dcp_gather_one_gpu.py", ["--world-size", "1", "--heads", "2",
                                               "--head-dim", "16", "--rope-dim", "4",
                                               "--tokens", "2", "--replays", "1"], tmp_path)
    assert [(r["tokens"], r["ordered"]) for r in out["records"]] == [(2, False), (2, True)]
    assert len(dump) == 4 and all(t.shape == (2, 2, 16) for t in dump.values())
