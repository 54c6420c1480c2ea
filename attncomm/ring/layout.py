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

Packed sequences (``cu_seqlens``, int32 ``[N + 1]`` boundaries over the global token order, the
same on every rank; varlen). ``"contiguous"`` cuts the packed sequence as it is;
``"zigzag"`` zigzags every sequence on its own (ring-flash-attention's zigzag varlen layout:
sequence i of length ``L_i``, ``L_i % 2W == 0``, is cut into 2W chunks and rank r holds chunks r
and 2W−1−r of every sequence, sequence after sequence, so rank r's shard of sequence i starts at
local row ``cu_seqlens[i] / W``). A step's work is then a list of ``Segment`` tuples, one per
sequence that has rows on both sides (``ring_segments``): query rows attend only keys of their
own sequence, causally within it; a step with no segment is skipped.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = ["LAYOUTS", "Block", "Segment", "ring_block", "ring_segments", "zigzag_shard",
           "zigzag_unshard", "positions", "layout_error", "cu_seqlens_error", "cu_values"]

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


class Segment(NamedTuple):
    """One sequence's work in a ring step (a plain tuple to ``attn_fn``): query rows
    ``[q_lo, q_hi)`` of the local block attend key rows ``[k_lo, k_hi)`` of the received block,
    causally (a square block of one sequence's same positions) or not."""

    q_lo: int
    q_hi: int
    k_lo: int
    k_hi: int
    causal: bool


def cu_seqlens_error(cu: tuple, seq_len: int, world_size: int, layout: str) -> str | None:
    """Why the boundaries ``cu`` (ints) cannot pack a sequence of ``seq_len`` positions over
    ``world_size`` ranks in ``layout``, or None."""
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != seq_len:
        return (f"cu_seqlens must start at 0 and end at S = W·S_r = {seq_len}, got "
                f"{list(cu)[:8]}{' …' if len(cu) > 8 else ''}")
    lens = [b - a for a, b in zip(cu, cu[1:])]
    if any(n < 0 for n in lens):
        return f"cu_seqlens must not decrease, got lengths {lens[:8]}"
    if layout == "zigzag":
        bad = [(i, n) for i, n in enumerate(lens) if n % (2 * world_size)]
        if bad:
            return (f"layout='zigzag' with cu_seqlens needs every sequence length divisible by "
                    f"2W = {2 * world_size} (each sequence is zigzagged on its own), got "
                    f"(sequence, length) {bad[:4]}")
    return None


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


def ring_segments(layout: str, causal: bool, world_size: int, rank: int, step: int,
                  seq_len_per_rank: int, cu: tuple) -> list[Segment]:
    """The segments rank ``rank`` computes at ring step ``step`` for the packed sequences ``cu``
    (boundaries over the global order; checked by ``cu_seqlens_error``), in local row
    coordinates of the query block and of the received key block; empty when the step has no
    pair of the same sequence (or causal masks every pair)."""
    s_r, w = seq_len_per_rank, world_size
    src = (rank - step) % w
    segs = []
    for a, b in zip(cu, cu[1:]):
        if b == a:
            continue
        if layout == "contiguous":
            qa, qb = max(a, rank * s_r), min(b, (rank + 1) * s_r)
            ka, kb = max(a, src * s_r), min(b, (src + 1) * s_r)
            if qa >= qb or ka >= kb or (causal and src > rank):
                continue
            segs.append(Segment(qa - rank * s_r, qb - rank * s_r, ka - src * s_r,
                                kb - src * s_r, causal and src == rank))
            continue
        lo, c = a // w, (b - a) // (2 * w)  # this sequence's local rows [lo, lo + 2c)
        if not causal or src == rank:
            segs.append(Segment(lo, lo + 2 * c, lo, lo + 2 * c, causal))
        elif src < rank:  # every query row sees the source's first chunk only
            segs.append(Segment(lo, lo + 2 * c, lo, lo + c, False))
        else:  # only the second query chunk sees the source's chunks, both of them
            segs.append(Segment(lo + c, lo + 2 * c, lo, lo + 2 * c, False))
    return segs


def positions(seq_len: int, world_size: int, rank: int, layout: str = "contiguous",
              cu_seqlens=None) -> torch.Tensor:
    """The global positions (int64 ``[S / W]``) rank ``rank`` holds of a sequence of ``seq_len``
    positions (``cu_seqlens``: packed sequences, zigzagged one by one under ``"zigzag"``).
    Raises ValueError when ``seq_len`` does not split (``W``, or ``2W`` for zigzag; every
    sequence's length by 2W for zigzag with ``cu_seqlens``)."""
    idx = torch.arange(seq_len, dtype=torch.int64)
    if layout == "contiguous":
        _validate_split(seq_len, world_size, "contiguous", world_size)
        return idx.view(world_size, -1)[rank].clone()
    return zigzag_shard(idx, world_size, rank, dim=0, cu_seqlens=cu_seqlens)


