"""Ulysses on gloo CPU ranks: bitwise round trips, attention against fp64, bad inputs."""
from __future__ import annotations

import math
import os
import random

import pytest
import torch
import torch.distributed as dist

from attncomm import ulysses
from attncomm.select import Decision
from attncomm.ulysses import UlyssesAttention, head_split, head_to_seq, seq_to_head
from attncomm.ulysses.layout import (group_head_ranges, head_offsets, kv_head_range,
                                     uniform_group)


# ------------------------------------------------------------------------------ helpers
def _gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _rand(g, shape, dtype=torch.float32):
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _ref_attention(q, k, v, causal, key_mask=None):
    """fp64 attention over ``[B, S, H, D]``; query head h uses KV head ``h // (Hq / Hkv)``;
    ``key_mask`` bool ``[B, S]`` (True = attend; every row must keep a key)."""
    m = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(m, dim=2)
    v = v.repeat_interleave(m, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[3])
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    if key_mask is not None:
        s = s.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    return torch.einsum("bhst,bthd->bshd", torch.softmax(s, dim=-1), v)


def _ref_norm_rope(x, w, eps, cos, sin):
    x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


def _seq_lens(world, pattern, seed):
    rng = random.Random(seed)
    if pattern == "even":
        return [5] * world
    lens = [rng.randint(0, 7) for _ in range(world)]
    lens[rng.randrange(world)] = 0
    lens[rng.randrange(world)] += 3
    return lens


# ------------------------------------------------------------------------------ pure layout
def test_head_split_and_ranges():
    assert head_split(7, 4) == [2, 2, 2, 1]
    assert head_split(12, 5) == [3, 3, 2, 2, 2]
    assert head_split(2, 3) == [1, 1, 0]
    assert head_offsets([2, 2, 2, 1]) == [0, 2, 4, 6]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="num_heads"):
            head_split(bad, 2)
    with pytest.raises(ValueError, match="world_size"):
        head_split(4, 0)
    assert kv_head_range(3, 6, 4) == (0, 2)
    assert kv_head_range(4, 4, 4) == (0, 0)
    assert uniform_group(0, 4, 2) and uniform_group(2, 6, 4) and not uniform_group(3, 6, 4)
    # pipeline groups cover every rank's heads exactly once
    for h, w, g in [(24, 2, 3), (7, 4, 2), (5, 3, 4)]:
        ranges = group_head_ranges(h, w, g)
        heads = sorted(x for grp in ranges for lo, hi in grp for x in range(lo, hi))
        assert heads == list(range(h))


# ------------------------------------------------------------------------------ round trips
def _roundtrips(rank, world, seed):
    cases = []
    for i, (h, pattern, b, d, dtype) in enumerate([
            (7, "uneven", 1, 4, torch.float32), (world * 2, "even", 2, 3, torch.bfloat16),
            (3, "uneven", 2, 8, torch.float16), (1, "uneven", 1, 2, torch.float64),
            (13, "even", 1, 5, torch.int32)]):
        lens = _seq_lens(world, pattern, seed + i)
        g = _gen(seed + 100 * i)
        full = (torch.randint(-1000, 1000, (b, sum(lens), h, d), generator=g, dtype=torch.int32)
                if dtype == torch.int32 else _rand(g, (b, sum(lens), h, d), dtype))
        off = head_offsets(lens)
        x = full[:, off[rank]:off[rank] + lens[rank]].clone()
        heads = head_split(h, world)
        ho = head_offsets(heads)
        y = seq_to_head(x, seq_lens=lens)
        want = full[:, :, ho[rank]:ho[rank] + heads[rank]]
        ok1 = y.shape == want.shape and torch.equal(y, want)
        back = head_to_seq(y, num_heads=h, seq_lens=lens)
        ok2 = back.shape == x.shape and torch.equal(back, x)
        # head_to_seq on fresh head-sharded data
        full2 = _rand(_gen(seed + 7 + i), (b, sum(lens), h, d), torch.float32)
        z = head_to_seq(full2[:, :, ho[rank]:ho[rank] + heads[rank]].clone(), num_heads=h,
                        seq_lens=lens)
        ok3 = torch.equal(z, full2[:, off[rank]:off[rank] + lens[rank]])
        cases.append((h, tuple(lens), ok1, ok2, ok3))
    cases.append(_non_contiguous(rank, world, seed))
    return cases


