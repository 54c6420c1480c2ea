"""Single-process fp64 references of every exchange, shared by the tests and the fuzz."""
from __future__ import annotations

import math

import torch

__all__ = ["ref_merge"]


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
