"""One GPU: the default attention of a block with a key-padding mask or with packed segments,
against the dense call of the same tokens, and every candidate kernel for the masked block.

For B ∈ {1, 2}, S = ``--seq`` (8192), (Hq, Hkv) ∈ {(24, 24), (24, 8)}, D = 128, bf16, causal
and not, it times (device µs, CUDA events around ``--reps`` calls, median of ``--iters``):

- ``dense``: ``ring.attention_with_lse(q, k, v, causal)`` (SDPA's own kernel with its LSE) and
  Ulysses' ``sdpa_attention`` without a mask: the baselines of the ratios;
- masks (all True, 25 % and 50 % padding at the end, random holes): ``attention_with_lse``
  with ``key_padding_mask`` (``path=default``), Ulysses' ``sdpa_attention`` with it
  (``ulysses``), and the two routes of the masked block: ``flash-varlen``
  (``ring.attn.masked_varlen``, non-causal) and ``bias`` (the mask as a broadcast −inf bias to
  cuDNN's kernel, else the efficient one: ``ring.attn._masked_bias``, the causal route);
- segments (``cu_seqlens``): one segment over the block and several (``attn_fn`` segments).

``ratio`` = µs ÷ the dense call of the same shape (goal ≤ 1.1); each record also has the max
abs error against an fp32 reference of the same masked / packed attention on the GPU (output;
LSE on live rows) and the kernel that ran. Checks first: the ATen schemas, a masked forward
under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync) and in a CUDA graph (replay =
eager, bit for bit).

    python scripts/ring_mask_one_gpu.py --out DIR [--seq 8192] [--iters 5] [--reps 5]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from attncomm.bench.common import meta  # noqa: E402
from attncomm.bench.ring import packing  # noqa: E402
from attncomm.bench.ring_kernels import device_us  # noqa: E402
from attncomm.ring import attn as ring_attn  # noqa: E402
from attncomm.ring.layout import Segment  # noqa: E402
from attncomm.ulysses import sdpa_attention  # noqa: E402

GOAL = 1.1


def reference(q, k, v, causal, mask=None, seg=None, chunk=1024):
    """fp32 attention on the GPU, query chunk by chunk: ``(out [B, S, Hq, Dv], lse [B, S,
    Hq])``; ``mask`` bool ``[B, S]``, ``seg`` int ``[S]`` (a sequence id per position)."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    out = torch.empty(b, s, hq, v.shape[3], dtype=torch.float32, device=q.device)
    lse = torch.empty(b, s, hq, dtype=torch.float32, device=q.device)
    pos = torch.arange(s, device=q.device)
    for bi in range(b):
        kf = k[bi].float().transpose(0, 1).repeat_interleave(rep, 0)
        vf = v[bi].float().transpose(0, 1).repeat_interleave(rep, 0)
        for lo in range(0, s, chunk):
            hi = min(s, lo + chunk)
            sc = torch.matmul(q[bi, lo:hi].float().transpose(0, 1), kf.transpose(-1, -2))
            sc *= 1.0 / math.sqrt(d)
            ok = torch.ones(hi - lo, s, dtype=torch.bool, device=q.device)
            if mask is not None:
                ok &= mask[bi][None, :]
            if causal:
                ok &= pos[None, :] <= pos[lo:hi, None]
            if seg is not None:
                ok &= seg[lo:hi, None] == seg[None, :]
            sc.masked_fill_(~ok, float("-inf"))
            l_ = torch.logsumexp(sc, -1)
            p = torch.exp(sc - torch.where(torch.isfinite(l_), l_, 0.0)[..., None])
            out[bi, lo:hi] = torch.matmul(p, vf).transpose(0, 1)
            lse[bi, lo:hi] = l_.t()
    return out, lse


