"""Key-padding masks and packed sequences (``cu_seqlens``) through ring attention, against the
fp64 reference of the whole masked / packed attention; the cases of ring-flash-attention's
varlen and zigzag varlen tests (packed sequences of uneven lengths, causal, the LSE compared),
plus a sequence shorter than a shard, one spanning every rank, and rows masked everywhere."""
from __future__ import annotations

import pytest
import torch

from attncomm.ring import RingAttention, positions, ring_attention, zigzag_shard, zigzag_unshard
from attncomm.ring.layout import ring_segments

from _ring_helpers import (assert_same_error_everywhere, bits_equal, compile_counted,
                           expect_value_error, gen, max_err, rand, ref_attention_lse)


def _lens_to_cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _packing(world: int, layout: str):
    """Uneven packings of ``S = W·S_r`` positions: a sequence shorter than a shard, one
    spanning every rank, an empty one."""
    unit = 2 * world if layout == "zigzag" else 1
    s_r = 4 * unit // world * 2 if layout == "zigzag" else 6
    s = s_r * world
    if layout == "zigzag":
        lens = [unit, s - 3 * unit, 0, 2 * unit]
    else:
        lens = [2, s - 5, 3] if world > 1 else [2, 4]
    return s_r, lens


@pytest.mark.parametrize("world", [4])
def test_zigzag_shard_with_cu_seqlens_roundtrip(world):
    lens = [2 * world, 0, 6 * world, 4 * world]
    cu = _lens_to_cu(lens)
    x = torch.arange(sum(lens))
    shards = [zigzag_shard(x, world, r, dim=0, cu_seqlens=cu) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards, dim=0, cu_seqlens=cu), x)
    for r in range(world):  # each sequence on its own: chunks r and 2W−1−r of every sequence
        want = torch.cat([zigzag_shard(x[a:b], world, r, dim=0)
                          for a, b in zip(cu.tolist(), cu.tolist()[1:]) if b > a])
        assert torch.equal(shards[r], want)
        assert torch.equal(positions(len(x), world, r, "zigzag", cu_seqlens=cu), want)
    with pytest.raises(ValueError, match="divisible by 2W = 8"):
        zigzag_shard(x, world, 0, dim=0, cu_seqlens=_lens_to_cu([4, sum(lens) - 4]))


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_segments_cover_the_packed_mask_exactly_once(layout, causal):
    world = 3
    s_r, lens = _packing(world, layout)
    cu = _lens_to_cu(lens)
    s = s_r * world
    ids = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    want = ids[:, None] == ids[None, :]
    if causal:
        want &= torch.ones(s, s, dtype=torch.bool).tril()
    seen = torch.zeros(s, s, dtype=torch.int64)
    for r in range(world):
        qpos = positions(s, world, r, layout, cu_seqlens=cu)
        for step in range(world):
            src = (r - step) % world
            kpos = positions(s, world, src, layout, cu_seqlens=cu)
            for q_lo, q_hi, k_lo, k_hi, c in ring_segments(layout, causal, world, r, step, s_r,
                                                           tuple(cu.tolist())):
                for i in range(q_lo, q_hi):
                    for j in range(k_lo, k_hi):
                        if not c or j - k_lo <= i - q_lo:
                            seen[qpos[i], kpos[j]] += 1
    assert torch.equal(seen, want.long()), (layout, causal)


# ------------------------------------------------------------------------------ on ranks
def _cases(world):
    # (B, Hq, Hkv, D, Dv, causal, layout, mask kind, packed)
    out = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            out.append((2, 4, 2, 8, 6, causal, layout, "random", False))
            out.append((1, 2, 1, 8, 8, causal, layout, None, True))
            out.append((2, 4, 2, 8, 8, causal, layout, "random", True))
    out.append((1, 2, 2, 8, 8, False, "contiguous", "rank1", False))  # a whole block masked
    return out


def _mask(kind, g, b, s, world, layout, s_r):
    if kind is None:
        return None
    m = torch.rand(b, s, generator=g) > 0.3
    m[:, 0] = False  # causal row 0 has no key at all
    if b > 1:
        m[1] = False  # every row of batch 1 masked
    if kind == "rank1" and world > 1:
        m[:, positions(s, world, 1, layout)] = False
    return m


