"""The ``symm`` DCP query-gather kernel of W simulated ranks on ONE GPU (``_one_gpu.SimRanks``):
bitwise check and timing where only a one-GPU machine is lent.

Checks, bit for bit, every rank's gathered query against ``rotate_tail`` then the gather — eager
steps with fresh data (both parity slots, LL and flag protocols, with and without the READY
handshake), then graph replays with fresh data copied in before each — then times CUDA graphs
of 10 steps (replay / 10, median of 100) against two baselines of the same run: the torch
version (``rotate_tail`` + one copy of every rank's slice into every rank's output, what an
all_gather moves, on one stream) and a device copy of one rank's slice (a floor); and the host
µs per launch of rank 0's wrapper (``launch_gather`` and Triton's launch). ``--fp8``: FP8
output (e4m3fn bytes with per-head scales, checked bit for bit against ``quantize_e4m3`` of the
fp32 rotation in torch on the same GPU). Random data from fixed seeds (one per token count and
variant), so two trees' runs can be compared bit for bit (``--dump``, ``--ab``).

    python scripts/dcp_gather_one_gpu.py [--world-size 2] [--tokens 1 2 4 8 16 32 64 128]
        [--heads 64] [--head-dim 576] [--rope-dim 64] [--replays 100] [--label NAME] [--fp8]
        [--column-block N] [--json PATH] [--dump PATH] [--tree PATH]
    python scripts/dcp_gather_one_gpu.py --ab REV|PATH [--rounds 2] [--out DIR] [options]

Compare versions, not absolute values: the W ranks share one GPU's SMs and memory, these are
not NVLink figures.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _one_gpu  # noqa: E402

ROOT = _one_gpu.use_tree(sys.argv)

import torch  # noqa: E402

from attncomm import config  # noqa: E402
from attncomm.dcp.query_gather import quantize_e4m3, rotate_tail  # noqa: E402


class GatherSim(_one_gpu.SimRanks):
    """W simulated ranks of one query-gather geometry on the current GPU."""

    def __init__(self, mod, W, H, D, R, T, dtype, ordered, timeout_s=2.0, fp8=False,
                 column_block=None, seed=0):
        self.mod, self.H, self.D, self.R, self.T = mod, H, D, R, T
        self.dtype, self.ordered, self.fp8 = dtype, ordered, fp8
        dev = torch.device(_one_gpu.device())
        self.hs = H // W
        torch.manual_seed(seed)
        # FP8: per-head scales around 1/64, so the largest of randn·2 saturate at 448
        self.scale = (torch.rand(H, device=dev) + 0.5) / 96 if fp8 else None
        out_dtype = torch.uint8 if fp8 else dtype
        itemsize = torch.empty((), dtype=out_dtype).element_size()
        self.layout = mod.GatherLayout(W, T, H, D, itemsize,
                                       mod.ll_rows_for(T * self.hs, D, itemsize))
        super().__init__(W, self.layout.total_bytes)
        self.q = torch.empty((W, T, self.hs, D), device=dev, dtype=dtype)
        self.cos = torch.empty((T, R), device=dev)
        self.sin = torch.empty((T, R), device=dev)
        self.fresh()
        n = T * H * D
        self.outs = [s.view(out_dtype)[:n].view(T, H, D) for s in self.slabs]
        kw = {"column_block_override": column_block} if column_block else {}
        timeout_ns = int(timeout_s * 1e9)
        self.calls = [(self._call(r, timeout_ns, kw), self._call(r, 1, kw)) for r in range(W)]

    def _call(self, r, timeout_ns, extra):
        """Rank r's launch as a closure: the descriptor interface (``GatherSlab``), or the
        one before it (up to 3a5fea2: the slab, peer tables and budget per launch)."""
        mod = self.mod
        cos, sin = (self.cos, self.sin) if self.R else (None, None)
        kw = dict(rank=r, layout=self.layout, n_programs_max=self.n_programs,
                  ordered=self.ordered, q_scale=self.scale, **extra)
        if "timeout_ns" in inspect.signature(mod.launch_gather).parameters:
            d = [p - self.ptrs[r] for p in self.ptrs]
            d_o, d_w, d_q = (torch.tensor([x // (16 * u) for x in d], dtype=torch.int64,
                                          device=self.raw.device)
                             for u in (self.layout.itemsize, 4, 8))
            kw.update(slab=self.slabs[r], delta_o=d_o, delta_w=d_w, delta_q=d_q,
                      state=self.state[r], errors=self.errors[r], timeout_ns=timeout_ns)
        else:
            kw["slab"] = mod.GatherSlab.build(self.layout, self.slabs[r], self.ptrs, r,
                                              self.state[r], self.errors[r], timeout_ns)
        q = self.q[r]
        return lambda: mod.launch_gather(q, cos, sin, **kw)

    def launch(self, r, loading=False):
        self.calls[r][loading]()

    def fresh(self):
        """New random queries and angles, in place (graph inputs keep their addresses)."""
        self.q.copy_(torch.randn(self.q.shape, device=self.q.device) * 2)
        ang = torch.rand((self.T, self.R // 2), device=self.q.device) * 30
        ang = torch.cat((ang, ang), -1)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

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
        bad = self.timed_out()
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


def run_tokens(mod, a, T, ordered, dump: _one_gpu.Dump | None = None) -> dict:
    """One token count and variant: checks (raise on any differing bit), times; the last
    eager step's and the last checked replay's outputs go into ``dump``."""
    W, H, D, R = a.world_size, a.heads, a.head_dim, a.rope_dim
    fp8 = getattr(a, "fp8", False)
    sim = GatherSim(mod, W, H, D, R, T, torch.bfloat16, ordered, fp8=fp8,
                    column_block=getattr(a, "column_block", None), seed=2 * T + ordered)
    sim.load_kernels()
    host = sim.launch_host_us() if getattr(a, "host", False) else None
    for i in range(4):  # eager, fresh data: epochs 1..4, both parity slots
        sim.fresh()
        sim.poison()
        sim.step()
        sim.check(f"T={T} eager step {i}")
    key = f"tokens={T} ordered={ordered}"
    if dump is not None:
        for r in range(W):
            dump.add(f"{key}/eager/r{r}", sim.outs[r])
    replay = sim.step  # a dry run (CPU) replays eager steps
    if _one_gpu.device() == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            sim.step()
        replay = graph.replay
    for i in range(a.replays):  # graph replays with fresh data, both slots
        sim.fresh()
        sim.poison()
        replay()
        sim.check(f"T={T} graph replay {i}")
    if dump is not None:
        for r in range(W):
            dump.add(f"{key}/graph/r{r}", sim.outs[r])
    t_symm = _one_gpu.graph_us(sim.step)
    sim.check(f"T={T} after timing")  # the last timed replay's data (unchanged inputs)
    t_torch = _one_gpu.graph_us(sim.baseline)
    src = sim.q[0].contiguous()
    dst = torch.empty_like(src)
    t_copy = _one_gpu.graph_us(lambda: dst.copy_(src))
    ll = mod.use_ll(T * sim.hs, sim.layout)
    mib = src.numel() * src.element_size() / 2 ** 20
    return {"label": a.label, "key": key, "tokens": T, "world_size": W, "ordered": ordered,
            "fp8": fp8, "protocol": "ll" if ll else "flag",
            "column_block": getattr(a, "column_block", None), "gpu_us": t_symm,
            "host_us": host, "torch_us": t_torch, "copy_us": t_copy, "mib_per_peer": mib}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=576)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--replays", type=int, default=100, help="checked graph replays per T")
    p.add_argument("--fp8", action="store_true", help="FP8 (e4m3fn) output with per-head scales")
    p.add_argument("--column-block", type=int, default=None,
                   help="force the flag kernel's column block (a power of two; tuning A/Bs)")
    _one_gpu.add_run_arguments(p, "write every checked output here (torch.save)")
    return p


def main(argv=None) -> int:
    config.force_safe_env()
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.ab:
        import ab_tree
        return ab_tree.main(__file__, a.ab, argv, rounds=a.rounds, out=a.out)
    gpu = (torch.cuda.get_device_name(0) if _one_gpu.device() == "cuda" else
           "CPU (a dry run under TRITON_INTERPRET=1: the times mean nothing)")
    import attncomm.dcp.query_gather.symm as mod
    a.host = True
    records, dump = [], _one_gpu.Dump()
    print(f"{a.label} ({ROOT}): W={a.world_size} simulated ranks on one "
          f"{gpu}, H={a.heads}, D={a.head_dim}, R={a.rope_dim}, "
          f"bf16{' → fp8' if a.fp8 else ''}, graph replay / 10 (µs); every result checked "
          f"bit for bit")
    print(f"{'tokens':>6} {'proto':>5} {'ordered':>7} {'symm':>8} {'host/launch':>11} "
          f"{'torch':>8} {'copy':>8} {'vs torch':>8} {'MiB/peer':>9}")
    for T in a.tokens:
        for ordered in (False, True):
            rec = run_tokens(mod, a, T, ordered, dump)
            records.append(rec)
            print(f"{T:>6} {rec['protocol']:>5} {str(ordered):>7} {rec['gpu_us']:>8.2f} "
                  f"{rec['host_us']:>11.2f} {rec['torch_us']:>8.2f} {rec['copy_us']:>8.2f} "
                  f"{rec['torch_us'] / rec['gpu_us']:>7.2f}× {rec['mib_per_peer']:>9.3f}",
                  flush=True)
    dump.save(a.dump)
    if a.json:
        meta = {"gpu": gpu, "torch": torch.__version__,
                "triton": __import__("triton").__version__, "heads": a.heads,
                "head_dim": a.head_dim, "rope_dim": a.rope_dim, "fp8": a.fp8,
                "simulated_world_size": a.world_size, "tree": ROOT}
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": records}, f, indent=1)
    print("ok: every gathered query bit for bit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
