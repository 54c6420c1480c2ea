"""DCP query-head gather: ``rotate_tail`` against an fp64 formula; ``gather_heads`` and
``DcpQueryGather`` on gloo ranks (W = 1..5 and 8), bitwise against the ranks' inputs (rotated
when RoPE is on); bad inputs on every rank."""
from __future__ import annotations

import pytest
import torch

from attncomm import dcp

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


# Per dtype: the integer view, a negative NaN with a payload, the canonical quiet NaN.
NAN_BITS = {torch.bfloat16: (torch.int16, -0x3F, 0x7FC0),          # 0xFFC1
            torch.float16: (torch.int16, -0x1FF, 0x7E00),          # 0xFE01
            torch.float32: (torch.int32, -0x3FFFFF, 0x7FC00000)}   # 0xFFC00001


def put_nan(t: torch.Tensor) -> None:
    view, odd, _ = NAN_BITS[t.dtype]
    t.view(view).fill_(odd)


def make_q(seed: int, W: int, T: int, H: int, D: int, dtype, R: int):
    """Every rank's slice ``[W, T, H/W, D]`` and (cos, sin) ``[T, R]`` (the same on every rank
    for the same seed), with special values in the payload (the gather moves bits)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(W, T, H // W, D, generator=g) * 3).to(dtype)
    if T and D > 1:
        q[0, 0, 0, 0] = float("nan")
        q[-1, -1, -1, 0] = float("inf")
        q[0, -1, 0, 1] = -0.0
    if T and R:  # a negative NaN with a payload in a rotated dim: stored canonical
        put_nan(q[0, 0, 0, D - 1:])
    rope = None
    if R:
        ang = torch.rand(T, R // 2, generator=g, dtype=torch.float64) * 40
        ang = torch.cat((ang, ang), dim=-1)
        rope = (ang.cos().float(), ang.sin().float())
    return q, rope


def rope_ref(q: torch.Tensor, cos, sin) -> torch.Tensor:
    """The rotation written out per half, fp32 products, one rounding (the documented bits)."""
    D, R = q.shape[-1], cos.shape[-1]
    x = q[..., D - R:].float()
    half = R // 2
    c, s = cos.float()[:, None], sin.float()[:, None]
    lo = x[..., :half] * c[..., :half] + (-x[..., half:]) * s[..., :half]
    hi = x[..., half:] * c[..., half:] + x[..., :half] * s[..., half:]
    out = q.clone()
    y = torch.cat((lo, hi), dim=-1)
    out[..., D - R:] = y.to(q.dtype)
    view, _, canonical = NAN_BITS[q.dtype]
    out[..., D - R:].view(view)[torch.isnan(y)] = canonical
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotate_tail_bits_and_fp64(dtype, seed):
    for T, h, D, R in [(3, 2, 8, 8), (5, 4, 576, 64), (1, 1, 6, 2), (0, 2, 8, 4)]:
        q, (cos, sin) = make_q(seed, 1, T, h, D, dtype, R)
        q = q[0]
        before = bits(q).clone()
        got = dcp.rotate_tail(q, cos, sin)
        assert torch.equal(bits(q), before), "q was modified"
        assert torch.equal(bits(got), bits(rope_ref(q, cos, sin))), f"seed={seed} {T, h, D, R}"
        assert torch.equal(bits(got[..., :D - R]), bits(q[..., :D - R]))
        if T:  # against fp64: within one rounding of the query dtype (plus fp32 noise)
            fin = torch.isfinite(q[..., D - R:]).all(-1)
            x = q[..., D - R:].double()
            c, s = cos.double()[:, None], sin.double()[:, None]
            half = R // 2
            ref = x * c + torch.cat((-x[..., half:], x[..., :half]), -1) * s
            err = (got[..., D - R:].double() - ref).abs()[fin]
            eps = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
            assert bool((err <= eps * (ref.abs()[fin] + 1) * 2).all()), err.max()
        inplace = q.clone()
        dcp.rotate_tail(inplace, cos, sin, out=inplace)
        assert torch.equal(bits(inplace), bits(got))


# ---------------------------------------------------------------------------------------------
# on gloo ranks
# ---------------------------------------------------------------------------------------------

def _gather_sweep(rank, W, seed):
    failures = []
    case = 0
    for dtype in DTYPES:
        for T, hs, D, R in [(0, 1, 8, 0), (1, 1, 8, 0), (3, 2, 16, 8), (7, 1, 576, 64),
                            (17, 3, 10, 0), (2, 2, 6, 6)]:
            for with_rope in ((False, True) if R else (False,)):
                case += 1
                H = hs * W
                q, rope = make_q(seed + case, W, T, H, D, dtype, R if with_rope else 0)
                mine = q[rank].clone()
                before = bits(mine).clone()
                want = q if rope is None else torch.stack([rope_ref(q[r], *rope)
                                                           for r in range(W)])
                want = want.permute(1, 0, 2, 3).reshape(T, H, D)
                for backend in ("all_gather", "auto"):
                    what = f"W={W} rank={rank} {backend} {dtype} T={T} H={H} D={D} R={R} " \
                           f"rope={with_rope} seed={seed + case}"
                    got = dcp.gather_heads(mine, backend=backend, rope=rope)
                    if got.shape != (T, H, D) or got.dtype != dtype:
                        failures.append(f"{what}: shape {tuple(got.shape)} {got.dtype}")
                    elif not torch.equal(bits(got), bits(want)):
                        failures.append(f"{what}: not bit for bit")
                    if not torch.equal(bits(mine), before):
                        failures.append(f"{what}: q was modified")
    return failures


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, pytest.param(8, marks=pytest.mark.slow)])
def test_gather_heads_bitwise(pools, W, seed):
    failures = sum(pools.run(W, _gather_sweep, seed), [])
    assert not failures, "\n".join(failures[:20])


def _gatherer_calls(rank, W, seed):
    failures = []
    H, D, R = 2 * W, 12, 4
    for rope_dim in (0, R):
        g = dcp.DcpQueryGather(max_tokens=9, num_heads=H, head_dim=D, dtype=torch.bfloat16,
                               rope_dim=rope_dim)
        if g.backend != "all_gather" or g.fallback_reason is None:
            failures.append(f"auto on CPU: backend {g.backend}, reason {g.fallback_reason}")
        for i, T in enumerate((9, 1, 0, 5, 9)):
            q, rope = make_q(seed + i, W, T, H, D, torch.bfloat16, rope_dim)
            want = q if rope is None else torch.stack([rope_ref(q[r], *rope) for r in range(W)])
            got = g(q[rank], rope=rope)
            if not torch.equal(bits(got), bits(want.permute(1, 0, 2, 3).reshape(T, H, D))):
                failures.append(f"rope_dim={rope_dim} T={T}: not bit for bit")
        too_long = torch.zeros(10, 2, D, dtype=torch.bfloat16)
        short = torch.zeros(2, 2, D, dtype=torch.bfloat16)
        bad_calls = {"T > max_tokens": (too_long, make_q(0, 1, 10, 2, D, torch.bfloat16,
                                                         rope_dim)[1]),
                     "rope mismatch": (short, None if rope_dim else
                                       make_q(0, 1, 2, 2, D, torch.bfloat16, 4)[1])}
        for label, (bad_q, bad_rope) in bad_calls.items():
            try:
                g(bad_q, rope=bad_rope)
                failures.append(f"{label} did not raise")
            except ValueError:
                pass
        g.check()
    return failures


@pytest.mark.parametrize("W", [1, 3])
def test_dcp_query_gather(pools, W, seed):
    failures = sum(pools.run(W, _gatherer_calls, seed), [])
    assert not failures, "\n".join(failures)


def _bad_gathers(rank, W):
    T, hs, D = 3, 2, 8
    q = torch.randn(T, hs, D)
    cs = (torch.randn(T, 4), torch.randn(T, 4))
    cases = {
        "int dtype": lambda: dcp.gather_heads(q.to(torch.int32)),
        "2-d q": lambda: dcp.gather_heads(q[0]),
        "unknown backend": lambda: dcp.gather_heads(q, backend="nope"),
        "odd rope dim": lambda: dcp.gather_heads(q, rope=(torch.randn(T, 3), torch.randn(T, 3))),
        "rope dim > D": lambda: dcp.gather_heads(q, rope=(torch.randn(T, 10),
                                                          torch.randn(T, 10))),
        "rope T wrong on rank 0": lambda: dcp.gather_heads(
            q, rope=(torch.randn(T + (rank == 0), 4), torch.randn(T + (rank == 0), 4))),
        "symm on CPU": lambda: dcp.gather_heads(q, backend="symm"),
        "gather fp8 out": lambda: dcp.DcpQueryGather(max_tokens=4, num_heads=hs * W,
                                                     head_dim=D, dtype=torch.bfloat16,
                                                     out_dtype=torch.float8_e4m3fn),
        "gather odd rope_dim": lambda: dcp.DcpQueryGather(max_tokens=4, num_heads=hs * W,
                                                          head_dim=D, dtype=torch.float32,
                                                          rope_dim=3),
        "gather H not divisible": lambda: dcp.DcpQueryGather(
            max_tokens=4, num_heads=hs * W + 1, head_dim=D, dtype=torch.float32),
    }
    if W > 1:
        # validate=True: a rank whose own signature an earlier test of this pool made it see
        # would skip the default first-sight check (tests/test_call_policy.py covers that rule)
        v = dict(validate=True)
        cases.update({
            "T differs": lambda: dcp.gather_heads(torch.randn(T + rank, hs, D), **v),
            "H/W differs": lambda: dcp.gather_heads(torch.randn(T, hs + rank, D), **v),
            "D differs": lambda: dcp.gather_heads(torch.randn(T, hs, D + rank), **v),
            "dtype differs": lambda: dcp.gather_heads(q.to(torch.bfloat16) if rank else q, **v),
            "rope on rank 0 only": lambda: dcp.gather_heads(q, rope=cs if rank == 0 else None,
                                                            **v),
            "rope dim differs": lambda: dcp.gather_heads(
                q, rope=(torch.randn(T, 4 + 2 * rank), torch.randn(T, 4 + 2 * rank)), **v),
        })
    else:
        cases.pop("gather H not divisible")
    out = []
    for label, call in cases.items():
        try:
            call()
            out.append((label, False, ""))
        except ValueError as exc:
            out.append((label, True, str(exc)))
    return out


@pytest.mark.parametrize("W", [1, 2, 3])
def test_bad_gathers_raise_on_every_rank(pools, W):
    per_rank = pools.run(W, _bad_gathers)
    for rank, results in enumerate(per_rank):
        for label, raised, _msg in results:
            assert raised, f"rank {rank}: {label} did not raise ValueError"
    msgs = {label: msg for label, _, msg in per_rank[0]}
    assert "needs q_scale" in msgs["gather fp8 out"]
    if W > 1:
        assert "T (tokens)" in msgs["T differs"]
        assert "H/W" in msgs["H/W differs"]
        assert "D (head_dim)" in msgs["D differs"]
        assert "dtype" in msgs["dtype differs"]
        assert "rope" in msgs["rope on rank 0 only"]
        assert "rank 0" in msgs["rope T wrong on rank 0"]
        assert "CUDA" in msgs["symm on CPU"]
