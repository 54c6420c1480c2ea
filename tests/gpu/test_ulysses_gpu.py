"""Ulysses on CUDA ranks (``cuda_pools``: a GPU each over NCCL where there are enough, else W
processes sharing one GPU): ce vs all_to_all bitwise (W = 2, 3, 4: uneven heads, a rank with
no head), slot alternation, cache eviction, the warm-up error during capture and graph replays
of the functional exchanges and of UlyssesAttention (both capture modes; all_to_all is staged
through the host on a shared GPU and refuses a capture), the flag-kernel path, the timeout
of one peer among W, and a one-rank forward that packs nothing against one that packs."""
from __future__ import annotations

import time

import pytest
import torch

import attncomm
from _gpu_ranks import CAPTURE_MODES, capture, dev, shared_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

W = 2


def _data(seed, shape, dtype, device):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _shapes(world):
    """(B, seq_lens, H, D, dtype): 7 heads split unevenly at every W, 3 heads over 4 ranks
    leave one rank without a head, a rank without rows, long rows."""
    return [(1, (64,) * world, 24, 128, torch.bfloat16),
            (2, (37, 0, 11, 5)[:world], 7, 64, torch.float16),
            (1, (5, 300, 17, 64)[:world], 3, 128, torch.float32),
            (1, (4096,) * world, 8, 128, torch.bfloat16)]