def _non_contiguous(rank, world, seed):
    """Default seq_lens (every rank the same S_r) with non-contiguous inputs: a slice of a bigger
    tensor along heads and D, and a transposed view. Results must equal, bit for bit, those of
    the contiguous copies and the expected slices of the whole sequence."""
    h, d, s_r = 2 * world + 1, 3, 4
    # every rank's shard, built on every rank: a slice along heads of a [2, S_r, H + 3, D]
    # tensor (rows strided, each row dense: read in place, no copy)
    bigs = [_rand(_gen(seed + 55 + p), (2, s_r, h + 3, d)) for p in range(world)]
    xs = [big[:, :, 1:1 + h] for big in bigs]
    x_nc, x_c = xs[rank], xs[rank].contiguous()
    full = torch.cat([x.contiguous() for x in xs], dim=1)
    heads, ho = head_split(h, world), head_offsets(head_split(h, world))
    want = full[:, :, ho[rank]:ho[rank] + heads[rank]]
    y = seq_to_head(x_nc)
    y_c = seq_to_head(x_c)
    # head_to_seq from a transposed view ([B, H_r, S, D] storage seen as [B, S, H_r, D])
    y_t = y_c.transpose(1, 2).contiguous().transpose(1, 2)
    back = head_to_seq(y_t, num_heads=h)
    back_c = head_to_seq(y_c, num_heads=h)
    noncontig = not x_nc.is_contiguous() and not y_t.is_contiguous()
    return ("non-contiguous", world, noncontig,
            torch.equal(y, y_c) and torch.equal(y, want),
            torch.equal(back, back_c) and torch.equal(back, x_c))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_roundtrip_bitwise(pools, world, seed):
    for rank_cases in pools.run(world, _roundtrips, seed):
        for case in rank_cases:
            assert all(case[2:]), f"seed {seed}: {case}"


# ------------------------------------------------------------------------------ attention
_ATTN_CASES = [
    # (Hq, Hkv, D, causal, seq pattern, B)
    (4, 4, 8, False, "even", 1),     # MHA
    (8, 2, 8, True, "uneven", 2),    # GQA 8/2
    (6, 1, 4, True, "uneven", 1),    # MQA
    (7, 7, 4, False, "uneven", 1),   # uneven heads
    (12, 3, 4, True, "even", 1),
]


def _checked_attn(q, k, v, causal):
    if q.shape[2] % k.shape[2]:
        raise AssertionError(f"attn_fn got h={q.shape[2]} g={k.shape[2]}")
    return ulysses.sdpa_attention(q, k, v, causal)