def _ring_masked(rank, world, seed):
    res = []
    for i, (b, hq, hkv, d, dv, causal, layout, kind, packed) in enumerate(_cases(world)):
        g = gen(seed + i)
        s_r, lens = _packing(world, layout)
        s = s_r * world
        cu = _lens_to_cu(lens) if packed else None
        q, k, v = (rand(g, (b, s, h, dd)).float().double()
                   for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
        valid = _mask(kind, g, b, s, world, layout, s_r)
        ref, ref_lse = ref_attention_lse(q, k, v, causal, key_valid=valid, cu_seqlens=cu)
        pos = positions(s, world, rank, layout, cu_seqlens=cu)
        local = [t[:, pos].float() for t in (q, k, v)]
        mask = None if valid is None else valid[:, pos]
        out = torch.full((1,), float("nan"))
        out, lse = ring_attention(*local, causal=causal, layout=layout, return_lse=True,
                                  key_padding_mask=mask, cu_seqlens=cu)
        empty = torch.isneginf(ref_lse[:, pos])
        with RingAttention(layout=layout) as mod:
            same = bits_equal(mod(*local, causal=causal, key_padding_mask=mask, cu_seqlens=cu),
                              out)
        res.append((i, int(empty.sum()),
                    bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()),
                    max_err(out[~empty], ref[:, pos][~empty]),
                    max_err(lse[~empty], ref_lse[:, pos][~empty]), same))
    # bitwise: a mask of all True is no mask; one packed sequence is the dense call
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            g = gen(seed + 100)
            s_r = 4
            q, k, v = (rand(g, (1, s_r, 2, 8), torch.float32) for _ in range(3))
            dense, dense_lse = ring_attention(q, k, v, causal=causal, layout=layout,
                                              return_lse=True)
            ones = torch.ones(1, s_r, dtype=torch.bool)
            om, oml = ring_attention(q, k, v, causal=causal, layout=layout, return_lse=True,
                                     key_padding_mask=ones)
            one = torch.tensor([0, s_r * world], dtype=torch.int32)
            op_, opl = ring_attention(q, k, v, causal=causal, layout=layout, return_lse=True,
                                      cu_seqlens=one)
            res.append((f"bits {layout} causal={causal}",
                        bits_equal(om, dense) and bits_equal(oml, dense_lse),
                        bits_equal(op_, dense) and bits_equal(opl, dense_lse)))
    return res


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_mask_and_packed_match_fp64(pools, world, seed):
    n_empty = 0
    for rank, res in enumerate(pools.run(world, _ring_masked, seed)):
        cases = _cases(world)
        for r in res:
            if isinstance(r[0], str):
                assert r[1], f"seed {seed}, W={world}, rank {rank}: {r[0]}: mask of all True"
                assert r[2], f"seed {seed}, W={world}, rank {rank}: {r[0]}: one sequence"
                continue
            i, empty, zero, err, lse_err, same = r
            where = f"seed {seed}, W={world}, rank {rank}, case {cases[i]}"
            n_empty += empty
            assert zero, f"{where}: an empty row is not exactly 0 / −inf"
            assert err < 2e-5 and lse_err < 1e-4, f"{where}: err {err} {lse_err}"
            assert same, f"{where}: RingAttention ≠ ring_attention"
    assert n_empty > 0, f"seed {seed}: no empty row (the cases test nothing)"


def _ring_bf16(rank, world, seed):
    """bf16 q/k/v with a mask and packed sequences: fp32 math and merge, rounded once."""
    res = []
    for i, (layout, causal) in enumerate([(lo, c) for lo in ("contiguous", "zigzag")
                                          for c in (False, True)]):
        g = gen(seed + i)
        s_r, lens = _packing(world, layout)
        s = s_r * world
        cu = _lens_to_cu(lens)
        q, k, v = (rand(g, (2, s, h, 8), torch.bfloat16) for h in (4, 2, 2))
        valid = _mask("random", g, 2, s, world, layout, s_r)
        ref, ref_lse = ref_attention_lse(q, k, v, causal, key_valid=valid, cu_seqlens=cu)
        pos = positions(s, world, rank, layout, cu_seqlens=cu)
        out, lse = ring_attention(*(t[:, pos] for t in (q, k, v)), causal=causal, layout=layout,
                                  return_lse=True, key_padding_mask=valid[:, pos],
                                  cu_seqlens=cu)
        ref, ref_lse = ref[:, pos], ref_lse[:, pos]
        empty = torch.isneginf(ref_lse)
        # one rounding to bf16 (half an ulp, 2⁻⁹ relative) over the fp32 arithmetic's error
        excess = ((out.double() - ref).abs() - 2.0 ** -8 * ref.abs()).max().item()
        res.append(((layout, causal), out.dtype, lse.dtype,
                    bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()),
                    excess, max_err(lse[~empty], ref_lse[~empty])))
    return res


