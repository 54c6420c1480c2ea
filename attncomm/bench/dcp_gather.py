"""``attncomm bench dcp --op gather|layer``: DCP's query gather, and gather + merge per step.

``--op gather``: ``DcpQueryGather`` of every gather backend (``all_gather`` = the process
group's all_gather_into_tensor, NCCL or gloo; ``symm`` on CUDA) at Kimi-K2.5's geometry by
default (64 heads, D = 576 with RoPE on the last R = 64 dims, bf16), tokens 1..128, eager and in
CUDA graphs (``--per-graph`` gathers per graph, replay / per-graph, replays back to back).
``--op layer``: what DCP communicates per decode layer, one gather then one merge of the
attention output (``[T, H, Dv]`` + LSE, Dv = 512): ``all_gather`` with each NCCL merge backend
(``ag_rs``, ``a2a``) against ``symm`` with ``symm_a2a`` (the gather ordered by the merge, as in
``DcpAttention``; attention itself is left out). Latency is the median over iterations of the
slowest rank; the speedup is the best NCCL (on CPU ranks: gloo) figure of the same run, mode and
tokens ÷ this one.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from .._dist import cpu_group
from .report import command_options
from .common import (latency_record, markdown_lines, meta, plot_lines,
                     print_table, progress, run_ranks, time_eager,
                     time_graph, write_json, graph_mode_skipped)
from ..dcp.lse_merge import DcpMerger
from ..dcp.query_gather import DcpQueryGather

__all__ = ["run_rank", "main", "add_speedups", "markdown_table"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_BASELINES = {"gather": ("all_gather",), "layer": ("all_gather+ag_rs", "all_gather+a2a")}
_FAST = {"gather": "symm", "layer": "symm+symm_a2a"}


def _config(args) -> dict:
    device = args.device
    cuda = device == "cuda"
    if args.op == "gather":
        backends = args.gather_backends or (["all_gather"] + (["symm"] if cuda else []))
    else:
        backends = list(_BASELINES["layer"]) + (["symm+symm_a2a"] if cuda else [])
    modes = args.modes or (["eager", "graph"] if cuda else ["eager"])
    if not cuda and any(m.startswith("graph") for m in modes):
        raise ValueError(f"--modes {' '.join(modes)}: graph modes need --device cuda")
    if args.heads % args.world_size:
        raise ValueError(f"--heads {args.heads} is not divisible by --world-size "
                         f"{args.world_size}")
    if args.rope_dim % 2 or args.rope_dim > args.head_dim:
        raise ValueError(f"--rope-dim {args.rope_dim} must be even and ≤ --head-dim")
    return dict(op=args.op, device=device, backends=backends, modes=modes, heads=args.heads,
                head_dim=args.head_dim, v_head_dim=args.v_head_dim, rope_dim=args.rope_dim,
                dtype=args.dtype, tokens=sorted(set(args.tokens)), warmup=args.warmup,
                iters=args.iters, per_graph=args.per_graph, progress=not args.no_progress)


def _build(cfg, name):
    """The callable timed for one backend name: ``fn(q, rope, out, lse)``."""
    dtype = _DTYPES[cfg["dtype"]]
    kw = dict(max_tokens=max(cfg["tokens"]), num_heads=cfg["heads"], head_dim=cfg["head_dim"],
              dtype=dtype, rope_dim=cfg["rope_dim"])
    if cfg["op"] == "gather":
        g = DcpQueryGather(backend=name, **kw)
        return (lambda q, rope, out, lse: g(q, rope=rope)), [g]
    gather_name, merge_name = name.split("+")
    g = DcpQueryGather(backend=gather_name, ordered_by_caller=True, **kw)
    m = DcpMerger(max_tokens=kw["max_tokens"], num_heads=cfg["heads"],
                  head_dim=cfg["v_head_dim"], dtype=dtype, backend=merge_name)

    def step(q, rope, out, lse):
        g(q, rope=rope)
        return m(out, lse)
    return step, [g, m]


def _inputs(cfg, T, device, rank):
    gen = torch.Generator(device=device).manual_seed(29 + rank)
    dtype = _DTYPES[cfg["dtype"]]
    H, W = cfg["heads"], dist.get_world_size()
    q = torch.randn((T, H // W, cfg["head_dim"]), generator=gen, device=device).to(dtype)
    rope = None
    if cfg["rope_dim"]:
        ang = torch.rand((T, cfg["rope_dim"]), generator=gen, device=device) * 30
        rope = (ang.cos(), ang.sin())
    out = torch.randn((T, H, cfg["v_head_dim"]), generator=gen, device=device).to(dtype)
    lse = torch.randn((T, H), generator=gen, device=device) * 2
    return q, rope, out, lse


def run_rank(rank: int, world_size: int, cfg: dict) -> list[dict] | None:
    """Every rank: build each backend, time every (tokens, mode); rank 0 returns the records."""
    device = torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" \
        else torch.device("cpu")
    g = cpu_group()
    total = len(cfg["backends"]) * len(cfg["tokens"]) * len(cfg["modes"])
    bar = progress(total, f"bench dcp --op {cfg['op']}", enabled=cfg["progress"] and rank == 0)
    records = []
    for name in cfg["backends"]:
        try:
            fn, objs = _build(cfg, name)
        except ValueError as exc:  # the same on every rank: skip the backend everywhere
            if rank == 0:
                print(f"bench dcp --op {cfg['op']}: skipping {name}: {exc}", flush=True)
            bar.update(len(cfg["tokens"]) * len(cfg["modes"]))
            continue
        for T in cfg["tokens"]:
            args = _inputs(cfg, T, device, rank)
            for mode in cfg["modes"]:
                if graph_mode_skipped(f"bench dcp --op {cfg['op']}", name, mode, args[0], bar,
                                      say=rank == 0 and T == cfg["tokens"][0]):
                    continue
                stats: dict = {}
                if mode == "graph":
                    times = time_graph(lambda: fn(*args), per_graph=cfg["per_graph"],
                                       warmup=cfg["warmup"], iters=cfg["iters"],
                                       barrier=lambda: dist.barrier(group=g), back_to_back=True,
                                       stats=stats)
                    for o in objs:
                        o.check()
                else:
                    times = time_eager(lambda: fn(*args), warmup=cfg["warmup"],
                                       iters=cfg["iters"], device=cfg["device"],
                                       barrier=lambda: dist.barrier(group=g))
                records.append(latency_record(times, stats, op=cfg["op"], backend=name,
                                              mode=mode, tokens=T, world_size=world_size))
                bar.update(1)
        fn = objs = None  # free the workspaces before the next backend's
    bar.close()
    return records if rank == 0 else None


def add_speedups(records: list[dict]) -> list[dict]:
    """Each record with ``speedup`` = the best baseline's latency (same op, mode, tokens) ÷ its
    latency; None without a baseline."""
    best: dict = {}
    for r in records:
        if r["backend"] in _BASELINES[r["op"]]:
            k = (r["op"], r["mode"], r["tokens"])
            best[k] = min(best.get(k, float("inf")), r["latency_us"])
    return [dict(r, speedup=(round(best[k] / r["latency_us"], 2)
                             if (k := (r["op"], r["mode"], r["tokens"])) in best
                             and r["latency_us"] > 0 else None)) for r in records]


def markdown_table(records: list[dict]) -> str:
    """One row per (mode, tokens), one column per backend (µs), and the fast path's speedup."""
    op = records[0]["op"]
    backends = list(dict.fromkeys(r["backend"] for r in records))
    keyed = {(r["mode"], r["tokens"], r["backend"]): r for r in add_speedups(records)}
    rows = [[mode, T, *((keyed.get((mode, T, b)) or {}).get("latency_us") for b in backends),
             (keyed.get((mode, T, _FAST[op])) or {}).get("speedup")]
            for mode in dict.fromkeys(r["mode"] for r in records)
            for T in sorted({r["tokens"] for r in records if r["mode"] == mode})]
    return "\n".join(markdown_lines(["mode", "tokens", *(f"{b} (µs)" for b in backends),
                                     f"{_FAST[op]} speedup vs best NCCL (×)"], rows))