def _attention_cases(rank, world, seed):
    results = []
    for i, (hq, hkv, d, causal, pattern, b) in enumerate(_ATTN_CASES):
        lens = _seq_lens(world, pattern, seed + i)
        if sum(lens) == 0:
            lens[0] = 3
        s = sum(lens)
        g = _gen(seed + 31 * i)
        q, k, v = (_rand(g, (b, s, h, d), torch.float64) for h in (hq, hkv, hkv))
        ref = _ref_attention(q, k, v, causal)
        off = head_offsets(lens)
        sl = slice(off[rank], off[rank] + lens[rank])
        local = [t[:, sl].float().contiguous() for t in (q, k, v)]
        outs, ran = {}, {}
        for groups in (0, 1, 2, 3):  # 1: one head group, sequential as 0
            mod = UlyssesAttention(_checked_attn, pipeline_groups=groups)
            outs[groups] = mod(*local, seq_lens=lens, causal=causal)
            ran[groups] = mod.last_pipeline_groups
        err = (outs[0].double() - ref[:, sl]).abs().max().item() if lens[rank] else 0.0
        same = all(torch.equal(outs[0], o) for o in outs.values()) and ran[1] == ran[0] == 1
        same = same and mod.last_in_exchanges == 1  # q, k, v in one exchange
        results.append((hq, hkv, tuple(lens), err, same))
    # v with another head_dim (and dtype): q/k in one exchange, v in its own
    lens = _seq_lens(world, "uneven", seed + 77)
    lens[-1] += 2
    s = sum(lens)
    g = _gen(seed + 78)
    q, k, v = _rand(g, (1, s, 6, 8), torch.float64), _rand(g, (1, s, 3, 8), torch.float64), \
        _rand(g, (1, s, 3, 4), torch.float64)
    off = head_offsets(lens)
    sl = slice(off[rank], off[rank] + lens[rank])
    mod = UlyssesAttention(_checked_attn, pipeline_groups=2)
    out = mod(q[:, sl].float(), k[:, sl].float(), v[:, sl].float(), seq_lens=lens, causal=True)
    ref = _ref_attention(q, k, v, True)[:, sl]
    err = (out.double() - ref).abs().max().item() if lens[rank] else 0.0
    results.append((6, 3, tuple(lens), err, mod.last_in_exchanges == 2 and
                    tuple(out.shape) == (1, lens[rank], 6, 4)))
    return results


@pytest.mark.parametrize("world", [2, 3, 4])
def test_attention_matches_fp64(pools, world, seed):
    for rank_results in pools.run(world, _attention_cases, seed):
        for hq, hkv, lens, err, same in rank_results:
            assert err < 2e-5, f"seed {seed}: Hq={hq} Hkv={hkv} lens={lens} err={err}"
            assert same, f"seed {seed}: pipelined ≠ sequential for Hq={hq} Hkv={hkv}"


def _gqa_w3_w4(rank, world, seed):
    # 8 q / 2 kv (the cases, at W=3 some ranks need both kv heads non-uniformly)
    lens = _seq_lens(world, "uneven", seed)
    lens[0] += 2
    s = sum(lens)
    g = _gen(seed)
    q, k, v = (_rand(g, (1, s, h, 16), torch.float64) for h in (8, 2, 2))
    off = head_offsets(lens)
    sl = slice(off[rank], off[rank] + lens[rank])
    out = UlyssesAttention(_checked_attn)(*(t[:, sl].float() for t in (q, k, v)),
                                          seq_lens=lens, causal=True)
    return (out.double() - _ref_attention(q, k, v, True)[:, sl]).abs().max().item() \
        if lens[rank] else 0.0


@pytest.mark.parametrize("world", [3, 4, 5])
def test_gqa_8q_2kv(pools, world, seed):
    errs = pools.run(world, _gqa_w3_w4, seed)
    assert max(errs) < 2e-5, f"seed {seed}: {errs}"


def _one_rank_case(rank, world, seed):
    # W = 1: a forward whose pack would only copy hands attn_fn the caller's tensors (its
    # head slices with head groups); norm/RoPE inside the fill or an FP8 payload still pack
    g = _gen(seed)
    q, k, v = (_rand(g, (2, 7, h, 8)) for h in (6, 2, 2))
    seen = []

    def attn(q_, k_, v_, causal):
        seen.append(tuple(t.data_ptr() for t in (q_, k_, v_)))
        return ulysses.sdpa_attention(q_, k_, v_, causal)

    ref = _ref_attention(q.double(), k.double(), v.double(), True)
    outs, ptrs = [], []
    for kw in (dict(pipeline_groups=0), dict(pipeline_groups=2),
               dict(pipeline_groups=0, payload_dtype=torch.float8_e4m3fn)):
        seen.clear()
        outs.append(UlyssesAttention(attn, **kw)(q, k, v, causal=True))
        ptrs.append(list(seen))
    own = (q.data_ptr(), k.data_ptr(), v.data_ptr())
    esz = q.element_size()
    halves = [(q.data_ptr(), k.data_ptr(), v.data_ptr()),  # heads [0, 3) and [3, 6) of q
              (q.data_ptr() + 3 * 8 * esz, k.data_ptr() + 8 * esz, v.data_ptr() + 8 * esz)]
    return ((outs[0].double() - ref).abs().max().item(), torch.equal(outs[0], outs[1]),
            ptrs[0] == [own], ptrs[1] == halves, all(p[0] != own[0] for p in ptrs[2]),
            (outs[2].double() - ref).abs().max().item())


