"""Ulysses on 2 GPUs: ce vs all_to_all bitwise, slot alternation, cache eviction, the warm-up
error during capture and graph replays (functional and UlyssesAttention), the flag-kernel path,
the timeout path."""
from __future__ import annotations

import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

W = 2


@pytest.fixture(scope="module")
def gpu_pool():
    from attncomm.launch import RankPool
    pool = RankPool(W, device="cuda")
    yield pool
    pool.close(force=not pool.alive)


def _data(seed, shape, dtype, device):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype).to(device)


_SHAPES = [  # (B, seq_lens, H, D, dtype)
    (1, (64, 64), 24, 128, torch.bfloat16), (2, (37, 0), 7, 64, torch.float16),
    (1, (5, 300), 3, 128, torch.float32), (1, (4096, 4096), 8, 128, torch.bfloat16)]


def _ce_vs_a2a(rank, world, seed):
    from attncomm import ulysses
    from attncomm.ulysses.layout import head_offsets
    dev = torch.device("cuda", rank)
    bad = []
    for rep in range(3):  # repeated calls alternate the staging slots
        for i, (b, lens, h, d, dtype) in enumerate(_SHAPES):
            full = _data(seed + 10 * rep + i, (b, sum(lens), h, d), dtype, dev)
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
    q, k, v = (_data(seed + 99, (1, 256, hh, 64), torch.bfloat16, dev) for hh in (12, 4, 4))
    norm = (torch.ones(64, device=dev), torch.ones(64, device=dev) * 1.5, 1e-6)
    cos = _data(seed + 5, (512, 64), torch.float32, dev)
    sin = _data(seed + 6, (512, 64), torch.float32, dev)
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