def _ce_vs_a2a(rank, world, seed):
    from attncomm import ulysses
    from attncomm.ulysses.layout import head_offsets
    d_ = dev()
    bad = []
    for rep in range(3):  # repeated calls alternate the staging slots
        for i, (b, lens, h, d, dtype) in enumerate(_shapes(world)):
            full = _data(seed + 10 * rep + i, (b, sum(lens), h, d), dtype, d_)
            off = head_offsets(lens)
            x = full[:, off[rank]:off[rank] + lens[rank]].clone()
            y_ce = ulysses.seq_to_head(x, seq_lens=lens, backend="ce")
            y_a2a = ulysses.seq_to_head(x, seq_lens=lens, backend="all_to_all")
            back = ulysses.head_to_seq(y_ce, num_heads=h, seq_lens=lens, backend="ce")
            if not torch.equal(y_ce, y_a2a):
                bad.append(("seq_to_head", rep, i))
            if not torch.equal(back, x):
                bad.append(("head_to_seq", rep, i))
    # UlyssesAttention: GQA, pipelined, qk_norm + rope
    q, k, v = (_data(seed + 99, (1, 256, hh, 64), torch.bfloat16, d_) for hh in (12, 4, 4))
    norm = (torch.ones(64, device=d_), torch.ones(64, device=d_) * 1.5, 1e-6)
    cos = _data(seed + 5, (256 * world, 64), torch.float32, d_)
    sin = _data(seed + 6, (256 * world, 64), torch.float32, d_)
    outs = {}
    for backend in ("ce", "all_to_all"):
        for pg in (0, 2):
            mod = ulysses.UlyssesAttention(backend=backend, pipeline_groups=pg, qk_norm=norm)
            outs[(backend, pg)] = mod(q, k, v, causal=True, rope=(cos, sin))
            if backend == "ce" and mod.last_backends != {"in": "ce", "out": "ce"}:
                bad.append(("attention backends", mod.last_backends))
    ref = outs[("all_to_all", 0)]
    for key, o in outs.items():
        if key[1] == 0 and not torch.equal(o, ref):
            bad.append(("attention", key))
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ce_bitwise_equals_all_to_all(cuda_pools, world, seed):
    for bad in cuda_pools.run(world, _ce_vs_a2a, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"


def _transport_cases(rank, world, seed, flag_mode, cache_entries):
    from attncomm.ulysses.all_to_all import AllToAllTransport
    from attncomm.ulysses.ce import CopyEngineTransport
    from attncomm.ulysses.layout import head_offsets, head_split, seq_to_head_plan
    dev_ = dev()
    ce = CopyEngineTransport(None, rank, world, 30.0, device=dev_, flag_mode=flag_mode,
                             cache_entries=cache_entries)
    a2a = AllToAllTransport(None, rank, world, 30.0)
    bad = []
    sizes = [16, 300, 1000, 2500, 16]  # the last one comes back after evictions
    for rep, s_r in enumerate(sizes * 2):
        h, d = 6, 64
        counts = head_split(h, world)
        offs = head_offsets(counts)
        plan = seq_to_head_plan(1, (s_r,) * world, d,
                                (tuple((offs[p], offs[p] + counts[p]) for p in range(world)),))
        x = _data(seed + rep * 7 + rank, (1, s_r, h, d), torch.bfloat16, dev_)
        why = ce.prepare(plan, torch.bfloat16)
        if why:
            bad.append(("blocker", why))
            continue
        ex = ce.start(plan, [x], torch.bfloat16, dev_)
        got = ex.wait().clone()
        ex.release()
        ex2 = a2a.start(plan, [x], torch.bfloat16, dev_)
        want = ex2.wait()
        if not torch.equal(got, want):
            bad.append(("mismatch", rep, s_r))
    torch.cuda.synchronize()
    out = bad, ce.flag_mode, ce.evictions, len(ce.cache)
    ce.close()  # collective: frees the staging once every rank is done with it
    return out


@pytest.mark.parametrize("flag_mode", ["auto", "kernel"])
def test_ce_flag_modes_and_cache_eviction(cuda_pools, flag_mode, seed):
    results = cuda_pools.run(W, _transport_cases, seed, flag_mode, 2, timeout_s=240)
    for bad, mode, evictions, entries in results:
        assert not bad, f"seed {seed}: {bad}"
        assert evictions >= 2 and entries <= 2
        if flag_mode == "kernel":
            assert mode == "kernel"
    assert len({r[1:] for r in results}) == 1  # same mode and eviction history everywhere


def _capture(rank, world, seed, mode):
    """A shape first seen inside the capture raises the warm-up error (no fallback to a
    transport nobody asked for); warmed-up shapes (auto: ce) replay bit for bit, and so does
    the ce round trip seq_to_head → head_to_seq captured right after an eager one. On a shared
    GPU all_to_all goes through the host, which a capture refuses (RuntimeError)."""
    from attncomm import ulysses
    d = dev()
    x = _data(seed + rank, (1, 1024, 16, 128), torch.bfloat16, d)
    seen = _data(seed + 7 + rank, (1, 2048, 16, 128), torch.bfloat16, d)
    # the warm-up: this shape takes ce (by size on GPUs of their own, by rule on a shared GPU);
    # the same validate= as inside the capture (it is part of the call's plan key)
    ulysses.seq_to_head(seen, backend="auto", validate=False)
    torch.cuda.synchronize()
    try:
        capture(lambda: ulysses.seq_to_head(x, backend="auto", validate=False), mode)
        new_shape = "NO ERROR"
    except ValueError as exc:
        new_shape = str(exc)
    graph, (y_seen, y_seen2) = capture(
        lambda: (ulysses.seq_to_head(seen, backend="auto", validate=False),
                 ulysses.seq_to_head(seen, backend="auto", validate=False)), mode)
    z = _data(seed + 11 + rank, (1, 512, 12, 64), torch.bfloat16, d)
    dest = torch.empty_like(z)

    def round_trip():
        y = ulysses.seq_to_head(z, backend="ce", validate=False)
        ulysses.head_to_seq(y, backend="ce", validate=False, output=dest)
        return y

    round_trip()  # eager, then its capture
    rt_graph, y_rt = capture(round_trip, mode)
    bad = []
    for rep in range(3):
        seen.copy_(_data(seed + 100 * rep + 50 + rank, seen.shape, seen.dtype, d))
        z.copy_(_data(seed + 100 * rep + 60 + rank, z.shape, z.dtype, d))
        dest.fill_(float("nan"))
        graph.replay()
        rt_graph.replay()
        torch.cuda.synchronize()
        want = ulysses.seq_to_head(seen, backend="all_to_all")
        if not (torch.equal(y_seen, want) and torch.equal(y_seen2, want)):
            bad.append(("auto", rep))
        if not (torch.equal(dest, z) and torch.equal(y_rt, ulysses.seq_to_head(
                z, backend="all_to_all"))):
            bad.append(("ce round trip", rep))
    shared = shared_gpu()
    staged = None
    if shared:
        ulysses.seq_to_head(z, backend="all_to_all", validate=False)
        try:
            capture(lambda: ulysses.seq_to_head(z, backend="all_to_all", validate=False), mode)
            staged = "NO ERROR"
        except RuntimeError as exc:
            staged = str(exc)
        torch.cuda.synchronize()
    return new_shape, bad, shared, staged


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_warm_up_error_during_capture_and_graph_replays(cuda_pools, mode, seed):
    for new_shape, bad, shared, staged in cuda_pools.run(W, _capture, seed, mode,
                                                         timeout_s=240):
        assert "first time inside CUDA graph capture" in new_shape, new_shape
        assert not bad, f"seed {seed}: replays {bad} differ"
        if shared:  # all_to_all staged through the host: a capture refuses it
            assert staged is not None and "cannot capture" in staged, staged


def _attention_capture(rank, world, seed, mode):
    """UlyssesAttention captured in ``mode`` after one eager forward, ce (and all_to_all where
    it is not staged through the host), sequential and G = 4, the fill with norm + RoPE:
    replays with new inputs equal eager bit for bit (ce's flags and slots across replays)."""
    from attncomm.ulysses import UlyssesAttention
    d = dev()
    q, k, v = (_data(seed + 3 * rank + i, (1, 1024, h, 128), torch.bfloat16, d)
               for i, h in enumerate((16, 4, 4)))
    norm = (torch.ones(128, device=d), torch.ones(128, device=d) * 1.5, 1e-6)
    rope = tuple(_data(seed + 9 + i, (1024 * world, 128), torch.float32, d) for i in range(2))
    bad = []
    backends = ("ce",) if shared_gpu() else ("ce", "all_to_all")
    for backend in backends:
        for groups in (0, 4):
            mod = UlyssesAttention(backend=backend, pipeline_groups=groups, qk_norm=norm)
            mod(q, k, v, rope=rope)
            graph, out = capture(lambda: mod(q, k, v, rope=rope), mode)
            if mod.last_pipeline_groups != max(groups, 1):
                bad.append((backend, groups, "groups", mod.last_pipeline_groups))
            for rep in range(3):
                for i, t in enumerate((q, k, v)):
                    t.copy_(_data(seed + 1000 * rep + 10 * rank + i, t.shape, t.dtype, d))
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                if not torch.equal(out, mod(q, k, v, rope=rope)):
                    bad.append((backend, groups, rep))
            mod.close()
    torch.cuda.synchronize()
    return bad


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_attention_capture_replays(cuda_pools, mode, seed):
    for bad in cuda_pools.run(W, _attention_capture, seed, mode, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"


def _timeout(rank, world, mode):
    """The last rank never takes part in an exchange: every other rank's wait gives up and
    names that rank alone, and the transport stays broken."""
    from attncomm import PeerTimeoutError
    from attncomm.ulysses.ce import CopyEngineTransport
    from attncomm.ulysses.layout import seq_to_head_plan
    silent = world - 1
    d = dev()
    ce = CopyEngineTransport(None, rank, world, 3.0, device=d, flag_mode=mode)
    plan = seq_to_head_plan(1, (8,) * world, 64, (tuple((2 * p, 2 * p + 2)
                                                        for p in range(world)),))
    assert ce.prepare(plan, torch.float32) is None
    x = torch.randn(1, 8, 2 * world, 64, device=d)
    if rank == silent:
        time.sleep(8.0)  # never takes part
        return "skipped"
    t0 = time.monotonic()
    try:
        ex = ce.start(plan, [x], torch.float32, d)
        ex.wait()  # the host does not wait: the stream does, bounded (device or watchdog)
        ex.release()
        torch.cuda.synchronize()  # returns once the wait gave up or was released
        ce.check()
    except PeerTimeoutError as exc:
        try:
            ce.start(plan, [x], torch.float32, d)
            again = None
        except PeerTimeoutError as exc2:  # broken for good
            again = exc2.peer_ranks
        return ("timeout", exc.peer_ranks, time.monotonic() - t0, again)
    return "no error"


@pytest.mark.parametrize("mode,world", [("auto", 2), ("kernel", 2), ("auto", 3)])
def test_ce_timeout_raises(mode, world):
    res = attncomm.launch(_timeout, world, device="cuda", args=(mode,), timeout_s=120)
    assert res[-1] == "skipped", res
    for r in res[:-1]:
        kind, peers, elapsed, again = r
        assert kind == "timeout" and peers == [world - 1] and again == [world - 1], res
        assert 2.5 < elapsed < 15, res


def _one_rank(rank, world, seed):
    """W = 1, bf16: a forward that packs nothing (attn_fn reads q, k, v) against one that packs
    (empty joint rows), against 2 head groups, and fused against unfused norm + RoPE, for
    contiguous q, k, v, views of a fused qkv tensor and a strided D, with and without a key
    mask: the names of the pairs whose bits differ."""
    from attncomm.ulysses import UlyssesAttention
    d_ = dev()
    b, s, h, d = 2, 256, 8, 128
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape):
        return torch.randn(shape, generator=g).to(torch.bfloat16).to(d_)

    layouts = {"contiguous": tuple(r(b, s, h, d) for _ in range(3)),
               "fused qkv": r(b, s, 3 * h, d).split(h, dim=2),
               "strided D": tuple(r(b, s, d, h).transpose(2, 3) for _ in range(3))}
    w = torch.randn(d, generator=g).to(d_)
    ang = torch.randn(s, d, generator=g).to(d_)
    rope, norm = (ang.cos(), ang.sin()), (w, w, 1e-6)
    mask = (torch.rand(b, s, generator=g) > 0.2).to(d_)
    empty = tuple(r(b, 0, h, d) for _ in range(3))  # joint rows of length 0: a packing forward
    bad = []
    for name, (q, k, v) in layouts.items():
        for m in (None, mask):
            kw = {} if m is None else {"key_padding_mask": m}
            local = UlyssesAttention(pipeline_groups=0)(q, k, v, **kw)
            pairs = {
                "packed": UlyssesAttention(pipeline_groups=0)(q, k, v, joint=empty, **kw)[0],
                "2 groups": UlyssesAttention(pipeline_groups=2)(q, k, v, **kw)}
            fused = UlyssesAttention(qk_norm=norm, pipeline_groups=0)(q, k, v, rope=rope, **kw)
            unfused = UlyssesAttention(qk_norm=norm, fuse_qk_norm_rope=False,
                                       pipeline_groups=0)(q, k, v, rope=rope, **kw)
            bad += [(name, m is not None, what) for what, other in pairs.items()
                    if not torch.equal(local, other)]
            if not torch.equal(fused, unfused):
                bad.append((name, m is not None, "fused vs unfused"))
    return bad


def test_one_rank_without_pack_keeps_the_bits(cuda_pools, seed):
    bad = cuda_pools.run(1, _one_rank, seed, timeout_s=240)[0]
    assert not bad, f"seed {seed}: bits differ for {bad}"
