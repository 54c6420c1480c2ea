"""UlyssesAttention with key-padding masks on gloo CPU ranks: against the fp64 attention of the
whole masked sequence (uneven sequences, GQA, causal, rows with no key at all), joint rows with
their own mask (a DiT's padded text tokens, front and back), one compiled graph for every mask
of a shape, a mask of all True giving the unmasked bits, and bad masks raised on every rank
alike."""
from __future__ import annotations

import pytest
import torch

from attncomm.ulysses import UlyssesAttention

from _ring_helpers import (assert_same_error_everywhere, bits_equal, compile_counted,
                           expect_value_error, gen, max_err, rand, ref_attention_lse)


def _shard(t, lens, rank):
    lo = sum(lens[:rank])
    return t[:, lo:lo + lens[rank]]


def _mask(g, b, s):
    m = torch.rand(b, s, generator=g) > 0.3
    m[:, 0] = False
    if b > 1:
        m[1] = False  # batch 1: no key anywhere
    return m


def _cat(joint, seq, position):
    return torch.cat([joint, seq] if position == "front" else [seq, joint], dim=1)


def _parts(out):
    return out if isinstance(out, tuple) else (out,)


def _joint_mask(kind, g, b, s_j):
    if kind is None:
        return None
    if kind == "random":
        return torch.rand(b, s_j, generator=g) > 0.4
    # "holes": a padded prompt with masked tokens inside it too (keys 1, 3 and 5 onwards)
    m = torch.ones(b, s_j, dtype=torch.bool)
    m[:, 1] = m[:, 3] = False
    m[:, 5:] = False
    return m


def _ulysses_masked(rank, world, seed):
    res = []
    lens = [3 + (r % 2) for r in range(world)]  # uneven S_r
    s = sum(lens)
    # (B, Hq, Hkv, causal, S_j (-1: no joint), position, joint mask, pipeline_groups); the last
    # two rows have head counts W does not divide (every rank a different head count)
    cases = [(2, 2 * world, world, False, -1, "front", None, 0),
             (2, 2 * world, 1, True, -1, "front", None, 0),
             (2, 2 * world, world, False, 3, "front", "random", 0),
             (1, world, world, False, 4, "back", "random", 0),
             (2, 2 * world, world, False, 3, "back", None, 0),
             (2, 2 * world + 1, 1, True, -1, "front", None, 2),
             (2, world + 1, world + 1, False, 7, "front", "holes", 2)]
    for i, (b, hq, hkv, causal, s_j, position, jkind, pg) in enumerate(cases):
        g = gen(seed + i)
        q, k, v = (rand(g, (b, s, h, 8)).float() for h in (hq, hkv, hkv))
        mask = _mask(g, b, s)
        local = [_shard(t, lens, rank) for t in (q, k, v)]
        kw = dict(seq_lens=lens, causal=causal, key_padding_mask=_shard(mask, lens, rank))
        mods = [UlyssesAttention(pipeline_groups=p) for p in sorted({0, pg})]
        if s_j < 0:
            ref, _ = ref_attention_lse(q, k, v, causal, key_valid=mask)
            outs = [mod(*local, **kw) for mod in mods]
            want = _shard(ref, lens, rank)
            jerr = 0.0
        else:
            joint = tuple(rand(g, (b, s_j, h, 8)).float() for h in (hq, hkv, hkv))
            jmask = _joint_mask(jkind, g, b, s_j)
            jvalid = torch.ones(b, s_j, dtype=torch.bool) if jmask is None else jmask
            ref, _ = ref_attention_lse(*(_cat(j, t, position) for j, t in zip(joint, (q, k, v))),
                                       False, key_valid=_cat(jvalid, mask, position))
            outs = [mod(*local, joint=joint, joint_position=position,
                        joint_key_padding_mask=jmask, **kw) for mod in mods]
            ref_seq = ref[:, s_j:] if position == "front" else ref[:, :s]
            ref_j = ref[:, :s_j] if position == "front" else ref[:, s:]
            want = _shard(ref_seq, lens, rank)
            jerr = max_err(outs[0][1], ref_j)
        outs = [_parts(o) for o in outs]
        out = outs[0][0]
        # pipelined head groups give the sequential bits (the joint rows' output too)
        same = all(bits_equal(a, c) for a, c in zip(outs[-1], outs[0]))
        same = same and mods[-1].last_pipeline_groups == max(pg, 1)
        res.append((i, max_err(out, want), jerr, not bool(out.isnan().any()), same))
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_mask_matches_fp64(pools, world, seed):
    for rank, res in enumerate(pools.run(world, _ulysses_masked, seed)):
        for i, err, jerr, finite, same in res:
            where = f"seed {seed}, W={world}, rank {rank}, case {i}"
            assert finite, f"{where}: NaN (a row with no key must be 0)"
            assert err < 1e-5 and jerr < 1e-5, f"{where}: err {err}, joint err {jerr}"
            assert same, f"{where}: pipelined ≠ sequential (or not pipelined)"