def test_one_rank_attends_on_the_parts(pools, seed):
    err, pipe_eq, direct, sliced, fp8_packed, fp8_err = pools.run(1, _one_rank_case, seed)[0]
    assert err < 2e-5, f"seed {seed}: err {err}"
    assert pipe_eq, f"seed {seed}: pipelined ≠ sequential"
    assert direct, f"seed {seed}: attn_fn did not get q, k, v themselves"
    assert sliced, f"seed {seed}: head groups did not get head slices of q, k, v"
    assert fp8_packed and fp8_err < 0.2, f"seed {seed}: FP8 payload at W=1: err {fp8_err}"


def _one_rank_groups_case(rank, world, seed):
    # W = 1, nothing packed, G head groups: every part split once and the outputs concatenated
    # once when the groups' heads of each part follow one another (_run_local), the general
    # loop otherwise (GQA groups sharing a KV head); both give the sequential forward's bits
    from attncomm.ulysses import forward_plan
    g = _gen(seed)
    calls, local, wide = [], [], [False]
    run_local = forward_plan.ForwardPlan._run_local

    def counted(self, *a, **kw):
        local.append(len(self.groups))
        return run_local(self, *a, **kw)

    def attn(q_, k_, v_, causal, **kw):
        calls.append(q_.shape[2])
        o = ulysses.sdpa_attention(q_, k_, v_, causal, **kw)
        return o.double() if wide[0] else o  # an output of another dtype than q's

    forward_plan.ForwardPlan._run_local = counted
    res = []
    try:
        # dv != 8: v travels in its own input exchange (two per group); normed: the norm as
        # its own pass before attn_fn reads the normed q, k
        for hq, hkv, groups, out64, masked, dv, normed in (
                (4, 4, 4, False, False, 8, False), (6, 2, 2, False, True, 8, False),
                (6, 2, 3, False, False, 8, False), (3, 3, 5, False, True, 8, False),
                (4, 2, 2, True, False, 8, False), (6, 3, 3, False, True, 4, False),
                (4, 2, 2, False, False, 8, True)):
            wide[0] = out64
            q, k = (_rand(g, (2, 7, h, 8)) for h in (hq, hkv))
            v = _rand(g, (2, 7, hkv, dv))
            norm = (_rand(g, (8,)), _rand(g, (8,)), 1e-6) if normed else None
            mask = torch.rand((2, 7), generator=g) > 0.3 if masked else None
            mask = None if mask is None else mask.index_fill(1, torch.tensor([0]), True)
            kw = {} if mask is None else dict(key_padding_mask=mask)
            mods = [UlyssesAttention(attn, pipeline_groups=n, qk_norm=norm,
                                     fuse_qk_norm_rope=not normed) for n in (0, groups)]
            seq = mods[0](q, k, v, causal=True, **kw)
            calls.clear()
            local.clear()
            got = mods[1](q, k, v, causal=True, **kw)
            assert mods[1].last_in_exchanges == (2 if dv != 8 else 1)
            res.append((hq, hkv, groups, torch.equal(seq, got), got.dtype == q.dtype,
                        sorted(calls), list(local)))
    finally:
        forward_plan.ForwardPlan._run_local = run_local
    return res


def test_one_rank_head_groups_split_once(pools, seed):
    res = pools.run(1, _one_rank_groups_case, seed)[0]
    for hq, hkv, groups, equal, dtype_ok, calls, local in res:
        case = f"seed {seed}: Hq {hq}, Hkv {hkv}, {groups} groups"
        assert equal and dtype_ok, case
        assert sum(calls) == hq and len(calls) == min(groups, hq), f"{case}: {calls}"
        # GQA with 3 groups over 6 query heads shares KV head 0 between groups 0 and 1
        assert local == ([] if (hq, hkv, groups) == (6, 2, 3) else [groups]), f"{case}: {local}"


