"""Shared benchmark plumbing: slowest-rank medians, tables, JSON, plots, and the run's metadata.
Each exchange's bench module builds on these. The timers (eager and CUDA graph) live in
``attncomm._timing`` (``DcpMerger``'s ``auto`` times with them too) and are re-exported here."""
from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _triton, config
from .._dist import cpu_group
from .._timing import time_eager, time_graph

__all__ = ["meta", "time_eager", "time_graph", "max_over_ranks", "slowest_rank_median",
           "print_table", "write_json", "plot_lines", "progress"]


def meta(device: str, world_size: int, **extra) -> dict:
    """The ``meta`` block of a benchmark JSON: gpu, world size, versions, date, host."""
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
    }
    out.update(extra)
    return out


def max_over_ranks(values: Sequence[float], group=None) -> list[float]:
    """Element-wise max of ``values`` over the ranks of ``group`` (through its gloo twin)."""
    t = torch.tensor(list(values), dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
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