def _compiled(rank, world, seed):
    torch._dynamo.reset()
    g = gen(seed)
    q, k, v = (rand(g, (1, 4, 2 * world, 8)).float() for _ in range(3))
    joint = tuple(rand(g, (1, 3, 2 * world, 8)).float() for _ in range(3))
    # (sequence mask, joint mask) pairs; the joint rows with their own mask are the
    # ulysses_attention_joint op, which must also take every mask of a shape in one graph
    masks = [torch.rand(1, 4, generator=g) > 0.5 for _ in range(2)]
    jmasks = [_joint_mask("random", g, 1, 3) for _ in range(2)]
    mod = UlyssesAttention(pipeline_groups=0)

    def dense(m, jm):
        return mod(q, k, v, key_padding_mask=m)

    def with_joint(m, jm):
        return mod(q, k, v, key_padding_mask=m, joint=joint, joint_key_padding_mask=jm)

    res = []
    for fn in (dense, with_joint):
        want = [fn(m, jm) for m, jm in zip(masks, jmasks)]  # the eager warm-up
        compiled, graphs = compile_counted(fn)
        got = [compiled(m, jm) for m, jm in zip(masks, jmasks)]
        same = all(bits_equal(x, y) for a, b in zip(got, want)
                   for x, y in zip(_parts(a), _parts(b)))
        res.append((fn.__name__, same, graphs[0]))
    return res


def test_mask_compiles_once_per_shape(pools, seed):
    for rank, res in enumerate(pools.run(2, _compiled, seed)):
        for name, same, graphs in res:
            assert same and graphs == 1, \
                f"seed {seed}, rank {rank}, {name}: same {same}, graphs {graphs}"


def _bad(rank, world):
    q = torch.randn(1, 4, 2 * world, 8)
    m = torch.ones(1, 4, dtype=torch.bool)
    joint = tuple(torch.randn(1, 2, 2 * world, 8) for _ in range(3))
    out = {}
    for name, kw, frag in [
            ("dtype", dict(key_padding_mask=m.int()), "key_padding_mask must be a bool tensor"),
            ("shape", dict(key_padding_mask=m[:, :2]), "[B, S_r] = [1, 4]"),
            ("one rank", dict(key_padding_mask=m if rank else None),
             "key_padding_mask given = 0 (rank 0)"),
            ("joint mask alone", dict(joint_key_padding_mask=m), "without joint rows"),
            ("joint mask shape", dict(joint=joint, joint_key_padding_mask=m),
             "joint_key_padding_mask must be a bool tensor [B, S_j] = [1, 2]")]:
        # validate=True: a mask on some ranks only may meet a signature seen without one
        out[name] = (expect_value_error(lambda: UlyssesAttention(validate=True)(q, q, q, **kw)),
                     frag)
    # A mask of another dtype after a good call is a new plan, checked like the first one.
    mod = UlyssesAttention()
    mod(q, q, q, key_padding_mask=m)
    out["dtype after a good call"] = (
        expect_value_error(lambda: mod(q, q, q, key_padding_mask=m.float())),
        "key_padding_mask must be a bool tensor")
    return out


def test_bad_masks_raise_on_every_rank(pools):
    assert_same_error_everywhere(pools.run(2, _bad))


def _all_true(rank, world, seed):
    g = torch.Generator().manual_seed(seed * 10 + rank)
    mod = UlyssesAttention()
    same = []
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 6, 2 * world, 16, generator=g).to(dtype) for _ in range(3))
        ones = torch.ones(2, 6, dtype=torch.bool)
        same.append(bits_equal(mod(q, k, v), mod(q, k, v, key_padding_mask=ones)))
    return same


def test_all_true_mask_is_no_mask_bitwise(pools, seed):
    """CPU: a key-padding mask of all True gives the unmasked forward's bits (fp32, bf16)."""
    for same in pools.run(2, _all_true, seed):
        assert all(same), f"seed {seed}: {same}"
