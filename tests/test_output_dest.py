"""Caller-owned destinations (``output=``) of the DCP and DP-attention calls, on gloo CPU ranks:
the call writes exactly the bits it would return (poisoned destinations, every merge backend,
non-contiguous destinations through one copy), returns the destination itself, and a wrong
destination is a ``ValueError`` naming it on every rank; the objects keep returning views."""
from __future__ import annotations

import pytest
import torch

from attncomm import dcp
from attncomm.dp_attention import DpPaddingMode, dp_gather, dp_reduce_scatter, dp_scatter

NAN = float("nan")


def _poisoned(shape, dtype=torch.float32, contiguous=True):
    """A NaN-filled destination; not contiguous: a slice of wider rows (contiguous anyway when
    it is a single row or empty)."""
    if contiguous:
        return torch.full(shape, NAN, dtype=dtype)
    return torch.full((*shape[:-1], shape[-1] + 3), NAN, dtype=dtype)[..., :shape[-1]]


def _merge_outputs(rank, world, seed):
    gen = torch.Generator().manual_seed(seed + rank)
    T, H, D = 5, 2 * world, 8
    out = torch.randn(T, H, D, generator=gen).to(torch.bfloat16)
    lse = torch.randn(T, H, generator=gen) * 2
    lse[0, 0] = float("-inf")  # an empty row
    bad = []
    for backend in ("reference", "ag_rs", "a2a"):
        for base in ("e", "2"):
            ref, ref_lse = dcp.merge(out, lse, backend=backend, lse_base=base, return_lse=True)
            o = _poisoned((T, H // world, D), torch.bfloat16)
            got = dcp.merge(out, lse, backend=backend, lse_base=base, output=o)
            o2, l2 = _poisoned((T, H // world, D), torch.bfloat16), _poisoned((T, H // world))
            got2, got2_lse = dcp.merge(out, lse, backend=backend, lse_base=base,
                                       return_lse=True, output=(o2, l2))
            o3 = _poisoned((T, H // world, D), torch.bfloat16, contiguous=False)
            got3, got3_lse = dcp.merge(out, lse, backend=backend, lse_base=base,
                                       return_lse=True, output=(o3, None))
            ok = (got is o and got2 is o2 and got2_lse is l2 and got3 is o3
                  and all(torch.equal(a, ref) for a in (o, o2, o3))
                  and all(torch.equal(a, ref_lse) for a in (l2, got3_lse)))
            if not ok:
                bad.append((backend, base))
    empty = _poisoned((0, H // world, D), torch.bfloat16)
    zero = dcp.merge(out[:0], lse[:0], backend="a2a", output=empty) is empty
    return bad, zero


@pytest.mark.parametrize("world", [1, 2])
def test_merge_writes_the_callers_output(pools, world):
    seed = 1100 + world
    for bad, zero in pools.run(world, _merge_outputs, seed):
        assert not bad and zero, f"seed {seed}: output= differs from the result for {bad}"


def _gather_outputs(rank, world, seed):
    gen = torch.Generator().manual_seed(seed + rank)
    res = []
    for T in (1, 3):
        q = torch.randn(T, 2, 8, generator=gen)
        ang = torch.rand(T, 4, generator=gen) * 6
        rope = (ang.cos(), ang.sin())
        for r in (None, rope):
            ref = dcp.gather_heads(q, rope=r)
            o = _poisoned((T, 2 * world, 8))
            o_nc = _poisoned((T, 2 * world, 8), contiguous=False)
            got, got_nc = dcp.gather_heads(q, rope=r, output=o), \
                dcp.gather_heads(q, rope=r, output=o_nc)
            res.append(got is o and got_nc is o_nc and torch.equal(o, ref)
                       and torch.equal(o_nc, ref))
    # the object keeps returning a view of its persistent buffer
    g = dcp.DcpQueryGather(max_tokens=4, num_heads=2 * world, head_dim=8, dtype=torch.float32)
    a, b = g(torch.randn(3, 2, 8, generator=gen)), g(torch.randn(2, 2, 8, generator=gen))
    return res, a.data_ptr() == b.data_ptr()


def test_gather_heads_writes_the_callers_output(pools):
    for res, view in pools.run(2, _gather_outputs, 1200):
        assert all(res) and view, res


def _bad_outputs(rank, world):
    gen = torch.Generator().manual_seed(rank)
    msgs = {}
    out, lse = torch.randn(7, 2 * world, 8, generator=gen), torch.randn(7, 2 * world,
                                                                          generator=gen)
    calls = {
        # a new signature on every rank (T=7), a wrong destination on rank 1 only: every rank
        # raises the same ValueError
        "dcp.merge": lambda: dcp.merge(out, lse, backend="a2a", output=torch.empty(
            7, 2, 8 if rank == 0 else 9)),
        "dcp.merge[lse]": lambda: dcp.merge(out[:6], lse[:6], backend="a2a", return_lse=True,
                                            output=(torch.empty(6, 2, 8), torch.empty(6, 3))),
        "dcp.gather_heads": lambda: dcp.gather_heads(out[:5, :2], output=torch.empty(
            5, 2 * world, 8, dtype=torch.float64)),
        "dp_gather": lambda: dp_gather(out[:3, 0], [3] * world, None, mode="sum_len",
                                       output=torch.empty(3, 8)),
        "dp_reduce_scatter": lambda: dp_reduce_scatter(
            out[:3 * world, 0], [3] * world, None, mode="max_len", output=torch.empty(2, 8)),
    }
    for name, call in calls.items():
        try:
            call()
        except ValueError as exc:
            msgs[name] = str(exc)
    return msgs


def test_a_wrong_output_raises_on_every_rank(pools):
    for msgs in pools.run(2, _bad_outputs):
        assert set(msgs) == {"dcp.merge", "dcp.merge[lse]", "dcp.gather_heads", "dp_gather",
                             "dp_reduce_scatter"}, msgs
        assert "rank 1: output must be a [7, 2, 8]" in msgs["dcp.merge"], msgs["dcp.merge"]
        assert "output LSE must be a contiguous [6, 2]" in msgs["dcp.merge[lse]"]
        assert "torch.float64" in msgs["dcp.gather_heads"]
        assert f"output must be a [{3 * 2}, 8]" in msgs["dp_gather"]
        assert "output must be a [3, 8]" in msgs["dp_reduce_scatter"]


def _dp_outputs(rank, world, seed):
    gen = torch.Generator().manual_seed(seed + rank)
    res = {}
    for counts in ([2] * world, [3, 1, 0][:world]):
        for mode in (DpPaddingMode.SUM_LEN, DpPaddingMode.MAX_LEN):
            for tp in (1, world) if world > 1 else (1,):
                dp = world // tp
                n = counts[:dp] if len(counts) >= dp else counts + [1] * (dp - len(counts))
                local = torch.randn(n[rank // tp], 6, generator=gen)
                ref = dp_gather(local, n, None, mode=mode, attn_tp_size=tp)
                o, o_nc = _poisoned(tuple(ref.shape)), _poisoned(tuple(ref.shape),
                                                                 contiguous=False)
                g_ok = (dp_gather(local, n, None, mode=mode, attn_tp_size=tp, output=o) is o
                        and dp_gather(local, n, None, mode=mode, attn_tp_size=tp,
                                      output=o_nc) is o_nc)
                # MAX_LEN padding rows are unspecified: compare each rank's slot only
                slots = [dp_scatter(t, n, q, mode=mode) for t in (ref, o, o_nc)
                         for q in range(dp)]
                k = len(slots) // 3
                g_ok = g_ok and all(torch.equal(slots[i], slots[i + k])
                                    and torch.equal(slots[i], slots[i + 2 * k])
                                    for i in range(k))
                partial = torch.randn(ref.shape, generator=gen)
                rs = dp_reduce_scatter(partial, n, None, mode=mode, attn_tp_size=tp)
                r, r_nc = _poisoned(tuple(rs.shape)), _poisoned(tuple(rs.shape),
                                                                contiguous=False)
                r_ok = (dp_reduce_scatter(partial, n, None, mode=mode, attn_tp_size=tp,
                                          output=r) is r
                        and dp_reduce_scatter(partial, n, None, mode=mode, attn_tp_size=tp,
                                              output=r_nc) is r_nc
                        and torch.equal(r, rs) and torch.equal(r_nc, rs))
                res[(tuple(n), mode.name, tp)] = g_ok and r_ok
    buf = torch.randn(5, 3, generator=gen)
    s = torch.empty(2, 3)
    res["dp_scatter"] = (dp_scatter(buf, [3, 2], 1, mode="sum_len", output=s) is s
                         and torch.equal(s, buf[3:]))
    try:
        dp_scatter(buf, [3, 2], 1, mode="sum_len", output=s, out=s)
    except ValueError as exc:
        res["both"] = "not both" in str(exc)
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_dp_calls_write_the_callers_output(pools, world):
    seed = 1300 + world
    for res in pools.run(world, _dp_outputs, seed):
        assert all(res.values()) and "both" in res, f"seed {seed}: {res}"
