"""``attncomm bench ulysses --fill``: the fill (norm + RoPE + pack into the send buffer) as the
Triton kernel, as torch ops, and against its floor, one process, one GPU.

Shapes: one rank's sequence shard at world size ``W`` (default 2) of q, k, v ``[1, S/W, H, D]``
(H query and KV heads, default 56, D = 128, bf16), for each ``S`` (default 8192 and 32768),
with and without qk_norm + RoPE; the send buffer has W regions (``ulysses/fill.py``).

- ``triton``: ``FillPlan(impl="triton")`` (one launch for q, k, v), each launch shape of
  ``FILL_CONFIGS`` tried; ``time_us`` is the best one's (``config``), ``default_time_us`` the
  library default's, ``configs`` all of them (the shape never changes the bits: every one is
  checked).
- ``torch``: ``fill_torch``: ``rms_norm_rope`` of q and k in fp32 torch ops, then the copies
  into the regions (the unfused path's work).
- ``triton-fp8``, ``torch-fp8`` (``payload: "fp8"``): the same with the FP8 payload
  (``payload_dtype=torch.float8_e4m3fn``: the kernel quantizes while it packs; the send buffer
  is ``D + 4`` bytes per (token, head), ``ulysses/fp8.py``), checked bitwise against each other.
- ``floor_us``: bytes read + written ÷ the bandwidth of a device-to-device copy measured in the
  same run (``copy_`` of a 1 GiB buffer: 2 GiB moved). FP8 writes ``D + 4`` bytes per row where
  bf16 writes ``2·D``: its floor is lower.

On CPU (``device="cpu"``, the smoke test): the torch rows only, timed with the host clock
(``common.time_eager``) against a 16 MiB host copy; the kernel rows are skipped (the
interpreter is a checker, not something to time: ``meta["skipped"]``).

Times: the GPU's time per call: a sleep kernel first (so the host's launch work is not on
the GPU's clock), then ``n`` calls back to back between two CUDA events, median of 5 such
windows ÷ ``n``. ``eager_call_us`` (triton) is one call between two events with an idle GPU
(what the 2026-12-01 first results reported: it adds the host's launch time). ``host_us``: the
host's time per call of a prepared ``FillPlan`` (Python + launch). Records ``{"impl", "seq",
"heads", "head_dim", "time_us", "floor_us", "qk_norm", ...}``.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import common
from ..ulysses import fp8 as _fp8
from ..ulysses.fill import (HEADS_PER_PROGRAM, LAUNCH_OPTIONS, FillPart, FillPlan,
                            default_block_s, fill_torch, send_layout)
from ..ulysses.layout import group_head_ranges

__all__ = ["fill_records", "copy_bandwidth", "FILL_CONFIGS"]

#: Launch shapes the bench tries: (rows per program, heads per program, warps).
FILL_CONFIGS = ((16, 4, 4), (16, 2, 4), (16, 8, 4), (8, 4, 4), (32, 4, 4), (32, 4, 8),
                (16, 4, 8), (32, 8, 8), (64, 2, 8))


def _median_us(fn, iters: int, device: str = "cuda") -> float:
    """One call between two events (CUDA: idle GPU before it, so the host's launch time is
    included) or on the host clock (CPU); median of ``iters``."""
    return statistics.median(common.time_eager(fn, warmup=3, iters=iters, device=device))


def device_us(fn, n: int = 10, windows: int = 5) -> float:
    """The GPU's time per call of ``fn``: a sleep kernel, then ``n`` calls back to back between
    two events (the host enqueues ahead, so its launch work is off the clock); median of
    ``windows`` windows ÷ ``n``."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(windows):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(times)


def host_us(fn, n: int = 50) -> float:
    """The host's time per call of ``fn`` (Python + launch), the GPU kept busy meanwhile."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    dt = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return dt


def copy_bandwidth(device, nbytes: int = 1 << 30, iters: int = 10) -> float:
    """Bytes moved per second (read + written) by a device-to-device ``copy_`` of
    ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = _median_us(lambda: dst.copy_(src), iters, torch.device(device).type)
    return 2 * nbytes / (t * 1e-6)


