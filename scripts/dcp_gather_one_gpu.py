"""The ``symm`` DCP query-gather kernel of W simulated ranks on ONE GPU: bitwise check and A/B
timing where only a one-GPU machine is lent.

Every simulated rank gets its own slab (all in one allocation, so peer offsets are plain pointer
differences), epoch, error word and inputs; each step launches the W ranks' kernels on W streams
(fork/join), so they run side by side as on W GPUs, except that "peer" stores go to this GPU's
own memory instead of over NVLink. The grid bound is SMs / W, so every program of every rank is
resident (the kernels spin on each other). Checks, bit for bit, every rank's gathered query
against ``rotate_tail`` then the gather — eager steps with fresh data (both parity slots, LL and
flag protocols, with and without the READY handshake), then graph replays with fresh data copied
in before each — then times CUDA graphs of 10 steps (replay / 10, median of 100) against two
baselines of the same run: the torch version (``rotate_tail`` + one copy of every rank's slice
into every rank's output, what an all_gather moves, on one stream) and a device copy of one
rank's slice (a floor). ``--fp8``: FP8 output (e4m3fn bytes with per-head scales, checked bit
for bit against ``quantize_e4m3`` of the fp32 rotation in torch on the same GPU).

    python scripts/dcp_gather_one_gpu.py [--world-size 2] [--tokens 1 2 4 8 16 32 64 128]
        [--heads 64] [--head-dim 576] [--rope-dim 64] [--kernel-module PATH] [--label NAME]
        [--fp8] [--column-block N] [--json PATH]

``--kernel-module`` loads ``launch_gather`` from another copy of ``gather_symm.py`` (an A/B of
two versions in one device call). Compare versions, not absolute values: the W ranks share one
GPU's SMs and memory, these are not NVLink figures.
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
sys.path[:0] = [ROOT]

from attncomm import config  # noqa: E402
from attncomm.bench.common import time_graph  # noqa: E402
from attncomm.dcp.query_gather import quantize_e4m3, rotate_tail  # noqa: E402


def _module(path: str | None):
    if path is None:
        import attncomm.dcp.query_gather.symm as mod
        return mod
    spec = importlib.util.spec_from_file_location("attncomm.dcp._gather_symm_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Sim:
    """W simulated ranks of one query-gather geometry on the current GPU."""

    def __init__(self, mod, W, H, D, R, T, dtype, ordered, timeout_s=2.0, fp8=False,
                 column_block=None):
        self.launch_kw = {"column_block_override": column_block} if column_block else {}
        self.mod, self.W, self.H, self.D, self.R, self.T = mod, W, H, D, R, T
        self.dtype, self.ordered, self.fp8 = dtype, ordered, fp8
        dev = torch.device("cuda")
        self.hs = H // W
        # FP8: per-head scales around 1/64, so the largest of randn·2 saturate at 448
        self.scale = (torch.rand(H, device=dev) + 0.5) / 96 if fp8 else None
        out_dtype = torch.uint8 if fp8 else dtype
        itemsize = torch.empty((), dtype=out_dtype).element_size()
        self.layout = mod.GatherLayout(W, T, H, D, itemsize,
                                       mod.ll_rows_for(T * self.hs, D, itemsize))
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
        self.q = torch.empty((W, T, self.hs, D), device=dev, dtype=dtype)
        self.cos = torch.empty((T, R), device=dev)
        self.sin = torch.empty((T, R), device=dev)
        self.fresh()
        n = T * H * D
        self.outs = [s.view(out_dtype)[:n].view(T, H, D) for s in self.slabs]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        self.n_programs = max(1, sms // W)
        self.timeout_ns = int(timeout_s * 1e9)
        # The rank streams come from the high-priority pool: torch hands out pooled streams
        # round robin, so a default-priority one can be the very stream that captures a
        # graph or times it; a rank kernel on that stream would be ordered after the
        # others' forks and the spinning ranks would wait on one that cannot start.
        self.streams = [torch.cuda.Stream(priority=-1) for _ in range(W)]

    def fresh(self):
        """New random queries and angles, in place (graph inputs keep their addresses)."""
        self.q.copy_(torch.randn(self.q.shape, device=self.q.device) * 2)
        ang = torch.rand((self.T, self.R // 2), device=self.q.device) * 30
        ang = torch.cat((ang, ang), -1)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def _launch(self, r, timeout_ns):
        d_o, d_w, d_q = self.deltas[r]
        cos, sin = (self.cos, self.sin) if self.R else (None, None)
        self.mod.launch_gather(
            self.q[r], cos, sin, slab=self.slabs[r], delta_o=d_o, delta_w=d_w, delta_q=d_q,
            state=self.state[r], errors=self.errors[r], rank=r, layout=self.layout,
            n_programs_max=self.n_programs, timeout_ns=timeout_ns, ordered=self.ordered,
            q_scale=self.scale, **self.launch_kw)

    def load_kernels(self):
        """Compile and load every rank's kernel alone (each times out at once): loading a module
        while another rank's kernel spins would stall it. Then reset everything."""
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

    def _slice(self, r):
        if not self.fp8:
            return rotate_tail(self.q[r], self.cos, self.sin) if self.R else self.q[r]
        x = self.q[r].float()
        if self.R:
            rotate_tail(self.q[r], self.cos, self.sin, out=x)
        hs = self.hs
        return quantize_e4m3(x, self.scale[r * hs:(r + 1) * hs]).view(torch.uint8)

    def want(self):
        rot = torch.stack([self._slice(r) for r in range(self.W)])
        return rot.permute(1, 0, 2, 3).reshape(self.T, self.H, self.D)

    def check(self, what):
        torch.cuda.synchronize()
        bad = [r for r in range(self.W) if bool(self.errors[r].any())]
        if bad:
            raise RuntimeError(f"{what}: ranks {bad} timed out (not resident together?)")
        want = self.want().contiguous().view(torch.uint8)
        for r in range(self.W):
            got = self.outs[r].contiguous().view(torch.uint8)
            if not torch.equal(got, want):
                n = int((got != want).sum())
                raise AssertionError(f"{what}: rank {r}'s gathered query differs in {n} bytes")

    def poison(self):
        for o in self.outs:
            o.fill_(0xA5 if self.fp8 else float("nan"))

    def baseline(self):
        """The torch version on one stream: rotate every slice, copy it into every output."""
        for r in range(self.W):
            src = self._slice(r)
            for o in self.outs:
                o[:, r * self.hs:(r + 1) * self.hs].copy_(src)


