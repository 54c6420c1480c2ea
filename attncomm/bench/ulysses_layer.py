"""``attncomm bench ulysses --layer``: a MiniMax-H3-like attention layer through
``UlyssesAttention``, sequential and pipelined, per transport, and the attention alone.

Layer: B = 1, S ∈ ``--layer-seq`` (default 8192 and 32768), ``--layer-heads`` query heads
(default 56) and as many KV heads unless ``--layer-kv-heads``, D = 128, bf16, non-causal SDPA,
with and without qk_norm + RoPE. Variants (``--layer-variants``):

- ``attention_only``: SDPA on this rank's head-sharded q, k, v ``[1, S, H/W, 128]``;
- ``sequential_all_to_all``, ``sequential_ce``: ``pipeline_groups=0``, norm + RoPE as their
  own pass, the transport packs (the unfused path);
- ``pipelined_auto``: the module's defaults (``pipeline_groups=-1``, the fused fill);
- ``pipelined_g2/g4/g7/g8``: N head groups, unfused;
- ``pipelined_fused``: ``auto_groups``'s count with the fused fill.

DiT options: ``--joint S_j`` adds ``S_j`` joint rows (the same on every rank, at the
front: a DiT's text tokens) to every forward, and ``attention_only`` runs over ``S + S_j``
rows; ``--payload none fp8`` runs every variant with each payload (``fp8``:
``payload_dtype=torch.float8_e4m3fn``). ``pipelined_auto`` measures its decision on CUDA
(``UlyssesAttention.pipeline_decision``: groups, both times, the reason when sequential is
kept), recorded as ``decision``.

Each record: ``{"variant", "transport", "seq", "heads", "groups", "qk_norm", "payload",
"joint", "time_us", ...}`` (slowest rank's median, eager, a barrier before every iteration). A
``summary`` record per (seq, qk_norm, payload) holds ``hidden = (sequential_all_to_all −
pipelined_auto) / (sequential_all_to_all − attention_only)`` and whether every variant's output
was bitwise equal (within one payload). ``--trace DIR``: a torch.profiler trace per variant
(rank 0 writes ``DIR/<variant>-<transport>-S<seq>-norm<0|1>-<payload>.json``) and the
per-layer budget from it (wall = compute union + exposed exchange + idle,
``bench/ulysses_timeline.py``).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.distributed as dist

from .. import collectives
from torch.profiler import ProfilerActivity, profile

from . import ulysses_timeline as timeline
from .common import markdown_lines
from ..ulysses.api import dense
from ..ulysses.attention import UlyssesAttention, auto_groups, sdpa_attention
from ..ulysses.fp8 import FP8_DTYPE
from ..ulysses.layout import head_split

__all__ = ["VARIANTS", "PAYLOADS", "layer_records", "variant_settings"]

VARIANTS = ("attention_only", "sequential_all_to_all", "sequential_ce", "pipelined_auto",
            "pipelined_g2", "pipelined_g4", "pipelined_g7", "pipelined_g8", "pipelined_fused")
#: ``--payload`` names → ``payload_dtype``.
PAYLOADS = {"none": None, "fp8": FP8_DTYPE}


def variant_settings(variant: str, transport: str, rule_groups: int):
    """``(backend, pipeline_groups, fuse_qk_norm_rope)`` of a module variant on ``transport``,
    or None when the variant does not run there."""
    if variant.startswith("sequential_"):
        return (transport, 0, False) if variant == f"sequential_{transport}" else None
    if variant == "pipelined_auto":
        return transport, -1, True
    if variant == "pipelined_fused":
        return transport, rule_groups if rule_groups > 1 else 0, True
    if variant.startswith("pipelined_g"):
        return transport, int(variant[len("pipelined_g"):]), False
    return None


def _inputs(world, rank, seq_total, heads, kv_heads, norm, device, dtype, s_j=0):
    torch.manual_seed(4321 + seq_total + rank)
    seq = tuple(head_split(seq_total, world))
    q, k, v = (torch.randn(1, seq[rank], h, 128, device=device).to(dtype)
               for h in (heads, kv_heads, kv_heads))
    g = torch.Generator(device="cpu").manual_seed(99 + seq_total)  # the same on every rank
    joint = (tuple(torch.randn(1, s_j, h, 128, generator=g).to(device=device, dtype=dtype)
                   for h in (heads, kv_heads, kv_heads)) if s_j else None)
    qk_norm = rope = None
    if norm:
        qk_norm = (torch.randn(128, generator=g).to(device), torch.randn(128, generator=g)
                   .to(device), 1e-6)
        pos = torch.arange(seq_total, dtype=torch.float64)[:, None]
        ang = pos * 10000.0 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)
        ang = torch.cat((ang, ang), dim=-1)
        rope = (ang.cos().float().to(device), ang.sin().float().to(device))
    h_r, kv_r = head_split(heads, world)[rank], head_split(kv_heads, world)[rank]
    packed = torch.randn(seq_total + s_j, 1, h_r + 2 * max(kv_r, 1), 128,
                         device=device).to(dtype)
    local = (packed[:, :, :h_r].permute(1, 0, 2, 3),
             packed[:, :, h_r:h_r + max(kv_r, 1)].permute(1, 0, 2, 3),
             packed[:, :, h_r + max(kv_r, 1):].permute(1, 0, 2, 3))
    return (q, k, v), seq, qk_norm, rope, local, joint


def _trace(fn, path, cpu_g, rank, iters=3) -> dict | None:
    """Profile ``iters`` back-to-back calls (one barrier before); rank 0 writes ``path``; every
    rank returns its budget (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    fn()
    torch.cuda.synchronize()
    dist.barrier(group=cpu_g)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    gpu, _ = timeline.load_trace(path)
    if rank != 0:
        os.remove(path)
    return timeline.budget(gpu, iters)


def layer_records(rank, world, opts, transports, dtype, device, cpu_g, time_fn) -> list[dict]:
    """Every variant per (seq, qk_norm, payload, transport); ``time_fn(fn) → slowest-rank
    median µs``."""
    heads = opts["layer_heads"]
    kv_heads = opts.get("layer_kv_heads") or heads
    s_j = opts.get("joint") or 0
    records = []
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 132)
    for seq_total in opts["layer_seqs"]:
        rule = auto_groups(head_split(heads, world), 1, seq_total + s_j, sms)
        for norm in opts["layer_norms"]:
            (q, k, v), seq, qk_norm, rope, local, joint = _inputs(
                world, rank, seq_total, heads, kv_heads, norm, device, dtype, s_j)
            attention = {}  # attention_only's time, the baseline of every payload's summary
            for payload in opts.get("payloads") or ["none"]:
                base = dict(seq=seq_total, heads=heads, kv_heads=kv_heads, qk_norm=norm,
                            world_size=world, geometry="layer", mode="eager", payload=payload,
                            joint=s_j)
                outs, times = {}, dict(attention)
                for variant in opts["layer_variants"]:
                    if variant == "attention_only" and payload != "none":
                        continue  # no exchange: the same as the plain payload's
                    runs = ([("none", None)] if variant == "attention_only" else
                            [(t, variant_settings(variant, t, rule)) for t in transports])
                    for tname, settings in runs:
                        if variant != "attention_only" and settings is None:
                            continue
                        rec = dict(base, variant=variant, transport=tname)
                        fn = _variant(rec, settings, local, (q, k, v), seq, qk_norm, rope,
                                      joint, payload, outs)
                        rec["time_us"] = time_fn(fn)
                        if opts.get("trace"):
                            name = (f"{variant}-{tname}-S{seq_total}-norm{int(norm)}-"
                                    f"{payload}.json")
                            rec["budget"] = _trace(fn, os.path.join(opts["trace"], name),
                                                   cpu_g, rank)
                        times[(variant, tname)] = rec["time_us"]
                        records.append(rec)
                attention = {k: t for k, t in times.items() if k[0] == "attention_only"}
                records.append(_summary(base, outs, times, cpu_g))
    return records


