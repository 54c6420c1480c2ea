"""CUDA ranks (``cuda_pools``: a GPU each over NCCL where there are enough, else W processes
sharing one GPU): UlyssesAttention pipelined vs sequential bitwise at W = 2, 3, 4
(head-independent attn_fn, G in {2, 4, 7} forced and pipelined, auto: measured on GPUs of their
own, sequential by rule on a shared GPU; three consecutive calls, GQA, uneven heads, both
transports, the memory decline), Dv != D (two input exchanges of one size bucket) over ce vs
all_to_all, and a peer that stops mid-forward → PeerTimeoutError naming it on every other
rank."""
from __future__ import annotations

import time

import pytest
import torch

import attncomm
from _gpu_ranks import dev, shared_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]
W = 2


def _one_head(q, k, v):
    s = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) / q.shape[3] ** 0.5
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.float()).to(q.dtype)


def _head_independent(q, k, v, causal):
    """Attention computed one head at a time: a head's bits do not depend on how many heads
    the call holds. (A batched matmul over h heads does not promise that on CUDA: cuBLAS picks
    its kernel by the batch count, so one head alone and the same head among four can round
    differently, and a pipelined head group of one head would differ from the sequential call
    for that reason alone.)"""
    m = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(m, dim=2), v.repeat_interleave(m, dim=2)
    return torch.cat([_one_head(q[:, :, h:h + 1], k[:, :, h:h + 1], v[:, :, h:h + 1])
                      for h in range(q.shape[2])], dim=2)