def graph_us(fn) -> float:
    return statistics.median(time_graph(fn, per_graph=10, back_to_back=True))


def run_tokens(mod, a, T, ordered) -> dict:
    W, H, D, R = a.world_size, a.heads, a.head_dim, a.rope_dim
    fp8 = getattr(a, "fp8", False)
    sim = Sim(mod, W, H, D, R, T, torch.bfloat16, ordered, fp8=fp8,
              column_block=getattr(a, "column_block", None))
    sim.load_kernels()
    for i in range(4):  # eager, fresh data: epochs 1..4, both parity slots
        sim.fresh()
        sim.poison()
        sim.step()
        sim.check(f"T={T} eager step {i}")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sim.step()
    for i in range(a.replays):  # graph replays with fresh data, both slots
        sim.fresh()
        sim.poison()
        graph.replay()
        sim.check(f"T={T} graph replay {i}")
    t_symm = graph_us(sim.step)
    sim.check(f"T={T} after timing")  # the last timed replay's data (unchanged inputs)
    t_torch = graph_us(sim.baseline)
    src = sim.q[0].contiguous()
    dst = torch.empty_like(src)
    t_copy = graph_us(lambda: dst.copy_(src))
    ll = mod.use_ll(T * sim.hs, sim.layout)
    mib = src.numel() * src.element_size() / 2 ** 20
    return {"label": a.label, "tokens": T, "world_size": W, "ordered": ordered, "fp8": fp8,
            "protocol": "ll" if ll else "flag",
            "column_block": getattr(a, "column_block", None),
            "symm_us": t_symm, "torch_us": t_torch, "copy_us": t_copy, "mib_per_peer": mib}


def main() -> int:
    config.force_safe_env()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=576)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--replays", type=int, default=100, help="checked graph replays per T")
    p.add_argument("--kernel-module", default=None)
    p.add_argument("--label", default="current")
    p.add_argument("--fp8", action="store_true", help="FP8 (e4m3fn) output with per-head scales")
    p.add_argument("--column-block", type=int, default=None,
                   help="force the flag kernel's column block (a power of two; tuning A/Bs)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a GPU", file=sys.stderr)
        return 2
    mod = _module(a.kernel_module)
    records = []
    print(f"{a.label}: W={a.world_size} simulated ranks on one {torch.cuda.get_device_name(0)}, "
          f"H={a.heads}, D={a.head_dim}, R={a.rope_dim}, bf16{' → fp8' if a.fp8 else ''}, "
          f"graph replay / 10 (µs); every "
          f"result checked bit for bit")
    print(f"{'tokens':>6} {'proto':>5} {'ordered':>7} {'symm':>8} {'torch':>8} {'copy':>8} "
          f"{'vs torch':>8} {'MiB/peer':>9}")
    for T in a.tokens:
        for ordered in (False, True):
            rec = run_tokens(mod, a, T, ordered)
            records.append(rec)
            print(f"{T:>6} {rec['protocol']:>5} {str(ordered):>7} {rec['symm_us']:>8.2f} "
                  f"{rec['torch_us']:>8.2f} {rec['copy_us']:>8.2f} "
                  f"{rec['torch_us'] / rec['symm_us']:>7.2f}× {rec['mib_per_peer']:>9.3f}")
    if a.json:
        meta = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "triton": __import__("triton").__version__, "heads": a.heads,
                "head_dim": a.head_dim, "rope_dim": a.rope_dim,
                "simulated_world_size": a.world_size,
                "kernel_module": a.kernel_module or "attncomm"}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    print("ok: every gathered query bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
