"""Ring attention: a sequence sharded over the ranks of a group, K/V blocks passed around the
ring with point-to-point transfers under the attention, partial outputs merged online by LSE.

- ``ring_attention`` / ``RingAttention``: the exchange (``ring/api.py``).
- ``zigzag_shard`` / ``zigzag_unshard`` / ``positions``: the layouts (``ring/layout.py``).
- ``attention_with_lse``: the default per-block ``attn_fn`` (``ring/attn.py``);
  ``reference_attention`` its fp32 math.
- ``merge_block``: the online merge step (``ring/merge.py``), the DCP merge's rule.
"""
from __future__ import annotations

from .api import RingAttention, ring_attention
from .attn import attention_with_lse, reference_attention
from .layout import LAYOUTS, positions, zigzag_shard, zigzag_unshard
from .merge import merge_block

__all__ = ["ring_attention", "RingAttention", "zigzag_shard", "zigzag_unshard", "positions",
           "LAYOUTS", "attention_with_lse", "reference_attention", "merge_block"]
