"""Ring attention: the layout table, the online merge (special values, torch and Triton paths),
the default attn_fn, and ``ring_attention`` on gloo CPU ranks against fp64 attention over the
whole sequence; bad inputs; a silent peer."""
from __future__ import annotations

import math
import random

import pytest
import torch
from _reference import ref_merge
from _ring_helpers import (SPECIALS, bits_equal, expect_value_error, gen, max_err, rand,
                           ref_attention_lse, special_blocks)

import attncomm
from attncomm.errors import PeerTimeoutError
from attncomm.ring import (RingAttention, attention_with_lse, positions, reference_attention,
                           ring_attention, zigzag_shard, zigzag_unshard)
from attncomm.ring import attn as ring_attn
from attncomm.ring.layout import ring_block
from attncomm.ring.merge import merge_block_torch, merge_block_triton, new_state


# ------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_shard_roundtrip(world):
    x = torch.arange(2 * 4 * world * 3).view(2, 4 * world, 3)
    shards = [zigzag_shard(x, world, r) for r in range(world)]
    assert torch.equal(zigzag_unshard(shards), x)
    c = 2  # 4W positions in 2W chunks
    for r in range(world):
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * world - 1 - r) * c,
                                                           (2 * world - r) * c))
        assert positions(4 * world, world, r, "zigzag").tolist() == want
        assert torch.equal(shards[r], x[:, want])
        assert positions(4 * world, world, r).tolist() == list(range(4 * r, 4 * r + 4))
    with pytest.raises(ValueError, match="does not split into 6 equal chunks"):
        zigzag_shard(torch.zeros(1, 8), 3, 0)
    with pytest.raises(ValueError, match=f"rank {world} is not in"):
        zigzag_shard(x, world, world)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("causal", [False, True])
def test_ring_blocks_cover_the_mask_exactly_once(layout, causal):
    # Every (query, key) pair the mask allows is attended by exactly one (rank, step) block,
    # no masked pair is, and no computed block is fully masked; zigzag causal: equal work per
    # rank at every step.
    for world in range(1, 6):
        s_r = 4
        s = world * s_r
        count = torch.zeros(s, s, dtype=torch.int64)
        for step in range(world):
            work = []
            for rank in range(world):
                src = (rank - step) % world
                blk = ring_block(layout, causal, world, rank, step, s_r)
                if blk is None:
                    work.append(0)
                    continue
                qp = positions(s, world, rank, layout)[blk.q_lo:blk.q_hi]
                kp = positions(s, world, src, layout)[blk.k_lo:blk.k_hi]
                pairs = torch.ones(len(qp), len(kp), dtype=torch.bool)
                if blk.causal:
                    pairs = torch.ones_like(pairs).tril()
                allowed = kp[None, :] <= qp[:, None] if causal else torch.ones_like(pairs)
                assert bool((pairs & allowed).any()), (world, rank, step, blk)
                count[qp[:, None].expand_as(pairs)[pairs], kp[None, :].expand_as(pairs)[pairs]] \
                    += 1
                work.append(int(pairs.sum()))
            if causal and layout == "zigzag" and step > 0:
                assert len(set(work)) == 1, (world, step, work)
        want = torch.ones(s, s, dtype=torch.int64)
        if causal:
            want = want.tril()
        assert torch.equal(count, want), (world, layout, causal)


# ------------------------------------------------------------------------------ merge
def _blocks(seed, b=2, s=5, h=3, dv=20):
    return special_blocks(seed, (b, s, h, dv))


def _merge_all(blocks, merge, b=2, s=5, h=3, dv=20):
    acc, acc_lse = new_state(b, s, h, dv, "cpu")
    for lo, hi, out, lse in blocks:
        merge(acc[:, lo:hi], acc_lse[:, lo:hi], out, lse)
    return acc, acc_lse


def _fp64_reference(blocks, b=2, s=5, h=3, dv=20):
    n = len(blocks)
    outs = torch.zeros(n, b, s, h, dv, dtype=torch.float64)
    lses = torch.full((n, b, s, h), float("-inf"), dtype=torch.float64)
    for i, (lo, hi, out, lse) in enumerate(blocks):
        outs[i, :, lo:hi] = out.double()
        lses[i, :, lo:hi] = lse.double()
    o, l = ref_merge(outs.view(n, b * s, h, dv), lses.view(n, b * s, h))
    return o.view(b, s, h, dv), l.view(b, s, h)


