"""One call of each one-GPU kernel at the bench shapes, inside a profiler range, for Nsight
Compute (``ncu --profile-from-start off``): the Ulysses fill (bf16 and FP8 payload, with and
without QK-norm + RoPE, q, k, v ``[1, S/2, 56, 128]`` bf16) and the ring's merge step
(``[1, S, 24, 128]`` bf16 block into the fp32 state).

    ncu --profile-from-start off --clock-control none --set full python scripts/kernel_profile.py
"""
from __future__ import annotations

import argparse

import torch

from attncomm.bench import ulysses_fill as bench_fill
from attncomm.ring import merge as ring_merge
from attncomm.ulysses import fp8
from attncomm.ulysses.fill import FillPlan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--ring-seq", type=int, default=8192)
    args = p.parse_args()
    cudart = torch.cuda.cudart()
    calls = []
    for norm in (True, False):
        parts, cos, sin, numel = bench_fill._case(args.seq, 56, 128, 2, norm, "cuda",
                                                  torch.bfloat16, 0)
        for payload in (None, fp8.FP8_DTYPE):
            run = bench_fill._Run(parts, cos, sin, payload, torch.device("cuda"), 3)
            plan = FillPlan(parts, 1e-6, norm, "triton", payload)
            out = run.out_k
            calls.append((f"fill norm={norm} payload={'fp8' if payload else 'bf16'}",
                          lambda plan=plan, parts=parts, cos=cos, sin=sin, out=out:
                          plan([x.x for x in parts], cos, sin, out)))
    g = torch.Generator(device="cpu").manual_seed(0)
    acc, acc_lse = ring_merge.new_state(1, args.ring_seq, 24, 128, "cuda")
    acc.normal_()
    acc_lse.normal_()
    o = torch.randn(1, args.ring_seq, 24, 128, generator=g).to("cuda", torch.bfloat16)
    lse = torch.randn(1, args.ring_seq, 24, generator=g).to("cuda")
    calls.append(("ring merge step", lambda: ring_merge.merge_block_triton(acc, acc_lse, o, lse)))
    for _, fn in calls:  # compile and warm up outside the profiled range
        fn()
        fn()
    torch.cuda.synchronize()
    for name, fn in calls:
        print("profiling:", name, flush=True)
        cudart.cudaProfilerStart()
        fn()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()


if __name__ == "__main__":
    main()