def _one_rank_strided_case(rank, world, seed):
    # W = 1, nothing packed: q, k, v with a strided D reach attn_fn as rows of heads × D, so a
    # masked forward (SDPA on the views as given) has the bits of their contiguous copies,
    # with the norm + RoPE unfused (its own pass) or fused (packed), and without them
    g = _gen(seed)
    b, s, d, eps = 2, 7, 8, 1e-6
    q, k, v = (_rand(g, (b, s, d, h)).transpose(2, 3) for h in (4, 2, 2))
    dense = [t.contiguous() for t in (q, k, v)]
    mask = torch.rand((b, s), generator=g) > 0.4
    mask[:, 0] = True  # causal rows all keep key 0
    w = _rand(g, (d,))
    ang = _rand(g, (s, d))
    rope = (ang.cos(), ang.sin())
    strides = []

    def attn(q_, k_, v_, causal, **kw):
        strides.extend(t.stride(3) for t in (q_, k_, v_))
        return ulysses.sdpa_attention(q_, k_, v_, causal, **kw)

    def run(xs, **kw):
        rot = dict(rope=rope) if "qk_norm" in kw else {}
        return UlyssesAttention(attn, pipeline_groups=0, **kw)(*xs, causal=True,
                                                                key_padding_mask=mask, **rot)

    norm = dict(qk_norm=(w, w, eps))
    normed = [run(xs, fuse_qk_norm_rope=f, **norm) for xs, f in
              (((q, k, v), False), (dense, False), ((q, k, v), True))]
    plain = [run(xs) for xs in ((q, k, v), dense)]
    ref = _ref_attention(*(t.double() for t in (q, k, v)), True, mask)
    return ((plain[0].double() - ref).abs().max().item(), torch.equal(plain[0], plain[1]),
            torch.equal(normed[0], normed[1]), torch.equal(normed[0], normed[2]),
            sorted(set(strides)))


def test_one_rank_strided_head_dim_keeps_the_bits(pools, seed):
    err, plain_eq, unfused_eq, fused_eq, strides = pools.run(1, _one_rank_strided_case, seed)[0]
    assert err < 2e-5, f"seed {seed}: err {err}"
    assert strides == [1], f"seed {seed}: attn_fn got D strides {strides}"
    assert plain_eq, f"seed {seed}: strided q, k, v ≠ their contiguous copies (no norm)"
    assert unfused_eq, f"seed {seed}: strided q, k, v ≠ their contiguous copies (unfused norm)"
    assert fused_eq, f"seed {seed}: fused ≠ unfused with strided q, k, v"