def _pipelined_vs_sequential(rank, world, seed):
    from attncomm.ulysses import UlyssesAttention
    from attncomm.ulysses import pipeline_choice
    from attncomm.ulysses.layout import head_offsets
    d = dev()
    shared = shared_gpu()
    bad = []
    for hq, hkv, lens in ((56, 8, (512,) * world), (7, 7, (300, 211, 97, 150)[:world]),
                          (12, 3, (0, 257, 31, 64)[:world])):
        g = torch.Generator().manual_seed(seed + hq)
        full = [torch.randn((1, sum(lens), h, 64), generator=g).to(torch.bfloat16)
                for h in (hq, hkv, hkv)]
        o = head_offsets(lens)[rank]
        q, k, v = (t[:, o:o + lens[rank]].to(d) for t in full)
        norm = (torch.randn(64, generator=g).to(d), torch.randn(64, generator=g).to(d), 1e-6)
        rope = tuple(torch.randn((sum(lens), 64), generator=g).to(d) for _ in range(2))
        for backend in ("all_to_all", "ce"):
            ref = None
            for groups in (0, 2, 4, 7, -1):
                mod = UlyssesAttention(_head_independent, backend=backend, qk_norm=norm,
                                       pipeline_groups=groups)
                for call in range(3):
                    out = mod(q, k, v, seq_lens=lens, rope=rope)
                    ref = out.clone() if ref is None else ref
                    if not torch.equal(out, ref):
                        bad.append((hq, backend, groups, call))
                if groups >= 2 and mod.last_pipeline_groups != groups:  # forced: pipelined
                    bad.append((hq, backend, groups, "ran", mod.last_pipeline_groups))
                if groups == -1:
                    why = mod.pipeline_decision.fallback_reason or ""
                    if shared and not (why.startswith("shared GPU")
                                       and mod.last_pipeline_groups == 1):
                        bad.append((hq, backend, "auto on a shared GPU", why,
                                    mod.last_pipeline_groups))
                    if not shared and "shared GPU" in why:
                        bad.append((hq, backend, "auto on GPUs of their own", why))
        # memory decline: this rank short of memory → every rank sequential, same bits
        orig = pipeline_choice._free_bytes
        pipeline_choice._FITS.clear()
        if rank == 1:
            pipeline_choice._free_bytes = lambda device: 0
        try:
            mod = UlyssesAttention(_head_independent, qk_norm=norm, pipeline_groups=4)
            out = mod(q, k, v, seq_lens=lens, rope=rope)
            if mod.last_pipeline_groups != 1 or not torch.equal(out, ref):
                bad.append((hq, "decline", mod.last_pipeline_groups))
        finally:
            pipeline_choice._free_bytes = orig
            pipeline_choice._FITS.clear()
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_pipelined_bitwise_equals_sequential(cuda_pools, world, seed):
    for bad in cuda_pools.run(world, _pipelined_vs_sequential, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"


def _peer_stops(rank, world):
    """The last rank stops answering mid-run: every other rank's forward raises
    PeerTimeoutError naming it (in that call or the next)."""
    from attncomm.errors import PeerTimeoutError
    from attncomm.ulysses import UlyssesAttention
    from attncomm.ulysses.api import reset_transports
    silent = world - 1
    q = torch.randn(1, 2048, 4 * world, 128, device=dev(), dtype=torch.bfloat16)
    mod = UlyssesAttention(backend="ce", pipeline_groups=4, timeout_s=3.0, validate=False)
    mod(q, q, q)  # every rank: staging allocated, kernels compiled
    torch.cuda.synchronize()
    got = None
    if rank != silent:
        try:
            for _ in range(2):  # the timeout surfaces in this call or at the next
                mod(q, q, q)
                torch.cuda.synchronize()
        except PeerTimeoutError as exc:
            got = (exc.peer_ranks, str(exc))
    else:
        time.sleep(8.0)  # stops answering mid-run
    reset_transports()
    return got


@pytest.mark.parametrize("world", [2, 3])
def test_peer_that_stops_raises_peer_timeout(world):
    res = attncomm.launch(_peer_stops, world, device="cuda", timeout_s=180)
    assert res[-1] is None, res
    for r in res[:-1]:
        assert r is not None and world - 1 in r[0], res


def _dv_differs(rank, world, seed):
    """Dv != D: q/k and v travel as two exchanges of one small size bucket (with the output
    exchange, every staging entry has one shape), so a head group's fill would land in a slot
    the previous group has not read yet if the transport handed it out again."""
    from attncomm.ulysses import UlyssesAttention
    from attncomm.ulysses.layout import head_offsets
    dev_ = dev()
    bad = []
    for hq, hkv, d, dv, lens in ((8, 4, 64, 32, (128, 96)), (12, 6, 32, 64, (64, 64))):
        g = torch.Generator().manual_seed(seed + hq)
        full = [torch.randn((1, sum(lens), h, e), generator=g).to(torch.bfloat16)
                for h, e in ((hq, d), (hkv, d), (hkv, dv))]
        o = head_offsets(lens)[rank]
        q, k, v = (t[:, o:o + lens[rank]].to(dev_) for t in full)
        norm = (torch.randn(d, generator=g).to(dev_), torch.randn(d, generator=g).to(dev_),
                1e-6)
        rope = tuple(torch.randn((sum(lens), d), generator=g).to(dev_) for _ in range(2))
        for fuse in (True, False):
            ref = UlyssesAttention(_head_independent, backend="all_to_all", qk_norm=norm,
                                   pipeline_groups=1, fuse_qk_norm_rope=fuse)(
                q, k, v, seq_lens=lens, rope=rope).clone()
            for backend in ("all_to_all", "ce"):
                for groups in (1, 2, 4):
                    mod = UlyssesAttention(_head_independent, backend=backend, qk_norm=norm,
                                           pipeline_groups=groups, fuse_qk_norm_rope=fuse)
                    for call in range(3):
                        out = mod(q, k, v, seq_lens=lens, rope=rope)
                        if backend == "ce" and mod.last_backends != {"in": "ce", "out": "ce"}:
                            bad.append((hq, fuse, "backends", mod.last_backends))
                        if groups > 1 and mod.last_pipeline_groups < 2:
                            bad.append((hq, fuse, "declined", groups))
                        if mod.last_in_exchanges != 2:
                            bad.append((hq, fuse, "exchanges", mod.last_in_exchanges))
                        if not torch.equal(out, ref):
                            bad.append((hq, fuse, backend, groups, call))
    torch.cuda.synchronize()
    return bad


def test_pipelined_dv_differs_ce_bitwise(cuda_pools, seed):
    for bad in cuda_pools.run(W, _dv_differs, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"
