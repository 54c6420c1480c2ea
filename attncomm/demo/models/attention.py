"""Attention cores for the demo: one-process attention with LSE, and DCP attention over a group.

``partial_attention`` is the per-shard computation of decode context parallelism: the attention of
every query over the keys this rank holds, with the log-sum-exp that ``attncomm.dcp.merge`` needs
to combine shards (DESIGN.md, "DCP merge"). With every key it is plain attention, the reference.
``dcp_attention`` is one attention layer under DCP: partial attention over the local KV shard,
``dcp.merge`` to this rank's head slice, then an all_gather of the head slices so the rest of the
layer runs replicated.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import collectives, dcp

__all__ = ["partial_attention", "full_attention", "dcp_attention", "gather_heads"]


def partial_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      valid: torch.Tensor | None, scale: float):
    """Attention of ``q`` over the keys ``k, v`` with the log-sum-exp of the scores.

    Arguments:
        q: ``[B, Sq, H, D]``; k, v: ``[B, Sk, H, D]`` (same dtype; ``Sk`` may be 0).
        valid: bool, broadcastable to ``[B, Sq, Sk]`` — which (query, key) pairs may attend
            (padding keys and, when causal, later positions are False); None: all.
        scale: the score scale (``1/√D``).

    Returns:
        ``out [B, Sq, H, D]`` in ``q``'s dtype and ``lse [B, Sq, H]`` fp32 (base e). A query row
        with no valid key gets ``out = 0`` and ``lse = −inf`` (an empty shard). Computed in fp32.
    """
    B, Sq, H, D = q.shape
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if valid is not None:
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, H, Sq]; −inf for rows without a key
    # Subtract a finite stand-in on empty rows: exp(−inf − 0) = 0, no NaN from −inf − (−inf).
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.float())
    return out.to(q.dtype), lse.transpose(1, 2).contiguous()


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   valid: torch.Tensor | None, scale: float) -> torch.Tensor:
    """One-process attention, ``[B, S, H, D]`` → ``[B, S, H, D]`` (the reference core)."""
    return partial_attention(q, k, v, valid, scale)[0]


def gather_heads(part: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather head slices: every rank's ``[T, H/W, D]`` (rank order = head order) →
    ``[T, H, D]``, identical on every rank."""
    W = dist.get_world_size(group)
    T, h, D = part.shape
    if W == 1:
        return part
    buf = torch.empty(W * h, T, D, dtype=part.dtype, device=part.device)
    collectives.all_gather_tensor(buf, part.transpose(0, 1).contiguous(), group=group)
    return buf.transpose(0, 1)


def dcp_attention(q: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor,
                  valid_local: torch.Tensor | None, scale: float, group=None, *,
                  backend: str = "auto") -> torch.Tensor:
    """Attention over a KV cache sharded across the ranks of ``group`` (DCP).

    Arguments:
        q: ``[B, Sq, H, D]``, the same on every rank.
        k_local, v_local: ``[B, Sk_r, H, D]``, this rank's KV shard (``Sk_r`` may be 0).
        valid_local: bool broadcastable to ``[B, Sq, Sk_r]`` (see ``partial_attention``).
        backend: the ``attncomm.dcp.merge`` backend.

    Returns:
        ``[B, Sq, H, D]`` in ``q``'s dtype, the same on every rank: partial attention over the
        local shard, ``dcp.merge`` (this rank's head slice), all_gather of the head slices.

    Raises:
        ValueError: ``H % W != 0`` (from ``dcp.merge``).
    """
    B, Sq, H, D = q.shape
    out, lse = partial_attention(q, k_local, v_local, valid_local, scale)
    merged = dcp.merge(out.reshape(B * Sq, H, D), lse.reshape(B * Sq, H), group,
                       backend=backend)
    return gather_heads(merged, group).reshape(B, Sq, H, D)