def _norm_rope_case(rank, world, seed):
    lens = _seq_lens(world, "uneven", seed)
    lens[0] += 2
    s, d, hq, hkv, eps = sum(lens), 8, 6, 2, 1e-6
    g = _gen(seed)
    q, k, v = (_rand(g, (1, s, h, d), torch.float64) for h in (hq, hkv, hkv))
    qw, kw = _rand(g, (d,), torch.float64), _rand(g, (d,), torch.float64)
    pos = torch.arange(s, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.cat((pos * inv, pos * inv), dim=-1)
    cos, sin = ang.cos(), ang.sin()
    ref = _ref_attention(_ref_norm_rope(q, qw, eps, cos, sin),
                         _ref_norm_rope(k, kw, eps, cos, sin), v, True)
    off = head_offsets(lens)
    sl = slice(off[rank], off[rank] + lens[rank])
    local = [t[:, sl].float() for t in (q, k, v)]
    norm = (qw.float(), kw.float(), eps)
    rope = (cos.float(), sin.float())
    outs = [UlyssesAttention(qk_norm=norm, fuse_qk_norm_rope=f, pipeline_groups=pg)(
        *local, seq_lens=lens, causal=True, rope=rope) for f, pg in
        ((True, 0), (False, 0), (True, 2))]
    err = (outs[0].double() - ref[:, sl]).abs().max().item() if lens[rank] else 0.0
    return err, torch.equal(outs[0], outs[1]), torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("world", [1, 2, 3])
def test_qk_norm_rope_fused_equals_unfused(pools, world, seed):
    for err, fused_eq, pipe_eq in pools.run(world, _norm_rope_case, seed):
        assert err < 5e-5, f"seed {seed}: err {err}"
        assert fused_eq, f"seed {seed}: fused ≠ unfused"
        assert pipe_eq, f"seed {seed}: pipelined ≠ sequential"


# ------------------------------------------------------------------------------ bad inputs
def _expect_value_error(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return f"WRONG {type(exc).__name__}: {exc}"
    return "NO ERROR"


def _bad_inputs(rank, world):
    """``{case: (message or WRONG/NO ERROR, distinctive fragment(s) its message must hold,
    whether every rank must get the same message)}``."""
    x = torch.randn(1, 3, 4, 2)
    out = {}

    def case(name, fn, fragment, same=True):
        out[name] = (_expect_value_error(fn), fragment, same)

    case("seq_lens length", lambda: seq_to_head(x, seq_lens=[3] * (world + 1)),
         f"seq_lens has {world + 1} entries, the group has {world} ranks")
    case("seq_lens not a sequence", lambda: seq_to_head(x, seq_lens=5),
         "seq_lens must be a sequence of ints, got 5")
    lens = [3] * world
    if rank == 1:
        lens[1] = 4  # disagrees with the tensor on rank 1 only
    case("seq_lens vs tensor", lambda: seq_to_head(x, seq_lens=lens),
         "rank 1: seq_lens[1] = 4 but x has S_r = 3")
    xd = torch.randn(1, 3, 4, 2 + (rank == world - 1))
    case("shape across ranks", lambda: seq_to_head(xd),
         "ranks disagree on the call's arguments: D = 2 (rank 0)")
    case("zero heads", lambda: seq_to_head(torch.randn(1, 3, 0, 2)),
         "x has 0 heads; at least one is needed")
    case("not 4-D", lambda: seq_to_head(torch.randn(3, 4, 2)),
         "x must be a 4-D tensor [B, S_r, H, D], got shape [3, 4, 2]")
    case("local check, validate off",
         lambda: seq_to_head(torch.randn(1, 3, 0, 2), validate=False),
         f"invalid arguments — rank {rank}: x has 0 heads", same=False)
    case("ce on CPU", lambda: seq_to_head(x, backend="ce"),
         ("backend='ce' cannot run here: rank 0: ", "not CUDA"))
    case("unknown backend", lambda: seq_to_head(x, backend="nccl"),
         "backend must be one of ['all_to_all', 'ce', 'auto'], got 'nccl'")
    case("h2s S not divisible", lambda: head_to_seq(torch.randn(1, world * 3 + 1, 2, 2)),
         f"S = {world * 3 + 1} is not divisible by W = {world}: pass seq_lens")
    case("h2s num_heads",
         lambda: head_to_seq(torch.randn(1, world * 3, 2, 2), num_heads=2 * world + 1),
         f"rank 0: x has H_r = 2 heads but head_split({2 * world + 1}, {world})[0] = 3")
    q, kv = torch.randn(1, 3, 6, 4), torch.randn(1, 3, 4, 4)
    case("Hq % Hkv", lambda: UlyssesAttention()(q, kv, kv), "Hq % Hkv != 0: Hq = 6, Hkv = 4")
    k2 = torch.randn(1, 3, 2, 4 + (rank == 0))
    case("attn D across", lambda: UlyssesAttention()(q, k2, k2),
         "rank 0: q has D = 4 but k has D = 5")
    cos = torch.randn(3 * world + 1, 4)
    case("rope shape", lambda: UlyssesAttention()(q, q, q, rope=(cos, cos)),
         f"rope cos/sin must be [S, D] = [{3 * world}, 4], got [{3 * world + 1}, 4]")
    # q not 4-D on rank 0 only: every rank raises the same ValueError naming the shapes
    q3 = q[0] if rank == 0 else q
    k = torch.randn(1, 3, 2, 4)
    case("attn not 4-D on rank 0", lambda: UlyssesAttention()(q3, k, k),
         "rank 0: q, k, v must be 4-D tensors [B, S_r, H, D], got q [3, 6, 4], k [1, 3, 2, 4], "
         "v [1, 3, 2, 4]")
    case("attn v not a tensor", lambda: UlyssesAttention()(q, k, None),
         "got q [1, 3, 6, 4], k [1, 3, 2, 4], v NoneType")
    case("pipeline_groups=-2", lambda: UlyssesAttention(pipeline_groups=-2),
         "pipeline_groups must be -1 (auto), 0 or 1 (sequential) or N ≥ 2 (head groups), "
         "got -2")
    for raw in ("-3", "two"):
        if rank == 0:  # a bad env value on one rank: still the same error everywhere
            os.environ["ATTNCOMM_ULYSSES_PIPELINE_GROUPS"] = raw
        try:
            case(f"env pipeline groups {raw}", lambda: UlyssesAttention()(q, k, k),
                 f"rank 0: ATTNCOMM_ULYSSES_PIPELINE_GROUPS={raw!r}")
        finally:
            os.environ.pop("ATTNCOMM_ULYSSES_PIPELINE_GROUPS", None)
    # the group still works afterwards
    y = seq_to_head(torch.full((1, 2, world, 1), float(rank)))
    out["_after"] = y.flatten().tolist()
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_bad_inputs_raise_on_every_rank(pools, world):
    results = pools.run(world, _bad_inputs)
    for key in results[0]:
        if key == "_after":
            continue
        msgs = [r[key][0] for r in results]
        assert all(not m.startswith(("WRONG", "NO ERROR")) for m in msgs), (key, msgs)
        for r, res in enumerate(results):
            msg, fragment, same = res[key]
            frags = fragment if isinstance(fragment, tuple) else (fragment,)
            assert all(f in msg for f in frags), (key, r, res[key])
        if same:
            assert len(set(msgs)) == 1, (key, msgs)
    for r in range(world):
        assert results[r]["_after"] == [float(s) for s in range(world) for _ in range(2)]


def _auto_fallback(rank, world):
    x = torch.randn(1, 2, world, 2)
    y = seq_to_head(x, backend="auto")
    # per module: an auto module records its own reason; an all_to_all module none
    q = torch.randn(1, 2, 2 * world, 4)
    auto_mod, a2a_mod = UlyssesAttention(backend="auto"), UlyssesAttention(backend="all_to_all")
    before = (auto_mod.fallback_reason, a2a_mod.fallback_reason)
    auto_mod(q, q, q)
    a2a_mod(q, q, q)
    mods = (auto_mod.fallback_reason, a2a_mod.fallback_reason)
    explicit = _expect_value_error(lambda: seq_to_head(x, backend="ce"))
    y2 = seq_to_head(x, backend="auto")
    return (ulysses.backend_availability(), explicit, torch.equal(y, y2), mods, before,
            hasattr(ulysses, "fallback_reason"))


def test_auto_falls_back_with_reason(pools):
    for avail, explicit, same, mods, before, global_reason in pools.run(2, _auto_fallback):
        assert avail["all_to_all"] is None and avail["ce"]
        assert "backend='ce' cannot run here" in explicit and "not CUDA" in explicit and same
        assert mods[0] and "ce not used" in mods[0] and "not CUDA" in mods[0], mods
        assert mods[1] is None and before == (None, None), (mods, before)
        assert not global_reason  # no process-global reason: per object only


def test_decide_transport_policy():
    """The pure policy: explicit ce that cannot run raises; auto below the size threshold is a
    choice (no reason), above it ce; an ineligible ce under auto gives its reason."""
    from attncomm.ulysses.api import AUTO_CE_MIN_BYTES, decide_transport
    big, small = AUTO_CE_MIN_BYTES, AUTO_CE_MIN_BYTES - 1
    assert decide_transport("auto", None, big) == Decision("ce")
    assert decide_transport("auto", None, small) == Decision("all_to_all")
    assert decide_transport("ce", None, small) == Decision("ce")
    got = decide_transport("auto", "no P2P", big)
    assert got.backend == "all_to_all" and "no P2P" in got.fallback_reason
    with pytest.raises(ValueError, match="no P2P"):
        decide_transport("ce", "no P2P", big)


# ------------------------------------------------------------------------------ caches
def _cache_keys(rank, world):
    """A new group's cache entries are keyed by the group object (an ``id`` can be reused by a
    later group); ``reset_transports`` forgets exactly them."""
    from attncomm.ulysses import api, ce, policy
    g = dist.new_group(list(range(world)), backend="gloo")
    y = seq_to_head(torch.full((1, 2, world, 1), float(rank)), g, backend="auto")
    ok_data = y.flatten().tolist() == [float(s) for s in range(world) for _ in range(2)]
    agreed = [k for k in ce._AGREED if k[0] is g]
    transports = [k for k in policy._TRANSPORTS if k[0] is g]
    by_id = [k for k in list(ce._AGREED) + list(policy._TRANSPORTS) if k[0] == id(g)]
    api.reset_transports(g)
    left = [k for k in policy._TRANSPORTS if k[0] is g]
    others = len(policy._TRANSPORTS)
    dist.destroy_process_group(g)
    return ok_data, len(agreed), len(transports), by_id, left, others


def test_caches_keyed_by_group_object(pools):
    for ok_data, agreed, transports, by_id, left, _ in pools.run(2, _cache_keys):
        assert ok_data and agreed == 1 and transports >= 1 and not by_id and not left


# ------------------------------------------------------------------------------ ce staging
_EVENTS: list = []


class _FakeStaging:
    """Stands in for ``ce._Staging`` on CPU: fails to allocate on ``fail[0]`` or to rendezvous
    on ``fail[1]`` (rank numbers, -1 none) and records what ran."""

    fail = (-1, -1)

    def __init__(self, group, rank, world, cap, device, *, failures=None, mapping=None):
        _EVENTS.append("alloc")
        self.rank, self.pinned, self.held = rank, False, [False, False]
        if rank == self.fail[0]:
            raise RuntimeError("CUDA out of memory (simulated)")

    def rendezvous(self):
        _EVENTS.append("rendezvous")
        if self.rank == self.fail[1]:
            raise RuntimeError("rendezvous broke (simulated)")


def _staging_steps(rank, world):
    """Allocation → agreement → rendezvous only if every rank allocated."""
    import collections
    from attncomm.ulysses import ce
    t = object.__new__(ce.CopyEngineTransport)
    t.group, t.rank, t.world_size, t.timeout_s = None, rank, world, 10.0
    t.device, t.capacity, t.evictions = torch.device("cpu"), 8, 0
    t.cache, t.failures, t.mapping = collections.OrderedDict(), None, "ipc"
    real = ce._Staging
    ce._Staging = _FakeStaging
    out = []
    try:
        for i, fail in enumerate([(-1, -1), (1, -1), (-1, 0)]):
            _FakeStaging.fail = fail
            _EVENTS.clear()
            why = t._allocate((False, 1 << (16 + i)))
            out.append((why, list(_EVENTS), len(t.cache)))
    finally:
        ce._Staging = real
    return out


def test_ce_staging_agrees_before_rendezvous(pools):
    results = pools.run(2, _staging_steps)
    for ok, alloc_fail, rdv_fail in results:
        assert ok == (None, ["alloc", "rendezvous"], 1), ok
        why, events, cached = alloc_fail  # rank 1 ran out of memory: nobody rendezvoused
        assert events == ["alloc"] and cached == 1, alloc_fail
        assert "staging allocation failed" in why and "rank 1: RuntimeError: CUDA out of memory" \
            in why and "rank 0" not in why, why
        why, events, cached = rdv_fail
        assert events == ["alloc", "rendezvous"] and cached == 1, rdv_fail
        assert "staging rendezvous failed" in why and "rank 0: RuntimeError: rendezvous broke" \
            in why, why
    assert results[0][1][0] == results[1][1][0] and results[0][2][0] == results[1][2][0]
