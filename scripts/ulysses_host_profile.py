"""Host cost per call of the Ulysses exchanges, and where it goes.

Measures, on one process group (gloo CPU ranks or NCCL GPU ranks, W = 1 or more), the host µs
of one steady-state call of ``seq_to_head``, ``head_to_seq``, ``UlyssesAttention`` sequential
and pipelined with G = 4 (and the bare ``attn_fn`` call they wrap), in units of one
``torch.add`` on a small tensor of the same device measured in the same run (on CUDA a sleep
kernel keeps the GPU busy, so the host never waits for it). Then a ``cProfile`` of each call,
its time split by phase (argument checks, transport choice and plans, fill, exchange start,
exchange wait/release, attn_fn, module attribute writes, the rest), scaled to the unprofiled
total; and the aten operators and Python function calls one call makes (counts, which do not
depend on the machine's load). Only public calls are used, so the same script measures an
older checkout (put it first on ``PYTHONPATH``) for a before/after table. ``--trace DIR``
also records rank 0's steady calls with ``torch.profiler`` (host and CUDA activities, Python
stacks): a Chrome trace per call in ``DIR`` and a table of its operators by host time.

    python scripts/ulysses_host_profile.py [--device cpu|cuda] [--world-size 1]
        [--shape 1 64 8 16] [--json PATH] [--markdown PATH] [--trace DIR] [--no-fill]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: an older checkout given there is measured

#: ``phase → [(file suffix, function name)]``: a call's cProfile time goes to the first phase
#: whose functions' cumulative time covers it (these functions do not nest across phases).
PHASES = {
    "argument checks": [("_dist.py", "validate_args"),
                        ("ulysses/api.py", "check_call"), ("ulysses/policy.py", "check_call"),
                        ("ulysses/attention.py", "_check"), ("ulysses/api.py", "_prologue"),
                        ("ulysses/attention.py", "_requested_groups")],
    "transport choice, plans": [("ulysses/api.py", "get_transport"),
                                ("ulysses/policy.py", "get_transport"),
                                ("ulysses/layout.py", "seq_to_head_plan"),
                                ("ulysses/layout.py", "head_to_seq_plan"),
                                ("ulysses/layout.py", "group_head_ranges"),
                                ("ulysses/attention.py", "_pipeline_groups")],
    "fill": [("ulysses/fill.py", "fill"), ("ulysses/fill.py", "__call__")],
    "exchange start": [("ulysses/all_to_all.py", "start"), ("ulysses/ce.py", "start"),
                       ("ulysses/all_to_all.py", "send_buffer"),
                       ("ulysses/ce.py", "send_buffer"), ("ulysses/transport.py", "send_buffer")],
    "exchange wait, release": [("ulysses/all_to_all.py", "wait"), ("ulysses/ce.py", "wait"),
                               ("ulysses/ce.py", "release")],
    "attn_fn": [("ulysses_host_profile.py", "attn"), ("ulysses/attention.py", "sdpa_attention")],
    "module attribute writes": [("torch/nn/modules/module.py", "__setattr__")],
}


def attn(q, k, v, causal):
    """The CPU stand-in for attention: one allocation of the output, as SDPA makes."""
    return q.new_empty(q.shape[0], q.shape[1], q.shape[2], v.shape[3])


def _per_call_us(fn, device, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the host µs per call of ``calls`` back-to-back calls (on CUDA
    behind a sleep kernel: the host never waits for the GPU)."""
    fn()
    fn()
    out = []
    for _ in range(rounds):
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda._sleep(int(3e8))
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        if device.type == "cuda":
            torch.cuda.synchronize()
    return statistics.median(out)


class _OpCounter(TorchDispatchMode):
    """Counts the aten operators (kernels, allocations, views) calls dispatch."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _counts(fn) -> tuple[int, int]:
    """``(aten ops, Python function calls)`` of one steady-state call: deterministic, so a
    before/after comparison of them does not depend on the machine's load."""
    fn()
    with _OpCounter() as ops:
        fn()
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())
    return ops.n, calls


