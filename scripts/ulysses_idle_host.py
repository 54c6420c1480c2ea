"""Why a Ulysses call started on an idle GPU costs more above bare SDPA than back to back.

Host µs of single calls, interleaved in rounds (``attncomm._timing.time_host``), each started on
an idle GPU (a synchronize first) and, in a second pass, behind a sleep kernel (a synchronize,
then ``torch.cuda._sleep``). Calls: ``torch.add`` (the unit), SDPA on the whole sequence, both
after an elementwise kernel launched just before them (where the fill sits in a Ulysses call),
and ``UlyssesAttention`` sequential with and without that kernel first. Prints per mode:

- SDPA's extra host time over a running kernel, beyond that kernel's own launch:
  ``(kernel + SDPA − SDPA) − (kernel + add − add)``, per round;
- the sequential call above SDPA in units, per round (with and without the kernel first).

Results: benchmarks/results/ulysses-idle-host-*.md. One GPU, W = 1::

    python3 scripts/ulysses_idle_host.py   # writes $OUT/ulysses_idle_host.json (or ./…)
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's attncomm, from any directory
from attncomm import launch, ulysses  # noqa: E402
from attncomm._timing import time_host  # noqa: E402

SEQ = "UlyssesAttention.sequential"


def body(rank, world):
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    x = torch.randn(1, 4096, 24, 128, device=dev, dtype=torch.bfloat16)
    full = torch.randn(1, 4096, 24, 128, device=dev, dtype=torch.bfloat16)
    big = torch.randn(16 << 20, device=dev)
    seq = ulysses.UlyssesAttention(ulysses.sdpa_attention, pipeline_groups=0)
    small = torch.ones(16, device=dev)
    sdpa = ulysses.sdpa_attention
    fns = {"add": lambda: torch.add(small, small),
           "sdpa": lambda: sdpa(full, full, full, False),
           "kernel+add": lambda: (big.mul_(1.0), torch.add(small, small)),
           "kernel+sdpa": lambda: (big.mul_(1.0), sdpa(full, full, full, False)),
           SEQ: lambda: seq(x, x, x),
           "kernel+" + SEQ: lambda: (big.mul_(1.0), seq(x, x, x))}
    names = list(fns)
    out = {}
    for mode in ("idle", "busy"):
        if mode == "idle":
            before = torch.cuda.synchronize
        else:
            def before():
                torch.cuda.synchronize()
                torch.cuda._sleep(2_000_000)
        t = time_host([fns[n] for n in names], repeats=300, rounds=10, warmup=20,
                      before=before)
        torch.cuda.synchronize()
        for n, per_round in zip(names, t):
            out[f"{mode}:{n}"] = [round(statistics.median(r), 2) for r in per_round]
    return out


def _report(r: dict) -> None:
    for mode in ("idle", "busy"):
        rr = {k.split(":", 1)[1]: v for k, v in r.items() if k.startswith(mode + ":")}
        med = {k: statistics.median(v) for k, v in rr.items()}
        print(f"{mode}: " + "; ".join(f"{k} {v:.1f} us" for k, v in med.items()))
        extra = [(a - b) - (c - d) for a, b, c, d in
                 zip(rr["kernel+sdpa"], rr["sdpa"], rr["kernel+add"], rr["add"])]
        above = [(s - b) / u for s, b, u in zip(rr[SEQ], rr["sdpa"], rr["add"])]
        after = [(s - b) / u for s, b, u in zip(rr["kernel+" + SEQ], rr["kernel+sdpa"],
                                                rr["add"])]
        print(f"  SDPA slower over a running kernel by {statistics.median(extra):.1f} us "
              f"(rounds {[round(e, 1) for e in extra]})")
        print(f"  {SEQ} above SDPA: {statistics.median(above):.2f} units "
              f"(rounds {[round(a, 2) for a in above]})")
        print(f"  both after a kernel: {statistics.median(after):.2f} units "
              f"(rounds {[round(a, 2) for a in after]})")


if __name__ == "__main__":
    res = launch(body, 1, device="cuda")[0]
    _report(res)
    with open(os.path.join(os.environ.get("OUT", "."), "ulysses_idle_host.json"), "w") as f:
        json.dump(res, f, indent=1)
