"""``attncomm bench dp-sync``: per-step DP-attention sync latency per sync path, and
dp_gather / dp_scatter / dp_reduce_scatter time per padding mode over token counts.

Sync: ``sync_us`` is ``MLPSyncBatchInfo.all_gather``, the whole call a scheduler makes each
step (six int64 per rank, one exchange, the checks and the min/max/TBO reduction);
``exchange_us`` is the transport alone (``exchange_rows``), a part of it. Both run back to back
in blocks of ``--block`` steps, their blocks alternating so that both see the same machine; the
per-step time of a block is block time / block size (steady state: each step needs every rank's
row, so this is the rate at which ranks can agree), median over blocks of the slowest rank. The
difference is the call's own work (a few µs); where the transport varies by more than that (gloo
on a busy host), ``exchange_us`` can come out above ``sync_us``. ``--hosts H`` makes consecutive
ranks act as H hosts (CPU only, through the test-only ``ATTNCOMM_TEST_HOST``): ``shm`` cannot
run there, ``hier`` (shared memory inside each host, gloo between host leaders) and ``cpu``
(gloo over every rank) can. Gathers: eager, every DP rank holding ``tokens`` rows of
``[hidden]`` (balanced, so MAX_LEN has no padding), median over iterations of the slowest rank
(CUDA events on GPU).
JSON: ``{"meta": {...}, "records": [{"sync", "world_size", "hosts", "sync_us", "exchange_us"},
{"op", "mode", "tokens", "world_size", "time_us"}, ...]}``.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group
from .common import (markdown_lines, meta, plot_series, print_table, progress, run_ranks,
                     slowest_rank_median, time_eager)
from .report import Report, add_common_arguments, command_options, emit, usage_error
from ..dp_attention.gather import (DpPaddingMode, dp_gather, dp_reduce_scatter, dp_scatter,
                                   global_layout)
from ..dp_attention.sync import MLPSyncBatchInfo, exchange_rows, resolve_sync

__all__ = ["add_arguments", "main", "run_rank", "markdown_tables", "with_speedups"]

_SYNCS = ("shm", "hier", "cpu", "device")
_DEFAULT_SYNCS = ("shm", "cpu", "device")  # one host; on several: hier, cpu, device
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --backends: the sync paths (--syncs, its older name, still works)
    add_common_arguments(p, backends=_SYNCS, default_backends=" ".join(_DEFAULT_SYNCS) + \
                         " (with --hosts > 1: hier cpu device)", aliases=("--syncs",))
    p.add_argument("--hosts", type=int, default=1,
                   help="consecutive ranks act as this many hosts (CPU; default 1)")
    p.add_argument("--steps", type=int, default=2000,
                   help="sync steps timed per path (default 2000)")
    p.add_argument("--block", type=int, default=50,
                   help="sync steps per timed block (default 50)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default="bf16",
                   help="gather payload dtype (default bf16)")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="tokens per DP rank (default 1 8 32 128 512 2048; CPU: 1 16 128)")
    p.add_argument("--ops", nargs="+", choices=("dp_gather", "dp_scatter", "dp_reduce_scatter"),
                   default=["dp_gather", "dp_scatter", "dp_reduce_scatter"],
                   help="gather ops to time, space separated (default: all three)")
    p.add_argument("--warmup", type=int, default=5,
                   help="untimed gather iterations (default 5)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed gather iterations (default 50; CPU 10)")


def _config(args) -> dict:
    cpu = args.device == "cpu"
    hosts = getattr(args, "hosts", 1)
    default = _DEFAULT_SYNCS if hosts == 1 else ("hier", "cpu", "device")
    cfg = dict(device=args.device, syncs=list(args.backends or default), steps=args.steps,
               hosts=hosts,
               block=args.block, hidden=args.hidden, dtype=args.dtype, ops=list(args.ops),
               warmup=args.warmup,
               tokens=list(args.tokens or ([1, 16, 128] if cpu else [1, 8, 32, 128, 512, 2048])),
               iters=args.iters or (10 if cpu else 50), progress=not args.no_progress)
    bad = [f"{k} must be ≥ 1, got {cfg[k]}" for k in ("steps", "block", "hidden", "iters")
           if cfg[k] < 1]
    bad += [f"--tokens must be ≥ 1, got {t}" for t in cfg["tokens"] if t < 1]
    if args.world_size < 1:
        bad.append(f"--world-size must be ≥ 1, got {args.world_size}")
    if not 1 <= hosts <= max(1, args.world_size):
        bad.append(f"--hosts must be in [1, --world-size], got {hosts}")
    if hosts > 1 and args.device != "cpu":
        bad.append("--hosts > 1 simulates hosts on CPU ranks only (--device cpu)")
    if hosts > 1 and "shm" in cfg["syncs"]:
        bad.append("shm cannot run on ranks of several hosts (--hosts > 1): leave it out")
    if bad:
        raise ValueError("; ".join(bad))
    return cfg


def _per_step(fns: dict, cfg: dict, cg) -> dict:
    """``{name: µs per step}`` for each function of ``fns``: median over blocks (slowest rank)
    of block time / block size, the functions' blocks alternating (one of each in turn)."""
    for fn in fns.values():
        for _ in range(max(cfg["block"], 20)):
            fn()
    blocks: dict = {name: [] for name in fns}
    for _ in range(max(1, cfg["steps"] // cfg["block"])):
        for name, fn in fns.items():
            dist.barrier(group=cg)
            t0 = time.perf_counter()
            for _ in range(cfg["block"]):
                fn()
            blocks[name].append((time.perf_counter() - t0) / cfg["block"] * 1e6)
    return {name: slowest_rank_median(b, None) for name, b in blocks.items()}


def _time_sync(path: str, world: int, rank: int, cfg: dict, device, cg) -> dict:
    """``sync_us``: the whole ``MLPSyncBatchInfo.all_gather``; ``exchange_us``: the transport
    alone (``exchange_rows``: rows in, every rank's rows out as ints), timed alike."""
    resolve_sync(path)  # one-time setup (host check, shm segment) outside the timing
    row = [rank + 1, rank + 1, 1, 0, 1, 2]

    def step():
        MLPSyncBatchInfo(world, 1, 1, rank + 1, rank + 1, True, False, True, 2).all_gather(
            device, None, sync=path)

    def exchange():
        exchange_rows(row, None, sync=path, device=device)

    us = _per_step({"sync_us": step, "exchange_us": exchange}, cfg, cg)
    return {"sync": path, "world_size": world, "hosts": cfg["hosts"], **us}


def _time_gathers(world: int, rank: int, cfg: dict, device, cg, bar) -> list[dict]:
    dtype = _DTYPES[cfg["dtype"]]
    cuda = device.type == "cuda"
    def barrier():
        dist.barrier(group=cg)

    out = []
    for tokens in cfg["tokens"]:
        gnt = [tokens] * world
        x = torch.randn(tokens, cfg["hidden"], device=device).to(dtype)
        for mode in DpPaddingMode:
            total, _ = global_layout(gnt, mode)
            buf = torch.randn(total, cfg["hidden"], device=device).to(dtype)
            dst = torch.empty_like(x)
            fns = {"dp_gather": lambda: dp_gather(x, gnt, None, mode=mode, validate=False),
                   "dp_scatter": lambda: dp_scatter(buf, gnt, rank, mode=mode, out=dst),
                   "dp_reduce_scatter": lambda: dp_reduce_scatter(buf, gnt, None, mode=mode,
                                                                  validate=False)}
            for op in cfg["ops"]:
                times = time_eager(fns[op], warmup=cfg["warmup"], iters=cfg["iters"],
                                   device="cuda" if cuda else "cpu", barrier=barrier)
                out.append({"op": op, "mode": mode.name, "tokens": tokens, "world_size": world,
                            "time_us": slowest_rank_median(times, None)})
                bar.update(1)
    return out


def run_rank(rank: int, world: int, cfg: dict) -> list[dict] | None:
    """Every rank: time each sync path, then each gather op; rank 0 returns the records."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    threads = torch.get_num_threads()
    if device.type == "cpu":  # ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cfg["hosts"] > 1:  # before the first host check: the layout is cached per group
        config.set_var("ATTNCOMM_TEST_HOST", f"sim{rank * cfg['hosts'] // world}")
    cg = cpu_group(None)
    total = len(cfg["syncs"]) + len(cfg["tokens"]) * 2 * len(cfg["ops"])
    bar = progress(total, "dp-sync", enabled=cfg["progress"] and rank == 0)
    records = []
    try:
        for path in cfg["syncs"]:
            records.append(_time_sync(path, world, rank, cfg, device, cg))
            bar.update(1)
        records += _time_gathers(world, rank, cfg, device, cg, bar)
    finally:
        bar.close()
        torch.set_num_threads(threads)
    return records if rank == 0 else None


def with_speedups(syncs: list[dict]) -> list[dict]:
    """Sync records plus ``speedup_vs_device`` (device time ÷ this path's time)."""
    dev = next((r["sync_us"] for r in syncs if r["sync"] == "device"), None)
    return [dict(r, speedup_vs_device=round(dev / r["sync_us"], 2) if dev and r["sync_us"] > 0
                 else None) for r in syncs]


def markdown_tables(records: list[dict], cfg: dict, world: int) -> str:
    """The sync table (µs per step, speedup over ``device``) and, per op, one row per token
    count with one column per padding mode (µs)."""
    syncs = with_speedups([r for r in records if "sync" in r])
    hosts = f" as {cfg['hosts']} simulated hosts" if cfg.get("hosts", 1) > 1 else ""
    lines = [f"DP-attention sync per step, W={world}{hosts}, {cfg['device']}: the whole "
             "`MLPSyncBatchInfo.all_gather`, and its transport alone (`exchange_rows`), timed in "
             "alternating blocks", ""]
    lines += markdown_lines(
        ["sync", "µs / step (all_gather)", "µs / step (transport only)", "speedup vs device (×)"],
        [[r["sync"], r["sync_us"], r["exchange_us"], r["speedup_vs_device"]] for r in syncs])
    ops = [r for r in records if "op" in r]
    keyed = {(r["op"], r["mode"], r["tokens"]): r["time_us"] for r in ops}
    modes = list(dict.fromkeys(r["mode"] for r in ops))
    lines += ["", f"gather / scatter / reduce_scatter, hidden {cfg['hidden']} {cfg['dtype']}, "
              f"tokens per DP rank, W={world} (µs)", ""]
    lines += markdown_lines(["op", "tokens", *modes],
                            [[op, t, *(keyed.get((op, m, t)) for m in modes)]
                             for op in dict.fromkeys(r["op"] for r in ops)
                             for t in sorted({r["tokens"] for r in ops if r["op"] == op})])
    return "\n".join(lines) + "\n"


def main(args) -> int:
    """The ``attncomm bench dp-sync`` command (0: done, 2: bad options)."""
    cfg = command_options(args, _config, "bench dp-sync")
    if cfg is None:
        return 2
    if cfg["device"] == "cuda" and torch.cuda.device_count() < args.world_size:
        return usage_error("dp-sync", f"--device cuda with --world-size {args.world_size} "
                                      f"needs {args.world_size} GPUs, found "
                                      f"{torch.cuda.device_count()}")
    load_before = os.getloadavg()
    records = run_ranks(run_rank, args.world_size, cfg["device"], (cfg,))[0]
    syncs = [r for r in records if "sync" in r]
    ops = [r for r in records if "op" in r]
    print_table(with_speedups(syncs), ["sync", "world_size", "sync_us", "exchange_us",
                                       "speedup_vs_device"],
                title=f"\nDP-attention sync per step (µs), {cfg['device']}, W={args.world_size} "
                      f"(sync_us: the whole MLPSyncBatchInfo.all_gather; exchange_us: its "
                      f"transport alone; alternating blocks)")
    print_table(ops, ["op", "mode", "tokens", "world_size", "time_us"],
                title=f"\ngather / scatter / reduce_scatter (µs), hidden {cfg['hidden']} "
                      f"{cfg['dtype']}, tokens per DP rank")
    m = meta(cfg["device"], args.world_size, bench="dp-sync", hosts=cfg["hosts"],
             hidden=cfg["hidden"],
             dtype=cfg["dtype"], steps=cfg["steps"], block=cfg["block"],
             iters=cfg["iters"], tokens_are="per DP rank (balanced)",
             sync_measures="sync_us: MLPSyncBatchInfo.all_gather per step, back to back; "
                           "exchange_us: its transport (exchange_rows) alone; the two in "
                           "alternating blocks",
             cpu_count=os.cpu_count(),
             load_average={"before": list(load_before), "after": list(os.getloadavg())})
    series = plot_series(ops, lambda r: f"{r['op']} ({r['mode']})", "tokens", "time_us")
    plot = dict(series=series, xlabel="tokens per DP rank", ylabel="time (µs, slowest rank)",
                title=f"dp_gather / scatter / reduce_scatter, W={args.world_size}, "
                      f"hidden {cfg['hidden']} {cfg['dtype']}", logx=True, logy=True)
    emit(args, Report(meta=m, records=records,
                      markdown=markdown_tables(records, cfg, args.world_size), plot=plot))
    return 0
