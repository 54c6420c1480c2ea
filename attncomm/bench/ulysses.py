"""``attncomm bench ulysses``: the Ulysses exchange per transport, eager and CUDA graph.

Two geometries:

- ``sweep``: ``seq_to_head`` of ``x [1, S_r, 8·W, 128]`` (bf16 on CUDA) with ``S_r`` chosen so
  each rank sends ``bytes_per_rank`` bytes to its peers, from ``--min-bytes`` to
  ``--max-bytes`` (×2 steps).
- ``dit``: a DiT layer's exchanges — q, k, v ``[1, S/W, 24, 128]`` in (one exchange) and the
  output back (B = 1, S = 32768 on CUDA).
- ``layer`` (``--layer`` / ``--layer-only``): a MiniMax-H3-like attention layer through
  ``UlyssesAttention``, sequential and pipelined, per transport (``bench/ulysses_layer.py``;
  ``--trace DIR`` adds a profiler trace and the per-layer budget of each variant).
- ``--fill``: the fill kernel against torch ops and its floor, one GPU
  (``bench/ulysses_fill.py``).
- DiT: ``--joint S_j`` gives the layer's forwards ``S_j`` joint rows (a DiT's text
  tokens), ``--payload none fp8`` runs the layer's variants with each q/k/v payload and, with
  ``fp8``, records the FP8 payload's error on random data from fixed seeds against fp64 and
  against the plain exchange (``bench/ulysses_fp8.py``); ``--dit-model`` times a Flux
  transformer sharded by attncomm (text tokens as joint rows) and by diffusers' own context
  parallelism on the same model (``bench/ulysses_dit.py``).

The time is the slowest rank's median per exchange (data landed in the receiver's final
buffer); bus bandwidth = bytes sent to peers per rank / time.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from .. import collectives, config
from .._dist import cpu_group
from . import common
from .report import NameList, Report, add_common_arguments, default_device, emit
from . import ulysses_dit as bench_dit
from . import ulysses_fp8 as bench_fp8
from . import ulysses_layer as bench_layer
from . import ulysses_timeline as timeline
from ..ulysses.policy import ce_reason, named_transport
from .ulysses_fill import fill_records
from .ulysses_layer import markdown_rows
from ..ulysses.layout import head_offsets, head_split, head_to_seq_plan, seq_to_head_plan

__all__ = ["add_arguments", "main", "run_rank", "report", "markdown_report", "fill_markdown"]

MiB = 1 << 20
_VARIANTS = ("attention_only", "sequential_all_to_all", "sequential_ce", "pipelined_auto",
             "pipelined_g2", "pipelined_g4", "pipelined_g7", "pipelined_g8", "pipelined_fused")
_TRANSPORTS = ("all_to_all", "ce")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # --backends: the transports (--transports, its older name, still works)
    add_common_arguments(p, backends=_TRANSPORTS, default_backends=" ".join(_TRANSPORTS),
                         aliases=("--transports",))
    p.add_argument("--modes", action=NameList, names=("eager", "graph"), default=None,
                   metavar="MODE", help="space separated: eager graph (default both; graph: "
                                        "CUDA only)")
    p.add_argument("--min-bytes", type=int, default=None,
                   help="smallest bytes sent to peers per rank (default 1 MiB; CPU 4 KiB)")
    p.add_argument("--max-bytes", type=int, default=None,
                   help="largest bytes sent to peers per rank (default 1 GiB; CPU 64 KiB)")
    p.add_argument("--dit-seq", type=int, default=None,
                   help="DiT sequence length S (default 32768; CPU 64; 0 skips)")
    p.add_argument("--layer", action="store_true",
                   help="also run the attention-layer benchmark (UlyssesAttention variants)")
    p.add_argument("--layer-only", action="store_true", help="run only the layer benchmark")
    p.add_argument("--layer-seq", default=None,
                   help="layer: total sequence lengths, comma-separated (default 8192,32768; "
                        "CPU 24)")
    p.add_argument("--layer-heads", type=int, default=56,
                   help="layer: query heads (default 56; head_dim 128)")
    p.add_argument("--layer-kv-heads", type=int, default=None,
                   help="layer: KV heads (default: as many as query heads)")
    p.add_argument("--layer-variants", default=",".join(_VARIANTS),
                   help="layer: comma-separated variants (default all)")
    p.add_argument("--layer-qk-norm", choices=["both", "on", "off"], default="both",
                   help="layer: with qk_norm + RoPE, without, or both (default)")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="layer: write a torch.profiler trace per variant into DIR and print "
                        "the per-layer budget (CUDA)")
    p.add_argument("--joint", type=int, default=0, metavar="S_j",
                   help="layer: joint rows per forward (a DiT's text tokens; default 0)")
    p.add_argument("--payload", action=NameList, names=tuple(bench_layer.PAYLOADS),
                   default=None, metavar="PAYLOAD",
                   help="layer: the q/k/v payloads to run, space separated: none fp8 "
                        "(default none; fp8 also records its error against fp64)")
    p.add_argument("--dit-model", action="store_true",
                   help="also time a Flux transformer sharded by attncomm and by diffusers' "
                        "context parallelism (needs diffusers; --layer-only skips the sweep)")
    p.add_argument("--fill", action="store_true",
                   help="run only the fill benchmark (one GPU: triton vs torch vs floor)")
    p.add_argument("--fill-seq", default="8192,32768",
                   help="fill: total sequence lengths (each rank's shard is S / W)")
    p.add_argument("--fill-heads", type=int, default=56, help="fill: heads (default 56)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default 20; CPU 5)")


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
    return named_transport(group, name, device, timeout), None


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
    def barrier():
        dist.barrier(group=cpu_g)

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
                          + (len(opts["layer_variants"]) * len(transports)
                             * len(opts["layer_seqs"]) * len(opts["layer_norms"])
                             * len(opts.get("payloads") or ["none"]) if layer else 0),
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
                if common.graph_mode_skipped("bench ulysses", name, mode,
                                             torch.empty(0, device=device), bar,
                                             say=rank == 0 and geometry == work[0][0]
                                             and n == work[0][1]):
                    continue
                med = common.slowest_rank_median(_time(fn, mode, device, opts["iters"], cpu_g),
                                                 cpu_g)
                records.append({"transport": name, "mode": mode, "world_size": world,
                                "geometry": geometry, "bytes_per_rank": sent,
                                "time_us": med, "busbw_gbps": sent / med / 1e3 if med else 0.0})
                bar.update(1)
        if len(finals) > 1:  # the transports must agree bit for bit
            vals = list(finals.values())
            flag = torch.tensor([int(all(torch.equal(vals[0], v) for v in vals[1:]))])
            collectives.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_g)
            for rec in records:
                if rec["geometry"] == geometry and rec["bytes_per_rank"] == sent:
                    rec["bitwise_equal"] = bool(flag.item())
    if layer:
        records += _layer(rank, world, opts, transports, dtype, device, cpu_g, bar)
        if "fp8" in opts.get("payloads", ()):
            records += bench_fp8.fp8_error_records(rank, world, device, cpu_g,
                                                   opts.get("fp8_cases"),
                                                   opts.get("fp8_seeds", bench_fp8.SEEDS))
    note = None
    if opts.get("dit_model"):
        recs, note = bench_dit.dit_model_records(rank, world, device, dtype, opts["iters"],
                                                 cpu_g, opts.get("dit_geometry"))
        records += recs
    bar.close()
    if rank == 0:
        return {"records": records, "skipped": skipped, "diffusers_cp_note": note}
    return None


# ------------------------------------------------------------------------- layer benchmark
def _layer(rank, world, opts, transports, dtype, device, cpu_g, bar) -> list[dict]:
    def time_fn(fn):
        bar.update(1)
        return common.slowest_rank_median(_time(fn, "eager", device, opts["iters"], cpu_g),
                                          cpu_g)
    if opts.get("trace") and rank == 0:
        os.makedirs(opts["trace"], exist_ok=True)
    dist.barrier(group=cpu_g)
    return bench_layer.layer_records(rank, world, opts, transports, dtype, device, cpu_g,
                                     time_fn)


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        return []


def _defaults(args) -> dict:
    device = args.device or default_device()
    cpu = device == "cpu"
    return {
        "device": device,
        "transports": list(args.backends or _TRANSPORTS),
        "modes": list(args.modes or ("eager", "graph")),
        "min_bytes": args.min_bytes or (4096 if cpu else MiB),
        "max_bytes": args.max_bytes or (65536 if cpu else 1024 * MiB),
        "dit_seq": (args.dit_seq if args.dit_seq is not None else (64 if cpu else 32768)),
        "iters": args.iters or (5 if cpu else 20),
        "no_progress": args.no_progress,
        "layer": bool(getattr(args, "layer", False)),
        "layer_only": bool(getattr(args, "layer_only", False)),
        "layer_seqs": _ints(getattr(args, "layer_seq", None) or ("24" if cpu else "8192,32768")),
        "layer_heads": getattr(args, "layer_heads", 56),
        "layer_kv_heads": getattr(args, "layer_kv_heads", None),
        "layer_variants": [x.strip() for x in
                           getattr(args, "layer_variants", ",".join(_VARIANTS)).split(",")
                           if x.strip()],
        "layer_norms": {"both": [True, False], "on": [True], "off": [False]}[
            getattr(args, "layer_qk_norm", "both")],
        "trace": getattr(args, "trace", None),
        "joint": getattr(args, "joint", 0) or 0,
        "payloads": list(getattr(args, "payload", None) or ["none"]),
        "dit_model": bool(getattr(args, "dit_model", False)),
        "fill": bool(getattr(args, "fill", False)),
        "fill_seqs": _ints(getattr(args, "fill_seq", "8192,32768")),
        "fill_heads": getattr(args, "fill_heads", 56),
    }


def _fill_main(args, opts) -> int:
    """``--fill``: one process on the current GPU (no ranks)."""
    if opts["device"] != "cuda":
        print("bench ulysses --fill: needs CUDA (the kernel is checked on CPU by the tests, "
              "under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    records, extra = fill_records(opts["fill_seqs"], opts["fill_heads"], 128,
                                  args.world_size, opts["iters"])
    common.print_table(records, ["impl", "seq", "qk_norm", "time_us", "floor_us", "vs_floor"],
                       title=f"Ulysses fill, one rank's shard at W={args.world_size}")
    meta = common.meta("cuda", 1, bench="ulysses-fill", dtype="bf16", **extra)
    emit(args, Report(meta=meta, records=records, markdown=fill_markdown(meta, records)))
    return 0 if all(r.get("bitwise_equal", True) for r in records) else 1


def fill_markdown(meta: dict, records: list[dict]) -> str:
    """``--fill``'s Markdown page: the run's facts and one row per (impl, S, qk_norm) with the
    GPU time, the floor (bytes moved ÷ the copy bandwidth of the same run), the ratio and
    whether the kernel's output equals the torch path's bit for bit."""
    lines = [f"# Ulysses fill — {meta.get('date')}, {meta.get('gpu')}", "",
             f"{meta.get('fill_geometry')}. torch {meta.get('torch')}, Triton "
             f"{meta.get('triton')}; copy bandwidth {meta.get('copy_bandwidth_gbps', 0):.0f} "
             "GB/s. Time: the GPU's per call, back to back.", ""]
    header = ["impl", "S", "qk_norm", "µs", "floor µs", "÷ floor", "bitwise equal"]
    rows = [[r["impl"], r["seq"], str(r["qk_norm"]), r["time_us"], r["floor_us"], r["vs_floor"],
             str(r["bitwise_equal"]) if "bitwise_equal" in r else "–"] for r in records]
    return "\n".join(lines + common.markdown_lines(header, rows)) + "\n"


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
    if opts["fill"]:
        return _fill_main(args, opts)
    if opts["layer"] or opts["layer_only"]:
        bad = [v for v in opts["layer_variants"] if v not in _VARIANTS]
        if bad or not opts["layer_variants"]:
            print(f"bench ulysses: unknown --layer-variants {bad} (choose from "
                  f"{list(_VARIANTS)})", file=sys.stderr)
            return 2
        if not opts["layer_seqs"] or min(opts["layer_seqs"]) < 1 or opts["layer_heads"] < 1:
            print(f"bench ulysses: --layer-seq ({opts['layer_seqs']}) and --layer-heads "
                  f"({opts['layer_heads']}) must be ≥ 1", file=sys.stderr)
            return 2
        kv = opts["layer_kv_heads"] or opts["layer_heads"]
        if kv < 1 or opts["layer_heads"] % kv:
            print(f"bench ulysses: --layer-kv-heads {kv} must divide --layer-heads "
                  f"{opts['layer_heads']}", file=sys.stderr)
            return 2
    if opts["joint"] < 0:
        print(f"bench ulysses: --joint must be ≥ 0, got {opts['joint']}", file=sys.stderr)
        return 2
    if opts["dit_model"]:
        why = bench_dit.flux.unavailable_reason()
        if why:
            print(f"bench ulysses: --dit-model: {why}", file=sys.stderr)
            return 2
    result = common.run_ranks(run_rank, args.world_size, opts["device"], (opts,))[0]
    opts["diffusers_cp_note"] = result.get("diffusers_cp_note")
    return report(result["records"], result["skipped"], args, opts)


def report(records: list, skipped: dict, args, opts: dict) -> int:
    """Print the table; write ``--json`` / ``--plot``; 1 if the transports disagreed."""
    for name, why in skipped.items():
        print(f"bench ulysses: transport {name} skipped: {why}")
    rows = [r for r in records if r["geometry"] in ("sweep", "dit")]
    if rows:
        common.print_table(rows, ["geometry", "transport", "mode", "world_size", "bytes_per_rank",
                                  "time_us", "busbw_gbps", "bitwise_equal"],
                           title=f"Ulysses exchange, W={args.world_size}, {opts['device']}")
    layer_rows = [r for r in records if r.get("geometry") == "layer"
                  and r["variant"] != "summary"]
    if layer_rows:
        common.print_table(layer_rows, ["seq", "joint", "qk_norm", "payload", "variant",
                                        "transport", "groups", "fused_fill", "time_us"],
                           title=f"Ulysses attention layer (UlyssesAttention, eager), "
                                 f"W={args.world_size}, {opts['device']}")
        for r in layer_rows:
            if r.get("budget"):
                print(f"  budget {r['variant']} {r['transport']} S={r['seq']} "
                      f"qk_norm={int(r['qk_norm'])}: {timeline.format_budget(r['budget'])}")
        for r in records:
            if r.get("variant") == "summary":
                print(f"  S={r['seq']} qk_norm={int(r['qk_norm'])} payload={r['payload']}: "
                      f"bitwise equal {r['bitwise_equal']}, hidden "
                      f"{r['hidden_vs_sequential_all_to_all']}")
    fp8_md = bench_fp8.markdown_rows(records)
    if fp8_md:
        print("\n".join(fp8_md))
    dit_md = bench_dit.markdown_rows(records, opts.get("diffusers_cp_note"))
    if dit_md:
        print("\n".join(dit_md))
    extra = {}
    if opts.get("layer") or opts.get("layer_only"):
        extra["layer_geometry"] = (f"B=1 S={opts['layer_seqs']} H={opts['layer_heads']} "
                                   f"Hkv={opts['layer_kv_heads'] or opts['layer_heads']} "
                                   f"D=128 non-causal SDPA, joint rows {opts['joint']}, "
                                   f"payloads {opts['payloads']}")
    if opts.get("diffusers_cp_note"):
        extra["diffusers_cp_note"] = opts["diffusers_cp_note"]
    meta = common.meta(opts["device"], args.world_size, bench="ulysses",
                       dtype="bf16" if opts["device"] == "cuda" else "fp32",
                       sweep_geometry="seq_to_head x[1, S_r, 8W, 128]",
                       dit_geometry=f"B=1 S={opts['dit_seq']} H=24 D=128 q/k/v in + out back",
                       skipped=skipped, **extra)
    series: dict = {}
    for r in records:
        if r["geometry"] == "sweep":
            xs, ys = series.setdefault(f"{r['transport']} {r['mode']}", ([], []))
            xs.append(r["bytes_per_rank"])
            ys.append(r["busbw_gbps"])
    plot = dict(series=series, xlabel="bytes sent to peers per rank",
                ylabel="bus bandwidth (GB/s)", logx=True,
                title=f"Ulysses seq_to_head, W={args.world_size}, {meta.get('gpu') or 'cpu'}")
    md = markdown_report(meta, records)
    md += "\n".join(bench_fp8.markdown_rows(records)
                    + bench_dit.markdown_rows(records, opts.get("diffusers_cp_note")))
    emit(args, Report(meta=meta, records=records, markdown=md.rstrip("\n") + "\n", plot=plot))
    bad = [r for r in records if r.get("bitwise_equal") is False]
    if bad:
        if any(r["geometry"] in ("sweep", "dit") for r in bad):
            print("bench ulysses: transports disagree bitwise!", file=sys.stderr)
        if any(r["geometry"] == "layer" for r in bad):
            print("bench ulysses: layer outputs differ bitwise (sequential vs pipelined or "
                  "across transports)!", file=sys.stderr)
        return 1
    return 0


def markdown_report(meta: dict, records: list[dict]) -> str:
    """A Markdown page: the run's facts and one row per (geometry, size, mode) with each
    transport's time and bus bandwidth and ce's speedup over all_to_all."""
    layer = markdown_rows(records)
    records = [r for r in records if r["geometry"] in ("sweep", "dit")]
    keyed = {(r["geometry"], r["bytes_per_rank"], r["mode"], r["transport"]): r for r in records}
    transports = list(dict.fromkeys(r["transport"] for r in records))
    header = ["geometry", "bytes sent per rank", "mode",
              *(f"{t} {u}" for t in transports for u in ("µs", "GB/s")), "ce ÷ all_to_all (×)"]
    where = meta.get("machine") or meta.get("host")
    lines = [f"# Ulysses all-to-all — {meta.get('date')}, {where}",
             "",
             f"W={meta.get('world_size')}, {meta.get('dtype')}, GPU {meta.get('gpu')}; torch "
             f"{meta.get('torch')}, Triton {meta.get('triton')}, CUDA {meta.get('cuda')}, NCCL "
             f"{meta.get('nccl')}. Sweep: {meta.get('sweep_geometry')}; DiT: "
             f"{meta.get('dit_geometry')}. Time: slowest-rank median per exchange (graph: 10 "
             "exchanges per graph, replay ÷ 10); bus bandwidth = bytes sent to peers per rank "
             "÷ time.", ""]
    rows = []
    for geo, nbytes, mode in dict.fromkeys((r["geometry"], r["bytes_per_rank"], r["mode"])
                                           for r in records):
        cells = []
        for t in transports:
            r = keyed.get((geo, nbytes, mode, t))
            cells += [r["time_us"], r["busbw_gbps"]] if r else [None, None]
        a, c = keyed.get((geo, nbytes, mode, "all_to_all")), keyed.get((geo, nbytes, mode, "ce"))
        rows.append([geo, nbytes, mode, *cells,
                     round(a["time_us"] / c["time_us"], 2) if a and c and c["time_us"] else None])
    if records:  # --layer-only: no exchange table
        lines += common.markdown_lines(header, rows)
    return "\n".join(lines + layer) + "\n"
