"""DP attention: the per-step sync of DP ranks before the MLP, and moving hidden states between
DP attention and the MLP that spans every rank.

- ``ForwardMode``, ``BatchView``, ``MLPSyncBatchInfo``, ``prepare_mlp_sync_batch``: six int64
  per rank, one exchange (``sync`` = "shm" | "hier" | "cpu" | "device" | "auto"), one decision
  everywhere; ``sync_decision`` says which path "auto" took and why.
- ``DpPaddingMode``, ``choose_padding_mode``, ``dp_gather``, ``dp_scatter``,
  ``dp_reduce_scatter``, ``select_cuda_graph_bs`` (``ops``: the first two as custom ops for
  torch.compile).
- ``compute_dp_attention_world_info``: where a rank sits in the DP / CP / TP layout.
"""
from __future__ import annotations

from . import ops  # noqa: F401 - registers the attncomm::dp_* custom ops
from .gather import (DpPaddingMode, choose_padding_mode, dp_gather, dp_reduce_scatter,
                     dp_scatter, global_layout, select_cuda_graph_bs)
from .ranks import compute_dp_attention_world_info
from .rows import sync_decision
from .sync import (BatchView, ForwardMode, MLPSyncBatchInfo, close_shm_channels, count_tokens,
                   prepare_mlp_sync_batch, resolve_sync)

__all__ = ["ForwardMode", "BatchView", "MLPSyncBatchInfo", "prepare_mlp_sync_batch",
           "count_tokens", "resolve_sync", "sync_decision", "close_shm_channels", "DpPaddingMode",
           "choose_padding_mode", "dp_gather", "dp_scatter", "dp_reduce_scatter",
           "select_cuda_graph_bs", "global_layout", "compute_dp_attention_world_info"]
