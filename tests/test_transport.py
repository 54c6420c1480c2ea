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


def _piecewise_unpack(plan, r, recv, final):
    pos = 0
    for s in range(plan.world_size):
        for x in plan.pieces[s][r]:
            final.as_strided((x.rows, x.cols), (x.dst_pitch, 1),
                             final.storage_offset() + x.dst_offset).copy_(
                recv[pos:pos + x.numel].view(x.rows, x.cols))
            pos += x.numel


def _pointer_span(plan, x, r):
    """The send buffer's place in ``x`` found from the pieces' addresses (the reference for
    ``ExchangePlan.send_span``)."""
    from attncomm.ulysses.transport import source_view
    views = [source_view([x], p) for d in range(plan.world_size) for p in plan.pieces[r][d]]
    if not views:
        return None
    expect = None
    for v, p in zip(views, [p for d in range(plan.world_size) for p in plan.pieces[r][d]]):
        if not v.is_contiguous() or (plan.tiled and p.rows > 1 and p.dst_pitch != p.cols):
            return None
        if expect is not None and v.data_ptr() != expect:
            return None
        expect = v.data_ptr() + v.numel() * v.element_size()
    first = (views[0].data_ptr() - x.data_ptr()) // x.element_size()
    return first, sum(v.numel() for v in views)


@pytest.mark.parametrize("trial", range(12))
def test_unpack_grid_and_send_span_match_the_pieces(seed, trial):
    """``unpack_grid``'s one strided copy lands every element where the per-piece copies do
    (poisoned final buffers compared bit for bit, grid or not), and ``send_span`` finds the
    send buffer where the pieces' addresses put it, for random plans (even and uneven heads,
    empty shards, B = 1 and 2, dense and strided sources)."""
    rnd = random.Random(seed * 1000 + trial)
    world = rnd.choice([1, 2, 3, 4])
    b, d = rnd.choice([1, 2]), rnd.choice([2, 4])
    seq = tuple(rnd.choice([0, 2, 3]) if rnd.random() < 0.3 else 3 for _ in range(world))
    if not any(seq):
        seq = (2,) * world
    h = rnd.choice([world, 2 * world, 2 * world + 1, max(1, world - 1)])
    heads = head_split(h, world)
    offs = head_offsets(heads)
    plans = [head_to_seq_plan(b, seq, d, tuple(heads), tuple(offs), h),
             seq_to_head_plan(b, seq, d, (tuple((offs[p], offs[p] + heads[p])
                                                for p in range(world)),))]
    g = torch.Generator().manual_seed(seed + trial)
    grids = 0
    for plan in plans:
        for r in range(world):
            recv = torch.randn(plan.recv_count(r), generator=g)
            want = torch.full((plan.recv_numel[r],), float("nan"))
            got = want.clone()
            _piecewise_unpack(plan, r, recv, want)
            from attncomm.ulysses.all_to_all import _unpack
            _unpack(plan, r, recv, got)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (plan, r)
            grids += plan.unpack_grid(r) is not None
            for wide in (0, 1):  # a dense source, and one with a gap between rows
                hs = heads[r] if plan is plans[0] else h
                rows = sum(seq) if plan is plans[0] else seq[r]
                x = torch.randn(b, rows, hs + wide, d, generator=g)[:, :, :hs]
                assert plan.send_span(r, x.stride()) == _pointer_span(plan, x, r), (plan, r)
    assert world == 1 or h % world or grids > 0  # even heads: the one-copy unpack is taken
