"""Where the host time of one eager ``dcp.merge`` / ``DcpMerger`` / ``dcp.gather_heads`` call
goes, by phase, on CPU (a gloo rank, W=1): each phase is the code the call runs, timed alone
(median of many calls, µs), beside the whole call; the exchange itself is stubbed out (the
backend returns its destination or a view at once), so what is left is attncomm's own host
work. Run it on two trees to compare them (the phases differ: each tree's own code path):

    PYTHONPATH=<tree> python scripts/dcp_host_phases.py [--json PATH]

The shapes are the host-cost table's (T=8, 64 heads × 512 bf16; the gather 64 × 576). On a
GPU the same phases cost about the same host µs; allocations and copies become kernel launches
there (one ``torch.add`` ≈ 11-16 µs of host on the H200 hosts): ``attncomm bench overhead``
measures those.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import attncomm

T, H, D, DQ = 8, 64, 512, 576


def _med(fn, n=20000) -> float:
    for _ in range(300):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1e3


def _stubs():
    from attncomm.dcp.lse_merge.collective import A2ABackend
    from attncomm.dcp.query_gather.all_gather import AllGatherBackend
    res = torch.zeros(T, H, D, dtype=torch.bfloat16)
    res_lse = torch.zeros(T, H)
    gathered = torch.zeros(T, H, DQ, dtype=torch.bfloat16)

    def merge(self, out, lse, res_=None, res_lse_=None):
        n = out.shape[0]
        return (res[:n] if res_ is None else res_), (res_lse[:n] if res_lse_ is None else
                                                     res_lse_)

    def gather(self, q, cos, sin, into=None):
        return gathered[:q.shape[0]] if into is None else into
    A2ABackend.__call__ = merge
    AllGatherBackend.__call__ = gather


def _phases_before(out, lse, q):
    """The pieces of the tree before the hot path (88bad0f, c0fe160)."""
    from attncomm import _dist, config
    from attncomm.dcp.lse_merge import api
    sig, labels = api._signature(out, lse, "a2a", "e", False)
    m = api._cached_merger(None, T, H, D, out.dtype, "a2a", "e", 60.0)
    return {
        "dcp.merge": {
            "resolve_group + get_world_size": lambda: dist.get_world_size(
                _dist.resolve_group(None, "dcp.merge")),
            "config.timeout_s (env)": lambda: config.timeout_s(None),
            "_check_local": lambda: api._check_local(out, lse, 1, "e", "a2a"),
            "_signature": lambda: api._signature(out, lse, "a2a", "e", False),
            "check_args (seen signature)": lambda: _dist.check_args(
                None, "dcp.merge", sig, labels, None, 60.0, None),
            "_cached_merger (LRU)": lambda: api._cached_merger(None, T, H, D, out.dtype, "a2a",
                                                               "e", 60.0),
            "DcpMerger.__call__ (backend stubbed)": lambda: m(out, lse, return_lse=True),
            "two clones (symm_a2a returns views)": lambda: (out[:, :H].clone(),
                                                            lse.clone()),
        },
    }


def _phases_after(out, lse, q):
    """The pieces of this tree's hot path (plans; no clone)."""
    from attncomm import config
    from attncomm.dcp import tracing
    from attncomm.dcp.lse_merge import functional as mf
    dcp = attncomm.dcp
    dcp.merge(out, lse, backend="a2a")
    entry = mf._PLANS._by_group[None][1]
    key = next(iter(entry))
    plan = entry[key]
    merger = plan.merger.get()
    dest = torch.empty(T, H, D, dtype=out.dtype)
    return {
        "dcp.merge": {
            "torch.compiler.is_compiling": torch.compiler.is_compiling,
            "two env reads (config.raw)": lambda: (config.raw("ATTNCOMM_TIMEOUT_S"),
                                                   config.raw("ATTNCOMM_VALIDATE")),
            "plan key (shapes, dtypes, devices, options)": lambda: (
                out.shape, out.dtype, lse.shape, lse.dtype, out.device, lse.device, "a2a", "e",
                False, None, None, "", "", tracing.dest_key(None)),
            "plan lookup": lambda: mf._PLANS.get(None, key),
            "result allocation (torch.empty)": lambda: torch.empty((T, H, D), dtype=out.dtype),
            "merger lookup (LRU order)": plan.merger.get,
            "DcpMerger.into (lse, contiguity; backend stubbed)": lambda: merger.into(
                out, lse, dest, None),
        },
    }


def _rank(rank, world):
    _stubs()
    dcp = attncomm.dcp
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    lse = torch.randn(T, H, generator=gen)
    q = torch.randn(T, H, DQ, generator=gen).to(torch.bfloat16)
    a, b = torch.randn(4), torch.randn(4)
    m = dcp.DcpMerger(max_tokens=16, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                      backend="a2a")
    g = dcp.DcpQueryGather(max_tokens=16, num_heads=H, head_dim=DQ, dtype=torch.bfloat16)
    whole = {"torch.add (CPU, 4 elements)": lambda: torch.add(a, b),
             "dcp.merge (whole call)": lambda: dcp.merge(out, lse, backend="a2a"),
             "DcpMerger (whole call)": lambda: m(out, lse),
             "dcp.gather_heads (whole call)": lambda: dcp.gather_heads(q),
             "DcpQueryGather (whole call)": lambda: g(q)}
    after = hasattr(attncomm.dcp.lse_merge, "functional")
    phases = (_phases_after if after else _phases_before)(out, lse, q)
    return {"tree": "after" if after else "before",
            "whole": {k: _med(f) for k, f in whole.items()},
            "phases": {op: {k: _med(f) for k, f in ps.items()} for op, ps in phases.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    res = attncomm.launch(_rank, 1)[0]
    print(f"[{res['tree']}] µs per call (median), exchange stubbed out")
    for k, v in res["whole"].items():
        print(f"  {k:50s} {v:7.2f}")
    for op, ps in res["phases"].items():
        print(f"  phases of {op}:")
        for k, v in ps.items():
            print(f"    {k:48s} {v:7.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