def test_merge_block_matches_fp64_with_special_values(seed):
    for case_seed in random.Random(seed).sample(range(1 << 30), 5):
        blocks = _blocks(case_seed)
        what = f"seed {seed} case {case_seed}"
        acc, acc_lse = _merge_all(blocks, merge_block_torch)
        ref, ref_lse = _fp64_reference(blocks)
        empty = torch.isneginf(ref_lse)
        assert bool(empty[0, 0, 0]), what
        assert torch.equal(acc[empty], torch.zeros_like(acc[empty])), what
        assert bool(torch.isneginf(acc_lse[empty]).all()), what
        assert not bool(acc.isnan().any()) and not bool(acc_lse.isnan().any()), what
        assert max_err(acc[~empty], ref[~empty]) < 1e-5, what
        assert max_err(acc_lse[~empty], ref_lse[~empty]) < 1e-5, what


# (b, s, h, dv): heads of 20 columns in 32-wide chunks; and 37 tokens of 128 columns, three
# token blocks of 16 rows per head, so the grid's (token block, head) split is exercised.
@pytest.mark.parametrize("shape", [(2, 5, 3, 20), (1, 37, 3, 128)])
def test_merge_block_triton_equals_torch_path(seed, shape):
    pytest.importorskip("triton")
    import os
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernel runs on CPU only under TRITON_INTERPRET=1")
    what = f"seed {seed} shape {shape}"
    blocks = _blocks(seed, *shape)
    a, al = _merge_all(blocks, merge_block_torch, *shape)
    t, tl_ = _merge_all(blocks, merge_block_triton, *shape)
    empty = torch.isneginf(al)
    assert torch.equal(torch.isneginf(tl_), empty), what
    assert torch.equal(t[empty], torch.zeros_like(t[empty])), what
    # the same fp32 operations; exp/log may differ by an ulp between numpy and torch
    assert max_err(t[~empty], a[~empty]) < 1e-6 * (1 + a[~empty].abs().max().item()), what
    assert max_err(tl_[~empty], al[~empty]) < 1e-5, what


# ------------------------------------------------------------------------------ attn_fn
def test_reference_attention_matches_fp64(seed):
    g = gen(seed)
    for hq, hkv, d, dv, causal in ((4, 4, 8, 8, False), (6, 2, 8, 5, True), (3, 1, 4, 4, True)):
        q, k, v = rand(g, (2, 7, hq, d)), rand(g, (2, 7, hkv, d)), rand(g, (2, 7, hkv, dv))
        out, lse = reference_attention(q.float(), k.float(), v.float(), causal)
        ref, ref_lse = ref_attention_lse(q, k, v, causal)
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert max_err(out, ref) < 1e-5 and max_err(lse, ref_lse) < 1e-5, f"seed {seed}"
        # the CPU default is this math, bit for bit
        o2, l2 = attention_with_lse(q.float(), k.float(), v.float(), causal)
        assert bits_equal(o2, out) and bits_equal(l2, lse) and ring_attn.last_kernel() == "math"
        # strides do not change the bits
        qt = q.float().transpose(1, 2).contiguous().transpose(1, 2)
        assert bits_equal(reference_attention(qt, k.float(), v.float(), causal)[0], out)
    # a −inf score weighs exactly 0; no key at all: out 0, lse −inf
    k = rand(g, (1, 4, 1, 4), torch.float32)
    k[0, 2, 0, 0] = float("-inf")
    q = torch.ones(1, 3, 1, 4)
    v = rand(g, (1, 4, 1, 3), torch.float32)
    keep = [0, 1, 3]
    out, lse = reference_attention(q, k, v, False)
    out2, lse2 = reference_attention(q, k[:, keep], v[:, keep], False)
    assert max_err(out, out2) < 1e-6 and max_err(lse, lse2) < 1e-6, f"seed {seed}"
    out, lse = reference_attention(q, k[:, :0], v[:, :0], False)
    assert torch.equal(out, torch.zeros(1, 3, 1, 3)) and bool(torch.isneginf(lse).all())
    with pytest.raises(ValueError, match="square block"):
        reference_attention(q, k, v, True)


# ------------------------------------------------------------------------------ on ranks
# (B, Hq, Hkv, D, Dv, S_r, causal, layout, dtype)
_CASES = [
    (1, 4, 4, 8, 8, 6, False, "contiguous", torch.float32),
    (2, 4, 4, 8, 8, 6, True, "contiguous", torch.float32),
    (2, 6, 2, 8, 5, 4, True, "zigzag", torch.float32),     # GQA, D ≠ Dv
    (1, 4, 1, 16, 16, 8, False, "zigzag", torch.float32),  # MQA
    (2, 3, 3, 8, 12, 6, True, "contiguous", torch.float32),
    (1, 4, 2, 8, 8, 6, True, "zigzag", torch.bfloat16),
    (1, 2, 2, 8, 8, 4, False, "contiguous", torch.float16),
]
_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}  # output rounding


