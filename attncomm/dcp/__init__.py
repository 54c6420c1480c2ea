"""DCP merge: merge per-rank partial attention outputs by their log-sum-exp.

Backends: ``reference`` (all_gather everything), ``ag_rs`` (all_gather LSE + local correction +
reduce_scatter), ``a2a`` (one packed all_to_all + local combine), ``symm_a2a`` (P2P stores into
symmetric memory, CUDA only), ``auto``. Before attention, the query-head all-gather:
``gather_heads`` / ``DcpQueryGather`` (backends ``all_gather``, ``symm``, ``auto``), with RoPE on
the last R dims fused into the producer. Each exchange has its folder (``lse_merge/``,
``query_gather/``) with one interface module its facade and backends import, built on what
``exchange`` gives both; ``attention`` chains them; ``ops`` registers the custom ops a
``torch.compile`` trace calls instead.
"""
from __future__ import annotations

from . import ops  # noqa: F401 - registers the attncomm::dcp_* custom ops
from .attention import DcpAttention
from .lse_merge import (BACKENDS, DcpMerger, available_backends, merge, merge_states,
                        shard_kv_interleaved)
from .query_gather import (FP8_DTYPE, FP8_MAX, GATHER_BACKENDS, DcpQueryGather, gather_heads,
                           quantize_e4m3, rotate_tail)

__all__ = ["merge_states", "merge", "DcpMerger", "shard_kv_interleaved", "available_backends",
           "BACKENDS", "gather_heads", "DcpQueryGather", "rotate_tail", "GATHER_BACKENDS",
           "DcpAttention", "quantize_e4m3", "FP8_DTYPE", "FP8_MAX"]
