"""diffusers' Flux transformer (``FluxTransformer2DModel``) with its attention through
``attncomm.ulysses.UlyssesAttention``: the image tokens sequence-sharded over the group, the text
tokens as joint rows.

Flux is an MMDiT: its double-stream blocks project text and image tokens with their own
weights and attend over ``[text; image]`` together; its single-stream blocks attend over the
concatenation ``[text; image]`` as one stream. Under Ulysses every rank holds all text tokens
and its shard of the image tokens (``head_split(S_img, W)`` contiguous rows, uneven allowed),
and ``FluxUlyssesProcessor`` runs each block's attention as
``UlyssesAttention(q_img, k_img, v_img, joint=(q_txt, k_txt, v_txt), joint_position="front")``:
the text rows stay out of the exchange, each rank takes its own heads of them, and the text
rows' output comes back with every head on every rank, so the text stream stays replicated
(the same bits on every rank) through the model. QK RMSNorm and Flux's RoPE (interleaved
pairs, diffusers' ``apply_rotary_emb``) are applied in the processor, per token, before the
exchange (``rope`` of ``UlyssesAttention`` is rotate-half over global positions; Flux's
rotation is not), exactly as diffusers' ``FluxAttnProcessor`` applies them.

diffusers is optional (``pip install -e ".[dit]"``): it is imported inside the functions
that need it; ``unavailable_reason()`` says whether it is there.

- ``flux_config(**overrides)``: a small Flux config (a few blocks, small dims).
- ``build_flux(config, seed, device, dtype)``: the model from its config, random weights from a
  fixed seed (nothing downloaded).
- ``flux_inputs(config, height, width, text_len, seed, batch)``: latents, text embeddings,
  pooled projection, timestep and position ids for an image of ``height × width`` tokens.
- ``shard_inputs(inputs, seq_lens, rank)``, ``sharded_forward(model, inputs, seq_lens, rank)``,
  ``ulysses_processors(model, processor)``: a rank's forward with the processor installed.
"""
from __future__ import annotations

import contextlib
import importlib.util

import torch

from ...ulysses import UlyssesAttention
from ...ulysses.layout import head_offsets

__all__ = ["FluxUlyssesProcessor", "flux_config", "build_flux", "flux_inputs", "shard_inputs",
           "sharded_forward", "ulysses_processors", "unavailable_reason"]


def unavailable_reason() -> str | None:
    """Why the Flux model cannot be built here (None when diffusers is importable)."""
    if importlib.util.find_spec("diffusers") is None:
        return 'diffusers is not installed (pip install -e ".[dit]")'
    return None


class FluxUlyssesProcessor:
    """A diffusers attention processor for Flux's ``FluxAttention`` that runs the attention core
    through ``attention`` (a ``UlyssesAttention``) with the text tokens as joint rows.

    Called by ``FluxAttention.forward`` as ``processor(attn, hidden_states,
    encoder_hidden_states, attention_mask, image_rotary_emb, **joint_attention_kwargs)``, where
    the model's ``joint_attention_kwargs`` must carry ``text_seq_len`` (text tokens) and
    ``image_seq_lens`` (every rank's image tokens, rank order):

    - double-stream block: ``hidden_states [B, S_r, E]`` (this rank's image tokens),
      ``encoder_hidden_states [B, S_t, E]`` (all text tokens) → ``(image out [B, S_r, E], text
      out [B, S_t, E])`` after ``to_out`` / ``to_add_out``;
    - single-stream block: ``hidden_states [B, S_t + S_r, E]`` (text rows first) → ``[B, S_t +
      S_r, H·D]`` (text rows first, every head).

    ``image_rotary_emb = (cos, sin)``, each ``[S_t + S_r, D]``, for the text rows then this
    rank's image rows (what the model computes from ``txt_ids`` and this rank's ``img_ids``).
    Attention masks are not supported (Flux passes none). Fused projections are not used.
    """

    def __init__(self, attention: UlyssesAttention):
        self.attention = attention

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None, text_seq_len: int | None = None,
                 image_seq_lens=None):
        if attention_mask is not None:
            raise ValueError("FluxUlyssesProcessor: attention masks are not supported")
        from diffusers.models.embeddings import apply_rotary_emb

        heads = (-1, attn.head_dim)
        q, k, v = (p(hidden_states).unflatten(-1, heads)
                   for p in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)
        double = encoder_hidden_states is not None
        if double:
            tq, tk, tv = (p(encoder_hidden_states).unflatten(-1, heads)
                          for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            tq, tk = attn.norm_added_q(tq), attn.norm_added_k(tk)
            s_t = tq.shape[1]
        else:
            if text_seq_len is None:
                raise ValueError("FluxUlyssesProcessor: a single-stream block needs "
                                 "joint_attention_kwargs['text_seq_len']")
            s_t = text_seq_len
            (tq, q), (tk, k), (tv, v) = ((x[:, :s_t], x[:, s_t:]) for x in (q, k, v))
        if image_rotary_emb is not None:
            cos, sin = image_rotary_emb
            text_rope, image_rope = (cos[:s_t], sin[:s_t]), (cos[s_t:], sin[s_t:])
            tq, tk = (apply_rotary_emb(x, text_rope, sequence_dim=1) for x in (tq, tk))
            q, k = (apply_rotary_emb(x, image_rope, sequence_dim=1) for x in (q, k))
        seq_lens = None if image_seq_lens is None else tuple(image_seq_lens)
        out, text = self.attention(q, k, v, seq_lens=seq_lens, joint=(tq, tk, tv))
        out, text = out.flatten(2, 3).to(q.dtype), text.flatten(2, 3).to(q.dtype)
        if double:
            out = attn.to_out[1](attn.to_out[0](out))
            return out, attn.to_add_out(text)
        return torch.cat((text, out), dim=1)


def flux_config(**overrides) -> dict:
    """A small ``FluxTransformer2DModel`` config: 2 double-stream and 2 single-stream blocks,
    6 heads of 16 (RoPE axes 4 + 6 + 6), 16 latent channels; ``overrides`` replace entries."""
    cfg = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2,
               attention_head_dim=16, num_attention_heads=6, joint_attention_dim=32,
               pooled_projection_dim=16, guidance_embeds=False, axes_dims_rope=(4, 6, 6))
    cfg.update(overrides)
    return cfg


