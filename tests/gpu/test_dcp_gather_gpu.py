"""DCP query gather on CUDA: the ``symm`` kernel with W simulated ranks on one GPU (bitwise);
on two GPUs (skipped on one) ``symm`` bitwise against ``all_gather`` over ≥ 100 graph replays
with fresh data, eager and graph interleaved, the ordering rule against a slow reader, ``auto``,
``DcpAttention`` and the timeout path. Run on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import importlib.util
import os
import time
import types

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm.dcp import DcpAttention, DcpQueryGather

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(2)]

W = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _need_gpus(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPU(s)")


@pytest.fixture(scope="module")
def cuda_pool():
    _need_gpus(W)
    pool = attncomm.RankPool(W, device="cuda")
    yield pool
    pool.close(force=not pool.alive)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _fresh(gen, q, cos, sin):
    q.copy_(torch.randn(q.shape, generator=gen, device=q.device) * 2)
    if cos is not None:
        ang = torch.rand((cos.shape[0], cos.shape[1] // 2), generator=gen, device=q.device) * 30
        ang = torch.cat((ang, ang), -1)
        cos.copy_(ang.cos())
        sin.copy_(ang.sin())


# ------------------------------------------------------------------------------ one GPU

@pytest.mark.gpus(1)
@pytest.mark.parametrize("ranks,fp8", [(2, False), (3, False), (2, True), (3, True)])
def test_symm_kernel_simulated_ranks_one_gpu(ranks, fp8):
    _need_gpus(1)
    spec = importlib.util.spec_from_file_location(
        "dcp_gather_one_gpu", os.path.join(ROOT, "scripts", "dcp_gather_one_gpu.py"))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    import attncomm.dcp.query_gather.symm as mod
    for T in (1, 3, 7, 8, 33, 128):
        a = types.SimpleNamespace(world_size=ranks, heads=16 * ranks, head_dim=576, rope_dim=64,
                                  replays=20, label="test", fp8=fp8)
        for ordered in (False, True):
            script.run_tokens(mod, a, T, ordered)  # raises on any differing bit


# ------------------------------------------------------------------------------ two GPUs

def _replays(rank, world_size, T, H, D, R, n, fp8=False):
    """Graph replays and eager calls interleaved, fresh data each: symm vs all_gather (FP8:
    the same e4m3 bytes, per-head scales around 1/64 so that the largest values saturate)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    hs = H // world_size
    kw = dict(out_dtype=torch.float8_e4m3fn,
              q_scale=torch.linspace(1 / 96, 1 / 48, H)) if fp8 else {}
    symm = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                          backend="symm", rope_dim=R, **kw)
    ref = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                         backend="all_gather", rope_dim=R, **kw)
    gen = torch.Generator(device=dev).manual_seed(100 + rank)
    q = torch.empty((T, hs, D), device=dev, dtype=torch.bfloat16)
    cos = torch.empty((T, R), device=dev) if R else None
    sin = torch.empty((T, R), device=dev) if R else None
    rope = (cos, sin) if R else None
    _fresh(gen, q, cos, sin)
    got = torch.empty((T, H, D), device=dev, dtype=symm.out_dtype)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got.copy_(symm(q, rope=rope))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got.copy_(symm(q, rope=rope))  # the reader enqueued before the next call
    for i in range(n):
        _fresh(gen, q, cos, sin)
        got.view(torch.uint8).fill_(0xA5)  # poison bytes
        if i % 3 == 2:
            got.copy_(symm(q, rope=rope))
        else:
            graph.replay()
        want = ref(q, rope=rope)
        torch.cuda.synchronize()
        symm.check()
        assert torch.equal(_bits(got), _bits(want)), f"rank {rank} T={T} step {i}"
    return int(symm._impl.ws.state[0])


@pytest.mark.parametrize("T", [1, 5, 8, 64, 128])
def test_symm_bitwise_vs_all_gather_graph_replays(cuda_pool, T):
    epochs = cuda_pool.run(_replays, T, 64, 576, 64, 110)
    assert epochs[0] == epochs[1] and epochs[0] > 110


@pytest.mark.parametrize("T", [1, 8, 128])
def test_symm_fp8_bitwise_vs_all_gather_graph_replays(cuda_pool, T):
    epochs = cuda_pool.run(_replays, T, 64, 576, 64, 110, True)
    assert epochs[0] == epochs[1] and epochs[0] > 110


def test_symm_without_rope_fp32_shapes(cuda_pool):
    cuda_pool.run(_replays, 9, 6, 40, 0, 30)