def _ring_cases(rank, world, seed):
    results = []
    for i, (b, hq, hkv, d, dv, s_r, causal, layout, dtype) in enumerate(_CASES):
        g = gen(seed + i)
        s = s_r * world
        q, k, v = (rand(g, (b, s, h, dd)).to(dtype).double()
                   for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
        ref, ref_lse = ref_attention_lse(q, k, v, causal)
        pos = positions(s, world, rank, layout)
        local = [t[:, pos].to(dtype) for t in (q, k, v)]
        out, lse = ring_attention(*local, causal=causal, layout=layout, return_lse=True)
        with RingAttention(layout=layout) as mod:
            same = bits_equal(mod(*local, causal=causal), out)
        results.append((i, out.dtype == dtype and tuple(out.shape) == (b, s_r, hq, dv),
                        max_err(out, ref[:, pos]), max_err(lse, ref_lse[:, pos]), same))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_matches_fp64(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _ring_cases, seed)):
        for i, shape_ok, err, lse_err, same in res:
            dtype = _CASES[i][-1]
            where = f"seed {seed}, W={world}, rank {rank}, case {_CASES[i]}"
            assert shape_ok, where
            assert err < _TOL[dtype], f"{where}: out err {err}"
            assert lse_err < 1e-4, f"{where}: lse err {lse_err}"
            assert same, f"{where}: RingAttention ≠ ring_attention"


_PAD = 1000.0  # a key whose first feature is exactly this is padding


