"""``attncomm bench ring``: ring attention, Ulysses and USP on the same shapes, and the ring's
per-step compute against its transfer.

For each total sequence length S (``--seq``) and masking (``--causal``), every rank holds
``S / W`` rows of q, k, v ``[1, S/W, H, D]`` (bf16 on CUDA, fp32 on CPU) and runs, timed as the
slowest rank's median per forward:

- ``ring <layout>``: ``ring_attention`` (``contiguous``, ``zigzag``), and beside it the same
  schedule's attention + merge alone (no transfer: ``compute_us``) and its W − 1 K/V transfers
  alone (no attention: ``transfer_us``); per step ``compute_us / W`` and ``transfer_us /
  (W − 1)``; ``exposed_us`` = forward − compute, the transfer time the attention did not hide;
- ``ulysses``: ``UlyssesAttention`` with the ring's per-block attention (output only);
- ``usp UxR <layout>``: ``USPAttention`` on every grid with U, R ≥ 2.

``--kernels`` adds the one-process costs of ``bench/ring_kernels.py`` (the merge step against
the attention it follows; attention with LSE against plain SDPA) on rank 0's device.

``--varlen`` runs the packed-sequence section instead of the exchange one: per S, N sequences
of uneven lengths (``packing``) packed into one batch of S tokens (``cu_seqlens``) against the
same tokens padded to the longest sequence (a ``[N, L_max]`` batch with the padding masked by
``key_padding_mask``), both through ``ring_attention``; ``padded / packed`` is the ratio. And on
each rank, one process: the default ``attn_fn`` on ``S/W`` tokens with a key-padding mask (all
True), with the segments of one sequence and with the segments of the packing, each against
the dense call of the same tokens (``/ dense``).
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group
from ..ring import attention_with_lse, ring_attention
from ..ring.comm import RingComm
from ..ring.layout import Segment, ring_block, zigzag_shard
from ..ring.merge import merge_block, new_state
from ..ulysses import UlyssesAttention
from ..usp import USPAttention, make_groups
from . import common
from .report import NameList, Report, add_common_arguments, emit, usage_error
from .ring_kernels import kernel_records

__all__ = ["add_arguments", "main", "run_rank", "report", "markdown_report", "grids"]

_VARIANTS = ("ring", "ulysses", "usp")
_LAYOUTS = ("contiguous", "zigzag")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_common_arguments(p, backends=_VARIANTS, default_backends=" ".join(_VARIANTS))
    p.add_argument("--seq", default=None,
                   help="total sequence lengths S, comma-separated (default 32768; CPU 64,256)")
    p.add_argument("--heads", type=int, default=None, help="query heads (default 24; CPU 4)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=None, help="head_dim (default 128; CPU 32)")
    p.add_argument("--layouts", action=NameList, names=_LAYOUTS, default=None, metavar="NAME",
                   help="ring layouts: contiguous zigzag (default both)")
    p.add_argument("--causal", choices=("both", "on", "off"), default="both",
                   help="causal attention, non-causal, or both (default)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations (default 20; "
                                                           "CPU 5)")
    p.add_argument("--kernels", action="store_true",
                   help="also time the merge step and the attention with LSE in one process "
                        "(rank 0's device)")
    p.add_argument("--kernels-only", action="store_true", help="only the --kernels part")
    p.add_argument("--varlen", action="store_true",
                   help="packed sequences (cu_seqlens) against the same tokens padded, and the "
                        "default attn_fn with a mask / segments against the dense call")
    p.add_argument("--kernel-seq", type=int, default=None,
                   help="--kernels: rows per step S_r (default 8192; CPU 256)")


def grids(world: int) -> list[tuple[int, int]]:
    """The USP grids ``(U, R)`` with U, R ≥ 2 of ``world`` ranks."""
    return [(u, world // u) for u in range(2, world) if world % u == 0 and world // u >= 2]


def _defaults(args) -> dict:
    cpu = args.device == "cpu"
    seqs = args.seq or ("64,256" if cpu else "32768")
    try:
        seq_list = [int(x) for x in str(seqs).split(",") if x.strip()]
    except ValueError:
        seq_list = []
    heads = args.heads or (4 if cpu else 24)
    return {"device": args.device, "variants": list(args.backends or _VARIANTS),
            "seqs": seq_list, "heads": heads, "kv_heads": args.kv_heads or heads,
            "head_dim": args.head_dim or (32 if cpu else 128),
            "layouts": list(args.layouts or _LAYOUTS),
            "causal": {"both": [False, True], "on": [True], "off": [False]}[args.causal],
            "iters": args.iters or (5 if cpu else 20), "no_progress": args.no_progress,
            "kernels": args.kernels or args.kernels_only, "kernels_only": args.kernels_only,
            "kernel_seq": args.kernel_seq or (256 if cpu else 8192),
            "varlen": bool(getattr(args, "varlen", False))}


def _error(opts: dict, world: int) -> str | None:
    if not opts["seqs"] or min(opts["seqs"]) < 1:
        return f"--seq must list sequence lengths ≥ 1, got {opts['seqs']}"
    parts = world * (2 if "zigzag" in opts["layouts"] else 1)
    bad = [s for s in opts["seqs"] if s % parts]
    if bad:
        return f"--seq {bad}: each must be a multiple of {parts} (the shards of the layouts)"
    if opts["heads"] < 1 or opts["kv_heads"] < 1 or opts["heads"] % opts["kv_heads"]:
        return f"--kv-heads {opts['kv_heads']} must divide --heads {opts['heads']}"
    if opts["head_dim"] < 1 or opts["kernel_seq"] < 1 or opts["iters"] < 1:
        return "--head-dim, --kernel-seq and --iters must be ≥ 1"
    return None


# ------------------------------------------------------------------------------ per rank
def _compute_only(q, k, v, layout, causal, world, rank):
    """The ring's attention + merge schedule on this rank's own K/V (no transfer)."""
    b, s_r, h, _ = q.shape
    acc, acc_lse = new_state(b, s_r, h, v.shape[3], q.device)
    for step in range(world):
        blk = ring_block(layout, causal, world, rank, step, s_r)
        if blk is not None:
            o, l = attention_with_lse(q[:, blk.q_lo:blk.q_hi], k[:, blk.k_lo:blk.k_hi],
                                      v[:, blk.k_lo:blk.k_hi], blk.causal)
            merge_block(acc[:, blk.q_lo:blk.q_hi], acc_lse[:, blk.q_lo:blk.q_hi], o, l)
    return acc.to(q.dtype)


def _transfer_only(comm, k, v, world):
    """The ring's W − 1 K/V transfers (double-buffered), no attention."""
    bufs = [(torch.empty_like(k), torch.empty_like(v)) for _ in range(2)]
    cur = (k, v)
    for step in range(world - 1):
        comm.wait(comm.start(list(cur), list(bufs[step % 2])), step)
        cur = bufs[step % 2]