def _variant(rec, settings, local, qkv, seq, qk_norm, rope, joint, payload, outs):
    """The timed function of one variant (its first output kept in ``outs``; the record gets
    the groups, transport and, for ``pipeline_groups=-1``, the decision)."""
    if settings is None:
        def fn(local=local):
            return dense(sdpa_attention(*local, False))
        rec["groups"] = None
        return fn
    backend, groups, fused = settings
    mod = UlyssesAttention(backend=backend, pipeline_groups=groups, qk_norm=qk_norm,
                           fuse_qk_norm_rope=fused, validate=False,
                           payload_dtype=PAYLOADS[payload])
    fn = functools.partial(mod, *qkv, seq_lens=seq, rope=rope, joint=joint)
    first = fn()
    outs[(rec["variant"], rec["transport"])] = (first[0] if joint is not None
                                                 else first).clone()
    rec.update(groups=mod.last_pipeline_groups, groups_requested=groups, fused_fill=fused,
               transport=mod.last_backends.get("in"))
    if mod.pipeline_decision is not None:
        rec["decision"] = dataclasses.asdict(mod.pipeline_decision)
    return fn


def _summary(base, outs, times, cpu_g) -> dict:
    vals = list(outs.values())
    same = all(torch.equal(vals[0], o) for o in vals[1:]) if vals else True
    flag = torch.tensor([int(same)])
    collectives.all_reduce(flag, op=dist.ReduceOp.MIN, group=cpu_g)
    seq_a2a = times.get(("sequential_all_to_all", "all_to_all"))
    att = times.get(("attention_only", "none"))
    autos = {t: v for (name, t), v in times.items() if name == "pipelined_auto"}
    hidden = {}
    if seq_a2a is not None and att is not None and seq_a2a > att:
        hidden = {t: (seq_a2a - v) / (seq_a2a - att) for t, v in autos.items()}
    return dict(base, variant="summary", transport=None, bitwise_equal=bool(flag.item()),
                hidden_vs_sequential_all_to_all=hidden,
                auto_vs_attention_only={t: v / att for t, v in autos.items()} if att else {})


