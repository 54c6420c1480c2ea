"""``attncomm bench ulysses --fill``: the fill (norm + RoPE + pack into the send buffer) as the
Triton kernel, as torch ops, and against its floor, one process, one GPU.

Shapes: one rank's sequence shard at world size ``W`` (default 2) of q, k, v ``[1, S/W, H, D]``
(H query and KV heads, default 56, D = 128, bf16), for each ``S`` (default 8192 and 32768),
with and without qk_norm + RoPE; the send buffer has W regions (``ulysses/fill.py``).

- ``triton``: ``fill_triton`` (one launch for q, k, v), each launch shape of ``FILL_CONFIGS``
  tried; ``time_us`` is the best one's (``config``), ``default_time_us`` the library default's,
  ``configs`` all of them (the shape never changes the bits: every one is checked).
- ``torch``: ``fill_torch``: ``rms_norm_rope`` of q and k in fp32 torch ops, then the copies
  into the regions (the unfused path's work).
- ``floor_us``: bytes read + written ÷ the bandwidth of a device-to-device copy measured in the
  same run (``copy_`` of a 1 GiB buffer: 2 GiB moved).

Times: the GPU's time per call: a sleep kernel first (so the host's launch work is not on
the GPU's clock), then ``n`` calls back to back between two CUDA events, median of 5 such
windows ÷ ``n``. ``eager_call_us`` (triton) is one call between two events with an idle GPU
(what the 2026-12-01 first results reported: it adds the host's launch time). ``host_us``: the
host's time per ``fill_triton`` call (Python + launch). Records ``{"impl", "seq", "heads",
"head_dim", "time_us", "floor_us", "qk_norm", ...}``.
"""
from __future__ import annotations

import statistics
import time

import torch

from . import common
from ..ulysses.fill import (HEADS_PER_PROGRAM, LAUNCH_OPTIONS, FillPart, default_block_s,
                            fill_torch, fill_triton, send_layout)
from ..ulysses.layout import group_head_ranges

__all__ = ["fill_records", "copy_bandwidth", "FILL_CONFIGS"]

#: Launch shapes the bench tries: (rows per program, heads per program, warps).
FILL_CONFIGS = ((16, 4, 4), (16, 2, 4), (16, 8, 4), (8, 4, 4), (32, 4, 4), (32, 4, 8),
                (16, 4, 8), (32, 8, 8), (64, 2, 8))


def _median_us(fn, iters: int) -> float:
    """One call between two events, idle GPU before it: includes the host's launch time."""
    return statistics.median(common.time_eager(fn, warmup=3, iters=iters, device="cuda"))


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
    t = _median_us(lambda: dst.copy_(src), iters)
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
    """Time every impl per (seq, qk_norm); ``(records, extra meta)``. Checks that the kernel's
    output equals the torch path's bit for bit (``bitwise_equal`` on the triton records)."""
    device = torch.device(device or "cuda")
    dtype = torch.bfloat16
    bw = copy_bandwidth(device)
    records = []
    for seq in seqs:
        for norm in (True, False):
            parts, cos, sin, numel = _case(seq, heads, head_dim, world, norm, device, dtype,
                                           seq + norm)
            item = torch.empty((), dtype=dtype).element_size()
            moved = 2 * 3 * parts[0].x.numel() * item  # q, k, v read once, written once
            if norm:
                moved += 2 * cos.numel() * cos.element_size()
            floor = moved / bw * 1e6
            out_t = torch.empty(numel, dtype=dtype, device=device)
            out_k = torch.empty(numel, dtype=dtype, device=device)
            fill_torch(parts, 1e-6, cos, sin, out=out_t)
            base = dict(seq=seq, heads=heads, head_dim=head_dim, world_size=world,
                        qk_norm=norm, floor_us=floor, bytes_moved=moved)
            t_torch = device_us(lambda: fill_torch(parts, 1e-6, cos, sin, out=out_t), 3, 3)
            configs = []
            for block_s, hb, warps in FILL_CONFIGS:
                shape = dict(block_s=block_s, heads_per_program=hb, num_warps=warps)
                out_k.fill_(float("nan"))
                fill_triton(parts, 1e-6, cos, sin, out=out_k, **shape)
                same = torch.equal(out_k, out_t)
                t = device_us(lambda: fill_triton(parts, 1e-6, cos, sin, out=out_k, **shape))
                configs.append(dict(shape, time_us=t, bitwise_equal=same))
            out_k.fill_(float("nan"))
            fill_triton(parts, 1e-6, cos, sin, out=out_k)
            same_default = torch.equal(out_k, out_t)
            call = lambda: fill_triton(parts, 1e-6, cos, sin, out=out_k)  # noqa: E731
            t_default = device_us(call)
            t_eager = _median_us(call, iters)
            t_host = host_us(call)
            best = min(configs, key=lambda c: c["time_us"])
            records.append(dict(base, impl="triton", time_us=best["time_us"],
                                config={k: best[k] for k in
                                        ("block_s", "heads_per_program", "num_warps")},
                                default_config=_default_config(head_dim),
                                default_time_us=t_default, eager_call_us=t_eager,
                                host_us=t_host, configs=configs,
                                bitwise_equal=same_default and all(c["bitwise_equal"]
                                                                   for c in configs),
                                vs_floor=best["time_us"] / floor,
                                speedup_vs_torch=t_torch / best["time_us"]))
            records.append(dict(base, impl="torch", time_us=t_torch, vs_floor=t_torch / floor))
    return records, {"copy_bandwidth_gbps": bw / 1e9, "fill_geometry":
                     f"q, k, v [1, S/{world}, {heads}, {head_dim}] bf16, {world} regions"}


def _default_config(head_dim: int) -> dict:
    return {"block_s": default_block_s(head_dim), "heads_per_program": HEADS_PER_PROGRAM,
            "num_warps": LAUNCH_OPTIONS["num_warps"]}
