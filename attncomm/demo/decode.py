"""Demo mode ``decode``: causal token-by-token decoding with a KV cache sharded across ranks (DCP).

The MiniLM layers run causally over ``cfg.decode_seqs`` token sequences (teacher-forced from the
corpus): first a ``cfg.decode_prefix``-token prefix in one pass, then ``cfg.decode_steps`` steps of
one token per sequence. Each layer's KV cache grows sharded: position p is stored only on rank
p % W. Every step each rank attends the new query over its own cache rows (LSE included, an empty
shard gives −inf), ``dcp.merge`` combines them into this rank's head slice and an all_gather of the
slices continues replicated. Compared: the final hidden states of every position against the same
causal computation in one process (one pass with a causal mask).
"""
from __future__ import annotations

import torch

from .. import dcp
from ..models import dcp_attention, full_attention
from .base import DemoConfig, DemoRow, RankContext
from .context_parallel import dcp_skip_reason

__all__ = ["NAME", "skip_reason", "backends", "run"]

NAME = "decode"


def skip_reason(cfg: DemoConfig, info) -> str | None:
    return dcp_skip_reason(cfg, info)


def backends(cfg: DemoConfig) -> list[str]:
    return dcp.available_backends(cfg.device)


def _reference(ctx: RankContext) -> torch.Tensor | None:
    """Rank 0: last hidden states ``[B, L, E]`` of the causal model in one process."""
    if ctx.rank != 0:
        return None
    ids = ctx.decode_ids
    L = ids.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=ctx.device).tril().unsqueeze(0)
    scale = ctx.model.scale
    return ctx.model.forward(ids, lambda i, q, k, v: full_attention(q, k, v, causal, scale))


class _ShardedCache:
    """This rank's KV cache rows of every layer: ``[B, cap, H, D]`` k and v per layer."""

    def __init__(self, ctx: RankContext, batch: int, total_len: int):
        info, W, r = ctx.info, ctx.world_size, ctx.rank
        cap = len(dcp.shard_kv_interleaved(total_len, W, r))
        shape = (batch, cap, info.num_heads, info.head_dim)
        self.k = [torch.empty(shape, dtype=ctx.model.dtype, device=ctx.device)
                  for _ in range(info.num_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.length = 0  # rows filled (the same in every layer between steps)


def _prefill(ctx: RankContext, cache: _ShardedCache, ids: torch.Tensor, backend: str):
    """The prefix in one pass: causal DCP attention over the local prefix positions."""
    P = ids.shape[1]
    local = dcp.shard_kv_interleaved(P, ctx.world_size, ctx.rank).to(ctx.device)
    n = local.numel()
    # valid[q, j]: key position local[j] is not after query position q.
    valid = (local.unsqueeze(0) <= torch.arange(P, device=ctx.device).unsqueeze(1)).unsqueeze(0)
    scale = ctx.model.scale

    def attend(i, q, k, v):
        cache.k[i][:, :n] = k[:, local]
        cache.v[i][:, :n] = v[:, local]
        return dcp_attention(q, cache.k[i][:, :n], cache.v[i][:, :n], valid, scale,
                             backend=backend)

    hidden = ctx.model.forward(ids, attend)
    cache.length = n
    return hidden


def _step(ctx: RankContext, cache: _ShardedCache, token: torch.Tensor, pos: int, backend: str):
    """One decode step: ``token [B, 1]`` at position ``pos`` → its last hidden state
    ``[B, 1, E]``. Only the owner rank (pos % W) stores the new K/V row."""
    model = ctx.model
    mine = pos % ctx.world_size == ctx.rank
    n = cache.length + int(mine)
    x = model.embed(token, torch.tensor([pos], device=ctx.device))
    for i in range(ctx.info.num_layers):
        q, k, v = model.layer_qkv(i, x)
        if mine:
            cache.k[i][:, n - 1] = k[:, 0]
            cache.v[i][:, n - 1] = v[:, 0]
        attn = dcp_attention(q, cache.k[i][:, :n], cache.v[i][:, :n], None, model.scale,
                             backend=backend)
        x = model.layer_finish(i, x, attn)
    cache.length = n
    return x


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Decode with a sharded KV cache; rank 0 returns the row."""
    ref = ctx.memo("decode_reference", lambda: _reference(ctx),
                   label="one-process reference")
    ids = ctx.decode_ids
    B, L = ids.shape
    P = ctx.cfg.decode_prefix
    outs: list[torch.Tensor] = []

    def work():
        cache = _ShardedCache(ctx, B, L)
        outs.append(_prefill(ctx, cache, ids[:, :P], backend))
        ctx.advance(1.0 / (L - P + 1))
        for pos in range(P, L):
            outs.append(_step(ctx, cache, ids[:, pos:pos + 1], pos, backend))
            ctx.advance(1.0 / (L - P + 1))

    seconds = ctx.timed(work)
    return ctx.row(NAME, backend, torch.cat(outs, dim=1), ref, seconds)