def _masking_attn(step_specials):
    """An attn_fn that masks padding keys; a row without a valid key gets a NaN payload and a
    special LSE (−inf, +inf, NaN in turn): an empty block as FlashAttention and others
    report it."""
    calls = [0]

    def attn_fn(q, k, v, causal):
        valid = k[:, :, 0, 0] != _PAD  # [B, Sk]
        qf, kf, vf = (t.double() for t in (q, k, v))
        rep = q.shape[2] // k.shape[2]
        kf, vf = kf.repeat_interleave(rep, 2), vf.repeat_interleave(rep, 2)
        sc = torch.einsum("bshd,bthd->bhst", qf, kf) / math.sqrt(q.shape[3])
        mask = ~valid[:, None, None, :]
        if causal:
            mask = mask | torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        sc = sc.masked_fill(mask, -math.inf)
        lse = torch.logsumexp(sc, -1)
        p = torch.exp(sc - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
        out = torch.einsum("bhst,bthd->bshd", p, vf).float()
        lse = lse.transpose(1, 2).float()
        empty = torch.isneginf(lse)
        special = step_specials[calls[0] % len(step_specials)]
        calls[0] += 1
        lse = torch.where(empty, torch.full_like(lse, special), lse)
        out = torch.where(empty[..., None], torch.full_like(out, float("nan")), out)
        return out, lse

    return attn_fn


def _all_masked_block(rank, world, seed):
    g = gen(seed)
    s_r, b, h, d = 4, 1, 2, 8
    s = s_r * world
    res = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            q, k, v = (rand(g, (b, s, h, d)).float().double() for _ in range(3))
            valid = torch.ones(b, s, dtype=torch.bool)
            valid[:, positions(s, world, 1, layout)] = False  # rank 1's whole block: padding
            valid[:, :2] = False  # the first two positions too: causal rows 0, 1 see nothing
            k[~valid] = 0.0
            k[..., 0][~valid[:, :, None].expand(b, s, h)] = _PAD
            ref, ref_lse = ref_attention_lse(q, k, v, causal, key_valid=valid)
            pos = positions(s, world, rank, layout)
            out, lse = ring_attention(*(t[:, pos].float() for t in (q, k, v)), causal=causal,
                                      layout=layout, return_lse=True,
                                      attn_fn=_masking_attn(SPECIALS))
            empty = torch.isneginf(ref_lse[:, pos])
            res.append((layout, causal, int(empty.sum()),
                        bool((out[empty] == 0).all()) and bool(torch.isneginf(lse[empty]).all()),
                        not bool(out.isnan().any()) and not bool(lse.isnan().any()),
                        max_err(out[~empty], ref[:, pos][~empty]),
                        max_err(lse[~empty], ref_lse[:, pos][~empty])))
    return res


@pytest.mark.parametrize("world", [3])
def test_all_masked_block_is_an_empty_shard(pools, world, seed):
    total_empty = 0
    for rank, res in enumerate(pools.run(world, _all_masked_block, seed)):
        for layout, causal, n_empty, zero, finite, err, lse_err in res:
            where = f"seed {seed}, rank {rank}, {layout}, causal={causal}"
            total_empty += n_empty
            assert zero, f"{where}: an empty row is not exactly 0 / −inf"
            assert finite, f"{where}: NaN leaked"
            assert err < 2e-5 and lse_err < 1e-4, f"{where}: err {err} {lse_err}"
    assert total_empty > 0, f"seed {seed}: no row was empty everywhere (the case tests nothing)"


# ------------------------------------------------------------------------------ bad inputs
def _bad_inputs(rank, world):
    out = {}
    q = torch.randn(1, 4, 4, 8)
    kv = torch.randn(1, 4, 2, 8)

    def case(name, fn, fragment, same=True):
        out[name] = (expect_value_error(fn), fragment, same)

    qs = torch.randn(1, 4 + (rank == world - 1) * 2, 4, 8)
    ks = torch.randn(1, qs.shape[1], 2, 8)
    case("S_r across ranks", lambda: ring_attention(qs, ks, ks),
         "S_r = " + ", ".join(f"{6 if r == world - 1 else 4} (rank {r})" for r in range(world)))
    q3 = torch.randn(1, 3, 4, 8)
    k3 = torch.randn(1, 3, 2, 8)
    case("zigzag odd S_r", lambda: ring_attention(q3, k3, k3, layout="zigzag"),
         "layout='zigzag' needs an even S_r (two chunks per rank), got S_r = 3")
    case("unknown layout", lambda: ring_attention(q, kv, kv, layout="stripe"),
         "layout must be one of ['contiguous', 'zigzag'], got 'stripe'")
    case("not 4-D", lambda: ring_attention(q[0], kv, kv),
         "q, k, v must be 4-D tensors [B, S_r, H, D], got q [4, 4, 8]")
    case("Hq % Hkv", lambda: ring_attention(torch.randn(1, 4, 3, 8), kv, kv),
         "Hq % Hkv != 0: Hq = 3, Hkv = 2")
    case("dtype mix", lambda: ring_attention(q, kv.half(), kv),
         "q, k, v must share one dtype among fp16/bf16/fp32")
    case("int dtype", lambda: ring_attention(*(torch.ones(1, 4, 2, 8, dtype=torch.int32),) * 3),
         "q, k, v must share one dtype among fp16/bf16/fp32")
    case("k D", lambda: ring_attention(q, torch.randn(1, 4, 2, 6), kv),
         "q has D = 8 but k has D = 6")
    case("v heads", lambda: ring_attention(q, kv, torch.randn(1, 4, 1, 8)),
         "need the same B and S_r; k and v the same Hkv")
    case("local check, validate off",
         lambda: ring_attention(q, kv, kv, layout="nope", validate=False),
         f"rank {rank}: layout must be one of", same=False)
    case("causal across ranks", lambda: ring_attention(q, kv, kv, causal=rank == 0),
         "causal = 1 (rank 0)")
    case("module layout on one rank",
         lambda: RingAttention(layout="zigzag" if rank == 0 else "bad"),
         "layout must be one of ['contiguous', 'zigzag'], got 'bad'")
    case("attn_fn result", lambda: ring_attention(q, kv, kv, attn_fn=lambda *a: (a[0], None)),
         "attn_fn must return (out [1, 4, 4, 8], lse [1, 4, 4])", same=False)
    # the group still works afterwards
    out["_after"] = ring_attention(torch.ones(1, 2, 1, 2), torch.ones(1, 2, 1, 2),
                                   torch.full((1, 2, 1, 2), float(rank))).flatten().tolist()
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
            assert fragment in msg, (key, r, msg)
        if same:
            assert len(set(msgs)) == 1, (key, msgs)
    mean = sum(range(world)) / world
    for r in range(world):
        assert results[r]["_after"] == pytest.approx([mean] * 4)


# ------------------------------------------------------------------------------ silent peer
def _silent_peer(rank, world, timeout_s):
    import time
    x = torch.randn(1, 2, 1, 4)
    ring_attention(x, x, x, timeout_s=timeout_s)  # warm: gloo pairs connected
    if rank == world - 1:
        time.sleep(timeout_s + 3)
        return ("skipped", None, 0.0)
    t0 = time.monotonic()
    try:
        ring_attention(x, x, x, validate=False, timeout_s=timeout_s)
    except PeerTimeoutError as exc:
        return ("PeerTimeoutError", exc.peer_ranks, time.monotonic() - t0, str(exc))
    return ("returned", None, time.monotonic() - t0)


@pytest.mark.slow
def test_silent_peer_is_named_by_its_ring_neighbours():
    # W = 3, rank 2 skips the call: rank 1 (whose send to rank 2 is never received) and rank 0
    # (waiting for rank 2's block) both name rank 2, within the budget.
    timeout_s = 2.0
    res = attncomm.launch(_silent_peer, 3, args=(timeout_s,), timeout_s=120)
    for rank in (0, 1):
        kind, peers, elapsed = res[rank][:3]
        assert kind == "PeerTimeoutError", res[rank]
        assert peers == [2], res[rank]
        assert elapsed < timeout_s + 5, res[rank]
        assert "ring_attention step 0: K/V" in res[rank][3], res[rank]
