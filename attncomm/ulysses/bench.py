"""``attncomm bench ulysses``: the Ulysses exchange per transport, eager and CUDA graph.

Two geometries:

- ``sweep``: ``seq_to_head`` of ``x [1, S_r, 8·W, 128]`` (bf16 on CUDA) with ``S_r`` chosen so
  each rank sends ``bytes_per_rank`` bytes to its peers, from ``--min-bytes`` to
  ``--max-bytes`` (×2 steps).
- ``dit``: a DiT layer's exchanges — q, k, v ``[1, S/W, 24, 128]`` in (one exchange) and the
  output back (B = 1, S = 32768 on CUDA).

The time is the slowest rank's median per exchange (data landed in the receiver's final
buffer); bus bandwidth = bytes sent to peers per rank / time.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from ..bench import common
from .layout import head_offsets, head_split, head_to_seq_plan, seq_to_head_plan

__all__ = ["add_arguments", "main", "run_rank", "report", "markdown_report"]

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when available")
    p.add_argument("--transports", default="all_to_all,ce",
                   help="comma-separated: all_to_all, ce (default both)")
    p.add_argument("--modes", default="eager,graph", help="eager, graph (graph: CUDA only)")
    p.add_argument("--min-bytes", type=int, default=None,
                   help="smallest bytes sent to peers per rank (default 1 MiB; CPU 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="largest bytes sent to peers per rank (default 1 GiB; CPU 64 KiB)")
    p.add_argument("--dit-seq", type=int, default=None,
                   help="DiT sequence length S (default 32768; CPU 64; 0 skips)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20)")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument("--plot", default=None, help="write a PNG of bus bandwidth here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help="write a Markdown summary (time, bus bandwidth, ce speedup) here")
    p.add_argument("--no-progress", action="store_true")


def _sizes(lo: int, hi: int) -> list[int]:
    out, n = [], lo
    while n <= hi:
        out.append(n)
        n *= 2
    return out


def _sweep_case(world, rank, nbytes, dtype, device):
    heads, d = 8 * world, 128
    item = torch.empty((), dtype=dtype).element_size()
    per_row = (heads - heads // world) * d * item
    s_r = max(1, nbytes // per_row) if world > 1 else max(1, nbytes // (heads * d * item))
    seq = (s_r,) * world
    counts = head_split(heads, world)
    offs = head_offsets(counts)
    plan = seq_to_head_plan(1, seq, d, (tuple((offs[p], offs[p] + counts[p])
                                              for p in range(world)),))
    x = torch.randn(1, s_r, heads, d, device=device).to(dtype)
    sent = sum(plan.numel[rank][p] for p in range(world) if p != rank) * item
    return plan, [x], sent


def _dit_case(world, rank, seq_total, dtype, device):
    heads, d = 24, 128
    seq = tuple(head_split(seq_total, world))  # S split as evenly as it goes
    counts = head_split(heads, world)
    offs = head_offsets(counts)
    rng = tuple((offs[p], offs[p] + counts[p]) for p in range(world))
    plan_in = seq_to_head_plan(1, seq, d, (rng, rng, rng))
    plan_out = head_to_seq_plan(1, seq, d, tuple(counts), tuple(offs), heads)
    qkv = [torch.randn(1, seq[rank], heads, d, device=device).to(dtype) for _ in range(3)]
    o = torch.randn(1, seq_total, counts[rank], d, device=device).to(dtype)
    out = torch.empty(1, seq[rank], heads, d, device=device, dtype=dtype)
    item = torch.empty((), dtype=dtype).element_size()
    sent = sum(plan_in.numel[rank][p] + plan_out.numel[rank][p]
               for p in range(world) if p != rank) * item
    return (plan_in, qkv, plan_out, [o], out), sent


def _transport(name, group, rank, world, device, timeout):
    from .api import _cached, ce_reason
    if name == "ce":
        why = ce_reason(group, device)
        if why:
            return None, why
    return _cached(group, name, device, timeout, rank, world), None


def _exchange_fn(t, plan, parts, dtype, device, out=None):
    def fn():
        ex = t.start(plan, parts, dtype, device, out=out)
        ex.wait()
        ex.release()
    return fn


def _dit_fn(t, case, dtype, device):
    plan_in, qkv, plan_out, o, out = case

    def fn():
        ex = t.start(plan_in, qkv, dtype, device)
        ex.wait()
        ex.release()
        ex2 = t.start(plan_out, o, dtype, device, out=out.view(-1))
        ex2.wait()
        ex2.release()
    return fn


def _prepare(t, plan, dtype):
    if t.name == "ce":
        why = t.start_blocker(plan, dtype)
        if why:
            raise RuntimeError(f"ce cannot run this size: {why}")


def _first_call(t, geometry, case, dtype, device):
    """Allocate what the transport needs, run one exchange eagerly (its result is compared
    across transports) and return ``(timed fn, result)``."""
    if geometry == "sweep":
        plan, parts = case
        _prepare(t, plan, dtype)
        ex = t.start(plan, parts, dtype, device)
        result = ex.wait().clone()
        ex.release()
        return _exchange_fn(t, plan, parts, dtype, device), result
    _prepare(t, case[0], dtype)
    _prepare(t, case[2], dtype)
    fn = _dit_fn(t, case, dtype, device)
    fn()
    return fn, case[4].clone()


def _time(fn, mode, device, iters, cpu_g):
    barrier = (lambda: dist.barrier(group=cpu_g))
    if mode == "graph":
        return common.time_graph(fn, per_graph=10, warmup=3, iters=iters, barrier=barrier)
    return common.time_eager(fn, warmup=3, iters=iters, device=device.type, barrier=barrier)


def run_rank(rank: int, world: int, opts: dict) -> list[dict] | None:
    """Run the benchmark on one rank of an initialised group; rank 0 returns the records."""
    from .. import config
    from ..launch import cpu_group
    device = (torch.device("cuda", torch.cuda.current_device()) if opts["device"] == "cuda"
              else torch.device("cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu" and opts.get("one_thread", True):
        # Ranks share the host's cores: one intra-op thread each avoids oversubscription
        # (a 2-core host otherwise spends 10x longer in strided copies).
        torch.set_num_threads(1)
    cpu_g = cpu_group(None)
    timeout = config.timeout_s(None)
    modes = [m for m in opts["modes"] if m != "graph" or device.type == "cuda"]
    transports, skipped = {}, {}
    for name in opts["transports"]:
        t, why = _transport(name, None, rank, world, device, timeout)
        if t is None:
            skipped[name] = why
        else:
            transports[name] = t
    sizes = _sizes(opts["min_bytes"], opts["max_bytes"])
    work = [("sweep", n) for n in sizes] + ([("dit", opts["dit_seq"])] if opts["dit_seq"] else [])
    bar = common.progress(len(work) * len(transports) * len(modes), "bench ulysses",
                          enabled=rank == 0 and not opts["no_progress"])
    records = []
    for geometry, n in work:
        torch.manual_seed(1234 + n)
        if geometry == "sweep":
            plan, parts, sent = _sweep_case(world, rank, n, dtype, device)
            case = (plan, parts)
        else:
            case, sent = _dit_case(world, rank, n, dtype, device)
        finals = {}
        for name, t in transports.items():
            fn, finals[name] = _first_call(t, geometry, case, dtype, device)
            for mode in modes:
                med = common.slowest_rank_median(_time(fn, mode, device, opts["iters"], cpu_g),
                                                 cpu_g)
                records.append({"transport": name, "mode": mode, "world_size": world,
                                "geometry": geometry, "bytes_per_rank": sent,
                                "time_us": med, "busbw_gbps": sent / med / 1e3 if med else 0.0})
                bar.update(1)
        if len(finals) > 1:  # the transports must agree bit for bit
            vals = list(finals.values())
            flag = torch.tensor([int(all(torch.equal(vals[0], v) for v in vals[1:]))])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_g)
            for rec in records:
                if rec["geometry"] == geometry and rec["bytes_per_rank"] == sent:
                    rec["bitwise_equal"] = bool(flag.item())
    bar.close()
    if rank == 0:
        return {"records": records, "skipped": skipped}
    return None


def _defaults(args) -> dict:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = device == "cpu"
    return {
        "device": device,
        "transports": [x.strip() for x in args.transports.split(",") if x.strip()],
        "modes": [x.strip() for x in args.modes.split(",") if x.strip()],
        "min_bytes": args.min_bytes or (4096 if cpu else MiB),
        "max_bytes": args.max_bytes or (65536 if cpu else 1024 * MiB),
        "dit_seq": (args.dit_seq if args.dit_seq is not None else (64 if cpu else 32768)),
        "iters": args.iters or (5 if cpu else 20),
        "no_progress": args.no_progress,
    }


def main(args) -> int:
    from ..launch import launch
    opts = _defaults(args)
    for t in opts["transports"]:
        if t not in ("all_to_all", "ce"):
            print(f"bench ulysses: unknown transport {t!r}", file=sys.stderr)
            return 2
    if opts["min_bytes"] > opts["max_bytes"]:
        print("bench ulysses: --min-bytes is above --max-bytes", file=sys.stderr)
        return 2
    result = launch(run_rank, args.world_size, device=opts["device"], args=(opts,))[0]
    return report(result["records"], result["skipped"], args, opts)


def report(records: list, skipped: dict, args, opts: dict) -> int:
    """Print the table; write ``--json`` / ``--plot``; 1 if the transports disagreed."""
    for name, why in skipped.items():
        print(f"bench ulysses: transport {name} skipped: {why}")
    rows = [dict(r, MB=r["bytes_per_rank"] / 1e6) for r in records]
    common.print_table(rows, ["geometry", "transport", "mode", "world_size", "MB", "time_us",
                              "busbw_gbps", "bitwise_equal"],
                       title=f"Ulysses exchange, W={args.world_size}, {opts['device']}",
                       fmt={"MB": "{:.3f}", "time_us": "{:.1f}", "busbw_gbps": "{:.1f}"})
    meta = common.meta(opts["device"], args.world_size, bench="ulysses",
                       dtype="bf16" if opts["device"] == "cuda" else "fp32",
                       sweep_geometry="seq_to_head x[1, S_r, 8W, 128]",
                       dit_geometry=f"B=1 S={opts['dit_seq']} H=24 D=128 q/k/v in + out back",
                       skipped=skipped)
    if args.json:
        common.write_json(args.json, meta, records)
    if getattr(args, "markdown", None):
        with open(args.markdown, "w") as f:
            f.write(markdown_report(meta, records))
    if args.plot:
        series = {}
        for r in records:
            if r["geometry"] != "sweep":
                continue
            xs, ys = series.setdefault(f"{r['transport']} {r['mode']}", ([], []))
            xs.append(r["bytes_per_rank"])
            ys.append(r["busbw_gbps"])
        common.plot_lines(args.plot, series, xlabel="bytes sent to peers per rank",
                          ylabel="bus bandwidth (GB/s)", logx=True,
                          title=f"Ulysses seq_to_head, W={args.world_size}, {meta.get('gpu') or 'cpu'}")
    bad = [r for r in records if r.get("bitwise_equal") is False]
    if bad:
        print("bench ulysses: transports disagree bitwise!", file=sys.stderr)
        return 1
    return 0


def markdown_report(meta: dict, records: list[dict]) -> str:
    """A Markdown page: the run's facts and one row per (geometry, size, mode) with each
    transport's time and bus bandwidth and ce's speedup over all_to_all."""
    keyed = {(r["geometry"], r["bytes_per_rank"], r["mode"], r["transport"]): r for r in records}
    transports = list(dict.fromkeys(r["transport"] for r in records))
    head = ("| geometry | MB sent per rank | mode | "
            + " | ".join(f"{t} µs | {t} GB/s" for t in transports) + " | ce ÷ all_to_all |")
    lines = [f"# Ulysses all-to-all — {meta.get('date')}, {meta.get('machine') or meta.get('host')}",
             "",
             f"W={meta.get('world_size')}, {meta.get('dtype')}, GPU {meta.get('gpu')}; torch "
             f"{meta.get('torch')}, Triton {meta.get('triton')}, CUDA {meta.get('cuda')}, NCCL "
             f"{meta.get('nccl')}. Sweep: {meta.get('sweep_geometry')}; DiT: "
             f"{meta.get('dit_geometry')}. Time: slowest-rank median per exchange (graph: 10 "
             "exchanges per graph, replay ÷ 10); bus bandwidth = bytes sent to peers per rank "
             "÷ time.", "", head, "|" + "---|" * (3 + 2 * len(transports) + 1)]
    seen = dict.fromkeys((r["geometry"], r["bytes_per_rank"], r["mode"]) for r in records)
    for geo, nbytes, mode in seen:
        cells = []
        for t in transports:
            r = keyed.get((geo, nbytes, mode, t))
            cells += [f"{r['time_us']:.1f}", f"{r['busbw_gbps']:.1f}"] if r else ["-", "-"]
        a, c = keyed.get((geo, nbytes, mode, "all_to_all")), keyed.get((geo, nbytes, mode, "ce"))
        sp = f"{a['time_us'] / c['time_us']:.2f}×" if a and c and c["time_us"] else "-"
        lines.append(f"| {geo} | {nbytes / 1e6:.1f} | {mode} | " + " | ".join(cells)
                     + f" | {sp} |")
    return "\n".join(lines) + "\n"
