"""Soak of the peer-mapped exchanges on ranks that share one GPU: thousands of ``symm_a2a``
merges in CUDA-graph replays and hundreds of Ulysses ``ce`` attention layers, fresh inputs on
every call, every output checked.

- ``symm_a2a``: one ``DcpMerger``, two graphs (two token counts, as an engine captures one per
  batch size) of ``PER_GRAPH`` merges each into their own destinations, replayed alternately
  with fresh inputs (rows with empty shards among them), an eager merge after every
  ``EAGER_EVERY`` replays (the device epoch runs through graphs and eager calls alike). Each
  merge against the fp64 merge of the same inputs (every rank draws every rank's inputs from
  the step's seed, so no reference needs a collective).
- ``ce``: ``UlyssesAttention(backend="ce")`` (sequential and 2 head groups alternately, GQA,
  uneven heads) against the same module over ``all_to_all``, bit for bit.

A ``PeerTimeoutError`` counts as a timeout and ends that exchange's soak (its object is broken).

``python -m attncomm.testing.soak --json PATH [--merges 5000] [--layers 500]``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

from attncomm import config, dcp, ulysses
from attncomm.bench.common import SHARED_GPU_NOTE
from attncomm.errors import PeerTimeoutError
from attncomm.launch import launch
from attncomm.testing.reference import ref_merge
from attncomm.ulysses.policy import get_transport

__all__ = ["soak_rank", "main", "PER_GRAPH"]

PER_GRAPH = 10     # merges captured in one graph (an engine's graph holds every layer)
EAGER_EVERY = 25   # an eager merge after this many replays
H, D = 16, 128


def _merge_inputs(gen, rank, world, n, dev):
    outs = torch.randn((world, n, H, D), generator=gen, device=dev)
    lses = torch.randn((world, n, H), generator=gen, device=dev) * 4
    empty = torch.rand((world, n, H), generator=gen, device=dev) < 0.1
    lses[empty] = float("-inf")
    outs[empty.unsqueeze(-1).expand_as(outs)] = float("nan")  # never read
    lses[:, 0] = float("-inf")  # row 0 is empty on every rank: exactly 0, LSE −inf
    outs = outs.to(torch.bfloat16)
    hs = H // world
    sl = slice(rank * hs, (rank + 1) * hs)
    want, want_lse = ref_merge(outs[:, :, sl], lses[:, :, sl])
    return outs[rank], lses[rank], want, want_lse


def _merge_bad(got, got_lse, want, want_lse) -> bool:
    g = got.double()
    if not bool(torch.isfinite(g).all()):
        return True
    empty = torch.isneginf(want_lse)
    if not bool((g[empty] == 0).all()) or not torch.equal(torch.isneginf(got_lse), empty):
        return True
    return not bool(((g - want).abs() <= 1.6e-2 * (1 + want.abs())).all())


def _soak_merges(rank, world, merges, timeout_s, seed):
    dev = torch.device("cuda", torch.cuda.current_device())
    m = dcp.DcpMerger(max_tokens=64, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                      backend="symm_a2a", timeout_s=timeout_s)
    hs = H // world
    graphs = []
    for n in (5, 37):
        ins = [(torch.zeros((n, H, D), dtype=torch.bfloat16, device=dev),
                torch.zeros((n, H), device=dev)) for _ in range(PER_GRAPH)]
        outs = [(torch.empty((n, hs, D), dtype=torch.bfloat16, device=dev),
                 torch.empty((n, hs), device=dev)) for _ in range(PER_GRAPH)]
        m.accept(*ins[0])
        for (o, l), (r, rl) in zip(ins, outs):  # the eager warm-up of the shape
            m.into(o, l, r, rl)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for (o, l), (r, rl) in zip(ins, outs):
                m.into(o, l, r, rl)
        graphs.append((n, graph, ins, outs))
    calls = bad = timeouts = 0
    e0 = int(m._impl.ws.state[0]) if hasattr(m._impl, "ws") else 0
    t0 = time.monotonic()
    step = 0
    try:
        while calls < merges:
            n, graph, ins, outs = graphs[step % 2]
            gen = torch.Generator(device=dev).manual_seed(seed + step)
            wants = []
            for (o, l) in ins:
                out, lse, want, want_lse = _merge_inputs(gen, rank, world, n, dev)
                o.copy_(out)
                l.copy_(lse)
                wants.append((want, want_lse))
            for r, rl in outs:
                r.fill_(float("nan"))
                rl.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            m.check()
            bad += sum(_merge_bad(r, rl, w, wl) for (r, rl), (w, wl) in zip(outs, wants))
            calls += PER_GRAPH
            if step % EAGER_EVERY == EAGER_EVERY - 1:
                out, lse, want, want_lse = _merge_inputs(gen, rank, world, 11, dev)
                got, got_lse = m(out, lse, return_lse=True)
                torch.cuda.synchronize()
                m.check()
                bad += _merge_bad(got, got_lse, want, want_lse)
                calls += 1
            step += 1
    except PeerTimeoutError:
        timeouts += 1
    seconds = time.monotonic() - t0
    epochs = int(m._impl.ws.state[0]) - e0 if hasattr(m._impl, "ws") else None
    m.close()
    return {"exchange": "symm_a2a", "calls": calls, "mismatches": int(bad),
            "timeouts": timeouts, "seconds": round(seconds, 2), "epochs_advanced": epochs,
            "backend": m.backend}


def _soak_layers(rank, world, layers, timeout_s, seed):
    dev = torch.device("cuda", torch.cuda.current_device())
    hq, hkv, s_r = 4 * world + 2, 2, 256  # GQA; q heads uneven over the ranks at W ≥ 3
    mods = {(b, g): ulysses.UlyssesAttention(backend=b, pipeline_groups=g, timeout_s=timeout_s)
            for b in ("ce", "all_to_all") for g in (0, 2)}
    calls = bad = timeouts = 0
    t0 = time.monotonic()
    try:
        for i in range(layers):
            gen = torch.Generator(device=dev).manual_seed(seed + 10 * i + rank)
            q = torch.randn((1, s_r, hq, 64), generator=gen, device=dev).to(torch.bfloat16)
            k = torch.randn((1, s_r, hkv, 64), generator=gen, device=dev).to(torch.bfloat16)
            v = torch.randn((1, s_r, hkv, 64), generator=gen, device=dev).to(torch.bfloat16)
            g = 2 if i % 2 else 0
            got = mods[("ce", g)](q, k, v, causal=bool(i % 3 == 0))
            want = mods[("all_to_all", g)](q, k, v, causal=bool(i % 3 == 0))
            torch.cuda.synchronize()
            bad += int(not torch.equal(got.view(torch.int16), want.view(torch.int16)))
            calls += 1
        get_transport(None, "ce", dev, timeout_s)  # raises a timeout the last call recorded
    except PeerTimeoutError:
        timeouts += 1
    seconds = time.monotonic() - t0
    for mod in mods.values():
        mod.close()
    return {"exchange": "ce", "calls": calls, "mismatches": int(bad), "timeouts": timeouts,
            "seconds": round(seconds, 2), "backend": "ce vs all_to_all, UlyssesAttention"}


def soak_rank(rank, world, merges, layers, timeout_s, seed):
    """One rank of the soak: ``[merge record, layer record]`` (rank 0's are reported)."""
    return [_soak_merges(rank, world, merges, timeout_s, seed),
            _soak_layers(rank, world, layers, timeout_s, seed)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncomm.testing.soak",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--merges", type=int, default=5000)
    ap.add_argument("--layers", type=int, default=500)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the soak needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    per_rank = launch(soak_rank, a.world, device="cuda", ranks_per_gpu=a.world,
                      args=(a.merges, a.layers, a.timeout, a.seed))
    records = []
    for i in range(2):  # every rank's counts summed; seconds: the slowest rank's
        recs = [r[i] for r in per_rank]
        rec = dict(recs[0])
        rec["mismatches"] = sum(r["mismatches"] for r in recs)
        rec["timeouts"] = sum(r["timeouts"] for r in recs)
        rec["seconds"] = max(r["seconds"] for r in recs)
        records.append(rec)
    for rec in records:
        print(f"{rec['exchange']}: {rec['calls']} calls, {rec['mismatches']} mismatches, "
              f"{rec['timeouts']} timeouts, {rec['seconds']:.1f} s")
    print(f"soak done in {time.monotonic() - t0:.0f} s (W={a.world} on one GPU; "
          f"{SHARED_GPU_NOTE})")
    if a.json:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0), "world_size": a.world,
                "machine": config.raw("ATTNCOMM_MACHINE") or None,
                "shared_gpu": SHARED_GPU_NOTE, "seed": a.seed,
                "timeout_s": a.timeout}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "records": records}, fh, indent=1)
            fh.write("\n")
    ok = all(r["mismatches"] == 0 and r["timeouts"] == 0 for r in records)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