def packing(s: int, unit: int) -> list[int]:
    """Uneven sequence lengths summing to ``s`` (each a multiple of ``unit``): halving shares,
    1/2, 1/4, 1/8, … of the tokens, at most 8 sequences, the rest in the last one."""
    lens, left = [], s
    while left > 0 and len(lens) < 7:
        n = max(unit, (left // 2) // unit * unit)
        if n >= left:
            break
        lens.append(n)
        left -= n
    return lens + [left] if left else lens


def _varlen_records(rank, world, opts, device, dtype, time_fn, base) -> list:
    """The ``--varlen`` section for one S (rank 0's records)."""
    h, hkv, d, s = opts["heads"], opts["kv_heads"], opts["head_dim"], base["seq"]
    out = []
    for layout in opts["layouts"]:
        unit = 2 * world if layout == "zigzag" else world
        lens = packing(s, unit)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        l_max = max(lens)
        g = torch.Generator(device="cpu").manual_seed(99 + s + rank)

        def make(b, n):
            return [torch.randn(b, n, x, d, generator=g).to(device=device, dtype=dtype)
                    for x in (h, hkv, hkv)]

        qp = make(1, s // world)
        qd = make(len(lens), l_max // world)
        # the padded batch: sequence i in row i, its padding masked (rank's shard of it)
        full = torch.arange(l_max)[None, :] < torch.tensor(lens)[:, None]
        mask = (full.chunk(world, dim=1)[rank] if layout == "contiguous"
                else zigzag_shard(full, world, rank)).to(device)
        for causal in opts["causal"]:
            t_packed = time_fn(lambda: ring_attention(*qp, causal=causal, layout=layout,
                                                      cu_seqlens=cu, validate=False))
            t_padded = time_fn(lambda: ring_attention(*qd, causal=causal, layout=layout,
                                                      key_padding_mask=mask, validate=False))
            out.append(dict(base, variant=f"ring {layout}", causal=causal, sequences=len(lens),
                            l_max=l_max, packed_us=t_packed, padded_us=t_padded,
                            ratio=t_padded / t_packed if t_packed else None))
    # the default attn_fn alone on this rank's S/W tokens (every rank runs it; rank 0 reports)
    n = s // world
    q, k, v = (torch.randn(1, n, x, d).to(device=device, dtype=dtype) for x in (h, hkv, hkv))
    ones = torch.ones(1, n, dtype=torch.bool, device=device)
    lens = packing(n, 1)
    starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
    for causal in opts["causal"]:
        one = [Segment(0, n, 0, n, causal)]
        packed = [Segment(a, b, a, b, causal) for a, b in zip(starts, starts[1:])]
        t_dense = time_fn(lambda: attention_with_lse(q, k, v, causal))
        for what, kw in (("mask (all True)", dict(key_padding_mask=ones)),
                         ("one segment", dict(segments=one)),
                         (f"{len(lens)} segments", dict(segments=packed))):
            t = time_fn(lambda: attention_with_lse(q, k, v, False if "segment" in what
                                                   else causal, **kw))
            out.append(dict(base, seq=n, variant=f"attn_fn {what}", causal=causal,
                            dense_us=t_dense, time_us=t, ratio=t / t_dense if t_dense else None))
    return out


def _ulysses_attn(q, k, v, causal):
    return attention_with_lse(q, k, v, causal)[0].to(q.dtype)


def _timer(opts, device, cpu_g):
    def barrier():
        dist.barrier(group=cpu_g)

    def time_fn(fn):
        times = common.time_eager(fn, warmup=2, iters=opts["iters"], device=device.type,
                                  barrier=barrier)
        return common.slowest_rank_median(times, cpu_g)
    return time_fn


def run_rank(rank: int, world: int, opts: dict) -> dict | None:
    """The exchange section on one rank of an initialised group; rank 0 returns the
    records."""
    device = (torch.device("cuda", torch.cuda.current_device()) if opts["device"] == "cuda"
              else torch.device("cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cpu_g = cpu_group(None)
    time_fn = _timer(opts, device, cpu_g)
    h, hkv, d = opts["heads"], opts["kv_heads"], opts["head_dim"]
    grid_groups = {gr: make_groups(*gr) for gr in grids(world)} if "usp" in opts["variants"] \
        else {}
    comm = RingComm(None, config.timeout_s(None), "bench ring") if world > 1 else None
    records = []
    for s in opts["seqs"]:
        g = torch.Generator(device="cpu").manual_seed(1234 + s + rank)
        q, k, v = (torch.randn(1, s // world, n, d, generator=g).to(device=device, dtype=dtype)
                   for n in (h, hkv, hkv))
        base = {"section": "exchange", "world_size": world, "seq": s, "heads": h,
                "kv_heads": hkv, "head_dim": d, "dtype": str(dtype)[6:]}
        if opts["varlen"]:
            records += _varlen_records(rank, world, opts, device, dtype, time_fn,
                                       dict(base, section="varlen"))
            continue
        for causal in opts["causal"]:
            if "ring" in opts["variants"]:
                for layout in opts["layouts"]:
                    t = time_fn(lambda: ring_attention(q, k, v, causal=causal, layout=layout,
                                                       validate=False))
                    c = time_fn(lambda: _compute_only(q, k, v, layout, causal, world, rank))
                    x = time_fn(lambda: _transfer_only(comm, k, v, world)) if comm else 0.0
                    records.append(dict(base, variant=f"ring {layout}", causal=causal,
                                        time_us=t, compute_us=c, transfer_us=x,
                                        per_step_compute_us=c / world,
                                        per_step_transfer_us=x / max(1, world - 1),
                                        exposed_us=max(0.0, t - c)))
            if "ulysses" in opts["variants"]:
                mod = UlyssesAttention(_ulysses_attn, pipeline_groups=0, validate=False)
                t = time_fn(lambda: mod(q, k, v, causal=causal))
                records.append(dict(base, variant="ulysses", causal=causal, time_us=t))
            for (u, r), (ug, rg) in grid_groups.items():
                for layout in opts["layouts"]:
                    mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                                       pipeline_groups=0, validate=False)
                    t = time_fn(lambda: mod(q, k, v, causal=causal))
                    records.append(dict(base, variant=f"usp {u}x{r} {layout}", causal=causal,
                                        time_us=t))
    return {"records": records} if rank == 0 else None


# ------------------------------------------------------------------------------ report
def _table(rows, columns, **kw):
    common.print_table([{c: r.get(c) for c in columns} for r in rows], columns, **kw)


def report(records: list, args, opts: dict) -> int:
    """Print the tables; write ``--json`` / ``--markdown`` / ``--plot``."""
    ex = [r for r in records if r.get("section") == "exchange"]
    if ex:
        _table(ex, ["seq", "causal", "variant", "time_us", "compute_us",
                                "transfer_us", "per_step_compute_us", "per_step_transfer_us",
                                "exposed_us"],
                           title=f"ring / Ulysses / USP, W={args.world_size}, {opts['device']}")
    var = [r for r in records if r.get("section") == "varlen"]
    if var:
        _table([r for r in var if "packed_us" in r],
               ["seq", "causal", "variant", "sequences", "l_max", "packed_us", "padded_us",
                "ratio"], title=f"packed (cu_seqlens) vs padded to the longest, "
                                f"W={args.world_size}, {opts['device']} (ratio: padded/packed)")
        _table([r for r in var if "dense_us" in r],
               ["seq", "causal", "variant", "dense_us", "time_us", "ratio"],
               title=f"default attn_fn, one process, {opts['device']} (ratio: / dense)")
    kern = [r for r in records if r.get("section") == "kernel"]
    if kern:
        _table(kern, ["seq", "causal", "op", "kernel", "gpu_us", "host_us", "ratio"],
                           title=f"one ring step, [1, {opts['kernel_seq']}, {opts['heads']}, "
                                 f"{opts['head_dim']}], {opts['device']}")
    meta = common.meta(opts["device"], args.world_size, bench="ring",
                       dtype="bf16" if opts["device"] == "cuda" else "fp32",
                       geometry=f"q [1, S/W, {opts['heads']}, {opts['head_dim']}], "
                                f"k/v {opts['kv_heads']} heads")
    series = common.plot_series(ex, lambda r: f"{r['variant']} causal={int(r['causal'])}", "seq",
                                "time_us")
    plot = dict(series=series, xlabel="total sequence length S", ylabel="µs per forward",
                logx=True, title=f"ring / Ulysses / USP, W={args.world_size}, "
                                 f"{meta.get('gpu') or 'cpu'}")
    emit(args, Report(meta=meta, records=records, markdown=markdown_report(meta, records),
                      plot=plot))
    return 0


def markdown_report(meta: dict, records: list[dict]) -> str:
    """A Markdown page: the run's facts, the forward times per variant, the ring's per-step
    compute and transfer, and (with --kernels) the merge and attention costs."""
    where = meta.get("machine") or meta.get("host")
    lines = [f"# Ring attention, Ulysses, USP — {meta.get('date')}, {where}", "",
             f"W={meta.get('world_size')}, {meta.get('dtype')}, GPU {meta.get('gpu')}; torch "
             f"{meta.get('torch')}, Triton {meta.get('triton')}; {meta.get('geometry')}. "
             "Time: slowest-rank median per forward.", ""]
    ex = [r for r in records if r.get("section") == "exchange"]
    if ex:
        lines += common.markdown_lines(
            ["S", "causal", "variant", "µs", "compute µs", "transfer µs", "per step compute",
             "per step transfer", "exposed µs"],
            [[r["seq"], int(r["causal"]), r["variant"],
              *(r.get(k) for k in ("time_us", "compute_us", "transfer_us", "per_step_compute_us",
                                   "per_step_transfer_us", "exposed_us"))] for r in ex])
    var = [r for r in records if r.get("section") == "varlen"]
    if var:
        lines += [""] + common.markdown_lines(
            ["S", "causal", "variant", "sequences", "L_max", "packed µs", "padded µs",
             "padded / packed"],
            [[r["seq"], int(r["causal"]), r["variant"], r["sequences"], r["l_max"],
              r["packed_us"], r["padded_us"], r["ratio"]] for r in var if "packed_us" in r])
        lines += [""] + common.markdown_lines(
            ["tokens", "causal", "default attn_fn", "dense µs", "µs", "/ dense"],
            [[r["seq"], int(r["causal"]), r["variant"], r["dense_us"], r["time_us"],
              r["ratio"]] for r in var if "dense_us" in r])
    kern = [r for r in records if r.get("section") == "kernel"]
    if kern:
        lines += [""] + common.markdown_lines(
            ["S_r", "causal", "op", "kernel", "GPU µs", "host µs", "ratio"],
            [[r["seq"], int(r["causal"]), r["op"], r["kernel"],
              *(r.get(k) for k in ("gpu_us", "host_us", "ratio"))] for r in kern])
    return "\n".join(lines) + "\n"


def main(args) -> int:
    config.force_safe_env()
    opts = _defaults(args)
    why = _error(opts, args.world_size)
    if why:
        return usage_error("ring", why)
    records: list = []
    if opts["kernels"]:
        device = torch.device("cuda", 0) if opts["device"] == "cuda" else torch.device("cpu")
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        records += [dict(r, section="kernel") for r in kernel_records(
            device, opts["kernel_seq"], opts["heads"], opts["head_dim"], dtype, opts["iters"])]
    if not opts["kernels_only"]:
        result = common.run_ranks(run_rank, args.world_size, opts["device"], (opts,))[0]
        records += result["records"]
    if not records:
        print("bench ring: nothing to run", file=sys.stderr)
        return 2
    return report(records, args, opts)

