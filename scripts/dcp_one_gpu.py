"""The symm_a2a DCP merge kernel of W simulated ranks on ONE GPU: an A/B of kernel versions where
only a one-GPU machine is lent.

Every simulated rank gets its own slab (all in one allocation, so peer offsets are plain
pointer differences), epoch, error word and inputs; each step launches the W ranks' kernels on W
streams (fork/join), so they run side by side exactly as on W GPUs, except that "peer" stores go
to this GPU's own memory instead of over NVLink. The grid bound is SMs / W, so every program of
every rank is resident (the kernels spin on each other). Checks every rank's result against the
fp64 reference, then times CUDA graphs of 10 steps (replay / 10, median of 100) and, as a floor,
a device-to-device copy of one rank's payload per peer.

    python scripts/dcp_one_gpu.py [--world-size 2] [--tokens 1 8 16 32 64 128]
        [--kernel-module PATH] [--ab [PATH]] [--rounds N] [--pdl] [--label NAME] [--json PATH]

``--kernel-module`` loads ``launch_merge`` / ``plan_blocks`` from another file. ``--ab`` runs
that file (default: the pre-split kernel, ``scripts/ab/symm_a2a_a91b3cd.py``) and the current
one in the same process on the same inputs: their results must be bitwise equal, and their
timings alternate over ``--rounds`` rounds (an A/B of two kernel versions in one device call).
Both layouts of a module are accepted: ``MergeSlab`` + ``launch_merge(slab=...)`` (the split
files) and the earlier ``launch_merge(slab=, delta_o=, ...)``. Reading: compare versions, not
absolute values. On an
H200 two kernel versions differed here as on 2× H200 (14.73 → 14.01 µs here, 19.43 → 18.83 µs
there, at 128 tokens), but the absolute figures mix in the W ranks sharing one GPU's SMs and
memory and the skew between the W streams' launches; they are not NVLink figures
(``benchmarks/results/dcp-kernel-2026-11-30-nvidia-h200-x2.md``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from _reference import ref_merge  # noqa: E402

from attncomm import config  # noqa: E402
from attncomm.bench.common import time_graph  # noqa: E402

PRE_SPLIT = os.path.join(ROOT, "scripts", "ab", "symm_a2a_a91b3cd.py")


def _kernel_module(path: str | None):
    if path is None:
        import attncomm.dcp.lse_merge.symm_a2a as mod
        return mod
    path = os.path.abspath(path)
    here = os.path.dirname(path)
    if here not in sys.path:  # its sibling imports (scripts/ab/symm_a91b3cd.py)
        sys.path.insert(0, here)
    if os.path.dirname(here) == os.path.join(ROOT, "attncomm"):
        name = "attncomm.dcp._symm_a2a_ab"  # inside the package: relative imports resolve
    else:
        name = "_ab_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Sim:
    """W simulated ranks of one DCP merge geometry on the current GPU."""

    def __init__(self, mod, W, H, D, T, dtype, timeout_s=2.0, seed=0, pdl=False):
        self.mod, self.W, self.H, self.D, self.T, self.pdl = mod, W, H, D, T, pdl
        dev = torch.device("cuda")
        hs = H // W
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_rows = T * hs
        self.layout = mod.SlabLayout(W, max_rows, D, itemsize,
                                     mod.ll_rows_for(max_rows, D, itemsize))
        stride = (self.layout.total_bytes + 4095) // 4096 * 4096
        self.raw = torch.zeros(W * stride + 4096, dtype=torch.uint8, device=dev)
        off = (-self.raw.data_ptr()) % 4096
        self.slabs = [self.raw[off + r * stride: off + r * stride + self.layout.total_bytes]
                      for r in range(W)]
        ptrs = [s.data_ptr() for s in self.slabs]
        self.deltas = []
        for r in range(W):
            d = [p - ptrs[r] for p in ptrs]
            self.deltas.append(tuple(torch.tensor([x // (16 * u) for x in d], dtype=torch.int64,
                                                  device=dev) for u in (itemsize, 4, 8)))
        self.state = [torch.zeros(4, dtype=torch.int32, device=dev) for _ in range(W)]
        self.errors = [torch.zeros(W, dtype=torch.int32, device=dev) for _ in range(W)]
        # split kernel files: the region pointers and peer tables, built once per rank
        self.mslabs = ([mod.MergeSlab.build(self.layout, self.slabs[r], dtype, ptrs, r,
                                            self.state[r], self.errors[r]) for r in range(W)]
                       if hasattr(mod, "MergeSlab") else None)
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.outs = torch.randn((W, T, H, D), device=dev, generator=gen).to(dtype)
        self.lses = torch.randn((W, T, H), device=dev, generator=gen) * 3
        self.res = [torch.full((T, hs, D), float("nan"), device=dev).to(dtype) for _ in range(W)]
        self.res_lse = [torch.full((T, hs), float("nan"), device=dev) for _ in range(W)]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.n_programs = max(1, sms // W)
        self.timeout_ns = int(timeout_s * 1e9)
        # The rank streams come from the high-priority pool: torch hands out pooled streams
        # round robin, so a default-priority one can be the very stream that captures a
        # graph or times it; a rank kernel on that stream would be ordered after the
        # others' forks and the spinning ranks would wait on one that cannot start.
        self.streams = [torch.cuda.Stream(priority=-1) for _ in range(W)]

    def _launch(self, r, timeout_ns):
        kw = dict(rank=r, world_size=self.W, num_heads=self.H, layout=self.layout,
                  n_programs_max=self.n_programs, timeout_ns=timeout_ns, pdl=self.pdl)
        if self.mslabs is not None:
            kw["slab"] = self.mslabs[r]
        else:
            d_o, d_w, d_q = self.deltas[r]
            kw.update(slab=self.slabs[r], delta_o=d_o, delta_w=d_w, delta_q=d_q,
                      state=self.state[r], errors=self.errors[r])
        self.mod.launch_merge(self.outs[r], self.lses[r], self.res[r], self.res_lse[r], **kw)

    def load_kernels(self):
        """Compile and load every rank's kernel alone (each times out at once): loading a
        module while another rank's kernel spins would stall it. Then reset everything. (Both
        timeouts fit int32, so the timed launches reuse these compiled kernels.)"""
        for r in range(self.W):
            self._launch(r, 1)
            torch.cuda.synchronize()
        for t in (*self.state, *self.errors, self.raw):
            t.zero_()
        torch.cuda.synchronize()

    def step(self):
        main = torch.cuda.current_stream()
        if any(s == main for s in self.streams):
            raise RuntimeError("a rank stream is the launching stream: ranks would serialize")
        for r, s in enumerate(self.streams):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                self._launch(r, self.timeout_ns)
        for s in self.streams:
            main.wait_stream(s)

    def check(self):
        torch.cuda.synchronize()
        bad = [r for r in range(self.W) if bool(self.errors[r].any())]
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


def graph_us(fn) -> float:
    """Median µs per call: 10 calls per CUDA graph, replays back to back (the bench helper)."""
    return statistics.median(time_graph(fn, per_graph=10, back_to_back=True))


def _measure(mod, label, W, H, D, T, seed, pdl):
    """One module at one token count: check, time, and return (record, results)."""
    sim = Sim(mod, W, H, D, T, torch.bfloat16, seed=seed, pdl=pdl)
    sim.load_kernels()
    sim.step()
    sim.check()
    for r in range(W):  # poison again: the graph replays must write everything
        sim.res[r].fill_(float("nan"))
        sim.res_lse[r].fill_(float("nan"))
    t_merge = graph_us(sim.step)
    err = sim.check()  # what the last replay left
    payload = sim.outs[0, :, : H // W].contiguous()
    dst = torch.empty_like(payload)
    t_copy = graph_us(lambda: dst.copy_(payload))
    mib = payload.numel() * payload.element_size() / 2 ** 20
    results = [(x.clone(), y.clone()) for x, y in zip(sim.res, sim.res_lse)]
    del sim
    return ({"label": label, "tokens": T, "world_size": W, "merge_us": t_merge,
             "copy_us": t_copy, "mib_per_peer": mib, "max_err": err}, results)


def _same_bits(a, b) -> bool:
    return all(torch.equal(x.view(torch.int16), y.view(torch.int16))
               and torch.equal(xl.view(torch.int32), yl.view(torch.int32))
               for (x, xl), (y, yl) in zip(a, b))


def main() -> int:
    config.force_safe_env()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--kernel-module", default=None, help="kernel file to run (default: the "
                   "package's)")
    p.add_argument("--ab", nargs="?", const=PRE_SPLIT, default=None, metavar="PATH",
                   help="also run PATH (default: the pre-split kernel) on the same inputs; "
                   "results compared bitwise, timings alternated")
    p.add_argument("--rounds", type=int, default=3, help="A/B rounds (alternating)")
    p.add_argument("--pdl", action="store_true", help="launch with PDL (capability ≥ 9.0)")
    p.add_argument("--label", default="current")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    mods = [(a.label, _kernel_module(a.kernel_module))]
    if a.ab:
        mods.insert(0, (os.path.basename(a.ab), _kernel_module(a.ab)))
    W, H, D = a.world_size, a.heads, a.head_dim
    rounds = a.rounds if a.ab else 1
    records, same = [], True
    print(f"W={W} simulated ranks on one {torch.cuda.get_device_name(0)}, H={H}, D={D}, bf16, "
          f"PDL {'on' if a.pdl else 'off'}, graph replay / 10 (µs); not NVLink figures")
    print(f"{'kernel':>24} {'round':>5} {'tokens':>6} {'merge':>8} {'copy':>8} {'MiB/peer':>9} "
          f"{'err':>9}")
    for T in a.tokens:
        for rnd in range(rounds):
            results = []
            for label, mod in (mods if rnd % 2 == 0 else mods[::-1]):
                rec, res = _measure(mod, label, W, H, D, T, seed=T, pdl=a.pdl)
                rec["round"] = rnd
                results.append(res)
                records.append(rec)
                print(f"{label:>24} {rnd:>5} {T:>6} {rec['merge_us']:>8.2f} "
                      f"{rec['copy_us']:>8.2f} {rec['mib_per_peer']:>9.3f} "
                      f"{rec['max_err']:>9.2e}")
            if len(results) == 2 and not _same_bits(*results):
                same = False
                print(f"  tokens {T}: results DIFFER between the two kernels")
    if a.ab:
        print("A/B: bitwise equal results at every token count" if same else
              "A/B: results differ")
        for T in a.tokens:
            meds = {label: statistics.median(r["merge_us"] for r in records
                                             if r["label"] == label and r["tokens"] == T)
                    for label, _ in mods}
            print(f"  tokens {T:>4}: " + ", ".join(f"{k} {v:.2f} µs" for k, v in meds.items()))
    if a.json:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": __import__("triton").__version__, "heads": H, "head_dim": D,
                "simulated_world_size": W, "kernel_module": a.kernel_module or "attncomm",
                "ab": a.ab, "pdl": a.pdl, "bitwise_equal": same if a.ab else None}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
