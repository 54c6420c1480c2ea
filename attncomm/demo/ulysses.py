"""Demo mode ``ulysses``: every attention layer of MiniLM on sequence-sharded activations.

Each chunk of corpus sentences is cut along the sequence into W contiguous shards of
``head_split(S, W)`` tokens (uneven; a rank may hold none). Every rank runs embeddings, QKV
projections, output projection and FFN on its own tokens only; the attention core is
``attncomm.ulysses.UlyssesAttention``: q, k, v go from sequence-sharded to head-sharded in one
all-to-all (12 heads over W=5 ranks → 3, 3, 2, 2, 2), each rank attends its heads over the whole
sequence (padding keys masked by the module's ``key_padding_mask``: each rank's shard of the
padding mask, gathered), and the output comes back sequence-sharded. At the end the
hidden states are gathered and mean-pooled. Compared: the sentence embeddings against the
one-process model. Backends (the ``backend`` column): ``all_to_all``, and ``ce`` on CUDA when
every pair of GPUs has P2P access; each also as ``<transport> fp8``, the q/k/v exchange with
the FP8 payload (``payload_dtype=torch.float8_e4m3fn``: lossy, so that row passes at
``base.FP8_THRESHOLD``).
"""
from __future__ import annotations

import torch

from ..collectives import gather_sequence
from .models import MiniLMInfo, full_attention, mean_pool
from ..ulysses import UlyssesAttention, head_split
from ..ulysses.layout import head_offsets
from ..ulysses.fp8 import FP8_DTYPE
from .base import FP8_THRESHOLD, DemoConfig, DemoRow, RankContext, sentence_reference

__all__ = ["NAME", "skip_reason", "backends", "run", "gather_sequence", "transports",
           "parse_backend"]

NAME = "ulysses"


def skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    return None  # any W: uneven heads and sequence shards (also empty ones) are fine


def _all_pairs_p2p(world_size: int) -> bool:
    """Whether the ranks' GPUs reach each other: P2P between every pair, or ranks that share
    GPUs (``attncomm.launch`` places them so when they outnumber the GPUs: CUDA IPC)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        return False
    n = min(world_size, torch.cuda.device_count())
    return all(torch.cuda.can_device_access_peer(a, b)
               for a in range(n) for b in range(n) if a != b)


def transports(cfg: DemoConfig) -> list[str]:
    """The Ulysses transports a demo row can ask for at ``cfg``."""
    names = ["all_to_all"]
    if cfg.device == "cuda" and cfg.world_size > 1 and _all_pairs_p2p(cfg.world_size):
        names.append("ce")
    return names


def backends(cfg: DemoConfig) -> list[str]:
    return [f"{t}{suffix}" for suffix in ("", " fp8") for t in transports(cfg)]


def parse_backend(backend: str):
    """``(transport, payload_dtype, threshold)`` of a row's backend name (``"<transport>"`` or
    ``"<transport> fp8"``): the FP8 rows pass at ``FP8_THRESHOLD``, the others at the dtype's
    (None)."""
    transport, _, payload = backend.partition(" ")
    if payload == "fp8":
        return transport, FP8_DTYPE, FP8_THRESHOLD
    return transport, None, None


def _block_attention(scale: float):
    """The module's ``attn_fn``: the one-process core with the model's scale; padding keys
    masked by the module's gathered ``key_padding_mask``."""

    def attn_fn(q, k, v, causal, key_padding_mask=None):
        valid = None if key_padding_mask is None else key_padding_mask[:, None, :]
        return full_attention(q, k, v, valid, scale)

    return attn_fn


def _attention(module: UlyssesAttention, valid: torch.Tensor, seq_lens: list[int]):
    def attend(i, q, k, v):
        return module(q, k, v, seq_lens=seq_lens, key_padding_mask=valid)

    return attend


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """Embed the corpus with Ulysses attention in every layer; rank 0 returns the row."""
    ref = sentence_reference(ctx)
    transport, payload, threshold = parse_backend(backend)
    module = UlyssesAttention(_block_attention(ctx.model.scale), group=ctx.group,
                              backend=transport, pipeline_groups=0, payload_dtype=payload)
    embs: list[torch.Tensor] = []

    def work():
        for ids, mask in ctx.sentence_chunks():
            lens = head_split(ids.shape[1], ctx.world_size)
            lo = head_offsets(lens)[ctx.rank]
            hi = lo + lens[ctx.rank]
            pos = torch.arange(lo, hi, device=ids.device)
            hidden = ctx.model.forward(ids[:, lo:hi],
                                       _attention(module, mask[:, lo:hi].bool(), lens),
                                       positions=pos)
            full = gather_sequence(hidden, lens, ctx.group)
            embs.append(mean_pool(full, mask))
            ctx.advance(1.0 / ctx.num_chunks)

    seconds = ctx.timed(work)
    used = set(module.last_backends.values())
    if used and used != {transport}:
        raise ValueError(f"ulysses demo: asked for backend {transport!r}, ran {sorted(used)}")
    return ctx.row(NAME, backend, torch.cat(embs), ref, seconds, threshold)