def _phases(fn, device, calls: int) -> dict:
    """Share of each phase in the profiled time of ``calls`` calls."""
    prof = cProfile.Profile()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda._sleep(int(6e8))
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats
    total = max((v[3] for k, v in stats.items() if k[2] == "<lambda>"), default=0.0)
    shares = {}
    for phase, funcs in PHASES.items():
        cum = sum(v[3] for (path, _, name), v in stats.items()
                  if any(path.endswith(f) and name == n for f, n in funcs))
        shares[phase] = cum / total if total else 0.0
    shares["rest (keys, views, allocation, Python)"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def _trace(name: str, fn, device, out_dir: str, calls: int = 3) -> None:
    """``calls`` steady calls of ``fn`` under ``torch.profiler`` (after two unrecorded ones):
    ``<name>.json`` (Chrome trace) and ``<name>.txt`` (operators by host time) in
    ``out_dir``."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts, with_stack=True) as prof:
        for _ in range(calls):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
    stem = os.path.join(out_dir, name.replace(" ", "_").replace("/", "_"))
    prof.export_chrome_trace(stem + ".json")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    with open(stem + ".txt", "w") as f:
        f.write(f"{name}: {calls} steady calls\n{table}\n")


def measure(rank: int, world: int, device_type: str, shape, calls: int, rounds: int,
            jit_launch: bool = False, trace_dir: str | None = None,
            no_fill: bool = False) -> dict:
    """Every op's host µs per call, its share by phase, and the unit (one ``torch.add``).
    ``jit_launch``: launch the fill through Triton's JIT every time (where the checkout has the
    cached launch). ``no_fill``: the fill does nothing (its results are then garbage): the
    counts of a CPU call without the torch fill's slicing and copies, what a CUDA call makes
    besides its one fill launch."""
    from attncomm import ulysses
    if no_fill:
        from attncomm.ulysses import fill
        fill.FillPlan.__call__ = lambda self, xs, cos=None, sin=None, out=None: None
    if jit_launch:  # the knob of this tree (compiled_launch) or an older one's (fill)
        from attncomm import compiled_launch
        from attncomm.ulysses import fill
        compiled_launch.REPLAY = False
        fill.CACHED_LAUNCH = False
    device = torch.device(device_type, rank if device_type == "cuda" else None) \
        if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    b, s, h, d = shape
    g = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn((b, s // world, h, d), generator=g).to(dtype).to(device)
    y = ulysses.seq_to_head(x)
    small = torch.ones(16, device=device)
    attn_fn = ulysses.sdpa_attention if device.type == "cuda" else attn
    seq = ulysses.UlyssesAttention(attn_fn, pipeline_groups=0)
    pipe = ulysses.UlyssesAttention(attn_fn, pipeline_groups=4)
    full = torch.randn((b, s, h, d), generator=g).to(dtype).to(device)
    ops = {
        "torch.add": lambda: torch.add(small, small),
        "attn_fn (bare, whole sequence)": lambda: attn_fn(full, full, full, False),
        "ulysses.seq_to_head": lambda: ulysses.seq_to_head(x),
        "ulysses.head_to_seq": lambda: ulysses.head_to_seq(y),
        "UlyssesAttention.sequential": lambda: seq(x, x, x),
        "UlyssesAttention.pipelined_g4": lambda: pipe(x, x, x),
    }
    rec = {}
    for name, fn in ops.items():
        rec[name] = {"host_us": _per_call_us(fn, device, calls, rounds)}
    unit = rec["torch.add"]["host_us"]
    base = rec["attn_fn (bare, whole sequence)"]["host_us"]
    for name, r in rec.items():
        r["units"] = r["host_us"] / unit
        if name.startswith("UlyssesAttention"):
            r["units_above_attn_fn"] = (r["host_us"] - base) / unit
        if name.startswith(("ulysses.", "UlyssesAttention")):
            r["phases"] = _phases(ops[name], device, max(20, calls // 2))
            r["aten_ops"], r["python_calls"] = _counts(ops[name])
    if trace_dir and rank == 0:
        os.makedirs(trace_dir, exist_ok=True)
        for name in ops:
            _trace(name, ops[name], device, trace_dir)
    return {"rank": rank, "world_size": world, "device": device_type, "shape": list(shape),
            "dtype": str(dtype), "unit_host_us": unit, "ops": rec}


def _run_rank(rank, world, device_type, shape, calls, rounds, jit_launch, trace_dir=None,
              no_fill=False):
    return measure(rank, world, device_type, shape, calls, rounds, jit_launch, trace_dir,
                   no_fill)


def markdown(res: dict, title: str) -> str:
    lines = [f"### {title}", "",
             f"{res['device']}, W = {res['world_size']}, x {res['shape']} ({res['dtype']}); "
             f"unit: one torch.add = {res['unit_host_us']:.2f} µs", "",
             "| call | host µs | units | units above attn_fn | aten ops | Python calls |",
             "|---|---|---|---|---|---|"]
    for name, r in res["ops"].items():
        above = r.get("units_above_attn_fn")
        lines.append(f"| {name} | {r['host_us']:.1f} | {r['units']:.2f} | "
                     f"{'' if above is None else f'{above:.2f}'} | {r.get('aten_ops', '')} | "
                     f"{r.get('python_calls', '')} |")
    phases = [n for n in res["ops"] if "phases" in res["ops"][n]]
    names = list(res["ops"][phases[0]]["phases"])
    lines += ["", "Host µs by phase (cProfile shares × the unprofiled total):", "",
              "| phase | " + " | ".join(phases) + " |", "|---" * (len(phases) + 1) + "|"]
    for ph in names:
        cells = [f"{res['ops'][n]['phases'][ph] * res['ops'][n]['host_us']:.1f}" for n in phases]
        lines.append(f"| {ph} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--shape", type=int, nargs=4, default=None,
                   help="B S H D of the whole sequence (default: cpu 1 64 8 16, cuda "
                        "1 4096 24 128)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--jit-launch", action="store_true",
                   help="launch the fill through Triton's JIT every time (no cached handle)")
    p.add_argument("--no-fill", action="store_true",
                   help="the fill does nothing (garbage results): counts without the CPU "
                        "torch fill's ops, as a CUDA call's one fill launch leaves them")
    p.add_argument("--title", default="Ulysses host cost per call")
    p.add_argument("--json", default=None)
    p.add_argument("--markdown", default=None)
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a torch.profiler trace of each call's steady calls (rank 0) here")
    args = p.parse_args(argv)
    shape = args.shape or ([1, 64, 8, 16] if args.device == "cpu" else [1, 4096, 24, 128])
    from attncomm import launch
    res = launch(_run_rank, args.world_size, device=args.device,
                 args=(args.device, shape, args.calls, args.rounds, args.jit_launch,
                       args.trace, args.no_fill))[0]
    md = markdown(res, args.title)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