def build_flux(config: dict, seed: int = 0, device="cpu", dtype=torch.float32):
    """``FluxTransformer2DModel(**config)`` with its default initialisation drawn under
    ``torch.manual_seed(seed)`` (the same weights in every process), in eval mode on ``device``
    in ``dtype``."""
    from diffusers import FluxTransformer2DModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FluxTransformer2DModel(**config)
    model = model.eval().to(device)
    # a cast only when needed (diffusers warns about casting to another dtype with to())
    return model if dtype == torch.float32 else model.to(dtype=dtype)


def flux_inputs(config: dict, height: int, width: int, text_len: int, seed: int = 0,
                batch: int = 1, device="cpu", dtype=torch.float32) -> dict:
    """The model's keyword inputs for an image of ``height × width`` latent tokens and
    ``text_len`` text tokens, drawn from ``seed``: ``hidden_states [B, h·w, C]``,
    ``encoder_hidden_states [B, S_t, E_txt]``, ``pooled_projections [B, E_pool]``,
    ``timestep [B]`` in (0, 1), ``img_ids [h·w, 3]`` (row, column), ``txt_ids [S_t, 3]``
    (zeros, as Flux pipelines pass)."""
    g = torch.Generator().manual_seed(seed)
    s = height * width
    img_ids = torch.zeros(s, 3)
    img_ids[:, 1] = torch.arange(s) // width
    img_ids[:, 2] = torch.arange(s) % width
    out = dict(hidden_states=torch.randn((batch, s, config["in_channels"]), generator=g),
               encoder_hidden_states=torch.randn((batch, text_len,
                                                  config["joint_attention_dim"]), generator=g),
               pooled_projections=torch.randn((batch, config["pooled_projection_dim"]),
                                              generator=g),
               timestep=torch.rand((batch,), generator=g), img_ids=img_ids,
               txt_ids=torch.zeros(text_len, 3))
    return {k: v.to(device=device, dtype=dtype) if v.is_floating_point() and "ids" not in k
            else v.to(device) for k, v in out.items()}


def shard_inputs(inputs: dict, seq_lens, rank: int) -> dict:
    """This rank's inputs: its contiguous image tokens (``hidden_states``, ``img_ids``); the
    text, pooled projection and timestep whole."""
    lo = head_offsets(list(seq_lens))[rank]
    hi = lo + seq_lens[rank]
    return dict(inputs, hidden_states=inputs["hidden_states"][:, lo:hi],
                img_ids=inputs["img_ids"][lo:hi])


def sharded_forward(model, inputs: dict, seq_lens, rank: int) -> torch.Tensor:
    """One forward of this rank's image tokens (``ulysses_processors`` installed): ``[B, S_r,
    C]``, the model's output for them."""
    part = shard_inputs(inputs, seq_lens, rank)
    kwargs = {"text_seq_len": inputs["encoder_hidden_states"].shape[1],
              "image_seq_lens": list(seq_lens)}
    with torch.no_grad():
        return model(**part, joint_attention_kwargs=kwargs, return_dict=False)[0]


@contextlib.contextmanager
def ulysses_processors(model, processor):
    """Install ``processor`` on every attention module of ``model``; the original processors
    come back on exit."""
    mods = [m for m in model.modules() if hasattr(m, "set_processor") and hasattr(m,
                                                                                  "processor")]
    saved = [m.processor for m in mods]
    for m in mods:
        m.set_processor(processor)
    try:
        yield model
    finally:
        for m, p in zip(mods, saved):
            m.set_processor(p)
