"""Where the sequence lives on a ring, and which block of work each ring step does (pure, no
communication).

Layouts of a sequence of ``S = W·S_r`` positions over the W ranks of a ring:

- ``"contiguous"``: rank r holds positions ``[r·S_r, (r+1)·S_r)``.
- ``"zigzag"``: the sequence is cut into 2W equal chunks of ``c = S_r / 2`` positions and rank r
  holds chunks r and 2W−1−r, in that order (ring-flash-attention's ``zigzag_ring_flash_attn``;
  Brandon et al., "Striped Attention", 2023, for the load-balance argument). Under causal
  attention every rank then does the same work at every step.

At ring step i (0 ≤ i < W) rank r attends the K/V block of rank ``src = (r − i) mod W``. With
causal attention a block is one of:

================  =========================  =================================================
layout            block                      work
================  =========================  =================================================
any               ``src == r``               causal attention of the local block
contiguous        ``src < r``                every query row, every key (not causal)
contiguous        ``src > r``                nothing: every key is later than every query
zigzag            ``src < r``                every query row, the first key chunk (chunk src)
zigzag            ``src > r``                the second query chunk (2W−1−r), every key
================  =========================  =================================================

A block that is fully masked is skipped, not computed: it is an empty shard of the merge.
Without causal masking every step attends every query row to every key.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["LAYOUTS", "Block", "ring_block", "zigzag_shard", "zigzag_unshard", "positions",
           "layout_error"]

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Block:
    """The work of one ring step on one rank: query rows ``[q_lo, q_hi)`` of the local block
    attend key rows ``[k_lo, k_hi)`` of the received block, causally or not. ``None`` from
    ``ring_block`` means the step has no work (fully masked)."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def layout_error(layout, seq_len_per_rank: int | None = None) -> str | None:
    """Why ``layout`` (with ``S_r`` rows per rank) cannot be used, or None."""
    if layout not in LAYOUTS:
        return f"layout must be one of {list(LAYOUTS)}, got {layout!r}"
    if layout == "zigzag" and seq_len_per_rank is not None and seq_len_per_rank % 2:
        return (f"layout='zigzag' needs an even S_r (two chunks per rank), got "
                f"S_r = {seq_len_per_rank}")
    return None


def ring_block(layout: str, causal: bool, world_size: int, rank: int, step: int,
               seq_len_per_rank: int) -> Block | None:
    """The block rank ``rank`` computes at ring step ``step`` (source rank ``(rank − step) mod
    W``) for ``S_r = seq_len_per_rank`` rows per rank, or None when the block is fully masked
    (see the module docstring's table)."""
    s_r = seq_len_per_rank
    src = (rank - step) % world_size
    if not causal:
        return Block(0, s_r, 0, s_r, False)
    if src == rank:
        return Block(0, s_r, 0, s_r, True)
    if layout == "contiguous":
        return Block(0, s_r, 0, s_r, False) if src < rank else None
    c = s_r // 2
    if src < rank:
        return Block(0, s_r, 0, c, False)
    return Block(c, s_r, 0, s_r, False)


def positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous"
              ) -> torch.Tensor:
    """The global positions (int64 ``[S / W]``) rank ``rank`` holds of a sequence of ``seq_len``
    positions. Raises ValueError when ``seq_len`` does not split (``W``, or ``2W`` for zigzag)."""
    idx = torch.arange(seq_len, dtype=torch.int64)
    if layout == "contiguous":
        _validate_split(seq_len, world_size, "contiguous", world_size)
        return idx.view(world_size, -1)[rank].clone()
    return zigzag_shard(idx, world_size, rank, dim=0)


def _validate_split(n: int, world_size: int, layout: str, parts: int) -> None:
    if world_size < 1 or not 0 <= n or n % parts:
        raise ValueError(f"layout={layout!r}: a sequence of {n} positions does not split into "
                         f"{parts} equal chunks (W = {world_size})")


def zigzag_shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the whole tensor ``x``: cut ``x`` along ``dim`` into
    ``2·world_size`` equal chunks and return chunks ``rank`` and ``2·world_size − 1 − rank``,
    concatenated in that order (a new tensor).

    Arguments:
        x: the whole tensor, e.g. ``[B, S, H, D]`` with ``dim=1``; any dtype.
        world_size: W, ranks of the ring. rank: ``0 ≤ rank < W``.
        dim: the sequence dimension.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by ``2·W``, or ``rank`` is out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard: rank {rank} is not in [0, {world_size})")
    n = x.shape[dim]
    _validate_split(n, world_size, "zigzag", 2 * world_size)
    chunks = x.chunk(2 * world_size, dim=dim) if n else [x] * (2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole tensor back from every rank's zigzag shard (``shards[r]`` from rank r, each
    holding two equal chunks along ``dim``): the inverse of ``zigzag_shard``.

    Raises:
        ValueError: no shards, shards of different shapes, or an odd length along ``dim``.
    """
    if not shards:
        raise ValueError("zigzag_unshard: no shards given")
    shape = tuple(shards[0].shape)
    if any(tuple(s.shape) != shape for s in shards):
        raise ValueError(f"zigzag_unshard: shards differ in shape: "
                         f"{[list(s.shape) for s in shards]}")
    if shape[dim] % 2:
        raise ValueError(f"zigzag_unshard: each shard needs two equal chunks along dim {dim}, "
                         f"got length {shape[dim]}")
    c = shape[dim] // 2
    first = [s.narrow(dim, 0, c) for s in shards]
    second = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(first + second, dim=dim)
