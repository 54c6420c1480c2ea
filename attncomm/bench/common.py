"""Shared benchmark plumbing: slowest-rank medians, tables, JSON, plots, and the run's metadata.
Each exchange's bench module builds on these. The timers (eager and CUDA graph) live in
``attncomm._timing`` (``DcpMerger``'s ``auto`` times with them too) and are re-exported here."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _triton, collectives, config
from .._dist import cpu_group
from .._timing import time_eager, time_graph
from ..launch import gpu_placement, launch

__all__ = ["meta", "time_eager", "time_graph", "max_over_ranks", "slowest_rank_median",
           "format_column", "format_rows", "markdown_lines", "print_table", "write_json",
           "plot_lines", "progress", "shared_gpu", "run_ranks", "SHARED_GPU_NOTE",
           "graph_skip_reason", "graph_mode_skipped"]

#: What every time measured on ranks that share a GPU is marked with: their contexts run in
#: time slices, so a wait on a peer costs slices, not NVLink time.
SHARED_GPU_NOTE = "shared GPU: not a speed figure"
#: Set by ``run_ranks`` when the bench's ranks share GPUs; tables, plots and meta say so.
_SHARED = False


def shared_gpu(device: str, world_size: int) -> bool:
    """Whether ``world_size`` CUDA ranks share GPUs here (more ranks than GPUs:
    ``attncomm.launch`` places them round-robin on a gloo group, peers mapped by CUDA IPC)."""
    if device != "cuda" or not torch.cuda.is_available():
        return False
    return len(set(gpu_placement(world_size, torch.cuda.device_count()))) < world_size


#: Backends and transports that exchange through peer-mapped memory, never a collective.
_PEER_MAPPED = ("symm_a2a", "symm", "ce")


def graph_skip_reason(backend: str, tensor: torch.Tensor, group=None) -> str | None:
    """Why ``backend``'s CUDA-graph mode is not timed on this rank (None: it is). A collective
    backend over CUDA ``tensor`` on a gloo ``group`` (ranks that share a GPU) goes through host
    copies, which a graph cannot capture; the peer-mapped ones capture anywhere. The same on
    every rank of a group."""
    if backend in _PEER_MAPPED or not tensor.is_cuda or not collectives.needs_host(group, tensor):
        return None
    return "its collectives go through host copies on a gloo group (ranks share a GPU): no graph"


def graph_mode_skipped(bench: str, backend: str, mode: str, tensor: torch.Tensor, bar, *,
                       say: bool) -> bool:
    """True when ``mode`` is a graph mode ``backend`` is not timed in here
    (``graph_skip_reason``): the progress ``bar`` advances, and the reason is printed when
    ``say`` (the caller's first such case on rank 0)."""
    why = graph_skip_reason(backend, tensor) if mode.startswith("graph") else None
    if why is not None:
        if say:
            print(f"{bench}: {backend} {mode}: skipped ({why})", flush=True)
        bar.update(1)
    return why is not None


def run_ranks(fn, world_size: int, device: str, args: tuple = ()) -> list:
    """``attncomm.launch(fn, world_size, device=device, args=args)`` for a bench: on ranks that
    share a GPU every table, plot and meta block printed after it carries
    ``SHARED_GPU_NOTE``."""
    global _SHARED
    _SHARED = shared_gpu(device, world_size)
    return launch(fn, world_size, device=device, args=args)


def meta(device: str, world_size: int, **extra) -> dict:
    """The ``meta`` block of a benchmark JSON: gpu, world size, versions, date, host, and
    ``shared_gpu`` (``SHARED_GPU_NOTE`` when the ranks shared GPUs, else None)."""
    gpu = None
    if device == "cuda" and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    out = {
        "gpu": gpu,
        "device": device,
        "world_size": world_size,
        "torch": torch.__version__,
        "triton": _triton.VERSION,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpu else None,
        "date": datetime.date.today().isoformat(),
        "host": platform.node(),
        "machine": config.raw("ATTNCOMM_MACHINE") or None,
        "shared_gpu": SHARED_GPU_NOTE if _SHARED or shared_gpu(device, world_size) else None,
    }
    out.update(extra)
    return out


def max_over_ranks(values: Sequence[float], group=None) -> list[float]:
    """Element-wise max of ``values`` over the ranks of ``group`` (through its gloo twin)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=cpu_group(group))
    return t.tolist()


def slowest_rank_median(times_us: Sequence[float], group=None) -> float:
    """Median over iterations of the slowest rank's time (max over ranks per iteration)."""
    return float(statistics.median(max_over_ranks(times_us, group)))


def latency_record(times_us: Sequence[float], stats: dict, **fields) -> dict:
    """A timed row (collective): ``fields``, ``latency_us`` (``slowest_rank_median`` of
    ``times_us``) and, when the graph timer measured it into ``stats``, ``gpu_idle_us`` (the
    slowest rank's)."""
    rec = dict(fields, latency_us=round(slowest_rank_median(times_us), 3))
    if "gpu_idle_us" in stats:
        rec["gpu_idle_us"] = round(max_over_ranks([stats["gpu_idle_us"]])[0], 3)
    return rec


def plot_series(records: Sequence[dict], label, x: str, y: str) -> dict:
    """``{label(r): ([r[x], ...], [r[y], ...])}``: one plotted line per label, the records in
    order."""
    series: dict = {}
    for r in records:
        xs, ys = series.setdefault(label(r), ([], []))
        xs.append(r[x])
        ys.append(r[y])
    return series


#: Significant digits the smallest nonzero number of a column keeps (``format_column``).
SIGNIFICANT = 3
_MAX_DECIMALS = 6  # past this (or from 1e9 up) a column is written in scientific notation


def _decimals_carried(v: float) -> int:
    """Decimals of ``v``'s shortest repr (a figure rounded to 2 decimals carries 2)."""
    text = repr(float(v))
    if "e" in text:  # below 1e-4 or from 1e16 up: more than a column shows in fixed point
        return _MAX_DECIMALS + 1
    return len(text.split(".")[1].rstrip("0"))


def format_column(values: Sequence) -> list[str]:
    """One format for every number of a table column: all ints → as they are; otherwise fixed
    point with the decimals that give the smallest nonzero magnitude ``SIGNIFICANT`` digits
    (no more than the values carry), or scientific notation for the whole column when that
    needs more than 6 decimals or a value reaches 1e9. None → ``-``; bools and strings as they
    are."""
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if all(isinstance(v, int) for v in nums):
        fmt = "{}"
    else:
        mags = [abs(float(v)) for v in nums if math.isfinite(v) and v != 0]
        if not mags:
            fmt = "{:.1f}"
        else:
            decimals = max(0, SIGNIFICANT - 1 - math.floor(math.log10(min(mags))))
            decimals = min(decimals, max(_decimals_carried(v) for v in mags))
            fmt = (f"{{:.{SIGNIFICANT - 1}e}}" if decimals > _MAX_DECIMALS or max(mags) >= 1e9
                   else f"{{:.{decimals}f}}")

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return fmt.format(v)
        return str(v)

    return [cell(v) for v in values]


def format_rows(rows: Sequence[Sequence]) -> list[list[str]]:
    """``rows`` (lists of cells) as strings, each column through ``format_column``."""
    cols = [format_column(col) for col in zip(*rows)] if rows else []
    return [list(r) for r in zip(*cols)] if cols else [[] for _ in rows]


def markdown_lines(header: Sequence[str], rows: Sequence[Sequence]) -> list[str]:
    """The lines of a Markdown table, each column's numbers in one format
    (``format_column``); a cell that is already a string stays as it is."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in format_rows(rows)]
    if _SHARED:
        lines += ["", f"({SHARED_GPU_NOTE}: ranks time-slice one GPU)"]
    return lines


def print_table(rows: Sequence[dict], columns: Sequence[str], title: str | None = None,
                fmt: dict | None = None) -> str:
    """Print (and return) a plain-text table of ``rows`` (dicts) over ``columns``: each
    column's numbers in one format (``format_column``), or ``fmt[column]`` (a ``str.format``
    pattern) where given."""
    fmt = fmt or {}
    cols = []
    for c in columns:
        vals = [r.get(c, "") for r in rows]
        cols.append(["-" if v is None else fmt[c].format(v) for v in vals] if c in fmt
                    else format_column(vals))
    body = [list(b) for b in zip(*cols)] if rows else []
    widths = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    if _SHARED:
        lines.append(f"({SHARED_GPU_NOTE}: ranks time-slice one GPU)")
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
    ax.set_title(title + (f"\n({SHARED_GPU_NOTE})" if _SHARED else ""))
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
