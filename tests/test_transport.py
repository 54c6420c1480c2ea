"""The Ulysses ``Transport`` interface on gloo CPU ranks: a producer that writes its outgoing
data into ``send_buffer`` gives the same bits as ``start(parts)``; the regions have the layout
the interface documents; prepare / result_aliases_staging need no branch on a name."""
from __future__ import annotations

import random

import pytest
import torch

from attncomm.ulysses.layout import head_offsets, head_split, head_to_seq_plan, seq_to_head_plan


def _plans(world, seed):
    rnd = random.Random(seed)
    seq = tuple(rnd.choice([0, 1, 3, 5]) for _ in range(world))
    if not any(seq):
        seq = (2,) * world
    b, d = rnd.choice([1, 2]), rnd.choice([4, 8])
    hq, hkv = 3 * world + 1, world + 1
    qh, kvh = head_split(hq, world), head_split(hkv, world)
    qo, ko = head_offsets(qh), head_offsets(kvh)
    q_ranges = tuple((qo[p], qo[p] + qh[p]) for p in range(world))
    kv_ranges = tuple((ko[p], ko[p] + kvh[p]) for p in range(world))
    return (b, seq, d, hq, hkv, qh,
            seq_to_head_plan(b, seq, d, (q_ranges, kv_ranges)),
            head_to_seq_plan(b, seq, d, tuple(qh), tuple(qo), hq))


def _send_buffer_cases(rank, world, seed):
    from attncomm.ulysses.all_to_all import AllToAllTransport
    from attncomm.ulysses.transport import fill_send_buffer, region_view

    b, seq, d, hq, hkv, qh, plan_in, plan_out = _plans(world, seed)
    g = torch.Generator().manual_seed(seed * 100 + rank)
    t = AllToAllTransport(None, rank, world, 30.0)
    assert t.prepare(plan_in, torch.float32) is None and not t.result_aliases_staging
    results = []
    dev = torch.device("cpu")
    q = torch.randn(b, seq[rank], hq, d, generator=g)
    kv = torch.randn(b, seq[rank], hkv, d, generator=g)
    o = torch.randn(b, sum(seq), qh[rank], d, generator=g)
    for plan, parts in ((plan_in, [q, kv]), (plan_out, [o])):
        ref = t.start(plan, parts, torch.float32, dev).wait().clone()
        sb = t.send_buffer(plan, torch.float32, dev)
        assert sb.flat is not None and sb.flat.numel() == sum(plan.numel[rank])
        for p, reg in enumerate(sb.regions):
            assert reg.numel() == plan.numel[rank][p]
            reg.fill_(float("nan"))  # poisoned: the producer must write every element
        fill_send_buffer(sb, parts)
        got = t.start(plan, [], torch.float32, dev, send=sb).wait()
        results.append(torch.equal(got.view(torch.int32), ref.view(torch.int32)))
        # the documented region layout of a tiled seq_to_head plan: this rank's rows of p's
        # final buffer, [S_rank, B, n(p), D], q heads then kv heads
        if plan is plan_in:
            for p in range(world):
                n = qh[p] + head_split(hkv, world)[p]
                want = torch.cat([q[:, :, head_offsets(qh)[p]:][:, :, :qh[p]],
                                  kv[:, :, head_offsets(head_split(hkv, world))[p]:]
                                  [:, :, :head_split(hkv, world)[p]]], dim=2)
                view = sb.regions[p].view(seq[rank], b, n, d).permute(1, 0, 2, 3)
                results.append(torch.equal(view, want))
        x = plan.pieces[rank][(rank + 1) % world]
        if x:
            v = region_view(plan, rank, (rank + 1) % world, x[0], sb.regions[(rank + 1) % world],
                            0)
            results.append(v.shape == (x[0].rows, x[0].cols))
    try:
        t.start(plan_out, [], torch.float32, dev, send=t.send_buffer(plan_in, torch.float32, dev))
        results.append(False)
    except ValueError as exc:
        results.append("another plan" in str(exc))
    return results


@pytest.mark.parametrize("world", [1, 2, 3])
def test_send_buffer_equals_start_from_parts(pools, world, seed):
    for res in pools.run(world, _send_buffer_cases, seed):
        assert all(res), (seed, res)
