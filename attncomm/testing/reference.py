"""Single-process fp64 references of every exchange, shared by the tests and the fuzz."""
from __future__ import annotations

import math

import torch

__all__ = ["ref_attention", "ref_merge", "ref_norm_rope"]


def ref_merge(outs: torch.Tensor, lses: torch.Tensor):
    """The DCP merge in fp64.

    ``outs [N, T, H, D]``, ``lses [N, T, H]`` (base e) → fp64 ``([T, H, D], [T, H])``:
    ``w_n = exp(L_n − m) / Σ_s exp(L_s − m)``, ``m = max_n L_n``. A non-finite LSE (−inf, +inf,
    NaN) counts as −inf (an empty source); a zero-weight source is never read; NaN/±inf in a
    contributing source's payload propagates; a row empty on every source (or ``N == 0``) gives
    0 and LSE −inf (the rule of docs/API.md, "Special values").
    """
    o = outs.double()
    l = lses.double()
    l = torch.where(torch.isfinite(l), l, torch.full_like(l, -math.inf))
    if l.shape[0] == 0:
        return (torch.zeros(o.shape[1:], dtype=torch.float64),
                torch.full(l.shape[1:], -math.inf, dtype=torch.float64))
    m = l.amax(0)
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(l - m)
    s = w.sum(0)
    num = torch.where(w.unsqueeze(-1) > 0, o * w.unsqueeze(-1), torch.zeros_like(o)).sum(0)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(num),
                      num / s.clamp_min(1e-300).unsqueeze(-1))
    lse = torch.where(empty, torch.full_like(m, -math.inf), torch.log(s) + m)
    return out, lse


def ref_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                  cos: torch.Tensor | None, sin: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm over D (``weight [D]`` or None: none), then rotate-half (NeoX) RoPE (``cos``,
    ``sin`` ``[S, D]`` or None), in fp64: ``x [B, S, H, D]`` → fp64."""
    x = x.double()
    if weight is not None:
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * weight.double()
    if cos is not None:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x = x * cos.double()[:, None, :] + rot * sin.double()[:, None, :]
    return x


def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Softmax attention in fp64, scale ``1/√D``: ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]``
    with query head h using KV head ``h // (Hq / Hkv)`` → ``[B, S, Hq, Dv]``."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    if causal:
        S = q.shape[1]
        mask = torch.ones(S, S, dtype=torch.bool).triu(1)
        s = s.masked_fill(mask, -math.inf)
    return torch.einsum("bhst,bthd->bshd", torch.softmax(s, dim=-1), v)