def test_ring_bf16_mask_and_packed_match_fp64(pools, seed):
    world = 2
    for rank, res in enumerate(pools.run(world, _ring_bf16, seed)):
        for case, dtype, lse_dtype, zero, excess, lse_err in res:
            where = f"seed {seed}, W={world}, rank {rank}, (layout, causal) {case}"
            assert dtype == torch.bfloat16 and lse_dtype == torch.float32, where
            assert zero, f"{where}: an empty row is not exactly 0 / −inf"
            assert excess < 1e-5 and lse_err < 1e-4, f"{where}: excess {excess}, lse {lse_err}"


# ------------------------------------------------------------------------------ user attn_fn
def _user_fn(rank, world):
    seen = []

    def attn_fn(q, k, v, causal, *, segments=None, key_padding_mask=None):
        seen.append((tuple(tuple(x) for x in segments), key_padding_mask is not None))
        from attncomm.ring import attention_with_lse
        return attention_with_lse(q, k, v, causal, segments=segments,
                                  key_padding_mask=key_padding_mask)

    s_r = 4
    cu = torch.tensor([0, 2, 4 * world], dtype=torch.int32)
    x = torch.ones(1, s_r, 1, 4)
    ring_attention(x, x, x, causal=True, attn_fn=attn_fn, cu_seqlens=cu,
                   key_padding_mask=torch.ones(1, s_r, dtype=torch.bool))
    return seen


def test_user_attn_fn_gets_segments(pools):
    res = pools.run(2, _user_fn)
    # rank 0: its own block, causal: sequence 0 rows [0, 2) and sequence 1 rows [2, 4)
    assert res[0] == [(((0, 2, 0, 2, True), (2, 4, 2, 4, True)), True)], res[0]
    # rank 1: its own block (sequence 1 only), then rank 0's block: rows of sequence 1 see
    # rank 0's keys [2, 4)
    assert res[1] == [(((0, 4, 0, 4, True),), True), (((0, 4, 2, 4, False),), True)], res[1]


# ------------------------------------------------------------------------------ torch.compile
def _ring_compiled(rank, world, seed):
    """``RingAttention`` and ``ring_attention`` under ``torch.compile(fullgraph=True)``, causal,
    with a mask and packed sequences that change between calls: one graph per function for all
    of a shape, the eager bits (out and LSE). The compiled calls come first, so boundaries no
    eager call planned are planned when the graph runs."""
    res = []
    for layout in ("contiguous", "zigzag"):
        torch._dynamo.reset()
        g = gen(seed + len(layout))
        s_r, unit = 8, 2 * world
        s = s_r * world
        q, k, v = (rand(g, (1, s_r, 2, 8), torch.float32) for _ in range(3))
        cus = [torch.tensor([0, unit, s], dtype=torch.int32),
               torch.tensor([0, s - unit, s], dtype=torch.int32)]
        masks = [torch.rand(1, s_r, generator=g) > 0.3 for _ in cus]
        mod = RingAttention(layout=layout)

        def module_fn(m, cu):
            return mod(q, k, v, causal=True, return_lse=True, key_padding_mask=m, cu_seqlens=cu)

        def functional_fn(m, cu):
            return ring_attention(q, k, v, causal=True, layout=layout, return_lse=True,
                                  key_padding_mask=m, cu_seqlens=cu)

        runs = {}
        for name, fn in (("RingAttention", module_fn), ("ring_attention", functional_fn)):
            compiled, graphs = compile_counted(fn)
            runs[name] = compiled
            got = [compiled(m, cu) for m, cu in zip(masks, cus)]
            want = [fn(m, cu) for m, cu in zip(masks, cus)]
            same = all(bits_equal(a, b) for pair_got, pair_want in zip(got, want)
                       for a, b in zip(pair_got, pair_want))
            res.append((layout, name, same, graphs[0]))
        mod.close()  # the compiled graph's op finds the module closed when it runs
        closed = expect_value_error(lambda: runs["RingAttention"](masks[0], cus[0]))
        res.append((layout, "closed module", "WRONG RuntimeError: RingAttention: this object "
                    "is closed" in closed, 1))
    return res


