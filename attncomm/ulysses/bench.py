"""``attncomm bench ulysses``: the Ulysses exchange per transport, eager and CUDA graph.

Two geometries:

- ``sweep``: ``seq_to_head`` of ``x [1, S_r, 8·W, 128]`` (bf16 on CUDA) with ``S_r`` chosen so
  each rank sends ``bytes_per_rank`` bytes to its peers, from ``--min-bytes`` to
  ``--max-bytes`` (×2 steps).
- ``dit``: a DiT layer's exchanges — q, k, v ``[1, S/W, 24, 128]`` in (one exchange) and the
  output back (B = 1, S = 32768 on CUDA).
- ``layer`` (``--layer`` / ``--layer-only``): how much of that exchange the head-group
  pipelining of ``UlyssesAttention`` hides under attention, per transport: the exchange alone,
  the local attention alone (SDPA on the head-sharded ``[1, S, H/W, 128]``), the module's
  forward with ``pipeline_groups=0`` (sequential) and ``--layer-groups`` groups (pipelined,
  default 4; ``-1``, automatic, is sequential today); ``hidden_fraction = (sequential − pipelined) / exchange``, ``speedup = sequential /
  pipelined``. Eager (per-iteration barrier): at the default size one forward takes
  milliseconds, so launch costs are small next to it.

The time is the slowest rank's median per exchange (data landed in the receiver's final
buffer); bus bandwidth = bytes sent to peers per rank / time.
"""
from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group
from ..bench import common
from ..launch import launch
from .api import _cached, ce_reason, dense
from .attention import UlyssesAttention, sdpa_attention
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
    p.add_argument("--layer", action="store_true",
                   help="also run the DiT layer pipelining benchmark (UlyssesAttention)")
    p.add_argument("--layer-only", action="store_true", help="run only the layer benchmark")
    p.add_argument("--layer-seq", type=int, default=None,
                   help="layer benchmark: total sequence length S (default 32768; CPU 64)")
    p.add_argument("--layer-heads", type=int, default=24,
                   help="layer benchmark: attention heads (default 24; head_dim 128)")
    p.add_argument("--layer-groups", type=int, default=4,
                   help="layer benchmark: pipeline_groups of the pipelined variant (default 4; "
                        "-1 is automatic, which is sequential)")
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


def _dit_case(world, rank, seq_total, dtype, device, heads=24):
    d = 128
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
    why = t.prepare(plan, dtype)
    if why:
        raise RuntimeError(f"{t.name} cannot run this size: {why}")


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
    if opts.get("layer_only"):
        work = []
    layer = opts.get("layer") or opts.get("layer_only")
    bar = common.progress(len(work) * len(transports) * len(modes)
                          + (len(_LAYER_VARIANTS) * len(transports) if layer else 0),
                          "bench ulysses", enabled=rank == 0 and not opts["no_progress"])
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
    if layer:
        records += _layer_records(rank, world, opts, transports, dtype, device, cpu_g, bar)
    bar.close()
    if rank == 0:
        return {"records": records, "skipped": skipped}
    return None


# ------------------------------------------------------------------------- layer benchmark
_LAYER_VARIANTS = ("exchange", "attention", "sequential", "pipelined")


def _layer_inputs(world, rank, opts, dtype, device):
    """The layer's tensors on this rank: the exchange case (its q, k, v ``[1, S_r, H, 128]``
    also feed the module) and, for attention alone, q, k, v ``[1, S, H_r, 128]`` laid out as
    the module receives them (views of one ``[S, 1, 3·H_r, 128]`` buffer)."""
    seq_total, heads = opts["layer_seq"], opts["layer_heads"]
    torch.manual_seed(4321 + seq_total + rank)
    case, _ = _dit_case(world, rank, seq_total, dtype, device, heads)
    h_r = head_split(heads, world)[rank]
    packed = torch.randn(seq_total, 1, 3 * h_r, 128, device=device).to(dtype)
    local = tuple(packed[:, :, i * h_r:(i + 1) * h_r].permute(1, 0, 2, 3) for i in range(3))
    return case, local, tuple(head_split(seq_total, world))


def _all_ranks(flag: bool, cpu_g) -> bool:
    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=cpu_g)
    return bool(t.item())


