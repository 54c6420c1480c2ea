"""The fp64 reference of the DCP merge, shared by the CPU, interpreter and GPU tests."""
from __future__ import annotations

import math

import torch


def ref_merge(outs: torch.Tensor, lses: torch.Tensor):
    """``outs [N, T, H, D]``, ``lses [N, T, H]`` (base e) → fp64 ``([T, H, D], [T, H])``:
    w_n = exp(L_n − m) / Σ exp(L_s − m); NaN LSE = −inf; zero-weight rows never read; a row empty
    on every source gives 0 and LSE −inf."""
    o = outs.double()
    l = lses.double()
    l = torch.where(torch.isnan(l), torch.full_like(l, -math.inf), l)
    m = l.amax(0)
    empty = torch.isneginf(m)
    m = torch.where(empty, torch.zeros_like(m), m)
    w = torch.exp(l - m)
    s = w.sum(0)
    num = torch.where(w.unsqueeze(-1) > 0, o * w.unsqueeze(-1), torch.zeros_like(o)).sum(0)
    out = torch.where(empty.unsqueeze(-1), torch.zeros_like(num), num / s.clamp_min(1e-300)
                      .unsqueeze(-1))
    lse = torch.where(empty, torch.full_like(m, -math.inf), torch.log(s) + m)
    return out, lse
