"""Shared benchmark plumbing: timing (eager and CUDA graph), slowest-rank medians, tables, JSON,
plots, and the run's metadata. Each exchange's bench module builds on these."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

__all__ = ["meta", "time_eager", "time_graph", "max_over_ranks", "slowest_rank_median",
           "print_table", "write_json", "plot_lines", "progress"]


def meta(device: str, world_size: int, **extra) -> dict:
    """The ``meta`` block of a benchmark JSON: gpu, world size, versions, date, host."""
    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    try:
        import triton
        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - triton is optional on CPU
        triton_version = None
    out = {
        "gpu": gpu,
        "device": device,
        "world_size": world_size,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "machine": os.environ.get("ATTNCOMM_MACHINE"),
    }
    out.update(extra)
    return out


def time_eager(fn: Callable[[], object], *, warmup: int = 10, iters: int = 100,
               device: str = "cuda", barrier: Callable[[], None] | None = None) -> list[float]:
    """Per-iteration times of ``fn()`` in µs. On CUDA each iteration is timed with events and
    preceded by ``barrier`` (e.g. a group barrier) so ranks start together."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            if barrier is not None:
                barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def time_graph(fn: Callable[[], object], *, per_graph: int = 10, warmup: int = 10,
               iters: int = 100, barrier: Callable[[], None] | None = None,
               back_to_back: bool = False, stats: dict | None = None) -> list[float]:
    """Capture ``per_graph`` consecutive calls of ``fn`` in one CUDA graph (as an engine's graph
    holds every layer) and return replay time / ``per_graph`` per iteration, in µs.

    ``back_to_back=False``: ``barrier`` before every timed replay (ranks start each replay
    together; for transfers long next to a barrier). ``True``: one ``barrier``, then the replays
    run back to back, each between its own events (for µs-scale work, where a per-replay barrier
    would dominate; ranks stay in step through the exchange itself). There, ``stats`` (a dict,
    if given) receives ``gpu_idle_us``: the median time the GPU sat between one replay's end
    event and the next one's start event, per call. Enqueued ahead, the next replay follows at
    once; a gap means the GPU waited for the host, and the times then measure the host (across
    ranks, the slowest rank's host), not the work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    if not back_to_back:
        times = time_eager(graph.replay, warmup=warmup, iters=iters, device="cuda",
                           barrier=barrier)
        return [t / per_graph for t in times]
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    if stats is not None and len(events) > 1:
        gaps = [e.elapsed_time(s) * 1e3 for (_, e), (s, _) in zip(events, events[1:])]
        stats["gpu_idle_us"] = statistics.median(gaps) / per_graph
    return [s.elapsed_time(e) * 1e3 / per_graph for s, e in events]


def max_over_ranks(values: Sequence[float], group=None) -> list[float]:
    """Element-wise max of ``values`` over the ranks of ``group`` (through its gloo twin)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        from .. import cpu_group
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group(group))
    return t.tolist()


def slowest_rank_median(times_us: Sequence[float], group=None) -> float:
    """Median over iterations of the slowest rank's time (max over ranks per iteration)."""
    return float(statistics.median(max_over_ranks(times_us, group)))


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None,
                fmt: dict | None = None) -> str:
    """Print (and return) a plain-text table of ``rows`` (dicts) over ``columns``."""
    fmt = fmt or {}

    def cell(row, col):
        v = row.get(col, "")
        if v is None:
            return "-"
        if col in fmt:
            return fmt[col].format(v)
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    body = [[cell(r, c) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for b in body:
        lines.append("  ".join(x.rjust(w) for x, w in zip(b, widths)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(path: str, meta_block: dict, records: Sequence[dict], key: str = "records") -> None:
    """Write ``{"meta": meta_block, key: records}`` to ``path`` (folders created)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta_block, key: list(records)}, f, indent=2)
        f.write("\n")


def plot_lines(path: str, series: dict[str, tuple[Sequence[float], Sequence[float]]], *,
               xlabel: str, ylabel: str, title: str, logx: bool = False,
               logy: bool = False) -> None:
    """One line per series name ``{name: (xs, ys)}``, saved as a PNG at ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def progress(total: int, desc: str, enabled: bool = True):
    """A tqdm progress bar on stderr (a no-op object when ``enabled`` is False)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, leave=False, dynamic_ncols=True)
