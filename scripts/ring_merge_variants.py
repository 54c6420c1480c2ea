"""The ring merge step's kernel in variants, timed in one process on one GPU, for a choice
between kernel versions: GPU µs of each (``bench.ulysses_fill.device_us``: 20 launches back to
back between CUDA events, median of 15 windows), against one device-to-device copy of half the
bytes each way timed in the same round, and whether its output (state and LSE, after one merge
of the same inputs) is bitwise equal to the first variant's. The variants: the block loads
masked by the weights (v0) or issued before the weights are known (``hoist``), and a 3-D grid
with the token block fastest (v0) or the head fastest (``hfast``; the library runs that order
on a flattened grid), at several rows per program and warps. The kernel restates the
library's math on purpose, to hold its versions side by side. Inputs:
``[1, SEQ, 24, 128]`` fp32 state with every 7th token empty, a bf16 block with an SDPA-layout
LSE, every 5th token NaN (empty).

    SEQ=8192 TREE=<repo root> python3 scripts/ring_merge_variants.py
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.environ.get("TREE", os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
from attncomm.bench.ulysses_fill import device_us  # noqa: E402
from attncomm.dcp.lse_merge.combine_kernels import live_lse  # noqa: E402


@triton.jit
def step(acc_ptr, acc_lse_ptr, o_ptr, lse_ptr, S, sa_b, sa_s, sa_h, sla_b, sla_s, sla_h,
         so_b, so_s, so_h, sl_b, sl_s, sl_h, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
         HOIST: tl.constexpr, HFAST: tl.constexpr):
    if HFAST:
        s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
        h = tl.program_id(0).to(tl.int64)
    else:
        s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        h = tl.program_id(1).to(tl.int64)
    smask = s < S
    s = s.to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    la_off = b * sla_b + h * sla_h + s * sla_s
    a_row = acc_ptr + b * sa_b + h * sa_h + s * sa_s
    o_row = o_ptr + b * so_b + h * so_h + s * so_s
    l0 = live_lse(tl.load(acc_lse_ptr + la_off, mask=smask, other=float("-inf")))
    l1 = live_lse(tl.load(lse_ptr + b * sl_b + h * sl_h + s * sl_s, mask=smask,
                           other=float("-inf")))
    cols = tl.arange(0, BLOCK_D)
    if HOIST:
        a = tl.load(a_row[:, None] + cols[None, :], mask=smask[:, None], other=0.0)
        o = tl.load(o_row[:, None] + cols[None, :], mask=smask[:, None],
                    other=0.0).to(tl.float32)
    m = tl.maximum(l0, l1)
    m = tl.where(m == float("-inf"), 0.0, m)
    w0 = tl.exp(l0 - m)
    w1 = tl.exp(l1 - m)
    tot = w0 + w1
    s_safe = tl.where(tot > 0, tot, 1.0)
    live0 = smask & (w0 > 0)
    live1 = smask & (w1 > 0)
    if HOIST:
        a = tl.where(live0[:, None], a, 0.0)
        o = tl.where(live1[:, None], o, 0.0)
    else:
        a = tl.load(a_row[:, None] + cols[None, :], mask=live0[:, None], other=0.0)
        o = tl.load(o_row[:, None] + cols[None, :], mask=live1[:, None],
                    other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    acc += w0[:, None] * a
    acc += w1[:, None] * o
    tl.store(a_row[:, None] + cols[None, :], acc / s_safe[:, None], mask=smask[:, None])
    tl.store(acc_lse_ptr + la_off, tl.where(tot > 0, tl.log(s_safe) + m, float("-inf")),
             mask=smask)


def run(acc, acc_lse, out, lse, bs, warps, hoist, hfast):
    B, S, H, D = acc.shape
    nb = -(-S // bs)
    grid = (H, nb, B) if hfast else (nb, H, B)
    step[grid](acc, acc_lse, out, lse, S, *acc.stride()[:3], *acc_lse.stride(),
               *out.stride()[:3], *lse.stride(), BLOCK_S=bs, BLOCK_D=D, HOIST=hoist,
               HFAST=hfast, num_warps=warps)


#: (name, rows per program, warps, loads before the weights, head-fastest grid)
VARIANTS = [("v0", 16, 4, False, False), ("hoist", 16, 4, True, False),
            ("hfast", 16, 4, False, True), ("hoist+hfast", 16, 4, True, True),
            ("hoist+hfast bs32", 32, 4, True, True), ("hoist+hfast bs32 w8", 32, 8, True, True),
            ("hoist+hfast bs8", 8, 4, True, True), ("hfast bs32", 32, 4, False, True)]


def main() -> None:
    S, B, H, D = int(os.environ.get("SEQ", 8192)), 1, 24, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    acc0 = torch.randn(B, S, H, D, device="cuda", generator=g)
    lsea0 = torch.randn(B, S, H, device="cuda", generator=g)
    lsea0[:, ::7] = float("-inf")
    out = torch.randn(B, S, H, D, device="cuda", generator=g).to(torch.bfloat16)
    lse = torch.randn(B, H, S, device="cuda", generator=g).transpose(1, 2)  # SDPA layout
    lse[:, ::5] = float("nan")
    nbytes = acc0.numel() * 8 + out.numel() * 2 + B * S * H * 12
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ref, res = None, []
    for rnd in range(3):
        copy = device_us(lambda: dst.copy_(src), 20, 15)
        for name, bs, w, ho, hf in VARIANTS:
            a, la = acc0.clone(), lsea0.clone()
            run(a, la, out, lse, bs, w, ho, hf)
            if ref is None:
                ref = (a.clone(), la.clone())
            same = (torch.equal(a.view(torch.int32), ref[0].view(torch.int32))
                    and torch.equal(la.view(torch.int32), ref[1].view(torch.int32)))
            t = device_us(lambda: run(a, la, out, lse, bs, w, ho, hf), 20, 15)  # noqa: B023
            r = dict(round=rnd, variant=name, gpu_us=round(t, 2), floor_us=round(copy, 2),
                     x_floor=round(t / copy, 4), bitwise_equal_v0=same)
            res.append(r)
            print(json.dumps(r), flush=True)
    print(f"bytes {nbytes}, copy of {nbytes // 2} B each way")
    for name, *_ in VARIANTS:
        mine = [r for r in res if r["variant"] == name]
        print(f"{name:>22} {statistics.mean(r['gpu_us'] for r in mine):8.2f} us  x_floor "
              f"{statistics.mean(r['x_floor'] for r in mine):.3f}  bits "
              f"{all(r['bitwise_equal_v0'] for r in mine)}")


if __name__ == "__main__":
    main()
