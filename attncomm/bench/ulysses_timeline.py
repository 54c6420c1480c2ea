"""A layer's GPU timeline from a torch.profiler trace: the per-layer budget (wall = compute union +
exposed exchange + idle), the idle gaps between compute kernels, and how far the host ran ahead.

Used by ``attncomm bench ulysses --layer --trace DIR`` and ``scripts/ulysses_one_gpu.py``. The
trace is the Chrome JSON that ``torch.profiler.profile.export_chrome_trace`` writes; GPU work is
its ``kernel``, ``gpu_memcpy`` and ``gpu_memset`` events, host work its ``cuda_runtime`` events.

Classification (by event, never by a backend's name): copies (``gpu_memcpy``), NCCL kernels and
the ``ce`` transport's flag kernels are *exchange*; every other kernel is *compute*. Budget over
a window of ``n`` layers, per layer::

    wall     = (last GPU event end − first GPU event start) / n
    compute  = |union of compute intervals| / n
    exposed  = |union of exchange intervals − compute union| / n
    idle     = wall − compute − exposed
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable, Sequence

__all__ = ["GpuEvent", "load_trace", "classify", "union", "subtract", "budget", "gaps",
           "host_lead_us", "format_budget"]

_EXCHANGE_KERNELS = re.compile(r"nccl|signal_kernel|wait_kernel", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class GpuEvent:
    """One GPU interval: ``name``, ``start``/``end`` in µs, ``stream``, ``kind`` ("compute" or
    "exchange"), ``correlation`` (links it to the host call that enqueued it; −1 unknown)."""

    name: str
    start: float
    end: float
    stream: int
    kind: str
    correlation: int = -1


def classify(name: str, category: str) -> str:
    """``"exchange"`` for copies, NCCL and flag kernels, else ``"compute"``."""
    if category == "gpu_memcpy" or _EXCHANGE_KERNELS.search(name):
        return "exchange"
    return "compute"


def load_trace(path: str) -> tuple[list[GpuEvent], list[dict]]:
    """``(GPU events sorted by start, host runtime events)`` of a Chrome trace file."""
    with open(path) as f:
        data = json.load(f)
    events = data.get("traceEvents", data) if isinstance(data, dict) else data
    gpu, host = [], []
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        corr = int(args.get("correlation", -1))
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            start = float(e["ts"])
            gpu.append(GpuEvent(e.get("name", ""), start, start + float(e["dur"]),
                                int(args.get("stream", e.get("tid", 0)) or 0),
                                classify(e.get("name", ""), cat), corr))
        elif cat == "cuda_runtime":
            host.append({"name": e.get("name", ""), "start": float(e["ts"]),
                         "end": float(e["ts"]) + float(e["dur"]), "correlation": corr})
    gpu.sort(key=lambda x: x.start)
    host.sort(key=lambda x: x["start"])
    return gpu, host


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same points."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def subtract(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]):
    """``a − b`` for disjoint sorted interval lists."""
    out, j = [], 0
    for lo, hi in a:
        cur = lo
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < hi:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < hi:
            out.append((cur, hi))
    return out


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def budget(events: Sequence[GpuEvent], layers: int = 1) -> dict:
    """``{"wall_us", "compute_us", "exposed_exchange_us", "idle_us", "exchange_us"}`` per layer
    over ``events`` (a window of ``layers`` layers); see the module docstring."""
    if not events:
        return {"wall_us": 0.0, "compute_us": 0.0, "exposed_exchange_us": 0.0, "idle_us": 0.0,
                "exchange_us": 0.0}
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    comp = union((e.start, e.end) for e in events if e.kind == "compute")
    exch = union((e.start, e.end) for e in events if e.kind == "exchange")
    n = max(1, layers)
    wall, c = (t1 - t0) / n, _length(comp) / n
    exposed = _length(subtract(exch, comp)) / n
    return {"wall_us": wall, "compute_us": c, "exposed_exchange_us": exposed,
            "idle_us": max(0.0, wall - c - exposed), "exchange_us": _length(exch) / n}


def gaps(events: Sequence[GpuEvent], kind: str = "compute") -> list[tuple[float, float]]:
    """The holes ``(start, length µs)`` in the union of ``kind`` events, in time order."""
    u = union((e.start, e.end) for e in events if e.kind == kind)
    return [(u[i][1], u[i + 1][0] - u[i][1]) for i in range(len(u) - 1)]


def host_lead_us(gpu: Sequence[GpuEvent], host: Sequence[dict]) -> dict:
    """How far the host ran ahead: ``enqueue_done_us`` (end of the last host runtime call that
    enqueued GPU work in the window) to ``gpu_done_us`` (end of the last GPU event); the lead
    is their difference (> 0: the host had enqueued everything before the GPU finished), and
    ``median_launch_lead_us`` the median time from a launch call to its kernel's start."""
    if not gpu or not host:
        return {"lead_us": 0.0, "median_launch_lead_us": 0.0}
    by_corr = {h["correlation"]: h for h in host if h["correlation"] >= 0}
    leads = sorted(e.start - by_corr[e.correlation]["end"] for e in gpu
                   if e.correlation in by_corr)
    linked = [by_corr[e.correlation]["end"] for e in gpu if e.correlation in by_corr]
    done = max(linked) if linked else max(h["end"] for h in host)
    gpu_done = max(e.end for e in gpu)
    return {"enqueue_done_us": done, "gpu_done_us": gpu_done, "lead_us": gpu_done - done,
            "median_launch_lead_us": leads[len(leads) // 2] if leads else 0.0}


def format_budget(b: dict) -> str:
    """``wall = compute + exposed exchange + idle`` in ms, as the seed's budget reads."""
    return (f"{b['wall_us'] / 1e3:.2f} = {b['compute_us'] / 1e3:.2f} (compute) + "
            f"{b['exposed_exchange_us'] / 1e3:.2f} (exposed exchange) + "
            f"{b['idle_us'] / 1e3:.2f} (idle) ms per layer; exchange "
            f"{b['exchange_us'] / 1e3:.2f} ms in all")
