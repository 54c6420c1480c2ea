"""Demo mode ``ring``: every attention layer of MiniLM as ring attention over W ranks.

Each chunk of corpus sentences is padded along the sequence to a multiple of W (contiguous) or
2W (zigzag) and cut into W equal shards by the layout (``attncomm.ring.positions``); every rank
runs embeddings (with its tokens' global positions), projections and FFN on its own tokens only,
and the attention core is ``attncomm.ring.RingAttention``: K/V blocks go around the ring and the
partial outputs merge by LSE. MiniLM is bidirectional, so no causal mask; padding keys are
masked by the ring's ``key_padding_mask`` (each rank's shard of the batch's padding mask, passed
around with its K/V block): a padding key's score is −inf and a block holding only padding is
an empty shard of the merge (LSE −inf). The per-block ``attn_fn`` is
``ring.reference_attention`` with the model's scale. Compared: the sentence embeddings of the
padded batch (sentences of different lengths) against the one-process model. Backends (the
``backend`` column): the layouts ``contiguous`` and ``zigzag``.
"""
from __future__ import annotations

import torch

from ..ring import RingAttention, positions, reference_attention, zigzag_unshard
from .base import DemoConfig, DemoRow, RankContext, sentence_reference
from .models import MiniLMInfo, mean_pool
from .ulysses import gather_sequence

__all__ = ["NAME", "skip_reason", "backends", "run", "block_attention", "pad_to"]

NAME = "ring"


def skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    return None  # any W: the sequence is padded to a multiple of the shard count


def backends(cfg: DemoConfig) -> list[str]:
    return ["contiguous", "zigzag"]


def pad_to(ids: torch.Tensor, mask: torch.Tensor, multiple: int):
    """``ids, mask [B, S]`` right-padded (token 0, mask 0) to a multiple of ``multiple``."""
    s = ids.shape[1]
    extra = -s % multiple
    if not extra:
        return ids, mask
    return (torch.cat([ids, ids.new_zeros(ids.shape[0], extra)], dim=1),
            torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1))


def block_attention(scale: float):
    """The per-block ``attn_fn`` with the model's score scale (not ``1/√(D + 1)``)."""

    def attn_fn(q, k, v, causal, key_padding_mask=None):
        return reference_attention(q, k, v, causal, scale=scale,
                                   key_padding_mask=key_padding_mask)

    return attn_fn


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Embed the corpus with ring attention in every layer; rank 0 returns the row."""
    ref = sentence_reference(ctx)
    layout, world = backend, ctx.world_size
    module = RingAttention(block_attention(ctx.model.scale), ctx.group, layout=layout)
    parts = world * (2 if layout == "zigzag" else 1)
    embs: list[torch.Tensor] = []

    def work():
        for ids, mask in ctx.sentence_chunks():
            ids_p, mask_p = pad_to(ids, mask, parts)
            s_pad = ids_p.shape[1]
            pos = positions(s_pad, world, ctx.rank, layout).to(ids.device)
            valid = mask_p[:, pos].bool()

            def attend(i, q, k, v):
                return module(q, k, v, key_padding_mask=valid)

            hidden = ctx.model.forward(ids_p[:, pos], attend, positions=pos)
            shards = gather_sequence(hidden, [len(pos)] * world, ctx.group).chunk(world, dim=1)
            full = torch.cat(shards, 1) if layout == "contiguous" else zigzag_unshard(shards)
            embs.append(mean_pool(full[:, :ids.shape[1]], mask))
            ctx.advance(1.0 / ctx.num_chunks)

    seconds = ctx.timed(work)
    return ctx.row(NAME, backend, torch.cat(embs), ref, seconds)
