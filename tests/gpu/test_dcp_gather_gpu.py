"""DCP query gather on CUDA: the ``symm`` kernel with W simulated ranks in one process (bitwise);
on CUDA ranks (``cuda_pools``: a GPU each over NCCL where there are enough, else W processes
sharing one GPU) ``symm`` bitwise against ``all_gather`` over ≥ 100 graph replays with fresh
data (captured in both capture modes), eager and graph interleaved, the ordering rule against a
slow reader, ``auto`` (by rule on a shared GPU), ``DcpAttention`` (symm + symm_a2a against
all_gather + the staged reference merge and fp64) and the timeout of one peer among W. Run on
the device: ``pytest -m gpu tests/gpu``."""
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
from _gpu_ranks import CAPTURE_MODES, capture, dev, shared_gpu

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

W = 2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _need_gpus(n):
    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPU(s)")


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


# ------------------------------------------------------------------------------ W ranks

def _replays(rank, world_size, T, H, D, R, n, fp8=False, mode="global"):
    """Graph replays (captured in ``mode`` right after an eager call of the shape) and eager
    calls interleaved, fresh data each: symm vs all_gather (FP8: the same e4m3 bytes, per-head
    scales around 1/64 so that the largest values saturate)."""
    d = dev()
    hs = H // world_size
    kw = dict(out_dtype=torch.float8_e4m3fn,
              q_scale=torch.linspace(1 / 96, 1 / 48, H)) if fp8 else {}
    symm = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                          backend="symm", rope_dim=R, **kw)
    ref = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                         backend="all_gather", rope_dim=R, **kw)
    gen = torch.Generator(device=d).manual_seed(100 + rank)
    q = torch.empty((T, hs, D), device=d, dtype=torch.bfloat16)
    cos = torch.empty((T, R), device=d) if R else None
    sin = torch.empty((T, R), device=d) if R else None
    rope = (cos, sin) if R else None
    _fresh(gen, q, cos, sin)
    got = torch.empty((T, H, D), device=d, dtype=symm.out_dtype)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got.copy_(symm(q, rope=rope))
    torch.cuda.current_stream().wait_stream(s)
    # the reader enqueued before the next call
    graph, _ = capture(lambda: got.copy_(symm(q, rope=rope)), mode)
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
        assert torch.equal(_bits(got), _bits(want)), f"rank {rank} T={T} {mode} step {i}"
    return int(symm._impl.ws.state[0])


@pytest.mark.parametrize("mode", CAPTURE_MODES)
@pytest.mark.parametrize("world,T", [(2, 1), (2, 5), (2, 8), (2, 64), (2, 128), (3, 8),
                                     (4, 33)])
def test_symm_bitwise_vs_all_gather_graph_replays(cuda_pools, world, T, mode):
    epochs = cuda_pools.run(world, _replays, T, 32 * world, 576, 64, 110, False, mode,
                            timeout_s=240)
    assert len(set(epochs)) == 1 and epochs[0] > 110, epochs


@pytest.mark.parametrize("T", [1, 8, 128])
def test_symm_fp8_bitwise_vs_all_gather_graph_replays(cuda_pools, T):
    epochs = cuda_pools.run(W, _replays, T, 64, 576, 64, 110, True, timeout_s=240)
    assert len(set(epochs)) == 1 and epochs[0] > 110, epochs


def test_symm_without_rope_fp32_shapes(cuda_pools):
    cuda_pools.run(W, _replays, 9, 6, 40, 0, 30, timeout_s=120)