def errors(res, ref) -> dict:
    out = res[0] if isinstance(res, tuple) else res
    e = {"out_err": (out.float() - ref[0]).abs().max().item(),
         "nan": bool(out.isnan().any())}
    if isinstance(res, tuple):
        live = torch.isfinite(ref[1])
        e["lse_err"] = (res[1][live] - ref[1][live]).abs().max().item() if live.any() else 0.0
        e["lse_live_match"] = bool(torch.equal(torch.isfinite(res[1]), live))
    return e


def masks(b, s, device, g) -> dict:
    pos = torch.arange(s, device=device)
    return {"all True": torch.ones(b, s, dtype=torch.bool, device=device),
            "pad 25%": (pos < s * 3 // 4)[None].expand(b, s).contiguous(),
            "pad 50%": (pos < s // 2)[None].expand(b, s).contiguous(),
            "holes 50%": (torch.rand(b, s, generator=g) > 0.5).to(device)}


def checks(device) -> dict:
    """Schemas, no host sync in the masked forward, and a CUDA graph of it = eager."""
    out = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    for name in ("_flash_attention_forward",):
        op = getattr(torch.ops.aten, name, None)
        out[f"schema {name}"] = str(op.default._schema) if op is not None else None
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 1024, h, 128, generator=g).to(device, torch.bfloat16)
               for h in (8, 2, 2))
    m = (torch.rand(2, 1024, generator=g) > 0.3).to(device)
    ring_attn.attention_with_lse(q, k, v, False, key_padding_mask=m)  # warm-up
    out["masked kernel"] = ring_attn.last_kernel()
    try:
        torch.cuda.set_sync_debug_mode("error")
        ring_attn.attention_with_lse(q, k, v, False, key_padding_mask=m)
        sdpa_attention(q, k, v, False, key_padding_mask=m)
        out["no host sync"] = True
    except RuntimeError as exc:
        out["no host sync"] = f"False: {exc}"[:300]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    try:
        eager = ring_attn.attention_with_lse(q, k, v, False, key_padding_mask=m)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            cap = ring_attn.attention_with_lse(q, k, v, False, key_padding_mask=m)
        graph.replay()
        torch.cuda.synchronize()
        out["cuda graph = eager"] = bool(torch.equal(cap[0], eager[0])
                                         and torch.equal(cap[1], eager[1]))
    except Exception as exc:  # noqa: BLE001 - the record says what failed
        out["cuda graph = eager"] = f"False: {type(exc).__name__}: {exc}"[:300]
    return out


