"""The symm_a2a DCP merge kernel of W simulated ranks on ONE GPU (``_one_gpu.SimRanks``): every
rank's result checked against the fp64 reference, then timed (CUDA graphs of 10 steps, replay /
10, median of 100) beside a device copy of one rank's payload per peer (a floor), and the host
µs per launch of rank 0's wrapper (``launch_merge`` and Triton's launch).

    python scripts/dcp_one_gpu.py [--world-size 2] [--tokens 1 8 16 32 64 128] [--pdl]
        [--label NAME] [--json PATH] [--dump PATH] [--tree PATH]
    python scripts/dcp_one_gpu.py --ab REV|PATH [--rounds 2] [--out DIR] [the options above]

``--dump`` writes every rank's results (fixed seeds) for a bitwise comparison; ``--tree`` runs
another tree's package (a ``git archive``); ``--ab`` runs a revision's tree and this one, each in
processes of its own, alternating over ``--rounds``, and compares their dumps bit for bit and
their times (``scripts/ab_tree.py``). Reading: compare versions, not absolute values. On an
H200 two kernel versions differed here as on 2× H200 (14.73 → 14.01 µs here, 19.43 → 18.83 µs
there, at 128 tokens), but the absolute figures mix in the W ranks sharing one GPU's SMs and
memory and the skew between the W streams' launches; they are not NVLink figures
(``benchmarks/results/dcp-kernel-2026-11-30-nvidia-h200-x2.md``).
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _one_gpu  # noqa: E402

ROOT = _one_gpu.use_tree(sys.argv)

import torch  # noqa: E402
from _reference import ref_merge  # noqa: E402

from attncomm import config  # noqa: E402


class MergeSim(_one_gpu.SimRanks):
    """W simulated ranks of one DCP merge geometry on the current GPU."""

    def __init__(self, mod, W, H, D, T, dtype, timeout_s=2.0, seed=0, pdl=False):
        self.mod, self.H, self.D, self.T = mod, H, D, T
        hs = H // W
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_rows = T * hs
        self.layout = mod.SlabLayout(W, max_rows, D, itemsize,
                                     mod.ll_rows_for(max_rows, D, itemsize))
        super().__init__(W, self.layout.total_bytes)
        dev = self.raw.device
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.outs = torch.randn((W, T, H, D), device=dev, generator=gen).to(dtype)
        self.lses = torch.randn((W, T, H), device=dev, generator=gen) * 3
        self.res = [torch.full((T, hs, D), float("nan"), device=dev).to(dtype) for _ in range(W)]
        self.res_lse = [torch.full((T, hs), float("nan"), device=dev) for _ in range(W)]
        timeout_ns = int(timeout_s * 1e9)
        self.calls = [(self._call(r, timeout_ns, pdl), self._call(r, 1, pdl)) for r in range(W)]

    def _call(self, r, timeout_ns, pdl):
        """Rank r's launch as a closure: the descriptor interface (``MergeSlab.build(...,
        timeout_ns)``), or the one before it (up to 3a5fea2: the budget per launch)."""
        mod = self.mod
        kw = dict(rank=r, world_size=self.W, num_heads=self.H, layout=self.layout,
                  n_programs_max=self.n_programs, pdl=pdl)
        if "timeout_ns" in inspect.signature(mod.launch_merge).parameters:
            kw.update(timeout_ns=timeout_ns,
                      slab=mod.MergeSlab.build(self.layout, self.slabs[r], self.outs.dtype,
                                               self.ptrs, r, self.state[r], self.errors[r]))
        else:
            kw["slab"] = mod.MergeSlab.build(self.layout, self.slabs[r], self.ptrs, r,
                                             self.state[r], self.errors[r], timeout_ns)
        args = (self.outs[r], self.lses[r], self.res[r], self.res_lse[r])
        return lambda: mod.launch_merge(*args, **kw)

    def launch(self, r, loading=False):
        self.calls[r][loading]()

    def check(self):
        bad = self.timed_out()
        if bad:
            raise RuntimeError(f"ranks {bad} timed out: the simulated ranks were not resident "
                               f"together")
        hs = self.H // self.W
        worst = 0.0
        for r in range(self.W):
            ref, ref_lse = ref_merge(self.outs[:, :, r * hs:(r + 1) * hs].cpu(),
                                     self.lses[:, :, r * hs:(r + 1) * hs].cpu())
            got = self.res[r].double().cpu()
            err = ((got - ref).abs() - 8e-3 * ref.abs()).max().item()
            lerr = (self.res_lse[r].double().cpu() - ref_lse).abs().max().item()
            if not (err <= 8e-3 and lerr <= 1e-4):
                raise AssertionError(f"rank {r}: error {err} (lse {lerr}) vs the fp64 reference")
            worst = max(worst, err)
        return worst


def measure(mod, a, T, dump: _one_gpu.Dump) -> dict:
    """One token count: check, time, host µs per launch; the results go into ``dump``."""
    W, H, D = a.world_size, a.heads, a.head_dim
    sim = MergeSim(mod, W, H, D, T, torch.bfloat16, seed=T, pdl=a.pdl)
    sim.load_kernels()
    host = sim.launch_host_us()
    sim.step()
    sim.check()
    for r in range(W):
        dump.add(f"T{T}/eager/r{r}/res", sim.res[r])
        dump.add(f"T{T}/eager/r{r}/lse", sim.res_lse[r])
        sim.res[r].fill_(float("nan"))  # poison again: the graph replays must write everything
        sim.res_lse[r].fill_(float("nan"))
    t_merge = _one_gpu.graph_us(sim.step)
    err = sim.check()  # what the last replay left
    for r in range(W):
        dump.add(f"T{T}/graph/r{r}/res", sim.res[r])
        dump.add(f"T{T}/graph/r{r}/lse", sim.res_lse[r])
    payload = sim.outs[0, :, : H // W].contiguous()
    dst = torch.empty_like(payload)
    t_copy = _one_gpu.graph_us(lambda: dst.copy_(payload))
    mib = payload.numel() * payload.element_size() / 2 ** 20
    protocol = "ll" if mod.use_ll(T * (H // W), sim.layout) else "flag"
    return {"label": a.label, "key": f"tokens={T}", "tokens": T, "world_size": W,
            "protocol": protocol, "gpu_us": t_merge, "host_us": host, "copy_us": t_copy,
            "mib_per_peer": mib, "max_err": err}


def _gpu_name() -> str:
    """The GPU's name, or what a dry run runs on (``_one_gpu.device``)."""
    if _one_gpu.device() == "cuda":
        return torch.cuda.get_device_name(0)
    return "CPU (a dry run under TRITON_INTERPRET=1: the times mean nothing)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--pdl", action="store_true", help="launch with PDL (capability ≥ 9.0)")
    _one_gpu.add_run_arguments(p, "write every result here (torch.save)")
    return p