def test_ring_compiles_with_mask_and_cu_seqlens(pools, seed):
    for rank, res in enumerate(pools.run(2, _ring_compiled, seed)):
        for layout, name, same, graphs in res:
            assert same and graphs == 1, \
                f"seed {seed}, rank {rank}, {name} {layout}: eager bits {same}, graphs {graphs}"


# ------------------------------------------------------------------------------ bad inputs
def _bad(rank, world):
    q = torch.randn(1, 4, 2, 8)
    m = torch.ones(1, 4, dtype=torch.bool)
    cu = torch.tensor([0, 3, 4 * world], dtype=torch.int32)
    out = {}

    def case(name, fn, fragment):
        out[name] = (expect_value_error(fn), fragment)

    case("mask dtype", lambda: ring_attention(q, q, q, key_padding_mask=m.float()),
         "key_padding_mask must be a bool tensor [B, S_r] = [1, 4]")
    case("mask shape", lambda: ring_attention(q, q, q, key_padding_mask=m[:, :3]),
         "key_padding_mask must be a bool tensor [B, S_r] = [1, 4]")
    case("mask on one rank",
         lambda: ring_attention(q, q, q, key_padding_mask=m if rank == 0 else None,
                                validate=True),
         "key_padding_mask given = 1 (rank 0)")
    case("cu dtype", lambda: ring_attention(q, q, q, cu_seqlens=cu.long()),
         "cu_seqlens must be a 1-D int32 tensor")
    case("cu end", lambda: ring_attention(q, q, q, cu_seqlens=cu[:2]),
         "cu_seqlens must start at 0 and end at S = W·S_r")
    case("cu zigzag", lambda: ring_attention(q, q, q, layout="zigzag", cu_seqlens=cu),
         "divisible by 2W")
    case("cu differs", lambda: ring_attention(
        q, q, q, cu_seqlens=torch.tensor([0, 2 + rank, 4 * world], dtype=torch.int32)),
        "cu_seqlens (CRC-32)")
    return out


def test_bad_mask_and_cu_seqlens_raise_on_every_rank(pools):
    assert_same_error_everywhere(pools.run(2, _bad))


@pytest.mark.parametrize("causal", [False, True])
def test_one_segment_over_the_block_is_the_dense_call(causal, seed):
    """``attention_with_lse`` with one segment that spans the whole block gives the dense
    call's bits (it is the dense call), with and without a key-padding mask."""
    from attncomm.ring import attention_with_lse
    from attncomm.ring.layout import Segment
    g = gen(seed)
    q, k, v = (rand(g, (2, 12, h, 8), torch.bfloat16) for h in (4, 2, 2))
    mask = torch.rand(2, 12, generator=g) > 0.3
    for kw in ({}, {"key_padding_mask": mask}):
        dense = attention_with_lse(q, k, v, causal, **kw)
        one = attention_with_lse(q, k, v, False, segments=[Segment(0, 12, 0, 12, causal)], **kw)
        assert bits_equal(dense[0], one[0]) and bits_equal(dense[1], one[1]), \
            f"seed {seed}, causal={causal}, mask={bool(kw)}"


