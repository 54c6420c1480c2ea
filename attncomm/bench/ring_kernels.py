"""The ring's per-step costs in one process: the online merge against the attention it follows,
and the default ``attn_fn`` (attention with its LSE) against plain SDPA on the same tensors.

One ring step on one rank is ``attn_fn`` on a ``[1, S_r, H, D]`` block, then ``merge_block`` of
its ``(out, lse)`` into the fp32 state. Both are timed here on the shapes of a step (a full block,
not causal: the step every rank takes W − 1 times; and the causal diagonal block): device µs per
call from CUDA events around 10 calls back to back (``device_us``), and beside it the host µs of
one call started on an idle GPU (``host_us``).
``attncomm bench ring --kernels`` and ``scripts/ring_one_gpu.py`` print and record them.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from .._timing import time_eager, time_host
from ..ring import attn as ring_attn
from ..ring.merge import merge_block, new_state

__all__ = ["kernel_records", "host_us", "device_us"]


def host_us(fn, device: torch.device, iters: int = 20) -> float:
    """Median host µs of one ``fn()`` call started on an idle device (synchronised before each
    call; the call's enqueueing only)."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    times = time_host([fn], repeats=iters, rounds=1, warmup=0, before=sync)[0][0]
    if sync is not None:
        sync()
    return float(statistics.median(times))


def device_us(fn, device: torch.device, iters: int = 20, reps: int = 10) -> float:
    """Median µs per ``fn()`` on the device: ``reps`` calls back to back between two events
    (so the host's launch latency before the first call is spread over ``reps``, not counted
    as device time), ``iters`` such batches."""
    def batch():
        for _ in range(reps):
            fn()
    return float(statistics.median(time_eager(batch, warmup=1, iters=iters,
                                              device=device.type))) / reps


def kernel_records(device: torch.device, seq: int, heads: int, head_dim: int,
                   dtype: torch.dtype, iters: int = 20, seed: int = 0) -> list[dict]:
    """Records for one step shape ``[1, seq, heads, head_dim]``: for causal False and True the
    µs (device and host) of ``attention_with_lse``, of plain SDPA, and of ``merge_block``, and
    the two ratios (``merge_vs_attention``, ``attn_lse_vs_sdpa``)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v = (torch.randn(1, seq, heads, head_dim, generator=g).to(device=device, dtype=dtype)
               for _ in range(3))
    base = {"seq": seq, "heads": heads, "head_dim": head_dim, "dtype": str(dtype)[6:],
            "device": device.type}
    out = []
    for causal in (False, True):
        def attn():
            return ring_attn.attention_with_lse(q, k, v, causal)

        def sdpa():
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=causal)

        o, lse = attn()
        kernel = ring_attn.last_kernel()
        acc, acc_lse = new_state(1, seq, heads, head_dim, device)
        merge_block(acc, acc_lse, o, lse)  # a live state: the timed merge reads both sources

        def merge():
            merge_block(acc, acc_lse, o, lse)

        rec = dict(base, causal=causal, kernel=kernel)
        times = {}
        for name, fn in (("attention_with_lse", attn), ("sdpa", sdpa), ("merge_step", merge)):
            times[name] = device_us(fn, device, iters)
            out.append(dict(rec, op=name, gpu_us=times[name], host_us=host_us(fn, device)))
        out.append(dict(rec, op="merge_vs_attention",
                        ratio=times["merge_step"] / times["attention_with_lse"]))
        out.append(dict(rec, op="attn_lse_vs_sdpa",
                        ratio=times["attention_with_lse"] / times["sdpa"]))
    return out
