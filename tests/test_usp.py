"""USP (Ulysses inside × ring across) on gloo CPU ranks: the layout, every U × R grid of W = 2,
3, 4 against fp64 attention over the whole sequence, (U, 1) = UlyssesAttention and (1, R) =
ring_attention bit for bit, make_groups, bad inputs raised on every rank of the grid."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from _ring_helpers import (bits_equal, compile_counted, expect_value_error, gen, max_err, rand,
                           ref_attention_lse)

from attncomm import usp
from attncomm.ring import positions, reference_attention, ring_attention
from attncomm.testing.reference import ref_norm_rope
from attncomm.ulysses import UlyssesAttention
from attncomm.usp import USPAttention, make_groups, usp_positions, usp_shard, usp_unshard


def _grids(world):
    return [(u, world // u) for u in range(1, world + 1) if world % u == 0]


_GRIDS: dict = {}  # rank side: (U, R) → this rank's groups, made once per pool


def _grid(u, r):
    if (u, r) not in _GRIDS:
        _GRIDS[(u, r)] = make_groups(u, r)
    return _GRIDS[(u, r)]


# ------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_usp_layout_gives_each_ulysses_group_its_ring_block(layout):
    for u, r in ((1, 1), (2, 1), (1, 3), (2, 2), (3, 2), (2, 4)):
        s = 4 * u * r
        x = torch.arange(2 * s).view(2, s)
        shards = [usp_shard(x, u, r, g, layout) for g in range(u * r)]
        assert torch.equal(usp_unshard(shards, u, r, layout), x), (u, r)
        for j in range(r):  # the Ulysses group j's span is ring rank j's block
            span = torch.cat([usp_positions(s, u, r, j * u + i, layout) for i in range(u)])
            assert torch.equal(span, positions(s, r, j, layout)), (u, r, j)
    with pytest.raises(ValueError, match="does not split into 8 equal chunks"):
        usp_shard(torch.zeros(1, 12), 2, 2, 0, "zigzag")


# ------------------------------------------------------------------------------ vs fp64
# (B, Hq, Hkv, D, Dv, S_r, causal, layout)
_CASES = [
    (1, 4, 4, 8, 8, 4, False, "contiguous"),
    (2, 4, 2, 8, 6, 4, True, "contiguous"),   # GQA, D ≠ Dv
    (1, 8, 2, 8, 8, 2, True, "zigzag"),
    (2, 6, 6, 4, 4, 6, False, "zigzag"),
    (1, 4, 1, 8, 8, 4, True, "zigzag"),       # MQA
]


def _usp_cases(rank, world, seed):
    out = []
    for u, r in _grids(world):
        ug, rg = _grid(u, r)
        for i, (b, hq, hkv, d, dv, s_r, causal, layout) in enumerate(_CASES):
            g = gen(seed + 97 * i + u)
            s = s_r * world
            q, k, v = (rand(g, (b, s, h, dd)) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
            ref = ref_attention_lse(q, k, v, causal)[0]
            pos = usp_positions(s, u, r, rank, layout)
            mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                               backend="all_to_all")
            res = mod(*(t[:, pos].float() for t in (q, k, v)), causal=causal)
            out.append(((u, r), i, max_err(res, ref[:, pos]), tuple(res.shape)))
        # RMSNorm + RoPE over global positions, and uneven seq_lens (equal group spans)
        g = gen(seed + 5 * u)
        s_r, hq, hkv, d, eps = 4, 4, 2, 8, 1e-6
        seq = [s_r + (1 if gr % u == 0 else -1) * (u > 1) for gr in range(world)]
        s = sum(seq)
        q, k, v = (rand(g, (1, s, h, d)) for h in (hq, hkv, hkv))
        qw, kw = rand(g, (d,)), rand(g, (d,))
        ang = torch.arange(s, dtype=torch.float64)[:, None] * 10000.0 ** (
            -torch.arange(0, d, 2, dtype=torch.float64) / d)
        ang = torch.cat((ang, ang), -1)
        ref = ref_attention_lse(ref_norm_rope(q, qw, eps, ang.cos(), ang.sin()),
                                ref_norm_rope(k, kw, eps, ang.cos(), ang.sin()), v, True)[0]
        lo = sum(seq[:rank])
        sl = slice(lo, lo + seq[rank])
        mod = USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all",
                           qk_norm=(qw.float(), kw.float(), eps), pipeline_groups=2)
        res = mod(*(t[:, sl].float() for t in (q, k, v)), seq_lens=seq, causal=True,
                  rope=(ang.cos().float(), ang.sin().float()))
        out.append(((u, r), "rope+norm+seq_lens", max_err(res, ref[:, sl]), tuple(res.shape)))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_usp_matches_fp64(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _usp_cases, seed)):
        for grid, case, err, shape in res:
            assert err < 5e-5, f"seed {seed}: W={world} rank {rank} grid {grid} case {case}: " \
                               f"err {err} (shape {shape})"


# ------------------------------------------------------------------------------ bit for bit
def _ulysses_attn(q, k, v, causal):
    return reference_attention(q, k, v, causal)[0].to(q.dtype)


def _degenerate(rank, world, seed):
    g = gen(seed)
    res = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            s_r = 4
            q, k, v = (rand(g, (2, s_r * world, h, 8), torch.float32) for h in (4, 2, 2))
            # (W, 1): UlyssesAttention with the same per-block attention
            ug, rg = _grid(world, 1)
            pos = usp_positions(s_r * world, world, 1, rank, layout)
            loc = [t[:, pos] for t in (q, k, v)]
            for pg in (0, 2):
                a = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                                 backend="all_to_all", pipeline_groups=pg)(*loc, causal=causal)
                b = UlyssesAttention(_ulysses_attn, ug, backend="all_to_all",
                                     pipeline_groups=pg)(*loc, causal=causal)
                res.append((f"({world}, 1) pg={pg} {layout} causal={causal}",
                            bits_equal(a, b)))
            # (1, W): ring_attention
            ug, rg = _grid(1, world)
            pos = usp_positions(s_r * world, 1, world, rank, layout)
            loc = [t[:, pos] for t in (q, k, v)]
            a = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                             backend="all_to_all")(*loc, causal=causal)
            b = ring_attention(*loc, rg, causal=causal, layout=layout)
            res.append((f"(1, {world}) {layout} causal={causal}", bits_equal(a, b)))
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_degenerate_grids_are_ulysses_and_ring_bit_for_bit(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _degenerate, seed)):
        for label, same in res:
            assert same, f"seed {seed}: rank {rank}: {label}"


# ------------------------------------------------------------------------------ groups
def _groups_and_warning(rank, world):
    out = {}
    for u, r in _grids(world):
        ug, rg = _grid(u, r)
        out[(u, r)] = (dist.get_process_group_ranks(ug), dist.get_process_group_ranks(rg))
    # two simulated hosts (ranks alternate): every Ulysses group of U = 2 spans both
    real = usp.host_identity
    usp.host_identity = lambda: f"host{rank % 2}/boot"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ug, rg = make_groups(2, world // 2)
            mod = USPAttention(ulysses_group=ug, ring_group=rg)
    finally:
        usp.host_identity = real
    out["warnings"] = [str(w.message) for w in caught
                       if issubclass(w.category, usp.UlyssesSpansHostsWarning)]
    out["reason"] = mod.topology_reason
    for name, fn in (("product", lambda: make_groups(3, 1)),
                     ("degree 0", lambda: make_groups(0, world)),
                     ("one rank", lambda: make_groups(world if rank else 1, 1 if rank else world))):
        try:
            fn()
            out[name] = "NO ERROR"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_make_groups_layout_warning_and_errors(pools):
    world = 4
    res = pools.run(world, _groups_and_warning)
    for rank, out in enumerate(res):
        for u, r in _grids(world):
            j, i = divmod(rank, u)
            assert out[(u, r)] == ([j * u + x for x in range(u)], [x * u + i for x in range(r)])
        assert len(out["warnings"]) == 1 and "spans 2 hosts" in out["warnings"][0], out
        assert out["warnings"][0] == res[0]["warnings"][0]
        assert "Ulysses group [" in out["reason"] and "host0/boot: ranks" in out["reason"]
        assert "3 · 1 = 3 does not equal the group's size 4" in out["product"]
        assert "must be ints ≥ 1, got 0 and 4" in out["degree 0"]
        assert "ranks disagree on the call's arguments: ulysses_degree = 1 (rank 0)" \
            in out["one rank"]


# ------------------------------------------------------------------------------ bad inputs
def _bad_inputs(rank, world):
    ug, rg = _grid(2, world // 2)
    mod = USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all", layout="zigzag")
    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 2, 8)
    out = {}

    def case(name, fn, fragment):
        out[name] = (expect_value_error(fn), fragment)

    # one rank of the other ring group and Ulysses group than rank 0 brings another D
    qd = torch.randn(1, 4, 4, 8 + 8 * (rank == world - 1))
    kd = torch.randn(1, 4, 2, qd.shape[3])
    case("D on the last rank", lambda: mod(qd, kd, kd), "D = 8 (rank 0), 16 (rank 1)")
    lens = [4] * world
    lens[0], lens[1] = 3, 3  # Ulysses group 0 holds 6 positions, group 1 holds 8
    qs = torch.randn(1, lens[rank], 4, 8)
    ks = torch.randn(1, lens[rank], 2, 8)
    case("unequal spans", lambda: mod(qs, ks, ks, seq_lens=lens),
         "every Ulysses group must hold the same number of positions")
    lens = [4, 5] * (world // 2)
    qo, ko = torch.randn(1, lens[rank], 4, 8), torch.randn(1, lens[rank], 2, 8)
    case("zigzag odd span", lambda: mod(qo, ko, ko, seq_lens=lens),
         "layout='zigzag' needs an even S_r")
    cos = torch.randn(4 * world + 1, 8)
    case("rope shape", lambda: mod(q, kv, kv, rope=(cos, cos)),
         f"rope must be (cos, sin) tensors [S, D] = [{4 * world}, 8]")
    case("backend on one rank",
         lambda: USPAttention(ulysses_group=ug, ring_group=rg,
                              backend="nccl" if rank == world - 1 else "auto"),
         "backend must be 'all_to_all', 'ce' or 'auto', got 'nccl'")
    case("layout", lambda: USPAttention(ulysses_group=ug, ring_group=rg, layout="stripe"),
         "layout must be one of ['contiguous', 'zigzag'], got 'stripe'")
    case("Hq % Hkv", lambda: mod(torch.randn(1, 4, 3, 8), kv, kv), "Hq % Hkv != 0")
    out["_after"] = mod(q, kv, kv, causal=True).shape == (1, 4, 4, 8)
    return out


def test_bad_inputs_raise_on_every_rank_of_the_grid(pools):
    world = 4
    results = pools.run(world, _bad_inputs)
    for key in results[0]:
        if key == "_after":
            continue
        for r, res in enumerate(results):
            msg, fragment = res[key]
            assert not msg.startswith(("WRONG", "NO ERROR")), (key, r, msg)
            assert fragment in msg, (key, r, msg)
    assert all(r["_after"] for r in results)


# ------------------------------------------------------------------------------ masks, varlen
def _usp_masked(rank, world, seed):
    out = []
    for u, r in _grids(world):
        ug, rg = _grid(u, r)
        for i, (layout, causal, packed, masked) in enumerate(
                [("contiguous", True, True, True), ("zigzag", True, True, True),
                 ("zigzag", False, False, True), ("contiguous", False, True, False)]):
            g = gen(seed + 31 * i + u)
            unit = 2 * r if layout == "zigzag" else 1
            s = 4 * unit * world if layout == "zigzag" else 4 * world
            lens = [unit, s - 3 * unit, 2 * unit] if layout == "zigzag" else [3, s - 5, 2]
            cu = torch.tensor([0, lens[0], lens[0] + lens[1], s], dtype=torch.int32)
            cu = cu if packed else None
            q, k, v = (rand(g, (2, s, h, 8)).float().double() for h in (2 * u, u, u))
            valid = None
            if masked:
                valid = torch.rand(2, s, generator=g) > 0.3
                valid[1] = False  # batch 1: no key anywhere
            ref = ref_attention_lse(q, k, v, causal, key_valid=valid, cu_seqlens=cu)[0]
            pos = usp_positions(s, u, r, rank, layout, cu_seqlens=cu)
            mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                               backend="all_to_all", pipeline_groups=0)
            res = mod(*(t[:, pos].float() for t in (q, k, v)), causal=causal,
                      key_padding_mask=None if valid is None else valid[:, pos], cu_seqlens=cu)
            out.append(((u, r), layout, causal, packed, max_err(res, ref[:, pos])))
        # (1, W) with a mask and packed sequences is ring_attention, bit for bit
        if u == 1:
            g = gen(seed)
            q, k, v = (rand(g, (1, 4, 2, 8), torch.float32) for _ in range(3))
            m = torch.rand(1, 4, generator=g) > 0.3
            cu = torch.tensor([0, 3, 4 * world], dtype=torch.int32)
            a = USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all")(
                q, k, v, causal=True, key_padding_mask=m, cu_seqlens=cu)
            b = ring_attention(q, k, v, rg, causal=True, key_padding_mask=m, cu_seqlens=cu)
            out.append(((u, r), "bits", True, True, 0.0 if bits_equal(a, b) else 1.0))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_usp_mask_and_packed_match_fp64(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _usp_masked, seed)):
        for grid, layout, causal, packed, err in res:
            assert err < 5e-5, f"seed {seed}: W={world} rank {rank} grid {grid} {layout} " \
                               f"causal={causal} packed={packed}: err {err}"


def _usp_compiled(rank, world, seed):
    """USP under ``torch.compile(fullgraph=True)`` with a mask and packed sequences that change
    between calls (the zigzag layout, rope): one graph for all of a shape, the eager bits. One
    grid, (U, R) = (1, W): the ring receives the boundaries (each grid costs a Dynamo trace)."""
    res = []
    for u, r in [(1, world)]:
        torch._dynamo.reset()
        ug, rg = _grid(u, r)
        g = gen(seed + u)
        s_r, s = 8, 8 * world
        q, k, v = (rand(g, (1, s_r, 2 * u, 8), torch.float32) for _ in range(3))
        ang = torch.arange(s, dtype=torch.float32)[:, None] * torch.rand(1, 8, generator=g)
        rope = (ang.cos(), ang.sin())
        unit = 2 * r
        cus = [torch.tensor([0, unit, s], dtype=torch.int32),
               torch.tensor([0, s - unit, s], dtype=torch.int32)]
        masks = [torch.rand(1, s_r, generator=g) > 0.3 for _ in cus]
        mod = USPAttention(ulysses_group=ug, ring_group=rg, layout="zigzag",
                           backend="all_to_all", pipeline_groups=0)

        def fn(m, cu):
            return mod(q, k, v, causal=True, rope=rope, key_padding_mask=m, cu_seqlens=cu)

        want = [fn(m, cu) for m, cu in zip(masks, cus)]  # eager (the ring's plans made here)
        compiled, graphs = compile_counted(fn)
        got = [compiled(m, cu) for m, cu in zip(masks, cus)]
        res.append(((u, r), all(bits_equal(a, b) for a, b in zip(got, want)), graphs[0]))
    return res


def test_usp_compiles_with_mask_and_cu_seqlens(pools, seed):
    for rank, res in enumerate(pools.run(2, _usp_compiled, seed)):
        for grid, same, graphs in res:
            assert same and graphs == 1, \
                f"seed {seed}, rank {rank}, grid {grid}: eager bits {same}, graphs {graphs}"


def _usp_masked_uneven(rank, world, seed):
    """Head counts U does not divide and uneven S_r inside a Ulysses group, with a mask and
    packed sequences, sequential and pipelined."""
    out = []
    for u, r in _grids(world):
        ug, rg = _grid(u, r)
        # (layout, causal, Hq, Hkv, uneven S_r, pipeline_groups)
        for i, (layout, causal, hq, hkv, uneven, pg) in enumerate(
                [("contiguous", True, u + 1, 1, False, 0),
                 ("zigzag", False, 2 * u + 1, 2 * u + 1, False, 2),
                 ("contiguous", True, u + 1, 1, True, 2)]):
            g = gen(seed + 31 * i + u)
            unit = 2 * r if layout == "zigzag" else 1
            span = 4 * unit * u if layout == "zigzag" else 4 * u  # one Ulysses group's rows
            # uneven: the first rank of each Ulysses group one more row, the last one fewer
            seq = [span // u + uneven * (u > 1) * ((gr % u == 0) - (gr % u == u - 1))
                   for gr in range(world)]
            s = span * r
            lens = [unit, s - 3 * unit, 2 * unit] if layout == "zigzag" else [3, s - 5, 2]
            cu = torch.tensor([0, lens[0], lens[0] + lens[1], s], dtype=torch.int32)
            q, k, v = (rand(g, (2, s, h, 8)) for h in (hq, hkv, hkv))
            valid = torch.rand(2, s, generator=g) > 0.3
            valid[1] = False  # batch 1: no key anywhere
            ref = ref_attention_lse(q, k, v, causal, key_valid=valid, cu_seqlens=cu)[0]
            if uneven:
                lo = sum(seq[:rank])
                pos = torch.arange(lo, lo + seq[rank])
            else:
                pos = usp_positions(s, u, r, rank, layout, cu_seqlens=cu)
            mod = USPAttention(ulysses_group=ug, ring_group=rg, layout=layout,
                               backend="all_to_all", pipeline_groups=pg)
            res = mod(*(t[:, pos].float() for t in (q, k, v)), causal=causal,
                      seq_lens=seq if uneven else None, key_padding_mask=valid[:, pos],
                      cu_seqlens=cu)
            out.append(((u, r), (layout, causal, hq, hkv, seq, pg),
                        max_err(res, ref[:, pos]), bool(res.isnan().any())))
    return out


@pytest.mark.parametrize("world", [3, 4])
def test_usp_mask_with_uneven_heads_and_lengths_matches_fp64(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _usp_masked_uneven, seed)):
        for grid, case, err, nan in res:
            assert not nan and err < 5e-5, \
                f"seed {seed}: W={world} rank {rank} grid {grid} case {case}: err {err}"


def _usp_bad_mask(rank, world):
    ug, rg = _grid(2, 2)
    mod = USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all")
    q = torch.randn(1, 4, 4, 8)
    m = torch.ones(1, 4, dtype=torch.bool)
    # a mask on some ranks only: a signature a rank may have seen without one, so checked with
    # validate=True (the first-sight rule cannot see a rank repeating a seen signature)
    every = USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all", validate=True)
    return [expect_value_error(lambda: every(q, q, q,
                                             key_padding_mask=m if rank != 3 else None)),
            expect_value_error(lambda: mod(q, q, q, key_padding_mask=m[:, :2])),
            expect_value_error(lambda: mod(q, q, q, cu_seqlens=torch.tensor([0, 5, 16])))]


def test_usp_bad_mask_raises_on_every_rank_of_the_grid(pools):
    res = pools.run(4, _usp_bad_mask)
    for i, frag in enumerate(["invalid arguments", "key_padding_mask must be a bool tensor",
                              "cu_seqlens must be a 1-D int32 tensor"]):
        msgs = [r[i] for r in res]
        assert all(frag in m or "another rank" in m for m in msgs), (i, msgs)
