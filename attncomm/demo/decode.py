"""Demo mode ``decode``: causal token-by-token decoding with a KV cache sharded across ranks (DCP).

The MiniLM layers run causally over ``cfg.decode_seqs`` token sequences (teacher-forced from the
corpus): first a ``cfg.decode_prefix``-token prefix in one pass, then ``cfg.decode_steps`` steps of
one token per sequence. Each layer's KV cache grows sharded: position p is stored only on rank
p % W. The prefix attends through ``dcp_attention`` (full queries, ``dcp.merge``). Every decode
step runs head-sharded through ``dcp.DcpAttention``: each rank projects only its own query heads
(its rows of the q projection), the layer gathers them (``DcpQueryGather``), attends all heads
over this rank's cache rows (LSE included, an empty shard gives −inf) and merges into this
rank's head slice; ``dcp.gather_heads`` of the slices continues replicated. Compared: the final
hidden states of every position against the same causal computation in one process (one pass
with a causal mask).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import dcp
from .models import dcp_attention, full_attention, partial_attention
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


def _own_qkv(model, i: int, x: torch.Tensor, rank: int, world_size: int):
    """This rank's query heads and the new token's k, v: ``x [B, 1, E]`` → ``q [B, H/W, D]``
    (only this rank's rows of the q projection), ``k, v [B, 1, H, D]``."""
    L = model.layers[i]
    H, D = model.info.num_heads, model.info.head_dim
    hs, E = H // world_size, H * D
    rows = slice(rank * hs * D, (rank + 1) * hs * D)
    B = x.shape[0]
    q = F.linear(x, L.qkv_w[rows], L.qkv_b[rows]).view(B, hs, D)
    kv = F.linear(x, L.qkv_w[E:], L.qkv_b[E:]).view(B, 1, 2, H, D)
    return q, kv[:, :, 0].contiguous(), kv[:, :, 1].contiguous()


def _decode_layer(ctx: RankContext, batch: int, backend: str) -> dcp.DcpAttention:
    """One ``DcpAttention`` for every layer: gather → attention over the local cache → merge
    with ``backend``."""
    scale = ctx.model.scale

    def attn_fn(q_all, k_local, v_local):  # [B, H, D] over [B, n, H, D] → [B, H, D], [B, H]
        out, lse = partial_attention(q_all[:, None], k_local, v_local, None, scale)
        return out[:, 0], lse[:, 0]

    info = ctx.info
    return dcp.DcpAttention(attn_fn, max_tokens=batch, num_heads=info.num_heads,
                            head_dim=info.head_dim, dtype=ctx.model.dtype,
                            merge_backend=backend)


def _step(ctx: RankContext, cache: _ShardedCache, token: torch.Tensor, pos: int,
          layer: dcp.DcpAttention):
    """One decode step: ``token [B, 1]`` at position ``pos`` → its last hidden state
    ``[B, 1, E]``. Only the owner rank (pos % W) stores the new K/V row."""
    model = ctx.model
    mine = pos % ctx.world_size == ctx.rank
    n = cache.length + int(mine)
    x = model.embed(token, torch.tensor([pos], device=ctx.device))
    for i in range(ctx.info.num_layers):
        q, k, v = _own_qkv(model, i, x, ctx.rank, ctx.world_size)
        if mine:
            cache.k[i][:, n - 1] = k[:, 0]
            cache.v[i][:, n - 1] = v[:, 0]
        merged = layer(q, cache.k[i][:, :n], cache.v[i][:, :n])  # [B, H/W, D]
        attn = dcp.gather_heads(merged, validate=False).unsqueeze(1)  # [B, 1, H, D]
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
        layer = _decode_layer(ctx, B, backend)
        outs.append(_prefill(ctx, cache, ids[:, :P], backend))
        ctx.advance(1.0 / (L - P + 1))
        for pos in range(P, L):
            outs.append(_step(ctx, cache, ids[:, pos:pos + 1], pos, layer))
            ctx.advance(1.0 / (L - P + 1))

    seconds = ctx.timed(work)
    return ctx.row(NAME, backend, torch.cat(outs, dim=1), ref, seconds)
