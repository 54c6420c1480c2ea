"""Host µs of one eager call of attncomm's public exchanges, for an A/B of two trees in one
device call: run it once per tree (``PYTHONPATH=<tree> python3 scripts/host_cost_ab.py``), in
alternation, on one GPU, W=1 (one NCCL rank: the exchange is trivial). W=1 is not the whole
host path of W>1: the cross-rank check, the ``ce`` transport and parts of the gather are skipped
at W=1; the figures are the host-cost table's W=1 rows (``attncomm bench overhead``).

It uses only names both trees export (``dcp.merge``, ``DcpMerger``, ``dcp.gather_heads``,
``ulysses.seq_to_head``, ``UlyssesAttention``, ``sdpa_attention``), so an older tree without
``attncomm bench overhead`` can be measured against the current one. Two rows time the SDPA
calls a W = 1 forward makes, on the views of its receive buffer that it passes ``attn_fn``
(q, k, v of one buffer; four such calls of a quarter of the heads for 4 head groups): what the
forward's own host work is measured above. Each row: synchronize, then time the call on the
host (median over ``--repeats``); the unit is one ``torch.add`` of
two small CUDA tensors timed the same way in the same process (``bench overhead``'s unit; it
varies from one process to the next, so compare trees in µs as well as in units). Shapes are
that table's. Writes one JSON line per run to ``--json`` (appended).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def host_us(fn, repeats: int, warmup: int = 10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True, help="the tree's name in the output (before/after)")
    p.add_argument("--repeats", type=int, default=300)
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
        forward's receive buffer hands ``attn_fn`` (the bare cost of the module's SDPA calls)."""
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
    res = {}
    for name, fn in rows.items():
        try:
            res[name] = round(host_us(fn, args.repeats), 2)
        except Exception as e:  # a row the tree cannot run is named, the others still run
            res[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
    unit = res["torch.add (unit)"]
    if not isinstance(unit, float):
        raise SystemExit(f"the unit row failed: {unit}")
    line = {"label": args.label, "tree": os.path.dirname(attncomm.__file__),
            "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
            "repeats": args.repeats, "host_us": res,
            "units": {k: round(v / unit, 2) for k, v in res.items() if isinstance(v, float)}}
    print(json.dumps(line, indent=1))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(line) + "\n")
    dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