def _case(seq, heads, d, world, norm, device, dtype, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    s_r = seq // world
    q, k, v = (torch.randn((1, s_r, heads, d), generator=g).to(dtype).to(device)
               for _ in range(3))
    ranges = tuple(group_head_ranges(heads, world, 1)[0])
    qw = torch.randn(d, generator=g).to(device) if norm else None
    kw = torch.randn(d, generator=g).to(device) if norm else None
    cos = torch.randn((s_r, d), generator=g).to(device) if norm else None
    sin = torch.randn((s_r, d), generator=g).to(device) if norm else None
    parts = [FillPart(q, ranges, qw, norm), FillPart(k, ranges, kw, norm), FillPart(v, ranges)]
    _, starts = send_layout(1, s_r, d, [ranges] * 3)
    return parts, cos, sin, starts[-1]


def fill_records(seqs=(8192, 32768), heads: int = 56, head_dim: int = 128, world: int = 2,
                 iters: int = 20, device=None) -> tuple[list[dict], dict]:
    """Time every impl per (seq, qk_norm, payload); ``(records, extra meta)``. Checks that the
    kernel's output equals the torch path's bit for bit (``bitwise_equal`` on the triton
    records). On CPU only the torch rows run (the smoke test)."""
    device = torch.device(device or "cuda")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16
    bw = copy_bandwidth(device, nbytes=(1 << 30) if cuda else (1 << 24),
                        iters=10 if cuda else 3)
    records = []
    for seq in seqs:
        for norm in (True, False):
            parts, cos, sin, _ = _case(seq, heads, head_dim, world, norm, device, dtype,
                                       seq + norm)
            for payload in (None, _fp8.FP8_DTYPE):
                run = _Run(parts, cos, sin, payload, device, iters)
                base = dict(seq=seq, heads=heads, head_dim=head_dim, world_size=world,
                            qk_norm=norm, payload="fp8" if payload else "bf16",
                            floor_us=run.moved / bw * 1e6, bytes_moved=run.moved)
                t_torch = run.torch_us()
                if cuda:
                    records.append(dict(base, **run.triton_record(base["floor_us"], t_torch)))
                records.append(dict(base, impl="torch" + run.suffix, time_us=t_torch,
                                    vs_floor=t_torch / base["floor_us"]))
    extra = {"copy_bandwidth_gbps": bw / 1e9, "fill_geometry":
             f"q, k, v [1, S/{world}, {heads}, {head_dim}] bf16, {world} regions; FP8 payload: "
             f"{_fp8.row_bytes(head_dim)} bytes per (token, head)"}
    if not cuda:
        extra["skipped"] = {"triton": "CPU: the kernel is checked under TRITON_INTERPRET=1 by "
                                      "the tests, not timed"}
    return records, extra


class _Run:
    """One (case, payload): the send buffers, the calls and their timers."""

    def __init__(self, parts, cos, sin, payload, device, iters):
        self.parts, self.cos, self.sin, self.payload = parts, cos, sin, payload
        self.cuda, self.iters = device.type == "cuda", iters
        self.suffix = "-fp8" if payload is not None else ""
        x = parts[0].x
        b, s_r, _, d = x.shape
        row = _fp8.row_bytes(d) if payload is not None else d
        wire = _fp8.WIRE_DTYPE if payload is not None else x.dtype
        _, starts = send_layout(b, s_r, row, [p.ranges for p in parts])
        self.out_t = torch.empty(starts[-1], dtype=wire, device=device)
        self.out_k = torch.empty_like(self.out_t)
        self.plans: dict = {}  # launch shape → its FillPlan
        # q, k, v read once, the send buffer written once (cos/sin read once with RoPE)
        self.moved = sum(p.x.numel() * p.x.element_size() for p in parts) \
            + self.out_t.numel() * self.out_t.element_size()
        if cos is not None:
            self.moved += 2 * cos.numel() * cos.element_size()
        self.torch_call()

    def torch_call(self):
        return fill_torch(self.parts, 1e-6, self.cos, self.sin, out=self.out_t,
                          payload_dtype=self.payload)

    def triton_call(self, **shape):
        key = tuple(sorted(shape.items()))
        plan = self.plans.get(key)
        if plan is None:
            plan = self.plans[key] = FillPlan(self.parts, 1e-6, self.cos is not None, "triton",
                                              self.payload, **shape)
        plan([p.x for p in self.parts], self.cos, self.sin, self.out_k)
        return self.out_k

    def torch_us(self) -> float:
        if self.cuda:
            return device_us(self.torch_call, 3, 3)
        return _median_us(self.torch_call, self.iters, "cpu")

    def _same(self, **shape) -> bool:
        self.out_k.view(torch.uint8).fill_(0xA5)  # poison
        self.triton_call(**shape)
        return torch.equal(self.out_k, self.out_t)

    def triton_record(self, floor: float, t_torch: float) -> dict:
        configs = []
        for block_s, hb, warps in FILL_CONFIGS:
            shape = dict(block_s=block_s, heads_per_program=hb, num_warps=warps)
            same = self._same(**shape)
            t = device_us(lambda: self.triton_call(**shape))  # noqa: B023 - called at once
            configs.append(dict(shape, time_us=t, bitwise_equal=same))
        same_default = self._same()
        t_default = device_us(self.triton_call)
        best = min(configs, key=lambda c: c["time_us"])
        d = self.parts[0].x.shape[3]
        return dict(impl="triton" + self.suffix, time_us=best["time_us"],
                    config={k: best[k] for k in ("block_s", "heads_per_program", "num_warps")},
                    default_config=_default_config(d), default_time_us=t_default,
                    eager_call_us=_median_us(self.triton_call, self.iters),
                    host_us=host_us(self.triton_call), configs=configs,
                    bitwise_equal=same_default and all(c["bitwise_equal"] for c in configs),
                    vs_floor=best["time_us"] / floor, speedup_vs_torch=t_torch / best["time_us"])


def _default_config(head_dim: int) -> dict:
    return {"block_s": default_block_s(head_dim), "heads_per_program": HEADS_PER_PROGRAM,
            "num_warps": LAUNCH_OPTIONS["num_warps"]}
