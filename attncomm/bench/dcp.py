"""``attncomm bench dcp``: latency of every DCP merge backend, eager and in CUDA graphs.

Default geometry is Kimi-K2.5's attention (64 heads, head_dim 512, bf16) at decode token counts
1/8/16/32/64/128. Graph mode captures 10 consecutive merges per graph (as an engine's graph holds
every layer) and reports replay time / 10; replays are enqueued back to back (no host sync in
between, as an engine replays them) and each is timed with CUDA events. ``graph-interleaved``
(on request) puts a small kernel that rewrites the input before every merge, as attention sits
between merges in an engine; it times kernel + merge. Graph records carry ``gpu_idle_us``, the
median time the GPU sat between replays, per call (slowest rank); a figure whose idle time
exceeds the run's smallest (the GPU's own launch gap) by ≥ 10 % of it is marked host-bound.
Eager mode times each call after a group barrier. 10 warm-up + 100 timed iterations;
``latency_us`` is the median over iterations of the slowest rank. The table gives each
backend's speedup over the best NCCL (on CPU ranks: gloo) backend of the same run.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group
from .common import (format_rows, graph_mode_skipped, latency_record, markdown_lines,
                     meta, plot_series, print_table, progress, run_ranks,
                     time_eager, time_graph)
from .report import Report, add_common_arguments, emit, usage_error
from . import dcp_gather as bench_gather
from ..dcp.lse_merge import DcpMerger
from ..dcp.lse_merge import BACKENDS

__all__ = ["add_arguments", "main", "run_rank"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_COLLECTIVE = ("ag_rs", "a2a")  # the "NCCL backends" the speedup compares against


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, backends=BACKENDS,
                         default_backends="reference ag_rs a2a, + symm_a2a on CUDA")
    p.add_argument("--heads", type=int, default=64, help="total heads H (default 64)")
    p.add_argument("--op", choices=("merge", "gather", "layer"), default="merge",
                   help="merge (default): the LSE merge; gather: the query-head all-gather "
                        "(attncomm.bench.dcp_gather); layer: gather + merge per decode step")
    p.add_argument("--head-dim", type=int, default=None,
                   help="head_dim D (default 512; --op gather/layer: 576, Kimi-K2.5's q)")
    p.add_argument("--rope-dim", type=int, default=64,
                   help="--op gather/layer: RoPE dims R at the end of each head (default 64)")
    p.add_argument("--v-head-dim", type=int, default=512,
                   help="--op layer: head_dim Dv of the merged attention output (default 512)")
    p.add_argument("--gather-backends", nargs="+", default=None,
                   choices=["all_gather", "symm", "auto"],
                   help="--op gather: default all_gather (+ symm on CUDA)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16", help="default bf16")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128],
                   help="token counts T ≥ 1 (default 1 8 16 32 64 128)")
    p.add_argument("--modes", nargs="+", choices=("eager", "graph", "graph-interleaved"),
                   default=None,
                   help="default: eager graph on CUDA, eager on CPU; graph-interleaved: a small "
                        "kernel that rewrites the input (out *= 1) before every merge in the "
                        "graph, as attention sits between merges in an engine (times kernel + "
                        "merge)")
    p.add_argument("--warmup", type=int, default=10, help="untimed iterations (default 10)")
    p.add_argument("--iters", type=int, default=100,
                   help="timed iterations; the median counts (default 100)")
    p.add_argument("--per-graph", type=int, default=10,
                   help="merges captured per graph (default 10)")


def _config(args) -> dict:
    device = args.device
    backends = args.backends or (["reference", "ag_rs", "a2a"]
                                 + (["symm_a2a"] if device == "cuda" else []))
    modes = args.modes or (["eager", "graph"] if device == "cuda" else ["eager"])
    if device == "cpu" and any(m.startswith("graph") for m in modes):
        raise ValueError(f"--modes {' '.join(modes)}: graph modes need --device cuda")
    if args.heads % args.world_size:
        raise ValueError(f"--heads {args.heads} is not divisible by --world-size "
                         f"{args.world_size}")
    return dict(device=device, backends=list(backends), modes=list(modes), heads=args.heads,
                head_dim=args.head_dim, dtype=args.dtype, tokens=sorted(set(args.tokens)),
                warmup=args.warmup, iters=args.iters, per_graph=args.per_graph,
                progress=not args.no_progress)


def _graph_times(fn, cfg, barrier, stats) -> list[float]:
    """``per_graph`` merges captured in one graph; back-to-back event-timed replays (µs/call);
    ``stats["gpu_idle_us"]``: the GPU's median wait between replays, per call."""
    return time_graph(fn, per_graph=cfg["per_graph"], warmup=cfg["warmup"], iters=cfg["iters"],
                      barrier=barrier, back_to_back=True, stats=stats)


