"""Ulysses all-to-all: sequence-sharded ↔ head-sharded activations around attention.

- ``head_split(H, W)``: heads per rank (uneven allowed: 7 over 4 → 2, 2, 2, 1).
- ``seq_to_head`` / ``head_to_seq``: the two exchanges, any head count, any sequence split.
- ``UlyssesAttention``: attention over the whole sequence on sequence-sharded q/k/v, with
  GQA/MQA, RMSNorm + RoPE and head-group pipelining (``pipeline_groups=-1``: decided by
  measurement on CUDA, ``pipeline_choice``); for diffusion transformers, joint rows
  (``forward(..., joint=(q_j, k_j, v_j))``: rows every rank holds, e.g. text tokens, kept out of
  the exchange and attended with the sequence) and the FP8 payload (``payload_dtype``, ``fp8``).
- Transports: ``all_to_all`` (the process group's ``all_to_all_single`` with split sizes) and
  ``ce`` (copy-engine copies into torch SymmetricMemory staging slots); ``auto`` picks
  (``attncomm.select``), and ``UlyssesAttention.fallback_reason`` says why it did not take
  ``ce`` (``backend_availability()`` for ``attncomm env``).
- ``torch.compile`` and CUDA graphs: while torch.compile traces, each exchange is one custom op
  (``ops``); a shape that one eager call has seen can be captured in a CUDA graph or compiled.
"""
from __future__ import annotations

from .api import backend_availability, head_to_seq, seq_to_head
from .attention import UlyssesAttention, rms_norm_rope, sdpa_attention
from .layout import head_split
from . import ops  # noqa: F401  (registers the custom ops torch.compile traces)

__all__ = ["head_split", "seq_to_head", "head_to_seq", "UlyssesAttention", "sdpa_attention",
           "rms_norm_rope", "backend_availability"]
