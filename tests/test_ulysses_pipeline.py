"""UlyssesAttention's head-group schedule on gloo CPU ranks: grouped runs bitwise against the
sequential run (the fill packing q/k/v with norm + RoPE, uneven heads and sequences, GQA with
Hkv < W, non-contiguous inputs, three consecutive calls), the group-count rule and the memory
decline (agreed: one rank short of memory makes every rank sequential)."""
from __future__ import annotations

import random

import pytest
import torch

from attncomm.ulysses import pipeline_choice
from attncomm.ulysses import UlyssesAttention, head_split
from attncomm.ulysses.attention import auto_groups


def _head_independent(q, k, v, causal):
    """An attn_fn whose every head's bits depend on that head only (so any grouping of the
    heads must give the sequential run's bits)."""
    m = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(m, dim=2), v.repeat_interleave(m, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / q.shape[3] ** 0.5
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.double()).to(q.dtype)


_CASES = [  # (Hq, Hkv, D, causal, norm, rope, layout)
    (8, 2, 8, True, True, True, "dense"),
    (7, 7, 4, False, True, False, "transposed"),
    (6, 1, 8, True, False, True, "sliced"),
    (12, 3, 4, False, False, False, "dense"),
]


def _local(g, b, s_r, h, d, layout):
    if layout == "transposed":
        return torch.randn((b, h, s_r, d), generator=g).transpose(1, 2)
    if layout == "sliced":
        return torch.randn((b, s_r, 2 * h, d), generator=g)[:, :, ::2]
    return torch.randn((b, s_r, h, d), generator=g)


def _grouped_vs_sequential(rank, world, seed):
    rng = random.Random(seed)
    bad = []
    for i, (hq, hkv, d, causal, norm, rope, layout) in enumerate(_CASES):
        lens = [rng.randint(0, 6) for _ in range(world)]
        lens[rng.randrange(world)] += 3
        s = sum(lens)
        g = torch.Generator().manual_seed(seed + 1000 * i + rank)
        q, k, v = (_local(g, 1, lens[rank], h, d, layout) for h in (hq, hkv, hkv))
        gw = torch.Generator().manual_seed(seed + i)  # the same weights and tables everywhere
        qk_norm = (torch.randn(d, generator=gw), torch.randn(d, generator=gw), 1e-5) \
            if norm else None
        cs = (torch.randn((s, d), generator=gw), torch.randn((s, d), generator=gw)) \
            if rope else None
        ref = None
        for groups in (0, 2, 7):
            for fused in (True, False):
                mod = UlyssesAttention(_head_independent, pipeline_groups=groups,
                                       qk_norm=qk_norm, fuse_qk_norm_rope=fused)
                for call in range(2):
                    out = mod(q, k, v, seq_lens=lens, causal=causal, rope=cs)
                    if ref is None:
                        ref = out
                    elif not torch.equal(out, ref):
                        bad.append((i, groups, fused, call))
                if mod.last_pipeline_groups != max(1, groups):
                    bad.append((i, groups, "ran", mod.last_pipeline_groups))
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_grouped_bitwise_equals_sequential(pools, world, seed):
    for bad in pools.run(world, _grouped_vs_sequential, seed):
        assert not bad, f"seed {seed}: (case, groups, fused, call) differing: {bad}"


def test_auto_groups_rule():
    # 56 heads at W = 2, 4, 8, S = 32768, 132 SMs: 7 (SGLang's choice for MiniMax-H3)
    for w in (2, 4, 8):
        assert auto_groups(head_split(56, w), 1, 32768, 132) == 7
    assert auto_groups(head_split(56, 8), 1, 8192, 132) == 1      # 1 head: half a wave
    assert auto_groups(head_split(56, 2), 1, 8192, 132) == 7      # 4 heads × 64 blocks
    assert auto_groups(head_split(7, 4), 1, 32768, 132) == 1      # 2,2,2,1: no even split
    assert auto_groups(head_split(24, 2), 1, 32768, 132) == 6     # ≤ 8, divides 12
    assert auto_groups(head_split(2, 3), 1, 32768, 132) == 1      # 1,1,0
    assert auto_groups([16, 16], 1, 128, 132) == 1                # one block per head
    assert auto_groups([16, 16], 1, 32768, 132, max_groups=3) == 2


def _decline(rank, world, short_rank):
    x = torch.randn(1, 4, 4, 8)
    orig = pipeline_choice._free_bytes
    pipeline_choice._FITS.clear()
    try:
        if rank == short_rank:
            pipeline_choice._free_bytes = lambda device: 0
        mod = UlyssesAttention(_head_independent, pipeline_groups=2)
        out = mod(x, x, x)
        seq = UlyssesAttention(_head_independent, pipeline_groups=0)(x, x, x)
        return mod.last_pipeline_groups, torch.equal(out, seq)
    finally:
        pipeline_choice._free_bytes = orig
        pipeline_choice._FITS.clear()


@pytest.mark.parametrize("world", [2, 3])
def test_memory_decline_is_agreed(pools, world):
    for short in (None, world - 1):
        res = pools.run(world, _decline, short)
        want = 2 if short is None else 1
        assert res == [(want, True)] * world, f"short rank {short}: {res}"