def _layer_fns(name, t, case, local, seq, opts, dtype, device):
    """``({variant: timed fn}, {variant: UlyssesAttention}, sequential out, pipelined out)``;
    each module runs once here (first call: staging buffers, group count)."""
    q, k, v = case[1]
    fns = {"exchange": _first_call(t, "dit", case, dtype, device)[0],
           "attention": lambda: dense(sdpa_attention(*local, False))}
    mods, outs = {}, {}
    for variant, groups in (("sequential", 0), ("pipelined", opts["layer_groups"])):
        mod = UlyssesAttention(backend=name, pipeline_groups=groups, validate=False)
        outs[variant] = mod(q, k, v, seq_lens=seq).clone()
        mods[variant] = mod
        fns[variant] = functools.partial(mod, q, k, v, seq_lens=seq)
    return fns, mods, outs


def _layer_records(rank, world, opts, transports, dtype, device, cpu_g, bar) -> list[dict]:
    """Time the four layer variants per transport (slowest-rank median, eager) and add one
    summary record per transport; outputs of sequential and pipelined runs (and of the
    transports) must agree bit for bit on every rank (``bitwise_equal`` on the summary)."""
    case, local, seq = _layer_inputs(world, rank, opts, dtype, device)
    records, first = [], None
    for name, t in transports.items():
        fns, mods, outs = _layer_fns(name, t, case, local, seq, opts, dtype, device)
        same = torch.equal(outs["sequential"], outs["pipelined"])
        if first is None:
            first = outs["sequential"]
        else:
            same = same and torch.equal(first, outs["sequential"])
        times = {}
        for variant in _LAYER_VARIANTS:
            times[variant] = common.slowest_rank_median(
                _time(fns[variant], "eager", device, opts["iters"], cpu_g), cpu_g)
            mod = mods.get(variant)
            records.append({"transport": name, "mode": "eager", "world_size": world,
                            "geometry": "layer", "variant": variant,
                            "time_us": times[variant],
                            "pipeline_groups": mod.last_pipeline_groups if mod else None,
                            "pipeline_groups_requested": mod.pipeline_groups if mod else None,
                            "seq": opts["layer_seq"], "heads": opts["layer_heads"]})
            bar.update(1)
        ex, sq, pp = times["exchange"], times["sequential"], times["pipelined"]
        records.append({"transport": name, "mode": "eager", "world_size": world,
                        "geometry": "layer", "variant": "summary",
                        "pipeline_groups": mods["pipelined"].last_pipeline_groups,
                        "seq": opts["layer_seq"], "heads": opts["layer_heads"],
                        "hidden_fraction": (sq - pp) / ex if ex > 0 else float("nan"),
                        "speedup": sq / pp if pp > 0 else float("nan"),
                        "bitwise_equal": _all_ranks(same, cpu_g)})
    return records


def _layer_rows(records: list[dict]) -> list[dict]:
    """One row per transport: the four times, groups, hidden fraction (clamped to [0, 1]),
    speedup, and whether the outputs agreed."""
    rows = {}
    for r in records:
        if r.get("geometry") != "layer":
            continue
        row = rows.setdefault(r["transport"], {"transport": r["transport"],
                                               "world_size": r["world_size"], "S": r["seq"],
                                               "heads": r["heads"]})
        if r["variant"] == "summary":
            row.update(groups=r["pipeline_groups"], speedup=r["speedup"],
                       bitwise_equal=r["bitwise_equal"],
                       hidden=min(1.0, max(0.0, r["hidden_fraction"]))
                       if r["hidden_fraction"] == r["hidden_fraction"] else None)
        else:
            row[f"{r['variant']}_us"] = r["time_us"]
    return list(rows.values())


_LAYER_COLS = ["transport", "world_size", "S", "heads", "groups", "exchange_us", "attention_us",
               "sequential_us", "pipelined_us", "hidden", "speedup", "bitwise_equal"]
_LAYER_FMT = {"exchange_us": "{:.1f}", "attention_us": "{:.1f}", "sequential_us": "{:.1f}",
              "pipelined_us": "{:.1f}", "hidden": "{:.2f}", "speedup": "{:.3f}"}