def markdown_rows(records: list[dict]) -> list[str]:
    """The layer section of the Markdown report: one row per timed record."""
    rows = [r for r in records if r.get("geometry") == "layer" and r["variant"] != "summary"]
    if not rows:
        return []
    lines = ["", "## Attention layer: sequential vs pipelined", "",
             "Slowest-rank median per forward, eager. groups: head groups the forward used; "
             "fused: norm + RoPE inside the fill kernel; payload: the q/k/v exchange's (fp8: "
             "e4m3 rows + fp32 scale); joint: joint rows per forward.", ""]
    lines += markdown_lines(
        ["S", "joint", "qk_norm", "payload", "variant", "transport", "groups", "fused",
         "time µs", "budget"],
        [[r["seq"], r.get("joint", 0), int(r["qk_norm"]), r.get("payload", "none"), r["variant"],
          r["transport"], r.get("groups") or None, int(bool(r.get("fused_fill"))), r["time_us"],
          timeline.format_budget(r["budget"]) if r.get("budget") else None] for r in rows])
    for r in rows:
        d = r.get("decision")
        if d:
            lines.append(f"\nS={r['seq']} payload={r.get('payload')} {r['transport']}: "
                         f"pipeline_groups=-1 decided {d['groups']} (candidate "
                         f"{d['candidate_groups']}; sequential {d['sequential_us']} µs, "
                         f"pipelined {d['pipelined_us']} µs; {d['fallback_reason']})")
    for r in records:
        if r.get("variant") == "summary":
            lines.append(f"\nS={r['seq']} qk_norm={int(r['qk_norm'])} payload="
                         f"{r.get('payload', 'none')}: bitwise equal {r['bitwise_equal']}; "
                         f"hidden (vs sequential_all_to_all) "
                         f"{r['hidden_vs_sequential_all_to_all']}")
    return lines

