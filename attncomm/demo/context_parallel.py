"""Demo mode ``context_parallel``: every attention layer under DCP, over the corpus sentences.

Every rank runs the MiniLM layers replicated except the attention core: the keys and values of
each layer are sharded across the W ranks (position p on rank p % W, ``dcp.shard_kv_interleaved``),
each rank computes the attention of all queries and all heads over its shard with the LSE (padding
keys masked; a shard holding only padding is an empty shard with −inf LSE), ``dcp.merge`` combines
the shards into this rank's head slice, and an all_gather of the head slices gives every rank the
full attention output to continue with. Compared: the sentence embeddings (mean pooling + L2
normalisation) against the one-process model.
"""
from __future__ import annotations

import torch

from .. import dcp
from .models import MiniLMInfo, dcp_attention, mean_pool
from .base import DemoConfig, DemoRow, RankContext, sentence_reference

__all__ = ["NAME", "skip_reason", "backends", "run", "dcp_skip_reason"]

NAME = "context_parallel"


def dcp_skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    """DCP merges return a head slice per rank, so the heads must divide evenly."""
    if info.num_heads % cfg.world_size:
        return (f"DCP needs num_heads % world_size == 0; the model has {info.num_heads} heads "
                f"and world_size is {cfg.world_size}")
    return None


def skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    return dcp_skip_reason(cfg, info)


def backends(cfg: DemoConfig) -> list[str]:
    return dcp.available_backends(cfg.device)


def _attend_fn(ctx: RankContext, mask: torch.Tensor, backend: str):
    """The attention core for one chunk: this rank's interleaved KV shard, merged by DCP."""
    local = dcp.shard_kv_interleaved(mask.shape[1], ctx.world_size, ctx.rank).to(ctx.device)
    valid = mask.bool()[:, local].unsqueeze(1)  # [b, 1, S_r]: padding keys never attend
    scale = ctx.model.scale

    def attend(i, q, k, v):
        return dcp_attention(q, k[:, local], v[:, local], valid, scale, backend=backend)

    return attend


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Embed the corpus with DCP attention in every layer; rank 0 returns the row."""
    ref = sentence_reference(ctx)
    embs: list[torch.Tensor] = []

    def work():
        for ids, mask in ctx.sentence_chunks():
            hidden = ctx.model.forward(ids, _attend_fn(ctx, mask, backend))
            embs.append(mean_pool(hidden, mask))
            ctx.advance(1.0 / ctx.num_chunks)

    seconds = ctx.timed(work)
    return ctx.row(NAME, backend, torch.cat(embs), ref, seconds)
