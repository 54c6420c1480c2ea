"""A one-GPU rehearsal of UlyssesAttention's head-group schedule: W simulated ranks in one
process, their exchanges on a copy engine, and the timeline that shows whether it overlaps.

Every simulated rank has its own sequence shard of q, k, v ``[1, S/W, H, D]``. Per head group,
each rank's fill kernel (norm + RoPE + pack, ``attncomm/ulysses/fill.py``) writes every
destination's rows straight into that destination's receive buffer (on this GPU: the data the
copy engines would have delivered over NVLink); then, as the exchange's stand-in, one copy per
(source, peer) moves the same message into the peer's slot in pinned host memory on a copy
stream, with its bytes scaled by ``host_bandwidth / nvlink_bandwidth`` so that it takes about
as long as the real message over NVLink (a same-device copy would behave like a kernel, not a
copy engine: ../shared/HARDWARE.md). Attention of group g waits for group g's copies (an event
between streams); group g+1's fill and copies are enqueued before group g's attention; each
group's output rows are written into their final place in every rank's ``out``, and the
output exchange's stand-in copies follow on a second copy stream. The host never waits for
the GPU inside a layer.

Reports, for the pipelined schedule (``auto_groups``'s count) and the sequential one: output
bitwise equal between the two, the per-layer budget (wall = compute + exposed exchange +
idle), the GPU's idle gaps between compute kernels (target: none over 20 µs), how far the host
ran ahead, and per group the share of group g+1's input copies that ran under group g's
attention. With ``--graph`` each schedule is also captured in a CUDA graph after one eager
layer (fills, copies, events between the streams, attention: the whole layer) and replayed:
the replay's output bitwise against the eager layer, the host µs per replayed layer, and the
same timeline figures for back-to-back replays. These overlap figures come from one GPU whose
copies go over PCIe to host memory, with scaled bytes, and W ranks' attention sharing its SMs:
they are NOT NVLink figures.

DiT options: ``--joint S_j`` gives every simulated rank ``S_j`` joint rows (a DiT's
text tokens, the same on every rank): each rank copies its heads of them into the first ``S_j``
rows of its receive buffers (the fill writes the exchanged rows after them), attention runs
over ``[joint; sequence]``, the joint rows' output lands in ``joint_out`` (``[1, S_j, H, D]``,
every head) and the head gather's stand-in copies ``S_j × heads`` rows to each peer.
``--payload none fp8`` runs each geometry with each q/k/v payload: with ``fp8`` the fill writes
the FP8 wire rows (``D + 4`` bytes per (token, head), ``ulysses/fp8.py``), the input stand-in
copies move those bytes (about half the bf16 ones, so half the scaled copy time, which the
budget shows) and each group's rows are dequantized into bf16 before its attention.

    python scripts/ulysses_one_gpu.py [--world-size 2] [--seq 8192 32768] [--heads 56]
        [--groups -1] [--nvlink-gbps 393] [--graph] [--joint S_j] [--payload none fp8]
        [--json PATH] [--markdown PATH] [--trace-dir DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from attncomm.bench import ulysses_timeline as timeline  # noqa: E402
from attncomm.ulysses import fp8  # noqa: E402
from attncomm.ulysses.attention import auto_groups, sdpa_attention  # noqa: E402
from attncomm.ulysses.fill import FillPart, FillPlan  # noqa: E402
from attncomm.ulysses.layout import group_head_ranges, head_offsets, head_split  # noqa: E402

NOT_NVLINK = ("NOTE: one GPU, copies to pinned host memory over PCIe with bytes scaled to "
              "NVLink time, W ranks sharing one GPU's SMs: these overlap figures are NOT "
              "NVLink figures.")
_ATTN = re.compile(r"flash|fmha|attention|sdpa|efficient", re.IGNORECASE)
#: NVLink one-direction copy-engine bandwidth on 2x H200 (../shared/HARDWARE.md), GB/s.
NVLINK_GBPS = 393.0


def host_copy_gbps(device, nbytes=256 << 20) -> float:
    """Device → pinned host copy bandwidth (GB/s), median of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    times.sort()
    return nbytes / times[len(times) // 2] / 1e9


class Rehearsal:
    """W simulated ranks of one Ulysses layer (H query = KV heads, D, bf16) on this GPU, with
    ``joint`` joint rows and the ``payload`` ("none" or "fp8") of the q/k/v exchange."""

    def __init__(self, world, seq_total, heads, head_dim=128, norm=True, scale=1.0, seed=0,
                 joint=0, payload="none"):
        self.W, self.S, self.H, self.D = world, seq_total, heads, head_dim
        self.S_j, self.fp8 = joint, payload == "fp8"
        self.dev = torch.device("cuda")
        self.seq = head_split(seq_total, world)
        self.off = head_offsets(self.seq)
        self.scale = scale
        g = torch.Generator(device="cpu").manual_seed(seed)
        dt = torch.bfloat16
        self.qkv = [[torch.randn((1, s, heads, head_dim), generator=g).to(dt).to(self.dev)
                     for _ in range(3)] for s in self.seq]
        self.eps = 1e-6
        self.w = ((torch.randn(head_dim, generator=g).to(self.dev),
                   torch.randn(head_dim, generator=g).to(self.dev)) if norm else (None, None))
        pos = torch.arange(seq_total, dtype=torch.float64)[:, None]
        ang = pos * 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        ang = torch.cat((ang, ang), dim=-1)
        self.rope = norm
        self.cos, self.sin = ang.cos().float().to(self.dev), ang.sin().float().to(self.dev)
        self.joint = [torch.randn((1, joint, heads, head_dim), generator=g).to(dt).to(self.dev)
                      for _ in range(3)]
        most = max(self.seq) * heads * 2 * head_dim * 3 + joint * heads * head_dim * 2
        self.slots = [torch.empty(max(256, int(most * scale) + 256), dtype=torch.uint8,
                                  pin_memory=True) for _ in range(world)]
        self.copy_in = torch.cuda.Stream(self.dev)
        self.copy_out = torch.cuda.Stream(self.dev)
        self.out = torch.empty(1, seq_total, heads, head_dim, dtype=dt, device=self.dev)
        self.joint_out = torch.empty(1, joint, heads, head_dim, dtype=dt, device=self.dev)
        self._bufs: dict = {}
        self.host = collections.Counter()  # host seconds per phase of layer()

    def _stand_in(self, src_flat, nbytes, p):
        """The exchange's stand-in for one message of ``nbytes``: ``(peer p's pinned slot,
        source)`` views of that × scale bytes of ``src_flat`` (contiguous, device), or None."""
        raw = src_flat.view(torch.uint8)
        n = (int(nbytes * self.scale) + 255) // 256 * 256
        n = min(n, raw.numel(), self.slots[p].numel())
        return (self.slots[p][:n], raw[:n]) if n else None

    def _plan(self, groups, g):
        """Everything group g enqueues, built once per (groups, g) and kept across layers (no
        per-layer views, parts, events or allocations; each rank's fill prepared once, as
        ``UlyssesAttention``'s plan prepares it): fill calls per rank, input and output
        stand-in copies, attention inputs and the output rows' places."""
        key = (groups, g)
        if key in self._bufs:
            return self._bufs[key]
        W, ranges = self.W, group_head_ranges(self.H, self.W, groups)[g]
        n = [hi - lo for lo, hi in ranges]
        s_j, row = self.S_j, fp8.row_bytes(self.D) if self.fp8 else self.D
        # the landing buffer attention reads: [S_j + S, 1, 3n, D], joint rows first
        land = [torch.empty(s_j + self.S, 1, 3 * n[p], self.D, dtype=torch.bfloat16,
                            device=self.dev) for p in range(W)]
        wire = ([torch.empty(self.S, 1, 3 * n[p], row, dtype=torch.uint8, device=self.dev)
                 for p in range(W)] if self.fp8 else [x[s_j:] for x in land])
        fills = []
        for s in range(W):
            q, k, v = self.qkv[s]
            o, ln = self.off[s], self.seq[s]
            parts = [FillPart(q, tuple(ranges), self.w[0], self.rope),
                     FillPart(k, tuple(ranges), self.w[1], self.rope),
                     FillPart(v, tuple(ranges))]
            fills.append((FillPlan(parts, self.eps, self.rope, "triton",
                                   payload_dtype=fp8.FP8_DTYPE if self.fp8 else None),
                          (q, k, v), self.cos[o:o + ln], self.sin[o:o + ln],
                          [wire[p][o:o + ln].view(-1) for p in range(W)]))
        item = 1 if self.fp8 else 2
        ins = [self._stand_in(wire[p][self.off[s]:self.off[s] + self.seq[s]].reshape(-1),
                              self.seq[s] * 3 * n[p] * row * item, p)
               for s in range(W) for p in range(W) if p != s]
        attn, outs, joints, deq = [], [], [], []
        for p, (lo, hi) in enumerate(ranges):
            if hi > lo:
                m = hi - lo
                buf = land[p].permute(1, 0, 2, 3)
                attn.append((buf[:, :, :m], buf[:, :, m:2 * m], buf[:, :, 2 * m:],
                             self.out[:, :, lo:hi], self.joint_out[:, :, lo:hi]))
                joints += [(land[p][:s_j, 0, i * m:(i + 1) * m], x[0, :, lo:hi])
                           for i, x in enumerate(self.joint) if s_j]
                if self.fp8:
                    deq.append((wire[p], land[p][s_j:]))
                outs += [self._stand_in(land[p].view(-1), self.seq[s] * m * self.D * 2, s)
                         for s in range(W) if s != p]
                outs += [self._stand_in(land[p].view(-1), s_j * m * self.D * 2, s)
                         for s in range(W) if s != p and s_j]  # the joint rows' head gather
        plan = (fills, [x for x in ins if x], attn, [x for x in outs if x],
                torch.cuda.Event(), torch.cuda.Event(), torch.cuda.Event(), joints, deq)
        self._bufs[key] = plan
        return plan

    def _fill_group(self, plan, cur):
        """Every rank's fill of a group into every destination's receive buffer (and its heads
        of the joint rows into their rows), then the input exchange's stand-in copies; returns
        the event after the copies."""
        fills, ins, _, _, ready, done, _, joints, _ = plan
        t0 = time.perf_counter()
        for prepared, xs, cos, sin, regions in fills:
            prepared(xs, cos, sin, regions)
        for dst, src in joints:
            dst.copy_(src)
        t1 = time.perf_counter()
        ready.record(cur)
        self.copy_in.wait_event(ready)
        with torch.cuda.stream(self.copy_in):
            for dst, src in ins:
                dst.copy_(src, non_blocking=True)
        done.record(self.copy_in)
        self.host["fill"] += t1 - t0
        self.host["input copies + events"] += time.perf_counter() - t1
        return done

    def layer(self, groups: int):
        """One forward of every simulated rank with ``groups`` head groups (1 = sequential);
        returns each rank's output ``[1, S_r, H, D]`` (views of one ``[1, S, H, D]`` tensor,
        so a group's output rows land in every rank's ``out`` with one copy). Enqueues only."""
        cur = torch.cuda.current_stream(self.dev)
        plans = [self._plan(groups, g) for g in range(groups)]
        arrived = self._fill_group(plans[0], cur)
        for g in range(groups):
            nxt = None
            if g + 1 < groups:  # group g+1's fill runs while group g's copies are in flight
                nxt = self._fill_group(plans[g + 1], cur)
            t0 = time.perf_counter()
            cur.wait_event(arrived)
            for src, dst in plans[g][8]:  # FP8 rows → bf16, before attention
                fp8.dequantize_packed(src, torch.bfloat16, out=dst)
            s_j = self.S_j
            for q, k, v, dst, jdst in plans[g][2]:
                o = sdpa_attention(q, k, v, False)
                dst.copy_(o[:, s_j:])
                if s_j:
                    jdst.copy_(o[:, :s_j])
            t1 = time.perf_counter()
            finished = plans[g][6]
            finished.record(cur)
            self.copy_out.wait_event(finished)
            with torch.cuda.stream(self.copy_out):
                for dst, src in plans[g][3]:
                    dst.copy_(src, non_blocking=True)
            self.host["attention + placement"] += t1 - t0
            self.host["output copies + events"] += time.perf_counter() - t1
            arrived = nxt
        cur.wait_stream(self.copy_out)
        return [self.out[:, o:o + s] for o, s in zip(self.off, self.seq)]


def _overlap(gpu, groups, world) -> list[float | None]:
    """Per group g < G−1 (first profiled layer): the share of group g+1's input stand-in copies
    that ran under group g's attention kernels."""
    copies = [e for e in gpu if e.kind == "exchange"]
    if not copies:
        return []
    in_stream = copies[0].stream
    ins = [e for e in copies if e.stream == in_stream]
    attn = [e for e in gpu if e.kind == "compute" and _ATTN.search(e.name)]
    per_in, per_att = max(1, world * (world - 1)), world
    out = []
    for g in range(groups - 1):
        cg = ins[(g + 1) * per_in:(g + 2) * per_in]
        ag = timeline.union((e.start, e.end) for e in attn[g * per_att:(g + 1) * per_att])
        total = sum(e.end - e.start for e in cg)
        if not cg or not ag or total <= 0:
            out.append(None)
            continue
        under = sum(min(e.end, b) - max(e.start, a) for e in cg for a, b in ag
                    if min(e.end, b) > max(e.start, a))
        out.append(under / total)
    return out


def host_cost(sim, groups, layers=5, step=None) -> dict:
    """The host's time to enqueue ``layers`` layers (no profiler; ``step()`` each, default
    ``sim.layer(groups)``), per layer and per group, and per phase of ``layer()``; a sleep
    kernel keeps the GPU busy so the host never waits."""
    step = step or (lambda: sim.layer(groups))
    step()
    torch.cuda.synchronize()
    sim.host.clear()
    torch.cuda._sleep(100_000_000)
    t0 = time.perf_counter()
    for _ in range(layers):
        step()
    dt = (time.perf_counter() - t0) * 1e6
    torch.cuda.synchronize()
    per = layers * groups
    return {"host_us_per_layer": dt / layers, "host_us_per_group": dt / per,
            "host_us_per_group_by_phase": {k: v * 1e6 / per for k, v in sim.host.items()}}


def profile(sim, groups, layers, path, cpu_ops=False, step=None):
    """Trace ``layers`` back-to-back layers (``step()`` each, default ``sim.layer(groups)``);
    the timeline summary (see the module doc). ``cpu_ops``: also record every torch op on the
    host (the profiler's own host cost then slows the enqueue); off, the trace holds the GPU's
    work and the host's CUDA runtime calls, which is all the summary reads."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx
    step = step or (lambda: sim.layer(groups))
    step()
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu_ops else [])
    with prof_ctx(activities=acts) as prof:
        for _ in range(layers):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    gpu, host = timeline.load_trace(path)
    # syncs among the layers' enqueue: before the last runtime call that enqueued GPU work
    # (the window's closing synchronize comes after it and is the trace's, not the layers')
    corr = {e.correlation for e in gpu if e.correlation >= 0}
    last = max((h["start"] for h in host if h["correlation"] in corr), default=float("inf"))
    syncs = [h for h in host if "Synchronize" in h["name"] and h["start"] < last]
    gs = timeline.gaps(gpu)
    # between groups: inside a layer's span from its first attention kernel to its last
    attn = [e for e in gpu if e.kind == "compute" and _ATTN.search(e.name)]
    per_layer = max(1, len(attn) // layers)
    spans = [(attn[i].start, attn[min(len(attn), i + per_layer) - 1].end)
             for i in range(0, len(attn), per_layer)]
    inner = [x for t, x in gs if any(a <= t < b for a, b in spans)]
    return {"budget": timeline.budget(gpu, layers), "host": timeline.host_lead_us(gpu, host),
            "max_gap_between_groups_us": max(inner, default=0.0),
            "gaps_between_groups_over_20us": sum(1 for x in inner if x > 20.0),
            "max_gap_us": max((x for _, x in gs), default=0.0),
            "gaps_over_20us": sum(1 for _, x in gs if x > 20.0),
            "gaps_us_top": sorted((round(x, 1) for _, x in gs), reverse=True)[:8],
            "host_syncs_in_window": len(syncs),
            "overlap_next_copies_under_attention": _overlap(gpu, groups, sim.W)}


def captured(sim, groups):
    """One layer of ``groups`` head groups captured in a CUDA graph after an eager layer (its
    plans, tables and kernels made there): ``(graph, outputs)``; each replay rewrites the
    outputs."""
    sim.layer(groups)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = sim.layer(groups)
    torch.cuda.synchronize()
    return graph, outs


def graph_record(sim, groups, layers, trace_dir, tag, name) -> dict:
    """The captured layer: bitwise against the eager one, host µs per replayed layer, and the
    timeline of back-to-back replays."""
    graph, outs = captured(sim, groups)
    eager = [o.clone() for o in sim.layer(groups)]
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    path = os.path.join(trace_dir, f"ulysses-rehearsal-{name}-graph-{tag}.json")
    rec = profile(sim, groups, layers, path, step=graph.replay)
    rec.update(host_cost(sim, groups, step=graph.replay))
    rec["bitwise_equal_to_eager"] = all(torch.equal(a, b) for a, b in zip(outs, eager))
    return rec


def run(world, seq_total, heads, groups, nvlink_gbps, trace_dir, layers=3, norm=True,
        cpu_ops=False, graph=False, joint=0, payload="none"):
    """One geometry: bitwise check, then the traced pipelined and sequential schedules."""
    dev = torch.device("cuda")
    host_gbps = host_copy_gbps(dev)
    scale = min(1.0, host_gbps / nvlink_gbps)
    sim = Rehearsal(world, seq_total, heads, norm=norm, scale=scale, seed=seq_total,
                    joint=joint, payload=payload)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    g = groups if groups > 0 else auto_groups(head_split(heads, world), 1, seq_total + joint,
                                              sms)
    seq_out = [o.clone() for o in sim.layer(1)] + [sim.joint_out.clone()]
    pipe_out = sim.layer(max(g, 1)) + [sim.joint_out]
    torch.cuda.synchronize()
    rec = {"world_size": world, "seq": seq_total, "heads": heads, "head_dim": 128,
           "qk_norm": norm, "groups": g, "joint": joint, "payload": payload,
           "host_copy_gbps": host_gbps, "nvlink_gbps": nvlink_gbps, "bytes_scale": scale,
           "bitwise_equal_to_sequential": all(torch.equal(a, b)
                                              for a, b in zip(seq_out, pipe_out))}
    os.makedirs(trace_dir, exist_ok=True)
    tag = f"S{seq_total}-J{joint}-{payload}"
    for name, gg in (("pipelined", max(g, 1)), ("sequential", 1)):
        path = os.path.join(trace_dir, f"ulysses-rehearsal-{name}-{tag}.json")
        rec[name] = profile(sim, gg, layers, path, cpu_ops)
        rec[name].update(host_cost(sim, gg))
    if cpu_ops is False:  # the pipelined trace again with every host op recorded, for scale
        path = os.path.join(trace_dir, f"ulysses-rehearsal-pipelined-cpuops-{tag}.json")
        rec["pipelined_cpu_ops_traced"] = profile(sim, max(g, 1), layers, path, True)
    if graph:
        for name, gg in (("pipelined", max(g, 1)), ("sequential", 1)):
            rec[f"{name}_graph"] = graph_record(sim, gg, layers, trace_dir, tag, name)
    rec["note"] = NOT_NVLINK
    return rec


def markdown(records, meta) -> str:
    lines = [f"# Ulysses one-GPU rehearsal — {meta['date']}, {meta['gpu']}", "", NOT_NVLINK, "",
             "Gaps: GPU idle between compute kernels; 'between groups' counts those inside a "
             "layer's span from its first attention kernel to its last, 'all' adds the layer "
             "edges (the first group's input and the last group's output exchange).", "",
             "| S | joint | payload | groups | schedule | wall ms | compute ms | "
             "exposed exch. ms | idle ms | max gap between groups µs | > 20 µs | "
             "max gap all µs | > 20 µs | host lead ms | host syncs | host µs / group | "
             "bitwise |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        for name in ("pipelined", "sequential", "pipelined_cpu_ops_traced", "pipelined_graph",
                     "sequential_graph"):
            if name not in r:
                continue
            x, b = r[name], r[name]["budget"]
            hu = x.get("host_us_per_group")
            lines.append(
                f"| {r['seq']} | {r.get('joint', 0)} | {r.get('payload', 'none')} | "
                f"{1 if name.startswith('sequential') else r['groups']} | "
                f"{name} | "
                f"{b['wall_us'] / 1e3:.3f} | {b['compute_us'] / 1e3:.3f} | "
                f"{b['exposed_exchange_us'] / 1e3:.3f} | {b['idle_us'] / 1e3:.3f} | "
                f"{x['max_gap_between_groups_us']:.1f} | {x['gaps_between_groups_over_20us']} | "
                f"{x['max_gap_us']:.1f} | {x['gaps_over_20us']} | "
                f"{x['host']['lead_us'] / 1e3:.2f} | {x['host_syncs_in_window']} | "
                f"{'-' if hu is None else f'{hu:.0f}'} | {r['bitwise_equal_to_sequential']} |")
    for r in records:
        ov = r["pipelined"]["overlap_next_copies_under_attention"]
        lines.append(f"\nS={r['seq']} joint={r.get('joint', 0)} payload="
                     f"{r.get('payload', 'none')}: bytes scaled by {r['bytes_scale']:.3f} "
                     f"(host copy {r['host_copy_gbps']:.1f} GB/s vs NVLink "
                     f"{r['nvlink_gbps']:.0f} GB/s); "
                     "share of group g+1's input copies under group g's attention: "
                     + ", ".join("-" if v is None else f"{v:.2f}" for v in ov))
        by = r["pipelined"].get("host_us_per_group_by_phase", {})
        lines.append("host µs per pipelined group by phase (no profiler): "
                     + ", ".join(f"{k} {v:.0f}" for k, v in by.items()))
        for name in ("pipelined", "sequential"):
            if f"{name}_graph" in r:
                gr, eg = r[f"{name}_graph"], r[name]
                lines.append(
                    f"CUDA graph, {name}: host µs per layer {gr['host_us_per_layer']:.1f} "
                    f"(eager {eg['host_us_per_layer']:.1f}); replay bitwise equal to the eager "
                    f"layer: {gr['bitwise_equal_to_eager']}; max GPU gap between groups "
                    f"{gr['max_gap_between_groups_us']:.1f} µs (eager "
                    f"{eg['max_gap_between_groups_us']:.1f}), gaps over 20 µs "
                    f"{gr['gaps_over_20us']} (eager {eg['gaps_over_20us']})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--heads", type=int, default=56)
    p.add_argument("--groups", type=int, default=-1, help="-1: auto_groups's count")
    p.add_argument("--nvlink-gbps", type=float, default=NVLINK_GBPS)
    p.add_argument("--layers", type=int, default=3, help="layers per traced window")
    p.add_argument("--cpu-ops", action="store_true",
                   help="trace every host op too (the profiler's host cost slows the enqueue)")
    p.add_argument("--graph", action="store_true",
                   help="also capture each schedule's layer in a CUDA graph and replay it")
    p.add_argument("--joint", type=int, default=0, metavar="S_j",
                   help="joint rows per simulated rank (a DiT's text tokens; default 0)")
    p.add_argument("--payload", nargs="+", choices=("none", "fp8"), default=["none"],
                   help="q/k/v payloads to run (default none)")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--trace-dir", default="rehearsal-traces")
    args = p.parse_args(argv)
    if args.joint < 0:
        p.error(f"--joint must be ≥ 0, got {args.joint}")
    if not torch.cuda.is_available():
        print("ulysses_one_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    records = [run(args.world_size, s, args.heads, args.groups, args.nvlink_gbps,
                   args.trace_dir, args.layers, cpu_ops=args.cpu_ops, graph=args.graph,
                   joint=args.joint, payload=payload)
               for s in args.seq for payload in args.payload]
    from attncomm.bench import common
    meta = common.meta("cuda", args.world_size, bench="ulysses-rehearsal", dtype="bf16",
                       note=NOT_NVLINK)
    md = markdown(records, meta)
    print(md)
    if args.json:
        common.write_json(args.json, meta, records)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    ok = all(r["bitwise_equal_to_sequential"] for r in records) and all(
        r[k]["bitwise_equal_to_eager"] for r in records for k in r if k.endswith("_graph"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