def _validate_split(n: int, world_size: int, layout: str, parts: int) -> None:
    if world_size < 1 or not 0 <= n or n % parts:
        raise ValueError(f"layout={layout!r}: a sequence of {n} positions does not split into "
                         f"{parts} equal chunks (W = {world_size})")


def cu_values(cu_seqlens) -> tuple:
    """``cu_seqlens`` (a tensor or a sequence) as a tuple of ints, read on the host."""
    return tuple(int(c) for c in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                  else cu_seqlens))


def _validate_cu(cu: tuple, n: int, world_size: int, op: str) -> None:
    why = cu_seqlens_error(cu, n, world_size, "zigzag")
    if why:
        raise ValueError(f"{op}: {why}")


def zigzag_shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, *,
                 cu_seqlens=None) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of the whole tensor ``x``: cut ``x`` along ``dim`` into
    ``2·world_size`` equal chunks and return chunks ``rank`` and ``2·world_size − 1 − rank``,
    concatenated in that order (a new tensor). With ``cu_seqlens`` every packed sequence is
    zigzagged on its own and the shards concatenated in sequence order (ring-flash-attention's
    zigzag varlen layout).

    Arguments:
        x: the whole tensor, e.g. ``[B, S, H, D]`` with ``dim=1``; any dtype.
        world_size: W, ranks of the ring. rank: ``0 ≤ rank < W``.
        dim: the sequence dimension.
        cu_seqlens: None, or the int boundaries ``[N + 1]`` (tensor or sequence) of packed
            sequences along ``dim``, from 0 to ``x.shape[dim]``.

    Raises:
        ValueError: ``x.shape[dim]`` (with ``cu_seqlens``: a sequence's length) is not
        divisible by ``2·W``, bad ``cu_seqlens``, or ``rank`` is out of range.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"zigzag_shard: rank {rank} is not in [0, {world_size})")
    if cu_seqlens is not None:
        cu = cu_values(cu_seqlens)
        _validate_cu(cu, x.shape[dim], world_size, "zigzag_shard")
        parts = [zigzag_shard(x.narrow(dim, a, b - a), world_size, rank, dim)
                 for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(parts, dim=dim) if parts else x.narrow(dim, 0, 0).clone()
    n = x.shape[dim]
    _validate_split(n, world_size, "zigzag", 2 * world_size)
    chunks = x.chunk(2 * world_size, dim=dim) if n else [x] * (2 * world_size)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1, *,
                   cu_seqlens=None) -> torch.Tensor:
    """The whole tensor back from every rank's zigzag shard (``shards[r]`` from rank r, each
    holding two equal chunks along ``dim``; with ``cu_seqlens``, two per packed sequence): the
    inverse of ``zigzag_shard`` with the same ``cu_seqlens``.

    Raises:
        ValueError: no shards, shards of different shapes, an odd length along ``dim``, or
        ``cu_seqlens`` that do not split the whole length (``W ×`` a shard's) by ``2W`` per
        sequence.
    """
    if not shards:
        raise ValueError("zigzag_unshard: no shards given")
    shape = tuple(shards[0].shape)
    if any(tuple(s.shape) != shape for s in shards):
        raise ValueError(f"zigzag_unshard: shards differ in shape: "
                         f"{[list(s.shape) for s in shards]}")
    if cu_seqlens is not None:
        w = len(shards)
        cu = cu_values(cu_seqlens)
        _validate_cu(cu, w * shape[dim], w, "zigzag_unshard")
        parts = [zigzag_unshard([s.narrow(dim, a // w, (b - a) // w) for s in shards], dim)
                 for a, b in zip(cu, cu[1:]) if b > a]
        return torch.cat(parts, dim=dim) if parts else shards[0].narrow(dim, 0, 0).clone()
    if shape[dim] % 2:
        raise ValueError(f"zigzag_unshard: each shard needs two equal chunks along dim {dim}, "
                         f"got length {shape[dim]}")
    c = shape[dim] // 2
    first = [s.narrow(dim, 0, c) for s in shards]
    second = [s.narrow(dim, c, c) for s in reversed(shards)]
    return torch.cat(first + second, dim=dim)
