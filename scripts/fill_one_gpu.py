"""The Ulysses fill kernel on one GPU at the bench's shapes: bits against the tree's own torch
path, the GPU's µs per call and the host's µs per call of a prepared ``FillPlan`` (its wrapper
and Triton's launch); the A/B of two trees' fills (``--ab``, ``scripts/ab_tree.py``).

Shapes as ``bench ulysses --fill``: q, k, v ``[1, S/2, 56, 128]`` bf16, 2 regions, with and
without qk_norm + RoPE (fp32 weights), into one flat send buffer; and with norm into regions
in separate allocations (as a transport's staging is passed). The helpers are the tree's own
``attncomm.bench.ulysses_fill`` (``device_us``: n calls back to back behind a GPU sleep;
``host_us``: n calls while the GPU sleeps).

    python scripts/fill_one_gpu.py [--seq 8192 32768] [--json PATH] [--dump PATH] [--tree PATH]
    python scripts/fill_one_gpu.py --ab REV|PATH [--rounds 2] [--out DIR] [--seq ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _one_gpu  # noqa: E402

ROOT = _one_gpu.use_tree(sys.argv)

import torch  # noqa: E402

from attncomm.bench import ulysses_fill as bench_fill  # noqa: E402
from attncomm.ulysses import fill  # noqa: E402


def case(seq: int, norm: bool, regions: bool, label: str, dump: _one_gpu.Dump) -> dict:
    dev = _one_gpu.device()
    if dev == "cpu":
        import _interp_rounding  # noqa: F401  (the interpreter's bf16 casts round as the GPU's)
    parts, cos, sin, numel = bench_fill._case(seq, 56, 128, 2, norm, dev, torch.bfloat16,
                                              seq + norm)
    want = fill.fill_torch(parts, 1e-6, cos, sin)
    out = torch.full_like(want, float("nan"))
    target = out
    if regions:  # the two regions in separate allocations, the second allocated first
        half = numel // 2
        second = torch.full((numel - half,), float("nan"), dtype=out.dtype, device=out.device)
        target = [torch.full((half,), float("nan"), dtype=out.dtype, device=out.device), second]
    plan = fill.FillPlan(parts, 1e-6, rope=cos is not None, impl="triton")
    xs = [p.x for p in parts]
    call = lambda: plan(xs, cos, sin, target)  # noqa: E731
    call()
    got = torch.cat(target) if regions else out
    key = f"seq={seq} norm={norm}" + (" regions" if regions else "")
    dump.add(key, got)
    gpu, host = ((bench_fill.device_us, bench_fill.host_us) if dev == "cuda" else
                 (_one_gpu.graph_us, _one_gpu.host_us))  # a dry run: the times mean nothing
    rec = dict(label=label, key=key, seq=seq, qk_norm=norm, regions=regions,
               bitwise_equal=torch.equal(got, want), gpu_us=gpu(call), host_us=host(call))
    print(json.dumps(rec), flush=True)
    return rec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    _one_gpu.add_run_arguments(p, "write every output (digests) here")
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.ab:
        import ab_tree
        return ab_tree.main(__file__, a.ab, argv, rounds=a.rounds, out=a.out)
    gpu = (torch.cuda.get_device_name(0) if _one_gpu.device() == "cuda" else
           "CPU (a dry run under TRITON_INTERPRET=1: the times mean nothing)")
    print(f"{a.label} ({ROOT}): the fill on one {gpu}")
    recs, dump = [], _one_gpu.Dump()
    for seq in a.seq:
        for norm in (True, False):
            recs.append(case(seq, norm, False, a.label, dump))
    recs.append(case(a.seq[0], True, True, a.label, dump))
    dump.save(a.dump)
    if a.json:
        meta = {"gpu": gpu, "torch": torch.__version__,
                "triton": __import__("triton").__version__, "tree": ROOT}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    return 0 if all(r["bitwise_equal"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