def _eager_times(fn, cfg, barrier) -> list[float]:
    return time_eager(fn, warmup=cfg["warmup"], iters=cfg["iters"], device=cfg["device"],
                      barrier=barrier)


def host_bound(record: dict, records: list[dict]) -> bool:
    """Whether a graph-mode record's GPU idle time between replays (``gpu_idle_us``, slowest
    rank) exceeds the smallest of the run (``records``: the GPU's own launch gap between
    graphs, about 3 µs per replay on H200) by ≥ 10 % of its latency: then a rank's GPU waited
    for its host, and the figure measures that host, not the merge alone."""
    idle = record.get("gpu_idle_us")
    if idle is None:
        return False
    base = min(r["gpu_idle_us"] for r in records if r.get("gpu_idle_us") is not None)
    return idle - base >= 0.1 * record["latency_us"]


def _inputs(T, H, D, dtype, device, rank):
    gen = torch.Generator(device=device).manual_seed(17 + rank)
    out = torch.randn((T, H, D), generator=gen, device=device).to(dtype)
    lse = torch.randn((T, H), generator=gen, device=device) * 2
    return out, lse


def run_rank(rank: int, world_size: int, cfg: dict) -> list[dict] | None:
    """Every rank: build each backend's merger, time every (tokens, mode); rank 0 returns the
    records (slowest-rank medians), the others None."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    dtype = _DTYPES[cfg["dtype"]]
    H, D = cfg["heads"], cfg["head_dim"]
    g = cpu_group()

    def barrier():
        dist.barrier(group=g)

    total = len(cfg["backends"]) * len(cfg["tokens"]) * len(cfg["modes"])
    bar = progress(total, "bench dcp", enabled=cfg["progress"] and rank == 0)
    records = []
    for backend in cfg["backends"]:
        try:
            merger = DcpMerger(max_tokens=max(cfg["tokens"]), num_heads=H, head_dim=D,
                               dtype=dtype, backend=backend)
        except ValueError as exc:  # same on every rank: skip the backend everywhere
            if rank == 0:
                print(f"bench dcp: skipping {backend}: {exc}", flush=True)
            bar.update(len(cfg["tokens"]) * len(cfg["modes"]))
            continue
        for T in cfg["tokens"]:
            out, lse = _inputs(T, H, D, dtype, device, rank)
            for mode in cfg["modes"]:
                if graph_mode_skipped("bench dcp", backend, mode, out, bar,
                                      say=rank == 0 and T == cfg["tokens"][0]):
                    continue
                if mode == "graph-interleaved":
                    def fn(out=out, lse=lse, merger=merger):  # the producer, then the merge
                        out.mul_(1.0)
                        return merger(out, lse)
                else:
                    fn = (lambda: merger(out, lse))  # noqa: E731 - the timed call
                stats: dict = {}
                graph = mode.startswith("graph")
                times = (_graph_times(fn, cfg, barrier, stats) if graph
                         else _eager_times(fn, cfg, barrier))
                if graph:
                    merger.check()
                records.append(latency_record(times, stats, backend=backend, mode=mode,
                                              tokens=T, world_size=world_size))
                bar.update(1)
        merger = fn = None  # free its workspace before the next backend's
    bar.close()
    return records if rank == 0 else None


def add_speedups(records: list[dict]) -> list[dict]:
    """Each record with ``speedup`` = best collective backend's latency / its latency (same
    mode and tokens); None when no collective backend ran."""
    best: dict = {}
    for r in records:
        if r["backend"] in _COLLECTIVE:
            k = (r["mode"], r["tokens"])
            best[k] = min(best.get(k, float("inf")), r["latency_us"])
    out = []
    for r in records:
        b = best.get((r["mode"], r["tokens"]))
        out.append(dict(r, speedup=round(b / r["latency_us"], 2) if b and r["latency_us"] > 0
                        else None))
    return out


def markdown_table(records: list[dict]) -> str:
    """Pivot: one row per (mode, tokens), one column per backend (µs), plus symm_a2a's
    speedup over the best collective backend. A host-bound figure (``host_bound``) is marked
    with ``ʰ`` and a note under the table."""
    backends = list(dict.fromkeys(r["backend"] for r in records))
    keyed = {(r["mode"], r["tokens"], r["backend"]): r for r in add_speedups(records)}
    keys = [(mode, T) for mode in dict.fromkeys(r["mode"] for r in records)
            for T in sorted({r["tokens"] for r in records if r["mode"] == mode})]
    rows = format_rows([[mode, T, *((keyed.get((mode, T, b)) or {}).get("latency_us")
                                    for b in backends),
                         (keyed.get((mode, T, "symm_a2a")) or {}).get("speedup")]
                        for mode, T in keys])
    for row, (mode, T) in zip(rows, keys):  # mark the host-bound figures
        for i, b in enumerate(backends):
            r = keyed.get((mode, T, b))
            if r and host_bound(r, records):
                row[2 + i] += "ʰ"
    lines = markdown_lines(["mode", "tokens", *(f"{b} (µs)" for b in backends),
                            "symm_a2a speedup vs best NCCL (×)"], rows)
    if any(host_bound(r, records) for r in records):
        lines.append("\nʰ host-bound: between graph replays a rank's GPU sat idle longer than "
                     "the run's smallest gap by ≥ 10 % of this time (`gpu_idle_us` in the JSON), "
                     "waiting for its host; the merge itself is faster than shown.")
    return "\n".join(lines)


def main(args) -> int:
    config.force_safe_env()

    if min(args.tokens) < 1:
        print(f"attncomm bench dcp: --tokens must be ≥ 1, got {args.tokens}", file=sys.stderr)
        return 2
    op = getattr(args, "op", "merge")
    if getattr(args, "head_dim", None) is None:
        args.head_dim = 512 if op == "merge" else 576
    if op != "merge":
        return bench_gather.main(args)
    try:
        cfg = _config(args)
    except ValueError as exc:
        return usage_error("dcp", str(exc))
    t0 = time.monotonic()
    results = run_ranks(run_rank, args.world_size, cfg["device"], (cfg,))
    records = results[0] or []
    rows = add_speedups(records)
    print_table(rows, ["backend", "mode", "tokens", "world_size", "latency_us", "speedup",
                       "gpu_idle_us"],
                title=f"DCP merge, W={args.world_size}, H={cfg['heads']}, D={cfg['head_dim']}, "
                      f"{cfg['dtype']} (speedup: best of {'/'.join(_COLLECTIVE)} ÷ this; "
                      f"gpu_idle_us: GPU wait between graph replays, per call)")
    slow = [f"{r['backend']} {r['mode']} {r['tokens']}" for r in records
            if host_bound(r, records)]
    if slow:
        print(f"warning: host-bound graph figures (the GPU waited for a host): "
              f"{', '.join(slow)}", file=sys.stderr)
    print(f"({time.monotonic() - t0:.1f} s)")
    emit(args, _report(args, cfg, records))
    if not records:
        print("attncomm bench dcp: no backend could run here (see the messages above)",
              file=sys.stderr)
        return 1
    return 0


def _report(args, cfg: dict, records: list[dict]) -> Report:
    """The JSON meta and records, the Markdown page and the latency-vs-tokens plot."""
    symm = config.overrides("ATTNCOMM_SYMM_")  # the symm_a2a knobs set in the environment
    m = meta(cfg["device"], args.world_size, heads=cfg["heads"], head_dim=cfg["head_dim"],
             dtype=cfg["dtype"], warmup=cfg["warmup"], iters=cfg["iters"],
             per_graph=cfg["per_graph"], symm_settings=symm)
    if cfg["device"] == "cuda":
        m = _gpu_meta(m)
    page = (f"# DCP merge — {m['date']}, {m.get('machine') or m['host']}\n\n"
            f"W={args.world_size}, H={cfg['heads']}, D={cfg['head_dim']}, {cfg['dtype']}; "
            f"GPU {m['gpu']}; torch {m['torch']}, Triton {m['triton']}, CUDA "
            f"{m['cuda']}, NCCL {m['nccl']}. {cfg['warmup']} warm-up + {cfg['iters']} "
            f"timed iterations, slowest-rank median; graph mode: {cfg['per_graph']} "
            f"merges per graph, replay / {cfg['per_graph']}. symm_a2a settings "
            f"(environment): {symm or 'defaults'}.\n\n"
            + markdown_table(records) + "\n")
    series = plot_series(records, lambda r: f"{r['backend']} ({r['mode']})", "tokens",
                         "latency_us")
    plot = dict(series=series, xlabel="tokens", ylabel="latency (µs, slowest rank)",
                title=f"DCP merge W={args.world_size}, H={cfg['heads']}, D={cfg['head_dim']}, "
                      f"{cfg['dtype']}", logx=True, logy=True)
    return Report(meta=m, records=records, markdown=page, plot=plot)


def _gpu_meta(m: dict) -> dict:
    # meta() reads the GPU name only when CUDA is initialised in this (parent) process.
    if m.get("gpu") is None and torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    return m