def _slow_reader(rank, world_size, T, n):
    """Rank 1 reads each result only after a long GPU sleep, rank 0 at once and then gathers
    again: without the READY handshake rank 0's next gather would overwrite what rank 1 has
    not read yet (flag protocol: T ≥ 8 here). Nothing else synchronises the ranks in the loop:
    every rank draws every rank's queries from per-rank seeds."""
    dev = torch.device("cuda", torch.cuda.current_device())
    H, D = 64, 576
    hs = H // world_size
    g = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                       backend="symm")
    gens = [torch.Generator(device=dev).manual_seed(7 + r) for r in range(world_size)]
    bad = 0
    for _ in range(n):
        qs = [(torch.randn((T, hs, D), generator=gn, device=dev) * 2).to(torch.bfloat16)
              for gn in gens]
        want = torch.cat(qs, dim=1)
        view = g(qs[rank])  # eager: one host sync for the error word, then the read
        if rank == 1:
            torch.cuda._sleep(20_000_000)  # ~10 ms
        got = view.clone()
        torch.cuda.synchronize()
        bad += int(not torch.equal(_bits(got), _bits(want)))
    g.check()
    return bad


def test_ordering_rule_slow_reader(cuda_pool):
    assert cuda_pool.run(_slow_reader, 32, 20) == [0, 0]


def _attention(rank, world_size, T, n):
    """DcpAttention with symm gather + symm_a2a merge in a graph vs all_gather + symm_a2a eager:
    bitwise (the merge is deterministic for equal inputs)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    H, D, Dv, S = 64, 576, 512, 37
    hs = H // world_size
    gen = torch.Generator(device=dev).manual_seed(50)
    k = torch.randn((S, H, D), generator=gen, device=dev).to(torch.bfloat16)
    local = attncomm.dcp.shard_kv_interleaved(S, world_size, rank).to(dev)
    kl = k[local].contiguous()

    def attn(qa):
        s = torch.einsum("thd,shd->ths", qa.float(), kl.float()) * D ** -0.5
        lse = torch.logsumexp(s, -1)
        return torch.einsum("ths,shd->thd", torch.softmax(s, -1),
                            kl[..., :Dv].float()).to(torch.bfloat16), lse

    kw = dict(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16, v_head_dim=Dv,
              rope_dim=64, merge_backend="symm_a2a")
    a = DcpAttention(attn, gather_backend="symm", **kw)
    b = DcpAttention(attn, gather_backend="all_gather", **kw)
    q = torch.empty((T, hs, D), device=dev, dtype=torch.bfloat16)
    cos, sin = torch.empty((T, 64), device=dev), torch.empty((T, 64), device=dev)
    out = torch.empty((T, hs, Dv), device=dev, dtype=torch.bfloat16)
    gen = torch.Generator(device=dev).manual_seed(60 + rank)
    _fresh(gen, q, cos, sin)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(a(q, rope=(cos, sin)))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(a(q, rope=(cos, sin)))
    for i in range(n):
        _fresh(gen, q, cos, sin)
        graph.replay()
        want = b(q, rope=(cos, sin))
        torch.cuda.synchronize()
        a.check()
        assert torch.equal(_bits(out), _bits(want)), f"rank {rank} step {i}"
    return a.backends


def test_dcp_attention_graph(cuda_pool):
    res = cuda_pool.run(_attention, 4, 30)
    assert res[0] == res[1] == ("symm", "symm_a2a"), res


def _auto(rank, world_size):
    g = DcpQueryGather(max_tokens=64, num_heads=64, head_dim=576, dtype=torch.bfloat16,
                       rope_dim=64)
    return g.backend, g.fallback_reason


def test_auto_agrees(cuda_pool):
    res = cuda_pool.run(_auto)
    assert res[0] == res[1] and res[0][0] in ("symm", "all_gather"), res
    assert (res[0][0] == "symm") == (res[0][1] is None), res


def _timeout_path(rank, world_size):
    from attncomm import PeerTimeoutError, cpu_group
    g = DcpQueryGather(max_tokens=16, num_heads=8, head_dim=64, dtype=torch.bfloat16,
                       backend="symm", timeout_s=2.0)
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for T in (2, 16):  # LL, then flag (each on a fresh gatherer after a timeout)
        q = torch.randn((T, 4, 64), device=dev).to(torch.bfloat16)
        g(q)  # one good call
        result = "skipped"
        if rank == 0:
            t0 = time.monotonic()
            try:
                g(q)
                result = "no error"
            except PeerTimeoutError as exc:
                waited = time.monotonic() - t0
                assert exc.peer_ranks == [1], exc.peer_ranks
                assert waited < 2.0 + 5.0, waited
                result = f"timeout after {waited:.2f}s"
            try:
                g(q)
                result += "; reuse allowed"
            except RuntimeError as exc:
                assert "unusable" in str(exc)
        dist.barrier(group=cpu_group())
        torch.cuda.synchronize()
        results.append(result)
        g = DcpQueryGather(max_tokens=16, num_heads=8, head_dim=64, dtype=torch.bfloat16,
                           backend="symm", timeout_s=2.0)
    return results


def test_timeout_path():
    _need_gpus(W)
    t0 = time.monotonic()
    res = attncomm.launch(_timeout_path, W, device="cuda", timeout_s=240)
    assert all(r.startswith("timeout after") and "reuse" not in r for r in res[0]), res
    assert res[1] == ["skipped", "skipped"]
    assert time.monotonic() - t0 < 240
