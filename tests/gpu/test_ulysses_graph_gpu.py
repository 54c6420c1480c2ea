"""One GPU, a one-rank group: ``UlyssesAttention`` (sequential and G = 4, the fill with norm +
RoPE, GQA) and the functional round trip captured in a CUDA graph after one eager warm-up, each
replay with different inputs bit for bit equal to eager; a shape first seen inside a capture
raises the warm-up error; ``torch.compile(mode="reduce-overhead")`` (inductor's CUDA graphs) of
the round trip and of ``UlyssesAttention``, bit for bit equal to eager."""
from __future__ import annotations

import pytest
import torch

from attncomm import ulysses
from attncomm.ulysses import UlyssesAttention

pytestmark = pytest.mark.gpu


def _rand(g, shape, dtype=torch.bfloat16):
    return torch.randn(shape, generator=g).to(dtype).cuda()


def _layer(seed, s=1024, hq=16, hkv=4, d=128):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_rand(g, (1, s, h, d)) for h in (hq, hkv, hkv))
    norm = (_rand(g, (d,), torch.float32), _rand(g, (d,), torch.float32), 1e-6)
    rope = (_rand(g, (s, d), torch.float32), _rand(g, (s, d), torch.float32))
    return q, k, v, norm, rope


def _refill(seed, *tensors):
    g = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


@pytest.mark.parametrize("groups", [0, 4])
def test_attention_capture_replays_bitwise(one_rank_group, groups, seed):
    q, k, v, norm, rope = _layer(seed)
    mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm)
    mod(q, k, v, rope=rope, causal=True)  # the eager warm-up of the shape
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod(q, k, v, rope=rope, causal=True)
    assert mod.last_pipeline_groups == max(groups, 1)
    for rep in range(3):  # a different input each replay
        _refill(seed + 1 + rep, q, k, v, *rope)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = mod(q, k, v, rope=rope, causal=True)
        assert torch.equal(out, want), f"seed {seed}: G={groups} replay {rep}"


def test_round_trip_capture_and_warm_up_error(one_rank_group, seed):
    g = torch.Generator().manual_seed(seed)
    x = _rand(g, (1, 512, 24, 128))
    dest = torch.empty_like(x)
    ulysses.head_to_seq(ulysses.seq_to_head(x), output=dest)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ulysses.seq_to_head(x)
        ulysses.head_to_seq(y, output=dest)
    for rep in range(3):
        _refill(seed + 1 + rep, x)
        dest.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(dest, x) and torch.equal(y, ulysses.seq_to_head(x)), f"seed {seed}"
    new = _rand(g, (1, 256, 24, 128))
    bad = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="first time inside CUDA graph capture"):
        with torch.cuda.graph(bad):
            ulysses.seq_to_head(new)
    with pytest.raises(ValueError, match="UlyssesAttention: the forward shape"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            UlyssesAttention()(new, new, new)
    torch.cuda.synchronize()
    assert torch.equal(ulysses.seq_to_head(new), new)  # the stream works afterwards


def test_reduce_overhead_compile_bitwise(one_rank_group, seed):
    torch._dynamo.reset()
    q, k, v, norm, rope = _layer(seed, s=512)
    mod = UlyssesAttention(pipeline_groups=2, qk_norm=norm)

    def layer(q, k, v, cos, sin):
        y = ulysses.seq_to_head(q)
        return mod(q, k, v, rope=(cos, sin)), ulysses.head_to_seq(y)

    layer(q, k, v, *rope)  # the eager warm-up of every shape
    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    for rep in range(4):  # warm-up run, recording, replays
        _refill(seed + 1 + rep, q, k, v, *rope)
        got = [t.clone() for t in compiled(q, k, v, *rope)]
        want = layer(q, k, v, *rope)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], q), f"seed {seed}: {rep}"
    torch._dynamo.reset()
