"""Demo mode ``dp_attention``: a DP-attention scheduler simulation whose MLP is MiniLM's.

W DP ranks, each with its own scheduler (random arrivals, idle stretches, prefills mixed with
decodes, prebuilt batches), run ``STEPS`` steps of sync → dp_gather → MLP → dp_scatter (and
dp_reduce_scatter). The MLP is layer 0's FFN of all-MiniLM-L6-v2 (``gelu(x W_up + b) W_down +
b``), tensor-parallel over every rank (the FFN width split in W slices); the tokens are the
model's embeddings of corpus tokens. Every step the ranks check that they decided alike and that
the MLP input is every rank's tokens (``attncomm.dp_attention.simulate``). Compared: every rank's
MLP output rows against one process running the FFN over all tokens in fp64. Backend "auto": the
padding mode chosen per step by ``choose_padding_mode`` and the sync path by ``sync="auto"``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .dp_simulate import MlpWeights, SimConfig, simulate_rank
from .base import DemoConfig, DemoRow, RankContext

__all__ = ["NAME", "STEPS", "skip_reason", "backends", "run"]

NAME = "dp_attention"
STEPS = 1000


def skip_reason(cfg: DemoConfig, info) -> str | None:
    return None  # any world size: every rank is one DP rank (attention-TP size 1)


def backends(cfg: DemoConfig) -> list[str]:
    return ["auto"]


def _token_source(ctx: RankContext):
    """``(step, dp_rank, n) → [n, E]``: embeddings of n consecutive corpus tokens, the same on
    every rank (the start depends on step and DP rank only)."""
    stream = ctx.input_ids[ctx.attention_mask.bool()]
    length = stream.numel()
    max_pos = ctx.info.max_positions

    def tokens(step: int, dp_rank: int, n: int) -> torch.Tensor:
        start = (step * 7919 + dp_rank * 104729) % length
        idx = (start + torch.arange(n, device=stream.device)) % length
        pos = torch.arange(n, device=stream.device) % max_pos
        return ctx.model.embed(stream[idx].unsqueeze(0), pos)[0]

    return tokens


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Run the simulation on every rank; rank 0 returns the row (min/max over every rank)."""
    layer = ctx.model.layers[0]
    weights = MlpWeights(layer.up_w.t(), layer.up_b, layer.down_w.t(), layer.down_b)
    cfg = SimConfig(steps=STEPS, sync="auto", dtype=ctx.model.dtype, device=ctx.device.type,
                    seed=1234)
    results: list = []

    def work():
        results.append(simulate_rank(ctx.rank, ctx.world_size, cfg, weights=weights,
                                     tokens=_token_source(ctx),
                                     progress=lambda f: ctx.advance(f)))

    seconds = ctx.timed(work)
    stats = [None] * ctx.world_size
    dist.all_gather_object(stats, results[0]["stats"], group=ctx.cpu_group)
    if ctx.rank != 0:
        return None
    return DemoRow(NAME, backend, ctx.world_size, min(s["min_cosine"] for s in stats),
                   max(s["max_abs_err"] for s in stats), seconds)