def _functional_outputs(rank, world_size, T, seed):
    """``dcp.gather_heads`` with ``symm`` against ``all_gather``, bit for bit, compared after
    the next call (which must not touch them): into a new tensor (a clone of the call's view), a
    contiguous ``output=`` and a permuted one (copied from the view), with and without RoPE.
    Returns the names of the cases that differ."""
    from attncomm import dcp
    d = dev()
    H, D, R = 16, 192, 64
    gen = torch.Generator(device=d).manual_seed(seed + rank)
    bad = []
    for step in range(2):
        q = (torch.randn((T, H // world_size, D), generator=gen, device=d) * 2).bfloat16()
        ang = torch.rand((T, R), generator=gen, device=d) * 6
        for rope in (None, (ang.cos(), ang.sin())):
            tag = f"step {step} rope {rope is not None}"
            want = dcp.gather_heads(q, rope=rope, backend="all_gather")
            new = dcp.gather_heads(q, rope=rope, backend="symm")
            flat = torch.full((T, H, D), 7.0, device=d, dtype=torch.bfloat16)
            perm = torch.full((H, T, D), 7.0, device=d, dtype=torch.bfloat16).transpose(0, 1)
            got_flat = dcp.gather_heads(q, rope=rope, backend="symm", output=flat)
            got_perm = dcp.gather_heads(q, rope=rope, backend="symm", output=perm)
            dcp.gather_heads(-q, rope=rope, backend="symm")  # compared after the next call
            torch.cuda.synchronize()
            for name, got in (("new", new), ("output", got_flat), ("permuted output", got_perm)):
                if not torch.equal(_bits(got), _bits(want)):
                    bad.append(f"{tag}: {name}")
            if got_flat is not flat or got_perm is not perm:
                bad.append(f"{tag}: output= not returned")
    return bad


@pytest.mark.parametrize("T", [1, 8])
def test_functional_symm_outputs_match_all_gather(cuda_pools, T):
    seed = 1234
    bad = cuda_pools.run(W, _functional_outputs, T, seed, timeout_s=180)
    assert bad == [[], []], f"seed {seed}, T={T}: cases that differ from all_gather: {bad}"


def _slow_reader(rank, world_size, T, n):
    """Rank 1 reads each result only after a long GPU sleep, rank 0 at once and then gathers
    again: without the READY handshake rank 0's next gather would overwrite what rank 1 has
    not read yet (flag protocol: T ≥ 8 here). Nothing else synchronises the ranks in the loop:
    every rank draws every rank's queries from per-rank seeds."""
    d = dev()
    H, D = 64, 576
    hs = H // world_size
    g = DcpQueryGather(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                       backend="symm")
    gens = [torch.Generator(device=d).manual_seed(7 + r) for r in range(world_size)]
    bad = 0
    for _ in range(n):
        qs = [(torch.randn((T, hs, D), generator=gn, device=d) * 2).to(torch.bfloat16)
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


def test_ordering_rule_slow_reader(cuda_pools):
    assert cuda_pools.run(W, _slow_reader, 32, 20, timeout_s=120) == [0, 0]


def _attention(rank, world_size, T, n):
    """DcpAttention with symm gather + symm_a2a merge in a graph vs all_gather + symm_a2a eager:
    bitwise (the merge is deterministic for equal inputs); vs all_gather + the staged
    ``reference`` merge and vs fp64 attention over the whole KV (of the queries the layer's
    attention received): within bf16 rounding."""
    d = dev()
    H, D, Dv, S = 64, 576, 512, 37
    hs = H // world_size
    gen = torch.Generator(device=d).manual_seed(50)
    k = torch.randn((S, H, D), generator=gen, device=d).to(torch.bfloat16)
    local = attncomm.dcp.shard_kv_interleaved(S, world_size, rank).to(d)
    kl = k[local].contiguous()
    seen = []

    def attn(qa):
        s = torch.einsum("thd,shd->ths", qa.float(), kl.float()) * D ** -0.5
        lse = torch.logsumexp(s, -1)
        return torch.einsum("ths,shd->thd", torch.softmax(s, -1),
                            kl[..., :Dv].float()).to(torch.bfloat16), lse

    def attn_seen(qa):  # the staged layer's attention, keeping the queries it received
        seen.append(qa.double())
        return attn(qa)

    kw = dict(max_tokens=T, num_heads=H, head_dim=D, dtype=torch.bfloat16, v_head_dim=Dv,
              rope_dim=64)
    a = DcpAttention(attn, gather_backend="symm", merge_backend="symm_a2a", **kw)
    b = DcpAttention(attn, gather_backend="all_gather", merge_backend="symm_a2a", **kw)
    c = DcpAttention(attn_seen, gather_backend="all_gather", merge_backend="reference", **kw)
    q = torch.empty((T, hs, D), device=d, dtype=torch.bfloat16)
    cos, sin = torch.empty((T, 64), device=d), torch.empty((T, 64), device=d)
    out = torch.empty((T, hs, Dv), device=d, dtype=torch.bfloat16)
    gen = torch.Generator(device=d).manual_seed(60 + rank)
    _fresh(gen, q, cos, sin)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out.copy_(a(q, rope=(cos, sin)))
    torch.cuda.current_stream().wait_stream(s)
    graph, _ = capture(lambda: out.copy_(a(q, rope=(cos, sin))), "global")
    sl = slice(rank * hs, (rank + 1) * hs)
    for i in range(n):
        _fresh(gen, q, cos, sin)
        graph.replay()
        want = b(q, rope=(cos, sin))
        staged = c(q, rope=(cos, sin))
        torch.cuda.synchronize()
        a.check()
        assert torch.equal(_bits(out), _bits(want)), f"rank {rank} step {i}"
        p = torch.softmax(torch.einsum("thd,shd->ths", seen.pop(), k.double()) * D ** -0.5, -1)
        ref = torch.einsum("ths,shd->thd", p, k[..., :Dv].double())[:, sl]
        for name, got in (("symm + symm_a2a", out), ("all_gather + reference", staged)):
            err = ((got.double() - ref).abs() - 2e-2 * (1 + ref.abs())).max().item()
            assert err <= 0, f"rank {rank} step {i}: {name} off fp64 by {err} over tolerance"
    return a.backends, c.backends


def test_dcp_attention_graph(cuda_pools):
    res = cuda_pools.run(W, _attention, 4, 30, timeout_s=240)
    assert all(r == (("symm", "symm_a2a"), ("all_gather", "reference")) for r in res), res


def _auto(rank, world_size):
    g = DcpQueryGather(max_tokens=64, num_heads=64, head_dim=576, dtype=torch.bfloat16,
                       rope_dim=64)
    return g.backend, g.fallback_reason, g.decision.rule, shared_gpu()


def test_auto_agrees(cuda_pools):
    res = cuda_pools.run(W, _auto, timeout_s=120)
    assert all(r == res[0] for r in res) and res[0][0] in ("symm", "all_gather"), res
    backend, fallback, rule, shared = res[0]
    assert (backend == "symm") == (fallback is None), res
    if shared:  # time-sliced ranks: symm by rule, not timed
        assert backend == "symm" and rule is not None and rule.startswith("shared GPU"), res
    else:
        assert rule is None, res


def _timeout_path(rank, world_size):
    """The last rank skips one gather: every other rank raises naming it; alone on the LL
    protocol (sends before any wait) and at W = 2. On the flag protocol at W ≥ 3 a rank first
    waits for every peer's READY, the silent one's until the deadline, so a live peer's rows
    may arrive after this rank's deadline (it is named too): the silent rank must be named,
    this rank never."""
    from attncomm import PeerTimeoutError, cpu_group
    silent = world_size - 1
    H = 4 * world_size
    d = dev()
    results = []
    for T in (2, 16):  # LL, then flag (each on a fresh gatherer after a timeout)
        g = DcpQueryGather(max_tokens=16, num_heads=H, head_dim=64, dtype=torch.bfloat16,
                           backend="symm", timeout_s=2.0)
        q = torch.randn((T, 4, 64), device=d).to(torch.bfloat16)
        g(q)  # one good call
        torch.cuda.synchronize()
        dist.barrier(group=cpu_group())
        result = "skipped"
        if rank != silent:
            t0 = time.monotonic()
            try:
                g(q)  # no host sync: the timeout shows at check() once the kernel gave up
                torch.cuda.synchronize()
                g.check()
                result = "no error"
            except PeerTimeoutError as exc:
                waited = time.monotonic() - t0
                if world_size == 2 or T == 2:
                    assert exc.peer_ranks == [silent], (T, exc.peer_ranks)
                else:
                    assert silent in exc.peer_ranks and rank not in exc.peer_ranks, \
                        (T, exc.peer_ranks)
                assert waited < 2.0 + 5.0, waited
                result = f"timeout after {waited:.2f}s"
            try:
                g(q)
                result += "; reuse allowed"
            except RuntimeError as exc:
                assert "unusable" in str(exc)
        torch.cuda.synchronize()  # before the barrier: the next gatherer's check is bounded
        dist.barrier(group=cpu_group())
        results.append(result)
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_timeout_path(world):
    t0 = time.monotonic()
    res = attncomm.launch(_timeout_path, world, device="cuda", timeout_s=240)
    for r in res[:-1]:
        assert all(x.startswith("timeout after") and "reuse" not in x for x in r), res
    assert res[-1] == ["skipped", "skipped"], res
    assert time.monotonic() - t0 < 240
