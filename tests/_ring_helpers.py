"""Shared by the ring and USP tests: seeded data, the fp64 reference with LSE and a key mask, and
bit comparisons."""
from __future__ import annotations

import math

import torch

__all__ = ["gen", "rand", "ref_attention_lse", "bits_equal", "max_err"]


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def rand(g: torch.Generator, shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def ref_attention_lse(q, k, v, causal: bool, key_valid=None, scale=None):
    """Attention in fp64 over the whole sequence: ``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]``,
    ``v [B, S, Hkv, Dv]`` (query head h uses KV head ``h // (Hq/Hkv)``), ``key_valid [B, S]``
    bool or None → ``(out [B, S, Hq, Dv], lse [B, S, Hq])`` fp64; a row with no valid key is 0
    with LSE −inf."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    n = q.shape[1]
    mask = torch.zeros(q.shape[0], 1, n, k.shape[1], dtype=torch.bool)
    if causal:
        mask |= torch.ones(n, n, dtype=torch.bool).triu(1)
    if key_valid is not None:
        mask |= ~key_valid[:, None, None, :]
    s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bhst,bthd->bshd", p, v)
    return out, lse.transpose(1, 2)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and the sign of zero included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
