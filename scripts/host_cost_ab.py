"""Host µs of one eager call of attncomm's public exchanges, for an A/B of two trees in one
device call: run it once per tree (``PYTHONPATH=<tree> python3 scripts/host_cost_ab.py``), in
alternation, on one GPU, W=1 (one NCCL rank: the exchange is trivial). W=1 is not the whole
host path of W>1: the cross-rank check, the ``ce`` transport and parts of the gather are skipped
at W=1; the figures are the host-cost table's W=1 rows (``attncomm bench overhead``).

It uses only names both trees export (``dcp.merge``, ``DcpMerger``, ``dcp.gather_heads``,
``ulysses.seq_to_head``, ``UlyssesAttention``, ``sdpa_attention``), so an older tree without
``attncomm bench overhead`` can be measured against the current one; the timer is this script's
tree's ``attncomm/_timing.py``, loaded by path, so both trees are timed alike. Two rows time the
SDPA calls a W = 1 forward that packs makes, on the views of its receive buffer that it passes
``attn_fn`` (q, k, v of one buffer; four such calls of a quarter of the heads for 4 head
groups): what the forward's own host work is measured above. A tree whose W = 1 forward packs
nothing without a norm or RoPE (``ulysses/forward_plan.py``, "One rank") hands ``attn_fn`` x
itself (its head slices with 4 groups) instead, so against such a tree compare ``units``, not
``units_above``. Every row is timed interleaved with the others in
``--rounds`` rounds (``_timing.time_host``: synchronize, then one call timed on the host); the
unit is one ``torch.add`` of two small CUDA tensors (``bench overhead``'s unit). ``units`` is
the median over rounds of each round's median ÷ that round's unit, ``units_above`` the median
over rounds of (call − the SDPA it wraps) ÷ unit (``_timing.paired``): a drift of the machine's
speed during the run falls on both sides. ``host_us`` is the median of the round medians (the
unit varies from one process to the next, so compare trees in units). Shapes are that table's.
Writes one JSON line per run to ``--json`` (appended).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

_spec = importlib.util.spec_from_file_location(
    "host_cost_ab_timing", os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "attncomm", "_timing.py"))
timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(timing)

#: Attention rows and the SDPA rows they are measured above.
ABOVE = {"UlyssesAttention g0": ("sdpa_attention (bare)", "sdpa_attention (plan views)"),
         "UlyssesAttention g4": ("sdpa_attention (bare)", "sdpa_attention x4 (group views)")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="the tree's name in the output (before/after)")
    p.add_argument("--repeats", type=int, default=300, help="timed calls per row")
    p.add_argument("--rounds", type=int, default=30, help="rounds the calls are spread over")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import attncomm
    from attncomm.dcp import DcpMerger, gather_heads, merge
    from attncomm.ulysses import UlyssesAttention, sdpa_attention, seq_to_head

    torch.cuda.set_device(0)
    store = tempfile.mktemp(prefix="host-cost-ab-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    g = torch.Generator(device="cuda").manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    T, H, D, Dq = 8, 64, 512, 576
    out = torch.randn((T, H, D), generator=g, device=dev).to(bf)
    lse = torch.randn((T, H), generator=g, device=dev)
    q = torch.randn((T, H, Dq), generator=g, device=dev).to(bf)
    x = torch.randn((1, 4096, 24, 128), generator=g, device=dev).to(bf)
    a, b = torch.ones(4, device=dev), torch.ones(4, device=dev)

    def merger(backend):
        m = DcpMerger(max_tokens=T, num_heads=H, head_dim=D, dtype=bf, backend=backend)
        return lambda: m(out, lse)

    def plan_views(heads: int, groups: int):
        """``groups`` calls of ``sdpa_attention`` on q, k, v of ``heads // groups`` heads each,
        views of one ``[S, B, 3 * heads // groups, D]`` buffer per call: the layout a W = 1
        forward that packs hands ``attn_fn`` (the bare cost of that module's SDPA calls)."""
        h = heads // groups
        s, b, d = x.shape[1], x.shape[0], x.shape[3]
        bufs = [torch.randn((s, b, 3 * h, d), generator=g, device=dev).to(bf)
                for _ in range(groups)]
        views = [[buf.as_strided((b, s, h, d), (3 * h * d, b * 3 * h * d, d, 1),
                                 buf.storage_offset() + i * h * d) for i in range(3)]
                 for buf in bufs]
        return lambda: [sdpa_attention(*qkv, False) for qkv in views]

    def ulysses(groups):
        mod = UlyssesAttention(sdpa_attention, pipeline_groups=groups)
        return lambda: mod(x, x, x)

    rows = {
        "torch.add (unit)": lambda: torch.add(a, b),
        "dcp.merge": lambda: merge(out, lse),
        "dcp.merge validate=False": lambda: merge(out, lse, validate=False),
        "DcpMerger.symm_a2a": merger("symm_a2a"),
        "DcpMerger.a2a": merger("a2a"),
        "dcp.gather_heads": lambda: gather_heads(q),
        "dcp.gather_heads validate=False": lambda: gather_heads(q, validate=False),
        "ulysses.seq_to_head": lambda: seq_to_head(x),
        "sdpa_attention (bare)": lambda: sdpa_attention(x, x, x, False),
        "sdpa_attention (plan views)": plan_views(x.shape[2], 1),
        "sdpa_attention x4 (group views)": plan_views(x.shape[2], 4),
        "UlyssesAttention g0": ulysses(0),
        "UlyssesAttention g4": ulysses(4),
    }
    res, ok = {}, {}
    for name, fn in rows.items():
        try:
            fn()
            ok[name] = fn
        except Exception as e:  # a row the tree cannot run is named, the others still run
            res[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    if "torch.add (unit)" not in ok:
        raise SystemExit(f"the unit row failed: {res['torch.add (unit)']}")
    times = timing.time_host(list(ok.values()), repeats=args.repeats, rounds=args.rounds,
                             before=torch.cuda.synchronize)
    torch.cuda.synchronize()
    med = {name: [statistics.median(t) for t in per_round] for name, per_round in zip(ok, times)}
    unit = med["torch.add (unit)"]
    res.update({name: round(statistics.median(m), 2) for name, m in med.items()})
    above = {f"{row} above {base}": round(timing.paired(med[row], unit, med[base]), 2)
             for row, bases in ABOVE.items() for base in bases if row in med and base in med}
    line = {"label": args.label, "tree": os.path.dirname(attncomm.__file__),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "repeats": args.repeats, "rounds": args.rounds, "host_us": res,
            "units": {k: round(timing.paired(m, unit), 2) for k, m in med.items()},
            "units_above": above}
    print(json.dumps(line, indent=1))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