def main(argv=None) -> int:
    config.force_safe_env()
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.ab:
        import ab_tree
        return ab_tree.main(__file__, a.ab, argv, rounds=a.rounds, out=a.out)
    gpu = _gpu_name()
    import attncomm.dcp.lse_merge.symm_a2a as mod
    print(f"{a.label} ({ROOT}): W={a.world_size} simulated ranks on one "
          f"{gpu}, H={a.heads}, D={a.head_dim}, bf16, PDL "
          f"{'on' if a.pdl else 'off'}, graph replay / 10 (µs); not NVLink figures")
    print(f"{'tokens':>6} {'proto':>5} {'merge':>8} {'host/launch':>11} {'copy':>8} "
          f"{'MiB/peer':>9} {'err':>9}")
    records, dump = [], _one_gpu.Dump()
    for T in a.tokens:
        rec = measure(mod, a, T, dump)
        records.append(rec)
        print(f"{T:>6} {rec['protocol']:>5} {rec['gpu_us']:>8.2f} {rec['host_us']:>11.2f} "
              f"{rec['copy_us']:>8.2f} {rec['mib_per_peer']:>9.3f} {rec['max_err']:>9.2e}",
              flush=True)
    dump.save(a.dump)
    if a.json:
        meta = {"gpu": gpu, "torch": torch.__version__,
                "triton": __import__("triton").__version__, "heads": a.heads,
                "head_dim": a.head_dim, "simulated_world_size": a.world_size, "pdl": a.pdl,
                "tree": ROOT, "median_gpu_us": statistics.median(r["gpu_us"] for r in records)}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
