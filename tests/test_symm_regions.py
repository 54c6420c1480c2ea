"""The substrate's slab layouts and the kernels' descriptor (attncomm.symm_regions): regions in
order, 128-byte cells, and the descriptor words built for the merge's and the gather's layouts
equal to those layouts' own offsets (bases, cells, peer offsets, wait budget); the fill's
descriptor against its send layout; the one bounded host poll (attncomm._wait)."""
from __future__ import annotations

import pytest
import torch

from attncomm.dcp.lse_merge import symm_layout as merge_layout
from attncomm.dcp.lse_merge.symm_layout import SlabLayout
from attncomm.dcp.query_gather import symm_layout as gather_layout
from attncomm.dcp.query_gather.symm_layout import GatherLayout
from attncomm.symm import DELTA_UNIT
from attncomm.symm_regions import (ALIGN, DESC_PEERS, DESC_REGIONS, DESC_TIMEOUT, Region,
                                   RegionLayout, descriptor)


def _words(desc: torch.Tensor) -> list[int]:
    return [int(v) for v in desc.tolist()]


def test_region_layout_places_aligned_cells_in_order():
    lay = RegionLayout([Region("a", 2, 10, 2), Region("b", 3, 0, 8), Region("c", 1, 129, 4)])
    assert [lay.base(n) for n in "abc"] == [0, 2 * ALIGN, 2 * ALIGN]  # an empty region: no bytes
    assert [lay.cell(n) for n in "abc"] == [ALIGN, 0, 2 * ALIGN]
    assert lay.total_bytes == 4 * ALIGN and lay.offset("a", 1) == ALIGN
    assert lay.fields() == [0, ALIGN // 2, 2 * ALIGN // 8, 0, 2 * ALIGN // 4, 2 * ALIGN // 4]
    with pytest.raises(ValueError, match="no cell 2"):
        lay.offset("a", 2)
    with pytest.raises(ValueError, match="no region 'z'"):
        lay.base("z")
    with pytest.raises(ValueError, match="distinct"):
        RegionLayout([Region("a", 1, 1, 1), Region("a", 1, 1, 1)])
    with pytest.raises(ValueError):
        Region("x", 1, 8, 3)


def _check_descriptor(desc, byte_offsets, peer_ptrs, rank, itemsize, timeout_ns):
    """``byte_offsets``: ``[(region index, unit, base bytes, cell bytes)]`` from the layout."""
    w = _words(desc)
    W = len(peer_ptrs)
    assert len(w) == DESC_PEERS + 3 * W and w[DESC_TIMEOUT] == timeout_ns
    for i, unit, base, cell in byte_offsets:
        assert w[DESC_REGIONS + 2 * i] * unit == base, (i, w)
        assert w[DESC_REGIONS + 2 * i + 1] * unit == cell, (i, w)
        assert w[DESC_REGIONS + 2 * i] % 16 == 0 and w[DESC_REGIONS + 2 * i + 1] % 16 == 0
    for k, unit in enumerate((itemsize, 4, 8)):
        got = w[DESC_PEERS + k * W:DESC_PEERS + (k + 1) * W]
        assert [g * DELTA_UNIT * unit for g in got] == [p - peer_ptrs[rank] for p in peer_ptrs]


@pytest.mark.parametrize("W,rows,D,item,ll", [(2, 4096, 512, 2, 512), (3, 7, 24, 4, 7),
                                              (8, 1, 1, 2, 0), (5, 33, 100, 2, 10)])
def test_merge_descriptor_matches_the_slab_layout(W, rows, D, item, ll):
    lay = SlabLayout(W, rows, D, item, ll)
    ptrs = [1 << 40, (1 << 40) + 3 * 65536, (1 << 40) - 7 * 4096, *range(1 << 41, 1 << 42,
                                                                        (1 << 41) // 8)][:W]
    for rank in range(W):
        desc = lay.descriptor(ptrs, rank, 12345, "cpu")
        cells = lay.cell_bytes()
        offsets = [(merge_layout.R_O, item, lay.o_offset(0, 0), lay.o_offset(0, 1 % W)
                    - lay.o_offset(0, 0) if W > 1 else cells["o"]),
                   (merge_layout.R_L, 4, lay.l_offset(0, 0), cells["l"]),
                   (merge_layout.R_F, 4, lay.f_offset(0, 0), cells["f"]),
                   (merge_layout.R_LLO, 8, lay.offset("llo", 0, 0), cells["llo"]),
                   (merge_layout.R_LLL, 8, lay.offset("lll", 0, 0), cells["lll"])]
        _check_descriptor(desc, offsets, ptrs, rank, item, 12345)
        st = lay.kernel_strides()  # what the interpreter tests stage by
        w = _words(desc)
        assert w[DESC_REGIONS + 2 * merge_layout.R_F] == st["f_base"]
        assert w[DESC_REGIONS + 2 * merge_layout.R_LLL + 1] == st["lll_cell"]


@pytest.mark.parametrize("W,T,H,D,item,ll", [(2, 128, 64, 576, 2, 227), (3, 7, 6, 24, 4, 14),
                                              (8, 1, 8, 1, 2, 0), (2, 5, 4, 24, 1, 10)])
def test_gather_descriptor_matches_the_gather_layout(W, T, H, D, item, ll):
    lay = GatherLayout(W, T, H, D, item, ll)
    ptrs = [(1 << 40) + r * 2 ** 30 for r in range(W)]
    sizes = lay.region_bytes()
    for rank in range(W):
        desc = lay.descriptor(ptrs, rank, 7, "cpu")
        offsets = [(gather_layout.R_OUT, item, 0, sizes["out"]),
                   (gather_layout.R_F, 4, lay.base("f"), sizes["f"] // (2 * W)),
                   (gather_layout.R_LL, 8, lay.base("ll"), sizes["ll"] // (2 * W)),
                   (gather_layout.R_READY, 4, lay.base("ready"), sizes["ready"])]
        _check_descriptor(desc, offsets, ptrs, rank, item, 7)
        st = lay.kernel_strides
        w = _words(desc)
        assert w[DESC_REGIONS + 2 * gather_layout.R_READY] == st["ready_base"]
        assert w[DESC_REGIONS + 2 * gather_layout.R_LL + 1] == st["ll_cell"]


def test_descriptor_refuses_misaligned_peers():
    lay = RegionLayout([Region("a", 2, 64, 2)])
    with pytest.raises(RuntimeError, match="op-name: peer slabs are not 128-byte aligned"):
        descriptor(lay, [0, 64], 0, 2, 1, "cpu", op="op-name")


def test_fill_descriptor_matches_the_send_layout():
    from attncomm.ulysses import fill_kernels as fk
    from attncomm.ulysses.fill import send_layout
    from attncomm.ulysses.fill_descriptor import descriptor as _descriptor
    b, s_r, d = 2, 5, 8
    ranges = (((0, 3), (3, 4)), ((0, 1), (0, 1)))  # q: 3 + 1 heads, k: head 0 for both ranks
    htot, starts = send_layout(b, s_r, d, ranges)
    strides = ((640, 128, 8, 1), (320, 64, 8, 1), (320, 64, 8, 1))
    desc = _descriptor(torch.device("cpu"), ranges, tuple(htot), tuple(starts[:-1]), b, d, 2,
                       s_r, 1e-6, 0b1011, strides, (8, 1, 16, 1))
    w = _words(desc.table)
    head = w[:fk.HEADER]
    assert head[fk.H_S] == s_r and head[fk.H_FLAGS] == 0b1011
    assert head[fk.H_COS_S:fk.H_SIN_D + 1] == [8, 1, 16, 1]
    assert torch.tensor([head[fk.H_EPS]], dtype=torch.int32).view(torch.float32).item() == \
        torch.tensor(1e-6, dtype=torch.float32).item()
    ents = [w[fk.HEADER + k * fk.ENTRY:fk.HEADER + (k + 1) * fk.ENTRY]
            for k in range(desc.entries)]
    assert len(w) == fk.HEADER + desc.entries * fk.ENTRY
    # q heads 0-1 and 2 to rank 0, head 3 to rank 1; k head 0 to both, after q's heads
    want = [(0, 0, 2, starts[0]), (0, 2, 1, starts[0] + 2 * d), (0, 3, 1, starts[1]),
            (1, 0, 1, starts[0] + 3 * d), (1, 0, 1, starts[1] + 1 * d)]
    assert [tuple(e[:4]) for e in ents] == want
    for e in ents:
        p = 0 if e[3] < starts[1] else 1
        assert e[fk.E_PITCH] == b * htot[p] * d and e[fk.E_BPITCH] == htot[p] * d
        assert tuple(e[fk.E_STRIDES:]) == strides[e[fk.E_PART]]
    # the stride codes every part shares: batch and row strides multiples of 16, head stride
    # 8 (nothing), element stride 1; cos/sin: rows 8 (nothing) and 16, elements 1
    codes = [(desc.spec >> (2 * k)) & 3 for k in range(8)]
    assert codes == [2, 2, 0, 1, 0, 1, 2, 1]
    mixed = (strides[0], strides[1], (320, 64, 8, 2))  # v's elements strided: nothing shared
    desc = _descriptor(torch.device("cpu"), ranges, tuple(htot), tuple(starts[:-1]), b, d, 2,
                       s_r, 1e-6, 0b1011, mixed, (8, 1, 16, 1))
    assert [(desc.spec >> (2 * k)) & 3 for k in range(4)] == [2, 2, 0, 0]


def test_poll_until_phases_bound_and_result():
    from attncomm._wait import poll_until
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    calls = []

    def never():
        calls.append(now[0])
        return 0

    assert poll_until(never, 0.01, interval_s=0.001, max_interval_s=0.004,
                      clock=lambda: now[0], sleep=sleep) is None
    assert slept[:4] == [0.001, 0.002, 0.004, 0.004] and now[0] > 0.01
    assert len(calls) == len(slept) + 2  # one check more at the bound
    answers = iter([0, 0, 7])
    assert poll_until(lambda: next(answers), 1.0, interval_s=0.5, clock=lambda: now[0],
                      sleep=sleep) == 7
    read = []
    assert poll_until(lambda: 0, lambda: read.append(1) or 0.5, interval_s=0.1,
                      clock=lambda: now[0], sleep=sleep) is None
    assert read == [1]  # a callable bound is read once
