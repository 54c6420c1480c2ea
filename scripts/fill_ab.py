"""A/B of the Ulysses fill kernel on one GPU: the kernel as of 6cb34e6 (scripts/ab/) against
the current one with cos/sin and the norm weight loaded broadcast over the heads
(``fill.ROPE_BCAST``) and loaded once then broadcast in registers, at the library's default
launch shape; each checked bitwise against its own torch reference.

Shapes as ``bench ulysses --fill``: q, k, v ``[1, S/2, 56, 128]`` bf16, 2 regions.

    python scripts/fill_ab.py [--seq 8192 32768] [--json PATH]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from attncomm.bench import ulysses_fill as bench_fill  # noqa: E402
from attncomm.ulysses import fill  # noqa: E402


def _old():
    path = os.path.join(ROOT, "scripts", "ab", "ulysses_fill_6cb34e6.py")
    spec = importlib.util.spec_from_file_location("ulysses_fill_6cb34e6", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def case(mod, seq, norm, label, setup=None):
    parts, cos, sin, numel = bench_fill._case(seq, 56, 128, 2, norm, "cuda", torch.bfloat16,
                                              seq + norm)
    parts = [mod.FillPart(p.x, p.ranges, p.weight, p.rope) for p in parts]
    if setup:
        setup()
    want = mod.fill_torch(parts, 1e-6, cos, sin)
    out = torch.full_like(want, float("nan"))
    call = lambda: mod.fill_triton(parts, 1e-6, cos, sin, out=out)  # noqa: E731
    call()
    same = torch.equal(out, want)
    rec = dict(variant=label, seq=seq, qk_norm=norm, bitwise_equal=same,
               time_us=bench_fill.device_us(call), eager_call_us=bench_fill._median_us(call, 20),
               host_us=bench_fill.host_us(call))
    print(json.dumps(rec), flush=True)
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    old = _old()
    recs = []
    for seq in a.seq:
        for norm in (True, False):
            recs.append(case(old, seq, norm, "6cb34e6"))
            for bc in (True, False):
                def setup(bc=bc):
                    fill.ROPE_BCAST = bc
                recs.append(case(fill, seq, norm, f"current rope_bcast={bc}", setup))
            fill.ROPE_BCAST = True
    if a.json:
        with open(a.json, "w") as f:
            json.dump(recs, f, indent=1)
    return 0 if all(r["bitwise_equal"] for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())