def main(args) -> int:
    """``attncomm bench dcp --op gather|layer`` (arguments: ``attncomm.bench.dcp``)."""
    cfg = command_options(args, _config, "bench dcp")
    if cfg is None:
        return 2
    t0 = time.monotonic()
    records = run_ranks(run_rank, args.world_size, cfg["device"], (cfg,))[0] or []
    what = "query gather" if cfg["op"] == "gather" else "gather + merge per decode layer"
    geo = (f"W={args.world_size}, H={cfg['heads']}, D={cfg['head_dim']}, R={cfg['rope_dim']}"
           + (f", Dv={cfg['v_head_dim']}" if cfg["op"] == "layer" else "") + f", {cfg['dtype']}")
    print_table(add_speedups(records), ["backend", "mode", "tokens", "world_size",
                                        "latency_us", "speedup", "gpu_idle_us"],
                title=f"DCP {what}, {geo} (speedup: best of "
                      f"{'/'.join(_BASELINES[cfg['op']])} ÷ this)")
    print(f"({time.monotonic() - t0:.1f} s)")
    m = meta(cfg["device"], args.world_size, op=cfg["op"], heads=cfg["heads"],
             head_dim=cfg["head_dim"], v_head_dim=cfg["v_head_dim"], rope_dim=cfg["rope_dim"],
             dtype=cfg["dtype"], warmup=cfg["warmup"], iters=cfg["iters"],
             per_graph=cfg["per_graph"])
    if cfg["device"] == "cuda" and m.get("gpu") is None and torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    if args.json:
        write_json(args.json, m, records)
    if getattr(args, "markdown", None) and records:
        with open(args.markdown, "w") as f:
            f.write(f"# DCP {what} — {m['date']}, {m.get('machine') or m['host']}\n\n{geo}; "
                    f"GPU {m.get('gpu')}; torch {m.get('torch')}, Triton {m.get('triton')}. "
                    f"{cfg['warmup']} warm-up + {cfg['iters']} timed iterations, slowest-rank "
                    f"median; graph mode: {cfg['per_graph']} calls per graph.\n\n"
                    + markdown_table(records) + "\n")
    if args.plot and records:
        series: dict = {}
        for r in records:
            xs, ys = series.setdefault(f"{r['backend']} ({r['mode']})", ([], []))
            xs.append(r["tokens"])
            ys.append(r["latency_us"])
        plot_lines(args.plot, series, xlabel="tokens", ylabel="latency (µs, slowest rank)",
                   title=f"DCP {what}, {geo}", logx=True, logy=True)
    if not records:
        print("attncomm bench dcp: no backend could run here", file=sys.stderr)
        return 1
    return 0