def run(device, s, iters, reps) -> list[dict]:
    recs = []
    g = torch.Generator().manual_seed(11)

    def timed(fn):
        return device_us(fn, device, iters, reps)

    for b in (1, 2):
        for hq, hkv in ((24, 24), (24, 8)):
            q, k, v = (torch.randn(b, s, h, 128, generator=g).to(device, torch.bfloat16)
                       for h in (hq, hkv, hkv))
            ms = masks(b, s, device, g)
            lens = packing(s, 1)
            starts = [0, *torch.tensor(lens).cumsum(0).tolist()]
            seg_id = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(
                device)
            for causal in (False, True):
                base = {"B": b, "S": s, "Hq": hq, "Hkv": hkv, "D": 128, "causal": causal}

                def rec(case, path, fn, ref, dense_us, **extra):
                    res = fn()
                    kernel = ring_attn.last_kernel() if path != "ulysses" else "-"
                    if res is None:
                        recs.append(dict(base, case=case, path=path, refused=True))
                        return None
                    t = timed(fn)
                    r = dict(base, case=case, path=path, kernel=kernel, us=t,
                             dense_us=dense_us, ratio=t / dense_us, **errors(res, ref), **extra)
                    recs.append(r)
                    print(json.dumps(r), flush=True)
                    return t

                ref = reference(q, k, v, causal)
                t_dense = timed(lambda: ring_attn.attention_with_lse(q, k, v, causal))
                rec("dense", "default", lambda: ring_attn.attention_with_lse(q, k, v, causal),
                    ref, t_dense)
                t_udense = timed(lambda: sdpa_attention(q, k, v, causal))
                rec("dense", "ulysses", lambda: sdpa_attention(q, k, v, causal), ref, t_udense)
                for name, m in ms.items():
                    ref = reference(q, k, v, causal, mask=m)
                    rec(name, "default", lambda: ring_attn.attention_with_lse(
                        q, k, v, causal, key_padding_mask=m), ref, t_dense)  # noqa: B023
                    rec(name, "ulysses", lambda: sdpa_attention(
                        q, k, v, causal, key_padding_mask=m), ref, t_udense)  # noqa: B023
                    cands = {"bias": lambda: ring_attn._masked_bias(
                        q, k, v, causal, m)}  # noqa: B023
                    if not causal:
                        cands["flash-varlen"] = lambda: ring_attn.masked_varlen(
                            q, k, v, m)  # noqa: B023
                    for path, fn in cands.items():
                        try:
                            rec(name, path, fn, ref, t_dense)
                        except Exception as exc:  # noqa: BLE001 - a candidate that fails
                            recs.append(dict(base, case=name, path=path,
                                             error=f"{type(exc).__name__}: {exc}"[:300]))
                for name, segs, seg in (
                        ("1 segment", [Segment(0, s, 0, s, causal)], None),
                        (f"{len(lens)} segments",
                         [Segment(a, z, a, z, causal) for a, z in zip(starts, starts[1:])],
                         seg_id)):
                    ref = reference(q, k, v, causal, seg=seg)
                    rec(name, "default", lambda: ring_attn.attention_with_lse(
                        q, k, v, False, segments=segs), ref, t_dense)  # noqa: B023
    return recs


def markdown(m, recs, check) -> str:
    lines = [f"# Masked and packed blocks on one GPU — {m['date']}, "
             f"{m.get('machine') or m.get('host')}", "",
             f"{m.get('gpu')}; torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}. "
             f"bf16, D = 128; device µs (CUDA events, median); ratio = µs ÷ the dense call of "
             f"the same shape (Ulysses' path ÷ its own dense SDPA); errors: max abs against an "
             f"fp32 reference of the same masked / packed attention. Goal ≤ {GOAL}.", "",
             "| B | Hq/Hkv | causal | case | path | kernel | µs | dense µs | ratio | out err "
             "| lse err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        if "us" not in r:
            why = "refused" if r.get("refused") else r.get("error", "")[:80]
            lines.append(f"| {r['B']} | {r['Hq']}/{r['Hkv']} | {int(r['causal'])} | "
                         f"{r['case']} | {r['path']} | - | - | - | {why} | - | - |")
            continue
        lse = f"{r['lse_err']:.2e}" if "lse_err" in r else "-"
        lines.append(f"| {r['B']} | {r['Hq']}/{r['Hkv']} | {int(r['causal'])} | {r['case']} | "
                     f"{r['path']} | {r['kernel']} | {r['us']:.1f} | {r['dense_us']:.1f} | "
                     f"{r['ratio']:.3f} | {r['out_err']:.2e}{' NaN' if r['nan'] else ''} | "
                     f"{lse} |")
    lines += ["", "Checks:", ""] + [f"- {k}: {v}" for k, v in check.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=".")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("ring_mask_one_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    check = checks(device)
    for k, v in check.items():
        print(f"check {k}: {v}", flush=True)
    recs = run(device, a.seq, a.iters, a.reps)
    m = meta("cuda", 1, bench="ring-mask-one-gpu", dtype="bf16", goal=GOAL, checks=check)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "ring-mask-one-gpu.json"), "w") as f:
        json.dump({"meta": m, "records": recs}, f, indent=2)
        f.write("\n")
    text = markdown(m, recs, check)
    with open(os.path.join(a.out, "ring-mask-one-gpu.md"), "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