def _layer_markdown(records: list[dict], meta: dict) -> list[str]:
    rows = _layer_rows(records)
    if not rows:
        return []
    lines = ["", "## DiT layer: exchange hidden by head-group pipelining", "",
             f"{meta.get('layer_geometry')}. UlyssesAttention forward, eager, slowest-rank "
             "median; exchange = q/k/v in + output back alone; attention = SDPA alone on the "
             "head-sharded sequence; hidden = (sequential − "
             "pipelined) ÷ exchange, clamped to [0, 1] (raw in the JSON); speedup = sequential "
             "÷ pipelined; groups = head groups the pipelined run used.", "",
             "| " + " | ".join(_LAYER_COLS) + " |", "|" + "---|" * len(_LAYER_COLS)]
    for row in rows:
        cells = []
        for c in _LAYER_COLS:
            v = row.get(c)
            cells.append("-" if v is None else _LAYER_FMT.get(c, "{}").format(v))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


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
        "layer": bool(getattr(args, "layer", False)),
        "layer_only": bool(getattr(args, "layer_only", False)),
        "layer_seq": (args.layer_seq if getattr(args, "layer_seq", None) is not None
                      else (64 if cpu else 32768)),
        "layer_heads": getattr(args, "layer_heads", 24),
        "layer_groups": getattr(args, "layer_groups", 4),
    }


def main(args) -> int:
    config.force_safe_env()
    opts = _defaults(args)
    for t in opts["transports"]:
        if t not in ("all_to_all", "ce"):
            print(f"bench ulysses: unknown transport {t!r}", file=sys.stderr)
            return 2
    if opts["min_bytes"] > opts["max_bytes"]:
        print("bench ulysses: --min-bytes is above --max-bytes", file=sys.stderr)
        return 2
    if opts["layer"] or opts["layer_only"]:
        if opts["layer_seq"] < 1 or opts["layer_heads"] < 1:
            print(f"bench ulysses: --layer-seq ({opts['layer_seq']}) and --layer-heads "
                  f"({opts['layer_heads']}) must be ≥ 1", file=sys.stderr)
            return 2
        if opts["layer_groups"] < -1 or opts["layer_groups"] in (0, 1):
            print(f"bench ulysses: --layer-groups must be -1 (auto) or ≥ 2, got "
                  f"{opts['layer_groups']}", file=sys.stderr)
            return 2
    result = launch(run_rank, args.world_size, device=opts["device"], args=(opts,))[0]
    return report(result["records"], result["skipped"], args, opts)


def report(records: list, skipped: dict, args, opts: dict) -> int:
    """Print the table; write ``--json`` / ``--plot``; 1 if the transports disagreed."""
    for name, why in skipped.items():
        print(f"bench ulysses: transport {name} skipped: {why}")
    rows = [dict(r, MB=r["bytes_per_rank"] / 1e6) for r in records if r["geometry"] != "layer"]
    if rows:
        common.print_table(rows, ["geometry", "transport", "mode", "world_size", "MB",
                                  "time_us", "busbw_gbps", "bitwise_equal"],
                           title=f"Ulysses exchange, W={args.world_size}, {opts['device']}",
                           fmt={"MB": "{:.3f}", "time_us": "{:.1f}", "busbw_gbps": "{:.1f}"})
    layer_rows = _layer_rows(records)
    if layer_rows:
        common.print_table(layer_rows, _LAYER_COLS, fmt=_LAYER_FMT,
                           title=f"Ulysses DiT layer pipelining (UlyssesAttention, eager), "
                                 f"W={args.world_size}, {opts['device']}")
    extra = {}
    if opts.get("layer") or opts.get("layer_only"):
        extra["layer_geometry"] = (f"B=1 S={opts['layer_seq']} H={opts['layer_heads']} D=128 "
                                   "non-causal, SDPA; pipelined pipeline_groups="
                                   f"{opts['layer_groups']}")
    meta = common.meta(opts["device"], args.world_size, bench="ulysses",
                       dtype="bf16" if opts["device"] == "cuda" else "fp32",
                       sweep_geometry="seq_to_head x[1, S_r, 8W, 128]",
                       dit_geometry=f"B=1 S={opts['dit_seq']} H=24 D=128 q/k/v in + out back",
                       skipped=skipped, **extra)
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
        if any(r["geometry"] != "layer" for r in bad):
            print("bench ulysses: transports disagree bitwise!", file=sys.stderr)
        if any(r["geometry"] == "layer" for r in bad):
            print("bench ulysses: layer outputs differ bitwise (sequential vs pipelined or "
                  "across transports)!", file=sys.stderr)
        return 1
    return 0


def markdown_report(meta: dict, records: list[dict]) -> str:
    """A Markdown page: the run's facts and one row per (geometry, size, mode) with each
    transport's time and bus bandwidth and ce's speedup over all_to_all."""
    layer = _layer_markdown(records, meta)
    records = [r for r in records if r["geometry"] != "layer"]
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
    if not records:  # --layer-only: no exchange table
        lines = lines[:-2]
    return "\n".join(lines + layer) + "\n"
