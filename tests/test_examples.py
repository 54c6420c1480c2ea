"""The worked examples run as their docstrings say: ``examples/dcp_merge_torchrun.py`` under
torchrun (``python -m torch.distributed.run``), two gloo ranks on CPU, prints its PASS line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_dcp_merge_under_torchrun_on_gloo():
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         os.path.join(ROOT, "examples", "dcp_merge_torchrun.py"), "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)  # ~20 s
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "dcp_merge_torchrun: PASS: W=2 on cpu (gloo)" in proc.stdout, out[-4000:]
