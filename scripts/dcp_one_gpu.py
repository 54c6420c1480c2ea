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
        [--kernel-module PATH] [--label NAME] [--json PATH]

``--kernel-module`` loads ``launch_merge`` / ``plan_blocks`` from another file (an A/B of two
kernel versions in one device call). Reading: compare versions, not absolute values. On an
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
from attncomm.symm import SlabLayout  # noqa: E402


def _kernel_module(path: str | None):
    if path is None:
        import attncomm.dcp.symm_a2a as mod
        return mod
    # named inside attncomm.dcp, so the file's relative imports resolve as in the package
    spec = importlib.util.spec_from_file_location("attncomm.dcp._symm_a2a_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Sim:
    """W simulated ranks of one DCP merge geometry on the current GPU."""

    def __init__(self, mod, W, H, D, T, dtype, timeout_s=2.0):
        self.mod, self.W, self.H, self.D, self.T = mod, W, H, D, T
        dev = torch.device("cuda")
        hs = H // W
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_rows = T * hs
        self.layout = SlabLayout(W, max_rows, D, itemsize,
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
        self.outs = torch.randn((W, T, H, D), device=dev).to(dtype)
        self.lses = torch.randn((W, T, H), device=dev) * 3
        self.res = [torch.full((T, hs, D), float("nan"), device=dev).to(dtype) for _ in range(W)]
        self.res_lse = [torch.full((T, hs), float("nan"), device=dev) for _ in range(W)]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.n_programs = max(1, sms // W)
        self.timeout_ns = int(timeout_s * 1e9)
        self.streams = [torch.cuda.Stream() for _ in range(W)]

    def _launch(self, r, timeout_ns):
        d_o, d_w, d_q = self.deltas[r]
        self.mod.launch_merge(
            self.outs[r], self.lses[r], self.res[r], self.res_lse[r], slab=self.slabs[r],
            delta_o=d_o, delta_w=d_w, delta_q=d_q, state=self.state[r], errors=self.errors[r],
            rank=r, world_size=self.W, num_heads=self.H, layout=self.layout,
            n_programs_max=self.n_programs, timeout_ns=timeout_ns)

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


def main() -> int:
    config.force_safe_env()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    p.add_argument("--kernel-module", default=None)
    p.add_argument("--label", default="current")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    mod = _kernel_module(a.kernel_module)
    W, H, D = a.world_size, a.heads, a.head_dim
    records = []
    print(f"{a.label}: W={W} simulated ranks on one {torch.cuda.get_device_name(0)}, H={H}, "
          f"D={D}, bf16, graph replay / 10 (µs)")
    print(f"{'tokens':>6} {'merge':>8} {'copy':>8} {'MiB/peer':>9} {'err':>9}")
    for T in a.tokens:
        sim = Sim(mod, W, H, D, T, torch.bfloat16)
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
        print(f"{T:>6} {t_merge:>8.2f} {t_copy:>8.2f} {mib:>9.3f} {err:>9.2e}")
        records.append({"label": a.label, "tokens": T, "world_size": W, "merge_us": t_merge,
                        "copy_us": t_copy, "mib_per_peer": mib, "max_err": err})
        del sim
    if a.json:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": __import__("triton").__version__, "heads": H, "head_dim": D,
                "simulated_world_size": W, "kernel_module": a.kernel_module or "attncomm"}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
