"""Demo mode ``usp``: every attention layer of MiniLM as USP — Ulysses inside groups of U
consecutive ranks, ring attention across the R groups (``attncomm.usp``).

W = U·R with U, R ≥ 2 (W = 4: U = 2, R = 2; U is the smallest such factor). Each chunk of corpus
sentences is padded to a multiple of U·R (contiguous) or 2·U·R (zigzag) and cut by the USP layout
(``usp_positions``: rank g holds piece g of the ring-ordered sequence). The attention core is
``USPAttention``: Ulysses all-to-all over the Ulysses group (12 heads → 6 per rank at U = 2),
ring attention over the ring group, all-to-all back. Padding keys are masked by USP's
``key_padding_mask`` (each rank's shard of the padding mask: gathered over the Ulysses group,
then passed around the ring with its K/V block). Compared: the sentence embeddings against the
one-process model. Backends (the ``backend`` column): the layout over the ring, with the grid.
"""
from __future__ import annotations

import torch

from ..usp import USPAttention, make_groups, usp_positions, usp_unshard
from .base import DemoConfig, DemoRow, RankContext, sentence_reference
from .models import MiniLMInfo, mean_pool
from .ring import block_attention, pad_to
from .ulysses import gather_sequence

__all__ = ["NAME", "skip_reason", "backends", "run", "grid"]

NAME = "usp"


def grid(world_size: int) -> tuple[int, int] | None:
    """``(U, R)``: the smallest U ≥ 2 dividing W with R = W / U ≥ 2, or None."""
    for u in range(2, world_size):
        if world_size % u == 0 and world_size // u >= 2:
            return u, world_size // u
    return None


def skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    if grid(cfg.world_size) is None:
        return (f"USP needs W = U·R with U, R ≥ 2 (W = 4: U = 2, R = 2); world_size is "
                f"{cfg.world_size}")
    return None


def backends(cfg: DemoConfig) -> list[str]:
    u, r = grid(cfg.world_size)
    return [f"U{u}xR{r} {layout}" for layout in ("contiguous", "zigzag")]


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Embed the corpus with USP attention in every layer; rank 0 returns the row."""
    ref = sentence_reference(ctx)
    u, r = grid(ctx.world_size)
    layout = backend.split()[-1]
    ug, rg = ctx.memo("usp_groups", lambda: make_groups(u, r, ctx.group))
    module = USPAttention(block_attention(ctx.model.scale), ulysses_group=ug, ring_group=rg,
                          pipeline_groups=0, layout=layout)
    parts = u * r * (2 if layout == "zigzag" else 1)
    embs: list[torch.Tensor] = []

    def work():
        for ids, mask in ctx.sentence_chunks():
            ids_p, mask_p = pad_to(ids, mask, parts)
            pos = usp_positions(ids_p.shape[1], u, r, ctx.rank, layout).to(ids.device)
            valid = mask_p[:, pos].bool()

            def attend(i, q, k, v):
                return module(q, k, v, key_padding_mask=valid)

            hidden = ctx.model.forward(ids_p[:, pos], attend, positions=pos)
            shards = gather_sequence(hidden, [len(pos)] * ctx.world_size,
                                     ctx.group).chunk(ctx.world_size, dim=1)
            full = usp_unshard(shards, u, r, layout)
            embs.append(mean_pool(full[:, :ids.shape[1]], mask))
            ctx.advance(1.0 / ctx.num_chunks)

    seconds = ctx.timed(work)
    return ctx.row(NAME, backend, torch.cat(embs), ref, seconds)
