"""FP8 (e4m3fn) query output of ``DcpQueryGather``: ``quantize_e4m3`` against an fp64
reference (error bound) and byte by byte against torch's conversion, the all_gather backend on
gloo ranks bitwise against the torch reference, bad scales on every rank. (The symm kernel's
FP8 path is checked under the interpreter in tests/test_gather_symm_cpu.py.)"""
from __future__ import annotations

import pytest
import torch
from test_dcp_gather import make_q

from attncomm import dcp
from attncomm.dcp.query_gather import FP8_MAX, quantize_e4m3

E4M3 = torch.float8_e4m3fn


def rope_f32(q: torch.Tensor, cos, sin) -> torch.Tensor:
    """The rotation per half in fp32, not rounded to q's dtype (what FP8 output quantizes)."""
    D, R = q.shape[-1], cos.shape[-1]
    out = q.float().clone()
    if R == 0:
        return out
    x = q[..., D - R:].float()
    half = R // 2
    c, s = cos.float()[:, None], sin.float()[:, None]
    lo = x[..., :half] * c[..., :half] + (-x[..., half:]) * s[..., :half]
    hi = x[..., half:] * c[..., half:] + x[..., :half] * s[..., half:]
    out[..., D - R:] = torch.cat((lo, hi), dim=-1)
    return out


def e4m3_ref_bytes(v: torch.Tensor) -> torch.Tensor:
    """The documented bytes of fp32 ``v`` (already divided by the scale): saturate, round to
    nearest even through torch's own conversion, NaN → 0x7F."""
    b = v.clamp(-FP8_MAX, FP8_MAX).to(E4M3).view(torch.uint8).clone()
    b[torch.isnan(v)] = 0x7F
    return b


def test_quantize_matches_definition_and_fp64_bound(seed):
    g = torch.Generator().manual_seed(seed)
    T, h, D = 7, 3, 40
    x = torch.randn(T, h, D, generator=g) * torch.tensor([1.0, 30.0, 1e-3])[None, :, None]
    x[0, 0, :6] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"),
                                -0.0, 1e6])
    scale = torch.tensor([0.01, 0.5, 2e-6])
    got = quantize_e4m3(x, scale)
    assert got.dtype == E4M3 and got.shape == x.shape
    want = e4m3_ref_bytes(x / scale[None, :, None])
    assert torch.equal(got.view(torch.uint8), want)
    b = got.view(torch.uint8)[0, 0, :6].tolist()
    assert b == [0x7F, 0x7F, 0x7E, 0xFE, 0x80, 0x7E], b  # NaN, NaN, +448, -448, -0, sat
    # dequantized error against fp64: half an e4m3 step (3 mantissa bits: 2**-4 relative)
    # for normal values in range, half the smallest subnormal (2**-10) absolute below
    xs = x.double() / scale.double()[None, :, None]
    fin = torch.isfinite(xs) & (xs.abs() <= FP8_MAX)
    deq = got.float().double()
    err = (deq - xs).abs()[fin]
    bound = torch.maximum(xs.abs()[fin] * 2.0 ** -4, torch.full_like(err, 2.0 ** -10))
    assert bool((err <= bound * (1 + 1e-6)).all()), float((err / bound).max())


def _fp8_calls(rank, W, seed):
    failures = []
    H, D = 2 * W, 24
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for rope_dim in (0, 8):
            scale = (torch.rand(H, generator=torch.Generator().manual_seed(seed)) + 0.01) / 40
            g = dcp.DcpQueryGather(max_tokens=6, num_heads=H, head_dim=D, dtype=dtype,
                                   rope_dim=rope_dim, out_dtype=E4M3, q_scale=scale,
                                   backend="all_gather")
            if g.out_dtype != E4M3 or g.q_scale.dtype != torch.float32:
                failures.append(f"attributes {g.out_dtype} {g.q_scale.dtype}")
            for i, T in enumerate((6, 1, 0, 4)):
                q, rope = make_q(seed + i, W, T, H, D, dtype, rope_dim)
                q = q * 8  # some values past 448 · scale: saturation
                rot = q.float() if rope is None else torch.stack(
                    [rope_f32(q[r], *rope) for r in range(W)])
                full = rot.permute(1, 0, 2, 3).reshape(T, H, D)
                want = e4m3_ref_bytes(full / scale[None, :, None])
                got = g(q[rank], rope=rope)
                what = f"W={W} rank={rank} {dtype} R={rope_dim} T={T}"
                if got.dtype != E4M3 or got.shape != (T, H, D):
                    failures.append(f"{what}: {got.dtype} {tuple(got.shape)}")
                elif not torch.equal(got.view(torch.uint8), want):
                    failures.append(f"{what}: FP8 bytes differ")
    return failures


@pytest.mark.parametrize("W", [1, 2, 3])
def test_fp8_gather_bitwise_on_gloo(pools, W, seed):
    failures = sum(pools.run(W, _fp8_calls, seed), [])
    assert not failures, "\n".join(failures[:20])


def _bad_scales(rank, W):
    H, D = 2 * W, 8
    kw = dict(max_tokens=4, num_heads=H, head_dim=D, dtype=torch.bfloat16, out_dtype=E4M3)
    cases = {
        "no scale": lambda: dcp.DcpQueryGather(**kw),
        "zero scale": lambda: dcp.DcpQueryGather(q_scale=torch.tensor([0.0] + [1.0] * (H - 1)),
                                                 **kw),
        "nan scale": lambda: dcp.DcpQueryGather(q_scale=float("nan"), **kw),
        "wrong shape": lambda: dcp.DcpQueryGather(q_scale=torch.ones(H + 1), **kw),
        "int8 out": lambda: dcp.DcpQueryGather(max_tokens=4, num_heads=H, head_dim=D,
                                               dtype=torch.bfloat16, out_dtype=torch.int8),
    }
    if W > 1:
        cases["scale differs"] = lambda: dcp.DcpQueryGather(q_scale=1.0 + rank, **kw)
    out = []
    for label, call in cases.items():
        try:
            call()
            out.append((label, False, ""))
        except ValueError as exc:
            out.append((label, True, str(exc)))
    return out


@pytest.mark.parametrize("W", [1, 2])
def test_bad_fp8_scales_raise_on_every_rank(pools, W):
    per_rank = pools.run(W, _bad_scales)
    for rank, results in enumerate(per_rank):
        for label, raised, _msg in results:
            assert raised, f"rank {rank}: {label} did not raise ValueError"
    msgs = {label: msg for label, _, msg in per_rank[0]}
    assert "needs q_scale" in msgs["no scale"]
    assert "heads [0]" in msgs["zero scale"]
    if W > 1:
        assert "q_scale" in msgs["scale differs"]
