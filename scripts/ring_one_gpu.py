"""One GPU: what a ring step costs beside its attention, and what the ring's attention costs
beside plain SDPA.

For each ``S_r`` (``--seq``) on a ``[1, S_r, H, D]`` bf16 block (default H = 24, D = 128):

- ``merge_vs_attention``: the online merge of one block (``ring.merge_block``, the Triton kernel)
  ÷ the attention it follows (``ring.attention_with_lse``); goal ≤ 0.05 at S_r = 8192;
- ``attn_lse_vs_sdpa``: ``attention_with_lse`` (SDPA's own kernel asked for its LSE) ÷
  ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors; goal ≤ 1.05;
- ``ring_w1_vs_attention``: a whole ``ring_attention`` forward on a one-rank NCCL group (state,
  merge, final cast; no transfer) ÷ ``attention_with_lse`` alone;

not causal (the block every rank attends W − 1 times) and causal (the diagonal block), device µs
per call from CUDA events around 10 calls back to back (median) and host µs of one call started
on an idle GPU (median). Before timing, the
attention and the merge are checked against fp64 on a small shape (errors recorded).

    python scripts/ring_one_gpu.py [--seq 4096 8192 16384] [--heads 24] [--head-dim 128]
        [--iters 30] [--json PATH] [--markdown PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _ring_helpers import gen, rand, ref_attention_lse  # noqa: E402

from attncomm import config  # noqa: E402
from attncomm.bench.common import meta  # noqa: E402
from attncomm.bench.ring_kernels import device_us, host_us, kernel_records  # noqa: E402
from attncomm.ring import attn as ring_attn  # noqa: E402
from attncomm.ring import ring_attention  # noqa: E402
from attncomm.ring.merge import merge_block_torch, merge_block_triton, new_state  # noqa: E402

GOALS = {"merge_vs_attention": 0.05, "attn_lse_vs_sdpa": 1.05}


def checks(device) -> dict:
    """Max errors against fp64 of the attention (each dtype) and of the merge (vs the torch
    path, special values included)."""
    out = {}
    g = gen(7)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for causal in (False, True):
            q, k, v = (rand(g, (1, 512, h, 128), dtype) for h in (8, 2, 2))
            o, l = ring_attn.attention_with_lse(q.to(device), k.to(device), v.to(device), causal)
            ref, ref_l = ref_attention_lse(q, k, v, causal)
            key = f"attention {str(dtype)[6:]} causal={int(causal)} ({ring_attn.last_kernel()})"
            out[key] = {"out_max_abs_err": (o.cpu().double() - ref).abs().max().item(),
                        "lse_max_abs_err": (l.cpu().double() - ref_l).abs().max().item()}
    acc = [new_state(1, 300, 8, 128, dev) for dev in ("cpu", device)]
    for i in range(3):
        o = rand(g, (1, 300, 8, 128), torch.bfloat16)
        l = rand(g, (1, 300, 8), torch.float32)
        l[0, i::7] = (float("-inf"), float("inf"), float("nan"))[i]
        merge_block_torch(*acc[0], o, l)
        merge_block_triton(*acc[1], o.to(device), l.to(device))
    a, al = acc[0]
    t, tl = (x.cpu() for x in acc[1])
    out["merge triton vs torch"] = {"out_max_abs_err": (t - a).abs().max().item(),
                                    "lse_max_abs_err": (tl - al).abs().max().item(),
                                    "nan": bool(t.isnan().any() or tl.isnan().any())}
    return out


def ring_w1_records(device, seq, heads, head_dim, iters) -> list[dict]:
    """``ring_attention`` on a one-rank NCCL group against ``attention_with_lse`` alone."""
    g = torch.Generator(device="cpu").manual_seed(seq)
    q, k, v = (torch.randn(1, seq, heads, head_dim, generator=g).to(device, torch.bfloat16)
               for _ in range(3))
    recs = []
    for causal in (False, True):
        def ring():
            return ring_attention(q, k, v, causal=causal, validate=False)

        def attn():
            return ring_attn.attention_with_lse(q, k, v, causal)

        t_ring = device_us(ring, device, iters)
        t_attn = device_us(attn, device, iters)
        base = {"seq": seq, "heads": heads, "head_dim": head_dim, "dtype": "bfloat16",
                "causal": causal, "kernel": ring_attn.last_kernel(), "device": "cuda"}
        recs.append(dict(base, op="ring_attention_w1", gpu_us=t_ring,
                         host_us=host_us(ring, device)))
        recs.append(dict(base, op="ring_w1_vs_attention", ratio=t_ring / t_attn))
    return recs


def markdown(meta_block, records, check) -> str:
    lines = [f"# Ring attention on one GPU — {meta_block['date']}, "
             f"{meta_block.get('machine') or meta_block.get('host')}", "",
             f"{meta_block.get('gpu')}; torch {meta_block['torch']}, Triton "
             f"{meta_block['triton']}, CUDA {meta_block['cuda']}. One block "
             f"[1, S_r, H, D] bf16; device µs: CUDA events around 10 calls back to back, "
             f"median; host µs: one call started on an idle GPU, median. Goals: merge ≤ 5 % "
             f"of the attention it follows at S_r = 8192; attention with LSE ≤ 1.05× plain "
             f"SDPA.", "",
             "| S_r | causal | op | kernel | GPU µs | host µs | ratio | goal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        goal = GOALS.get(r["op"])
        verdict = "-" if goal is None or "ratio" not in r else (
            f"≤ {goal}: {'met' if r['ratio'] <= goal else 'NOT met'}")
        cells = [f"{r[k]:{f}}" if k in r else "-"
                 for k, f in (("gpu_us", ".1f"), ("host_us", ".1f"), ("ratio", ".4f"))]
        lines.append(f"| {r['seq']} | {int(r['causal'])} | {r['op']} | {r['kernel']} | "
                     + " | ".join(cells) + f" | {verdict} |")
    lines += ["", "Checks against fp64 (max abs error):", ""]
    lines += [f"- {k}: {v}" for k, v in check.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=24)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args(argv)
    config.force_safe_env()
    if not torch.cuda.is_available():
        print("ring_one_gpu: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    check = checks(device)
    for k, v in check.items():
        print(f"check {k}: {v}", flush=True)
    records = []
    for s in a.seq:
        records += kernel_records(device, s, a.heads, a.head_dim, torch.bfloat16, a.iters)
    store = tempfile.mkdtemp(prefix="ring-one-gpu-")
    dist.init_process_group("nccl", init_method=f"file://{store}/store", rank=0, world_size=1,
                            device_id=device)
    try:
        for s in a.seq:
            records += ring_w1_records(device, s, a.heads, a.head_dim, a.iters)
    finally:
        dist.destroy_process_group()
    for r in records:
        print(json.dumps(r), flush=True)
    m = meta("cuda", 1, bench="ring-one-gpu", dtype="bf16", goals=GOALS, checks=check)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": m, "records": records}, f, indent=2)
            f.write("\n")
    text = markdown(m, records, check)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