# ------------------------------------------------------------------------------ masks as varlen
def _masks(g, b, sk):
    """Key-padding masks ``[b, sk]``: random holes, then row 0 all True, row 1 all False, row 2
    padded at the end (as many rows of these as ``b`` has)."""
    m = torch.rand(b, sk, generator=g) > 0.4
    for i, row in enumerate((torch.ones(sk), torch.zeros(sk),
                             torch.arange(sk) < sk // 3)[:b]):
        m[i] = row.bool()
    return m


def test_compact_keys_puts_each_rows_attended_keys_first_in_order(seed):
    """``compact_keys``: a permutation of the flattened keys; row b's attended keys, in their
    own order, at ``[cu_k[b], cu_k[b+1])``; the masked keys after ``cu_k[B]``."""
    from attncomm.ring.attn import compact_keys
    g = gen(seed)
    for b, sk in ((1, 1), (4, 9), (3, 16)):
        m = _masks(g, b, sk)
        order, cu = compact_keys(m)
        where = f"seed {seed}, mask {m.int().tolist()}"
        assert order.dtype == torch.int64 and cu.dtype == torch.int32, where
        assert torch.equal(order.sort()[0], torch.arange(b * sk)), where
        flat = torch.arange(b * sk).view(b, sk)
        want = [0] + torch.cumsum(m.sum(1), 0).tolist()
        assert cu.tolist() == want, where
        for i in range(b):
            assert torch.equal(order[want[i]:want[i + 1]], flat[i][m[i]]), f"{where}, row {i}"
        assert bool((~m.view(-1)[order[want[-1]:]]).all()), where


def _emulated_varlen(qf, kf, vf, cu_q, cu_k, max_q, max_k):
    """The varlen kernels' contract on CPU (fp32 math per batch entry), with what they leave in
    an entry without keys: a NaN output and LSE +inf (which ``masked_varlen`` must clear)."""
    from attncomm.ring import reference_attention
    out = torch.full((qf.shape[0], qf.shape[1], vf.shape[2]), float("nan"), dtype=qf.dtype)
    lse = torch.full(qf.shape[:2], float("inf"))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    assert max(y - x for x, y in zip(cq, cq[1:])) <= max_q
    assert max(y - x for x, y in zip(ck, ck[1:])) <= max_k
    for i in range(len(cq) - 1):
        if ck[i + 1] > ck[i]:
            o, l_ = reference_attention(qf[None, cq[i]:cq[i + 1]], kf[None, ck[i]:ck[i + 1]],
                                        vf[None, ck[i]:ck[i + 1]], False)
            out[cq[i]:cq[i + 1]], lse[cq[i]:cq[i + 1]] = o[0].to(qf.dtype), l_[0]
    return out, lse


@pytest.mark.parametrize("hkv", [4, 2], ids=["MHA", "GQA"])
def test_masked_varlen_packing_matches_fp64(hkv, seed):
    """The packing and the result of ``masked_varlen`` (the CUDA path of a masked block), its
    kernel emulated on CPU: against fp64 of the masked attention, B = 4 with an all-True row,
    a row with no attended key (0, LSE −inf), end padding and random holes, Sq ≠ Sk, GQA."""
    from attncomm.ring import attn as ring_attn
    g = gen(seed)
    b, sq, sk, hq, d = 4, 5, 11, 4, 8
    q = rand(g, (b, sq, hq, d), torch.bfloat16)
    k, v = (rand(g, (b, sk, hkv, d), torch.bfloat16) for _ in range(2))
    m = _masks(g, b, sk)
    out, lse = ring_attn._masked_varlen(q, k, v, m, "emulated", _emulated_varlen)
    assert ring_attn.last_kernel() == "emulated"
    ref, ref_lse = ref_attention_lse(q, k, v, False, key_valid=m)
    where = f"seed {seed}, Hkv {hkv}, mask {m.int().tolist()}"
    assert out.shape == (b, sq, hq, d) and out.dtype == torch.bfloat16, where
    assert bits_equal(out[1], torch.zeros_like(out[1])), f"{where}: row without keys not 0"
    assert bool(torch.isneginf(lse[1]).all()), f"{where}: row without keys not LSE -inf"
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), live), where
    assert max_err(out, ref) < 2e-2, f"{where}: out err {max_err(out, ref)}"
    assert max_err(lse[live], ref_lse[live]) < 1e-5, f"{where}: lse err"


def test_masked_varlen_is_cuda_only():
    """On CPU the masked block keeps its fp32 math path (``masked_varlen`` declines), so a
    mask of all True still gives the unmasked bits there."""
    from attncomm.ring import attn as ring_attn
    q, k, v = (torch.randn(1, 4, 2, 8, dtype=torch.bfloat16) for _ in range(3))
    assert ring_attn.masked_varlen(q, k, v, torch.ones(1, 4, dtype=torch.bool)) is None
