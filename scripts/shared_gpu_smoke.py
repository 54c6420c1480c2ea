"""A quick pass over every peer-mapped path on ranks that share one GPU, each check caught and
reported (a first look on a device before the GPU suite; the suite is ``tests/gpu``):

    python scripts/shared_gpu_smoke.py [--world 2 3] [--json PATH]

Per world size: the group's GPU layout and peer mapping; ``DcpMerger(backend="symm_a2a")`` eager
against fp64 and graph-replayed (captured in torch's default global mode right after eager
calls, so the watchdog's CUDA calls meet a capture); ``DcpQueryGather(backend="symm")`` bitwise;
``seq_to_head`` / ``head_to_seq`` over ``ce`` against the staged ``all_to_all``; a
``UlyssesAttention(backend="ce")`` forward captured in both capture modes; ``backend="auto"``'s
choice and its rule; the caller's own collectives between calls. Times are not speed figures.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attncomm  # noqa: E402
from attncomm import capability, collectives, dcp, ulysses  # noqa: E402
from attncomm.testing.reference import ref_merge  # noqa: E402


def _check(results: dict, name: str, fn) -> None:
    t0 = time.monotonic()
    try:
        detail = fn()
        results[name] = {"ok": True, "detail": detail, "seconds": round(time.monotonic() - t0, 2)}
    except Exception as exc:  # noqa: BLE001 - reported, the next check runs
        results[name] = {"ok": False, "detail": f"{type(exc).__name__}: {exc}",
                         "trace": traceback.format_exc()[-3000:],
                         "seconds": round(time.monotonic() - t0, 2)}


def _gather(x):
    W = torch.distributed.get_world_size()
    out = torch.empty((W * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.all_gather_tensor(out, x.contiguous())
    return out.view(W, *x.shape)


def _rank(rank, world):
    dev = torch.device("cuda", torch.cuda.current_device())
    res: dict = {}
    H, D = 8 * world, 64
    hs = H // world

    def layout():
        m = capability.peer_mapping(None)
        return {"gpus": capability.group_gpus(None).gpus, "shared": capability.group_gpus(
            None).shared_reason(), "mapping": (m.kind, m.why, m.unavailable),
            "backend": str(torch.distributed.get_backend())}
    _check(res, "layout", layout)

    state = {}

    def merge_eager():
        m = state["m"] = dcp.DcpMerger(max_tokens=32, num_heads=H, head_dim=D,
                                       dtype=torch.bfloat16, backend="symm_a2a", timeout_s=20)
        worst = 0.0
        for i, T in enumerate((1, 7, 32)):
            g = torch.Generator(device=dev).manual_seed(10 + i)
            outs = torch.randn((world, T, H, D), generator=g, device=dev).to(torch.bfloat16)
            lses = torch.randn((world, T, H), generator=g, device=dev)
            lses[world - 1, :, 0] = float("-inf")
            outs[world - 1, :, 0] = float("nan")
            got = m(outs[rank].contiguous(), lses[rank].contiguous())
            torch.cuda.synchronize()
            m.check()
            want, _ = ref_merge(outs[:, :, rank * hs:(rank + 1) * hs].double(),
                                lses[:, :, rank * hs:(rank + 1) * hs].double())
            err = ((got.double() - want).abs() / (1 + want.abs())).max().item()
            assert err < 2e-2, f"T={T}: error {err}"
            worst = max(worst, err)
        return {"worst_rel_err": worst, "mapping": m._impl.ws.mapping}
    _check(res, "symm_a2a eager", merge_eager)

    def merge_graph(mode):
        m = state["m"]
        T = 9
        out = torch.zeros((T, H, D), dtype=torch.bfloat16, device=dev)
        lse = torch.zeros((T, H), device=dev)
        m(out, lse)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            got = m(out, lse)
        bad = 0
        for i in range(30):
            g = torch.Generator(device=dev).manual_seed(100 + i)
            outs = torch.randn((world, T, H, D), generator=g, device=dev).to(torch.bfloat16)
            lses = torch.randn((world, T, H), generator=g, device=dev)
            out.copy_(outs[rank])
            lse.copy_(lses[rank])
            graph.replay()
            torch.cuda.synchronize()
            m.check()
            want, _ = ref_merge(outs[:, :, rank * hs:(rank + 1) * hs].double(),
                                lses[:, :, rank * hs:(rank + 1) * hs].double())
            bad += int(((got.double() - want).abs() / (1 + want.abs())).max().item() >= 2e-2)
        assert bad == 0, f"{bad} of 30 replays wrong"
        return {"replays": 30, "epoch": int(m._impl.ws.state[0])}
    _check(res, "symm_a2a graph (global)", lambda: merge_graph("global"))
    _check(res, "symm_a2a graph (thread_local)", lambda: merge_graph("thread_local"))
    _check(res, "symm_a2a close", lambda: state["m"].close())

    def gather():
        gq = dcp.DcpQueryGather(max_tokens=16, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                                backend="symm", timeout_s=20)
        for T in (1, 8, 16):
            q = torch.randn((T, hs, D), device=dev).to(torch.bfloat16)
            got = gq(q).clone()
            torch.cuda.synchronize()
            want = _gather(q).permute(1, 0, 2, 3).reshape(T, H, D)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"T={T}"
        gq.close()
        return "bitwise"
    _check(res, "gather symm", gather)

    def ce():
        h = 2 * world + 1
        lens = [64 + 8 * r for r in range(world)]
        bad = []
        for i in range(5):
            x = torch.randn((1, lens[rank], h, 64), device=dev).to(torch.bfloat16)
            a = ulysses.seq_to_head(x, seq_lens=lens, backend="ce")
            b = ulysses.seq_to_head(x, seq_lens=lens, backend="all_to_all")
            back = ulysses.head_to_seq(a, num_heads=h, seq_lens=lens, backend="ce")
            # the caller's own collective between library calls, of a size of its own
            flag = torch.full((3 + i,), float(rank), device=dev)
            got = torch.empty((world * (3 + i),), device=dev)
            collectives.all_gather_tensor(got, flag)
            if not torch.equal(a, b) or not torch.equal(back, x):
                bad.append(i)
            if got.view(world, -1)[:, 0].tolist() != [float(r) for r in range(world)]:
                bad.append(f"caller gather {i}")
        torch.cuda.synchronize()
        assert not bad, bad
        return "bitwise vs all_to_all"
    _check(res, "ce seq_to_head", ce)

    def attention(mode, groups):
        mod = ulysses.UlyssesAttention(backend="ce", pipeline_groups=groups)
        q, k, v = (torch.randn((1, 128, hh, 64), device=dev).to(torch.bfloat16)
                   for hh in (2 * world, 2, 2))
        mod(q, k, v)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode=mode):
            out = mod(q, k, v)
        bad = 0
        for _ in range(5):
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, device=dev).to(t.dtype))
            graph.replay()
            torch.cuda.synchronize()
            bad += int(not torch.equal(out, mod(q, k, v)))
        mod.close()
        assert bad == 0, f"{bad} replays differ from eager"
        return {"fallback_reason": mod.fallback_reason}
    for mode in ("global", "thread_local"):
        for groups in (0, 4):
            _check(res, f"UlyssesAttention ce capture {mode} G={groups}",
                   lambda mode=mode, groups=groups: attention(mode, groups))

    def auto():
        m = dcp.DcpMerger(max_tokens=8, num_heads=H, head_dim=D, dtype=torch.bfloat16)
        out = {"merge": (m.backend, m.decision.rule, m.fallback_reason)}
        m.close()
        mod = ulysses.UlyssesAttention()
        q = torch.randn((1, 64, 2 * world, 64), device=dev).to(torch.bfloat16)
        mod(q, q, q)
        out["ulysses"] = (mod.last_backends, mod.fallback_reason)
        mod.close()
        return out
    _check(res, "auto by rule", auto)
    attncomm.release()
    torch.cuda.synchronize()
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    report, failed = {}, 0
    for w in a.world:
        t0 = time.monotonic()
        try:
            per_rank = attncomm.launch(_rank, w, device="cuda", ranks_per_gpu=w, timeout_s=300)
        except Exception as exc:  # noqa: BLE001 - reported
            report[f"W={w}"] = {"launch": {"ok": False, "detail": f"{type(exc).__name__}: {exc}"}}
            print(f"W={w}: launch failed: {type(exc).__name__}: {exc}", flush=True)
            failed += 1
            continue
        report[f"W={w}"] = per_rank[0]
        for name, r in per_rank[0].items():
            oks = [pr[name]["ok"] for pr in per_rank]
            failed += not all(oks)
            detail = r["detail"] if all(oks) else next(pr[name] for pr in per_rank
                                                        if not pr[name]["ok"])
            print(f"W={w} {name}: {'ok' if all(oks) else 'FAIL'} ({r['seconds']} s) {detail}",
                  flush=True)
            if not all(oks):
                print(detail.get("trace", ""), flush=True)
        print(f"W={w}: {time.monotonic() - t0:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
