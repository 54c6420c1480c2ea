"""The layer budget from a trace (bench/ulysses_timeline.py) on synthetic GPU timelines."""
from __future__ import annotations

import json

from attncomm.bench import ulysses_timeline as timeline
from attncomm.bench.ulysses_timeline import GpuEvent


def _ev(name, a, b, kind, corr=-1, stream=7):
    return GpuEvent(name, a, b, stream, kind, corr)


def test_budget_adds_up():
    # compute [0, 10) and [12, 20); exchange [5, 14) (hidden but for [10, 12)) and [21, 23)
    evs = [_ev("flash", 0, 10, "compute"), _ev("Memcpy PtoP", 5, 14, "exchange"),
           _ev("flash", 12, 20, "compute"), _ev("ncclKernel", 21, 23, "exchange")]
    b = timeline.budget(evs)
    assert b == {"wall_us": 23, "compute_us": 18, "exposed_exchange_us": 4, "idle_us": 1,
                 "exchange_us": 11}
    assert timeline.budget(evs, layers=2)["wall_us"] == 11.5
    assert timeline.gaps(evs) == [(10, 2)]
    assert "23.00" not in timeline.format_budget(b) and "0.02 = 0.02" in timeline.format_budget(b)


def test_interval_algebra():
    assert timeline.union([(3, 4), (0, 2), (1, 3), (5, 5)]) == [(0, 4)]
    assert timeline.subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert timeline.subtract([(0, 1), (4, 6)], []) == [(0, 1), (4, 6)]


def test_classify_and_load(tmp_path):
    assert timeline.classify("ncclDevKernel_SendRecv", "kernel") == "exchange"
    assert timeline.classify("wait_kernel", "kernel") == "exchange"
    assert timeline.classify("Memcpy DtoH (Device -> Pinned)", "gpu_memcpy") == "exchange"
    assert timeline.classify("flash_fwd_kernel", "kernel") == "compute"
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "fill_kernel", "ts": 100, "dur": 5,
         "args": {"stream": 7, "correlation": 1}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 103, "dur": 10,
         "args": {"stream": 9, "correlation": 2}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 50, "dur": 4,
         "args": {"correlation": 1}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 60, "dur": 2,
         "args": {"correlation": 2}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1, "dur": 2}]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    gpu, host = timeline.load_trace(str(path))
    assert [e.kind for e in gpu] == ["compute", "exchange"] and len(host) == 2
    lead = timeline.host_lead_us(gpu, host)
    assert lead["enqueue_done_us"] == 62 and lead["gpu_done_us"] == 113
    assert lead["lead_us"] == 51 and lead["median_launch_lead_us"] == 46