def test_ce_bitwise_equals_all_to_all(gpu_pool, seed):
    for bad in gpu_pool.run(_ce_vs_a2a, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"


def _transport_cases(rank, world, seed, flag_mode, cache_entries):
    from attncomm.ulysses.all_to_all import AllToAllTransport
    from attncomm.ulysses.ce import CopyEngineTransport
    from attncomm.ulysses.layout import head_offsets, head_split, seq_to_head_plan
    dev = torch.device("cuda", rank)
    ce = CopyEngineTransport(None, rank, world, 30.0, device=dev, flag_mode=flag_mode,
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
        x = _data(seed + rep * 7 + rank, (1, s_r, h, d), torch.bfloat16, dev)
        why = ce.prepare(plan, torch.bfloat16)
        if why:
            bad.append(("blocker", why))
            continue
        ex = ce.start(plan, [x], torch.bfloat16, dev)
        got = ex.wait().clone()
        ex.release()
        ex2 = a2a.start(plan, [x], torch.bfloat16, dev)
        want = ex2.wait()
        if not torch.equal(got, want):
            bad.append(("mismatch", rep, s_r))
    torch.cuda.synchronize()
    return bad, ce.flag_mode, ce.evictions, len(ce.cache)


@pytest.mark.parametrize("flag_mode", ["auto", "kernel"])
def test_ce_flag_modes_and_cache_eviction(gpu_pool, flag_mode, seed):
    results = gpu_pool.run(_transport_cases, seed, flag_mode, 2, timeout_s=240)
    for bad, mode, evictions, entries in results:
        assert not bad, f"seed {seed}: {bad}"
        assert evictions >= 2 and entries <= 2
        if flag_mode == "kernel":
            assert mode == "kernel"
    assert len({r[1:] for r in results}) == 1  # same mode and eviction history everywhere


def _capture(rank, world, seed):
    """A shape first seen inside the capture raises the warm-up error (no fallback to a
    transport nobody asked for); warmed-up shapes (ce) replay bit for bit."""
    from attncomm import ulysses
    dev = torch.device("cuda", rank)
    x = _data(seed + rank, (1, 1024, 16, 128), torch.bfloat16, dev)
    seen = _data(seed + 7 + rank, (1, 2048, 16, 128), torch.bfloat16, dev)
    ulysses.seq_to_head(seen, backend="auto")  # the warm-up: this shape takes ce
    torch.cuda.synchronize()
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ulysses.seq_to_head(x, backend="auto", validate=False)
        new_shape = "NO ERROR"
    except ValueError as exc:
        new_shape = str(exc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_seen = ulysses.seq_to_head(seen, backend="auto", validate=False)
        y_seen2 = ulysses.seq_to_head(seen, backend="auto", validate=False)
    bad = []
    for rep in range(3):
        seen.copy_(_data(seed + 100 * rep + 50 + rank, seen.shape, seen.dtype, dev))
        graph.replay()
        torch.cuda.synchronize()
        want = ulysses.seq_to_head(seen, backend="all_to_all")
        if not (torch.equal(y_seen, want) and torch.equal(y_seen2, want)):
            bad.append(rep)
    return new_shape, bad


def test_warm_up_error_during_capture_and_graph_replays(gpu_pool, seed):
    for new_shape, bad in gpu_pool.run(_capture, seed, timeout_s=240):
        assert "first time inside CUDA graph capture" in new_shape, new_shape
        assert not bad, f"seed {seed}: replays {bad} differ"


def _attention_capture(rank, world, seed):
    """UlyssesAttention captured after one eager forward, both transports, sequential and
    G = 4, the fill with norm + RoPE: replays with new inputs equal eager bit for bit (ce's
    flags and slots across replays)."""
    from attncomm.ulysses import UlyssesAttention
    dev = torch.device("cuda", rank)
    q, k, v = (_data(seed + 3 * rank + i, (1, 1024, h, 128), torch.bfloat16, dev)
               for i, h in enumerate((16, 4, 4)))
    norm = (torch.ones(128, device=dev), torch.ones(128, device=dev) * 1.5, 1e-6)
    rope = tuple(_data(seed + 9 + i, (2048, 128), torch.float32, dev) for i in range(2))
    bad = []
    for backend in ("ce", "all_to_all"):
        for groups in (0, 4):
            mod = UlyssesAttention(backend=backend, pipeline_groups=groups, qk_norm=norm)
            mod(q, k, v, rope=rope)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = mod(q, k, v, rope=rope)
            for rep in range(3):
                for i, t in enumerate((q, k, v)):
                    t.copy_(_data(seed + 1000 * rep + 10 * rank + i, t.shape, t.dtype, dev))
                graph.replay()
                torch.cuda.synchronize()
                if not torch.equal(out, mod(q, k, v, rope=rope)):
                    bad.append((backend, groups, rep))
            mod.close()
    torch.cuda.synchronize()
    return bad


def test_attention_capture_replays_two_gpus(gpu_pool, seed):
    for bad in gpu_pool.run(_attention_capture, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"


def _timeout(rank, world, mode):
    from attncomm import PeerTimeoutError
    from attncomm.ulysses.ce import CopyEngineTransport
    from attncomm.ulysses.layout import seq_to_head_plan
    dev = torch.device("cuda", rank)
    ce = CopyEngineTransport(None, rank, world, 3.0, device=dev, flag_mode=mode)
    plan = seq_to_head_plan(1, (8, 8), 64, (((0, 2), (2, 4)),))
    assert ce.prepare(plan, torch.float32) is None
    x = torch.randn(1, 8, 4, 64, device=dev)
    if rank == 1:
        time.sleep(8.0)  # never takes part
        return "skipped"
    t0 = time.monotonic()
    try:
        ex = ce.start(plan, [x], torch.float32, dev)
        ex.wait()  # the host does not wait: the stream does, bounded (device or watchdog)
        ex.release()
        torch.cuda.synchronize()  # returns once the wait gave up or was released
        ce.check()
    except PeerTimeoutError as exc:
        try:
            ce.start(plan, [x], torch.float32, dev)
            again = None
        except PeerTimeoutError as exc2:  # broken for good
            again = exc2.peer_ranks
        return ("timeout", exc.peer_ranks, time.monotonic() - t0, again)
    return "no error"


@pytest.mark.parametrize("mode", ["auto", "kernel"])
def test_ce_timeout_raises(gpu_pool, mode):
    res = gpu_pool.run(_timeout, mode, timeout_s=120)
    kind, peers, elapsed, again = res[0]
    assert kind == "timeout" and peers == [1] and again == [1] and 2.5 < elapsed < 15, res
