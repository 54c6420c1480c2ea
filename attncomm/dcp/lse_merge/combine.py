"""The LSE combine math of the DCP merge: a Triton kernel for CUDA tensors, plain torch for CPU.

For partial outputs ``O_n`` with log-sum-exps ``L_n`` (base e) of the same query row over disjoint
key sets, the exact attention output over their union is ``Σ_n w_n O_n`` with
``w_n = exp(L_n − m) / Σ_s exp(L_s − m)``, ``m = max_n L_n`` and merged LSE ``m + log Σ_s
exp(L_s − m)`` (the online-softmax rescaling of Milakov & Gimelshein 2018, as used by
FlashAttention's split-KV and by vLLM/SGLang's ``merge_attn_states``).

Special values (both paths, and every backend built on them; docs/API.md "Special values"):
an LSE that is not finite (−inf, +inf or NaN) marks an empty source and counts as −inf (vLLM and
SGLang treat FlashAttention's +inf for a keyless row the same way); ``m := 0`` when every LSE of
the row is −inf; a source whose weight is 0 (an empty source, or underflow) is never read, so
whatever its payload holds cannot leak; the divide is guarded, so a row empty on every source
gives exactly 0 and LSE −inf. A contributing source's payload is used as is: NaN or ±inf in it
propagates to the merged row. Accumulation is fp32; the output is rounded once.

The Triton kernels also run on CPU tensors under ``TRITON_INTERPRET=1`` (how CI tests them);
``ATTNCOMM_COMBINE_IMPL=triton|torch`` forces a path.
"""
from __future__ import annotations

import torch

from ... import _triton, config

__all__ = ["combine", "combine_torch", "scale_own", "scale_own_torch", "use_triton"]

if _triton.REASON is None:
    from . import combine_kernels as _k
