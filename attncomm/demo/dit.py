"""Demo mode ``dit``: a diffusion transformer — diffusers' Flux (``FluxTransformer2DModel``) —
with its image tokens sequence-sharded over W ranks and its text tokens as Ulysses joint rows.

The model is small and built from its config (``models/flux.py``: 2 double-stream and 2
single-stream blocks, 6 heads of 16, random weights from a fixed seed: nothing downloaded); the
input is a 12 × 13 latent image (156 image tokens: uneven shards ``head_split(156, W)``) and 10
text tokens, drawn from a fixed seed. Every rank runs the whole model on its image tokens and
all text tokens; each block's attention goes through ``UlyssesAttention`` with
``FluxUlyssesProcessor`` (the image tokens exchanged, the text tokens attended as joint rows at
the front, their output gathered over heads so the text stream stays the same on every rank).
Compared: the output for every image token (gathered) against the unmodified model in one
process, per token (cosine over the output channels). Backends: the Ulysses transports of the
``ulysses`` mode, each also with the FP8 payload (``<transport> fp8``, passing at
``base.FP8_THRESHOLD``). Needs diffusers (``pip install -e ".[dit]"``); skipped without it.
"""
from __future__ import annotations

import torch

from ..ulysses import UlyssesAttention, head_split
from .base import DemoConfig, DemoRow, RankContext
from .models import MiniLMInfo
from .models import flux
from .ulysses import gather_sequence, parse_backend, transports

__all__ = ["NAME", "model_line", "skip_reason", "backends", "run", "IMAGE", "TEXT_TOKENS",
           "SEED"]

NAME = "dit"
#: Latent image (height, width) in tokens, text tokens, and the seed of weights and inputs.
IMAGE = (12, 13)
TEXT_TOKENS = 10
SEED = 2026


def model_line(cfg: DemoConfig) -> str:
    """The line the demo prints for this mode's model (not MiniLM's)."""
    c = flux.flux_config()
    return (f"model Flux (diffusers FluxTransformer2DModel from its config: {c['num_layers']} "
            f"double-stream and {c['num_single_layers']} single-stream blocks, "
            f"{c['num_attention_heads']} heads of {c['attention_head_dim']}, random weights, "
            f"seed {SEED}): a {IMAGE[0]} × {IMAGE[1]} latent image "
            f"({IMAGE[0] * IMAGE[1]} image tokens) and {TEXT_TOKENS} text tokens")


def skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None:
    return flux.unavailable_reason()


def backends(cfg: DemoConfig) -> list[str]:
    return [f"{t}{suffix}" for suffix in ("", " fp8") for t in transports(cfg)]


def _model(ctx: RankContext):
    def build():
        config = flux.flux_config()
        model = flux.build_flux(config, SEED, ctx.device, ctx.cfg.torch_dtype)
        inputs = flux.flux_inputs(config, *IMAGE, TEXT_TOKENS, SEED + 1, device=ctx.device,
                                  dtype=ctx.cfg.torch_dtype)
        return model, inputs
    return ctx.memo("dit_model", build, label="dit: building Flux")


def _reference(ctx: RankContext, model, inputs) -> torch.Tensor | None:
    """The one-process output ``[B, S_img, C]`` (rank 0 computes it; None elsewhere)."""
    def compute():
        if ctx.rank != 0:
            return None
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]
    return ctx.memo("dit_reference", compute, label="dit: one-process reference")


def run(ctx: RankContext, backend: str) -> DemoRow | None:
    """The sharded Flux forward with Ulysses joint attention; rank 0 returns the row."""
    model, inputs = _model(ctx)
    ref = _reference(ctx, model, inputs)
    transport, payload, threshold = parse_backend(backend)
    module = UlyssesAttention(group=ctx.group, backend=transport, payload_dtype=payload)
    lens = head_split(IMAGE[0] * IMAGE[1], ctx.world_size)
    out = []

    def work():
        with flux.ulysses_processors(model, flux.FluxUlyssesProcessor(module)):
            out.append(flux.sharded_forward(model, inputs, lens, ctx.rank))
        ctx.advance(1.0)

    seconds = ctx.timed(work)
    used = set(module.last_backends.values())
    if used and used != {transport}:
        raise ValueError(f"dit demo: asked for backend {transport!r}, ran {sorted(used)}")
    full = gather_sequence(out[0], lens, ctx.group)
    return ctx.row(NAME, backend, full, ref, seconds, threshold)
