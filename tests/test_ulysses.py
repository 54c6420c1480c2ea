"""Ulysses on gloo CPU ranks: bitwise round trips, attention against fp64, bad inputs."""
from __future__ import annotations

import math
import random

import pytest
import torch
import torch.distributed as dist

from attncomm import ulysses
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


def _ref_attention(q, k, v, causal):
    """fp64 attention over ``[B, S, H, D]``; query head h uses KV head ``h // (Hq / Hkv)``."""
    m = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(m, dim=2)
    v = v.repeat_interleave(m, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[3])
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
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
    # default seq_lens (every rank the same S_r) and a non-contiguous input
    xt = _rand(_gen(seed + 55), (2, 6, 4 * world, 3)).transpose(0, 0)[:, :, ::1]
    y = seq_to_head(xt.permute(0, 1, 2, 3))
    back = head_to_seq(y)
    cases.append(("default", world, True, torch.equal(back, xt), True))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_roundtrip_bitwise(pools, world):
    seed = random.randrange(1 << 30)
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
        outs = {}
        for groups in (0, 2, 3):
            mod = UlyssesAttention(_checked_attn, pipeline_groups=groups)
            outs[groups] = mod(*local, seq_lens=lens, causal=causal)
        err = (outs[0].double() - ref[:, sl]).abs().max().item() if lens[rank] else 0.0
        same = all(torch.equal(outs[0], o) for o in outs.values())
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
def test_attention_matches_fp64(pools, world):
    seed = random.randrange(1 << 30)
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
def test_gqa_8q_2kv(pools, world):
    seed = random.randrange(1 << 30)
    errs = pools.run(world, _gqa_w3_w4, seed)
    assert max(errs) < 2e-5, f"seed {seed}: {errs}"


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


@pytest.mark.parametrize("world", [2, 3])
def test_qk_norm_rope_fused_equals_unfused(pools, world):
    seed = random.randrange(1 << 30)
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
    x = torch.randn(1, 3, 4, 2)
    out = {}
    out["seq_lens length"] = _expect_value_error(lambda: seq_to_head(x, seq_lens=[3] * (world + 1)))
    lens = [3] * world
    if rank == 1:
        lens[1] = 4  # disagrees with the tensor on rank 1 only
    out["seq_lens vs tensor"] = _expect_value_error(lambda: seq_to_head(x, seq_lens=lens))
    xd = torch.randn(1, 3, 4, 2 + (rank == world - 1))
    out["shape across ranks"] = _expect_value_error(lambda: seq_to_head(xd))
    out["zero heads"] = _expect_value_error(lambda: seq_to_head(torch.randn(1, 3, 0, 2)))
    out["not 4-D"] = _expect_value_error(lambda: seq_to_head(torch.randn(3, 4, 2)))
    out["local check, validate off"] = _expect_value_error(
        lambda: seq_to_head(torch.randn(1, 3, 0, 2), validate=False))
    out["ce on CPU"] = _expect_value_error(lambda: seq_to_head(x, backend="ce"))
    out["unknown backend"] = _expect_value_error(lambda: seq_to_head(x, backend="nccl"))
    out["h2s S not divisible"] = _expect_value_error(
        lambda: head_to_seq(torch.randn(1, world * 3 + 1, 2, 2)))
    out["h2s num_heads"] = _expect_value_error(
        lambda: head_to_seq(torch.randn(1, world * 3, 2, 2), num_heads=2 * world + 1))
    q, kv = torch.randn(1, 3, 6, 4), torch.randn(1, 3, 4, 4)
    out["Hq % Hkv"] = _expect_value_error(lambda: UlyssesAttention()(q, kv, kv))
    k2 = torch.randn(1, 3, 2, 4 + (rank == 0))
    out["attn D across"] = _expect_value_error(lambda: UlyssesAttention()(q, k2, k2))
    cos = torch.randn(3 * world + 1, 4)
    out["rope shape"] = _expect_value_error(
        lambda: UlyssesAttention()(q, q, q, rope=(cos, cos)))
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
        msgs = [r[key] for r in results]
        assert all(not m.startswith(("WRONG", "NO ERROR")) for m in msgs), (key, msgs)
    assert results[0]["seq_lens vs tensor"] == results[1]["seq_lens vs tensor"]
    assert "seq_lens[1] = 4" in results[0]["seq_lens vs tensor"]
    assert "Hq % Hkv" in results[0]["Hq % Hkv"]
    assert "not CUDA" in results[0]["ce on CPU"]
    for r in range(world):
        assert results[r]["_after"] == [float(s) for s in range(world) for _ in range(2)]


def _auto_fallback(rank, world):
    from attncomm.ulysses import api
    x = torch.randn(1, 2, world, 2)
    y = seq_to_head(x, backend="auto")
    reason = ulysses.fallback_reason
    real = api._tracing
    api._tracing = lambda: True  # as if torch.compile were tracing
    try:
        y2 = seq_to_head(x, backend="auto")
        traced_reason = ulysses.fallback_reason
        explicit = _expect_value_error(lambda: seq_to_head(x, backend="ce"))
    finally:
        api._tracing = real
    return (reason, ulysses.backend_availability(), traced_reason, explicit,
            torch.equal(y, y2))


def test_auto_falls_back_with_reason(pools):
    for reason, avail, traced, explicit, same in pools.run(2, _auto_fallback):
        assert reason and "not CUDA" in reason
        assert avail["all_to_all"] is None and avail["ce"]
        assert "torch.compile" in traced and "torch.compile" in explicit and same
