"""DCP merge: merge per-rank partial attention outputs by their log-sum-exp.

Backends: ``reference`` (all_gather everything), ``ag_rs`` (all_gather LSE + local correction +
reduce_scatter), ``a2a`` (one packed all_to_all + local combine), ``symm_a2a`` (P2P stores into
symmetric memory, CUDA only), ``auto``.
"""
from __future__ import annotations

from .api import (BACKENDS, DcpMerger, available_backends, merge, merge_states,
                  shard_kv_interleaved)

__all__ = ["merge_states", "merge", "DcpMerger", "shard_kv_interleaved", "available_backends",
           "BACKENDS"]
