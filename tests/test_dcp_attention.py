"""DcpAttention on gloo ranks (W = 1..4): head-sharded queries gathered (with RoPE on the last
R dims), attention over an interleaved KV shard, merged — against attention over the whole KV
cache in one process (fp64), empty shards included."""
from __future__ import annotations

import pytest
import torch

from attncomm import dcp


def _partial(q, k, v, scale):
    """Attention of ``q [T, H, D]`` over ``k [S, H, D]``, ``v [S, H, Dv]`` with its LSE (fp32;
    −inf and 0 for S == 0)."""
    s = torch.einsum("thd,shd->ths", q.float(), k.float()) * scale
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return torch.einsum("ths,shd->thd", p, v.float()).to(q.dtype), lse


def _case(seed, W, T, hs, D, Dv, R, S, dtype):
    g = torch.Generator().manual_seed(seed)
    H = hs * W
    q = torch.randn(T, H, D, generator=g).to(dtype)
    k = torch.randn(S, H, D, generator=g).to(dtype)
    v = torch.randn(S, H, Dv, generator=g).to(dtype)
    ang = torch.rand(T, R // 2, generator=g, dtype=torch.float64) * 20
    ang = torch.cat((ang, ang), -1)
    return q, k, v, (ang.cos().float(), ang.sin().float())


def _run(rank, W, seed):
    failures = []
    for i, (T, hs, D, Dv, R, S, dtype) in enumerate([
            (3, 2, 24, 16, 8, 13, torch.float32), (1, 1, 72, 64, 64, 5, torch.float32),
            (4, 3, 16, 16, 0, 2, torch.bfloat16), (0, 2, 8, 8, 4, 3, torch.float32)]):
        q, k, v, rope = _case(seed + i, W, T, hs, D, Dv, R or 2, S, dtype)
        scale = D ** -0.5
        local = dcp.shard_kv_interleaved(S, W, rank)
        layer = dcp.DcpAttention(lambda qa, kl, vl: _partial(qa, kl, vl, scale),
                                 max_tokens=max(T, 1), num_heads=hs * W, head_dim=D,
                                 dtype=dtype, v_head_dim=Dv, rope_dim=R)
        sl = slice(rank * hs, (rank + 1) * hs)
        got = layer(q[:, sl].contiguous(), k[local], v[local], rope=rope if R else None)
        # one process, fp64: rotate (the documented fp32 rotation), attend over every key
        qr = dcp.rotate_tail(q, *rope) if R else q
        s = torch.einsum("thd,shd->ths", qr.double(), k.double()) * scale
        ref = torch.einsum("ths,shd->thd", torch.softmax(s, -1), v.double())[:, sl]
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        what = f"W={W} rank={rank} case {i} seed={seed + i}"
        if got.shape != (T, hs, Dv) or got.dtype != dtype:
            failures.append(f"{what}: shape {tuple(got.shape)} {got.dtype}")
        elif T and (got.double() - ref).abs().max().item() > tol:
            failures.append(f"{what}: err {(got.double() - ref).abs().max().item()}")
        if layer.backends != ("all_gather", layer.merger.backend):
            failures.append(f"{what}: backends {layer.backends}")
    bad = dcp.DcpAttention(lambda qa: (qa[:, :1], qa[..., 0].float()), max_tokens=2,
                           num_heads=2 * W, head_dim=8, dtype=torch.float32)
    try:
        bad(torch.randn(2, 2, 8))
        failures.append("attn_fn returning [T, 1, D] was accepted")
    except ValueError as exc:
        if "attn_fn must return" not in str(exc):
            failures.append(f"unclear error: {exc}")
    return failures


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_dcp_attention_matches_one_process(pools, W, seed):
    failures = sum(pools.run(W, _run, seed), [])
    assert not failures, "\n".join(failures)