else:
    _k = None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton path handles tensor ``t`` (CUDA, or forced for interpreter tests)."""
    forced = config.get("ATTNCOMM_COMBINE_IMPL")
    if forced == "torch" or _k is None:
        return False
    if forced == "triton":
        return True
    return t.is_cuda


# --------------------------------------------------------------------------------------------
# torch path
# --------------------------------------------------------------------------------------------

def _weights_torch(lses: torch.Tensor):
    """``lses [N, ...]`` fp32 → (unnormalised weights ``[N, ...]``, their sum ``[...]``, the
    max ``[...]``)."""
    lses = lses.float()
    # NaN < inf and +inf < inf are both False: every non-finite LSE becomes −inf (empty).
    lses = torch.where(lses < float("inf"), lses, torch.full_like(lses, float("-inf")))
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # exp(-inf) = 0
    return w, w.sum(dim=0), m


def _merged_lse(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.where(s > 0, torch.log(torch.where(s > 0, s, torch.ones_like(s))) + m,
                       torch.full_like(s, float("-inf")))


def combine_torch(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype):
    """``outs [N, T, H, D]``, ``lses [N, T, H]`` (base e) → (``[T, H, D]`` out_dtype, ``[T, H]``
    fp32). ``N == 0`` gives zeros and LSE −inf."""
    if outs.shape[0] == 0:
        return _no_sources(outs, out_dtype)
    w, s, m = _weights_torch(lses)
    acc = torch.zeros(outs.shape[1:], dtype=torch.float32, device=outs.device)
    for n in range(outs.shape[0]):
        wn = w[n].unsqueeze(-1)
        acc += torch.where(wn > 0, outs[n].float() * wn, torch.zeros_like(acc))
    s_safe = torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    return (acc / s_safe).to(out_dtype), _merged_lse(s, m)


def scale_own_torch(out: torch.Tensor, lses: torch.Tensor, rank: int, dest: torch.Tensor):
    """The ag_rs correction: ``dest [W, T, H/W, D]`` fp32 ← this rank's ``out [T, H, D]`` times
    its normalised weight, laid out by destination head slice; returns the merged LSE ``[T, H]``."""
    w, s, m = _weights_torch(lses)
    s_safe = torch.where(s > 0, s, torch.ones_like(s))
    wr = (w[rank] / s_safe).unsqueeze(-1)
    scaled = torch.where(wr > 0, out.float() * wr, torch.zeros((), dtype=torch.float32,
                                                               device=out.device))
    W = dest.shape[0]
    T, H, D = out.shape
    dest.copy_(scaled.view(T, W, H // W, D).permute(1, 0, 2, 3))
    return _merged_lse(s, m)


def _no_sources(outs: torch.Tensor, out_dtype: torch.dtype):
    # Zero sources: every row is empty everywhere.
    T, H, D = outs.shape[1:]
    return (torch.zeros((T, H, D), dtype=out_dtype, device=outs.device),
            torch.full((T, H), float("-inf"), dtype=torch.float32, device=outs.device))


# --------------------------------------------------------------------------------------------
# Triton path (the kernels: combine_kernels)
# --------------------------------------------------------------------------------------------

def _block_d(D: int) -> int:
    return min(1024, 1 << (max(D, 16) - 1).bit_length())


def combine(outs: torch.Tensor, lses: torch.Tensor, out_dtype: torch.dtype,
            out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None):
    """Merge ``N`` partial results.

    Arguments:
        outs: ``[N, T, H, D]`` fp16/bf16/fp32, any strides with a unit stride on D.
        lses: ``[N, T, H]`` fp32, base e, any strides.
        out_dtype: dtype of the merged output.
        out, lse_out: contiguous ``[T, H, D]`` ``out_dtype`` / ``[T, H]`` fp32 destinations
            (None: new tensors), written with exactly the bits a fresh result would hold.

    Returns:
        ``([T, H, D]`` in ``out_dtype``, ``[T, H]`` fp32 base-e LSE)``: the destinations, or
        fresh contiguous tensors.
    """
    if not use_triton(outs) or outs.shape[0] == 0:
        o, lse = combine_torch(outs, lses, out_dtype)  # N == 0 included
        return _into(o, out), _into(lse, lse_out)
    N, T, H, D = outs.shape
    if out is None:
        out = torch.empty((T, H, D), dtype=out_dtype, device=outs.device)
    if lse_out is None:
        lse_out = torch.empty((T, H), dtype=torch.float32, device=outs.device)
    if T * H == 0:
        return out, lse_out
    if outs.stride(3) != 1:
        outs = outs.contiguous()
    bd = _block_d(D)
    grid = (T * H, -(-D // bd))
    _k.combine_kernel[grid](outs, lses, out, lse_out, N, H, D,
                            outs.stride(0), outs.stride(1), outs.stride(2),
                            lses.stride(0), lses.stride(1), lses.stride(2),
                            out.stride(0), out.stride(1), BLOCK_D=bd)
    return out, lse_out


def _into(t: torch.Tensor, dest: torch.Tensor | None) -> torch.Tensor:
    return t if dest is None else dest.copy_(t)


def scale_own(out: torch.Tensor, lses: torch.Tensor, rank: int, dest: torch.Tensor):
    """The ag_rs correction step.

    Arguments:
        out: this rank's partial output ``[T, H, D]`` (unit stride on D).
        lses: every rank's LSE ``[W, T, H]`` fp32 base e.
        rank: this rank's index in ``lses``.
        dest: ``[W, T, H/W, D]`` fp32, written with this rank's output times its normalised
            weight, grouped by destination head slice (ready for reduce_scatter).

    Returns:
        The merged LSE ``[T, H]`` fp32 base e, for all heads.
    """
    if not use_triton(out):
        return scale_own_torch(out, lses, rank, dest)
    T, H, D = out.shape
    W = dest.shape[0]
    lse_out = torch.empty((T, H), dtype=torch.float32, device=out.device)
    if T * H == 0:
        return lse_out
    if out.stride(2) != 1:
        out = out.contiguous()
    bd = _block_d(D)
    grid = (T * H, -(-D // bd))
    _k.scale_own_kernel[grid](out, lses, dest, lse_out, rank, W, H, H // W, D,
                              out.stride(0), out.stride(1),
                              lses.stride(0), lses.stride(1), lses.stride(2),
                              dest.stride(0), dest.stride(1), dest.stride(2), BLOCK_D=bd)
    return lse_out
