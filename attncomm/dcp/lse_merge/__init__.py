"""The DCP merge: per-rank partial attention outputs merged by their log-sum-exp.

``functional`` is the facade's call (``merge``, its hot path and traced path), ``api`` the
objects (``DcpMerger``, ``merge_states``); ``backend`` the interface every backend implements and
the registry; ``collective`` (``reference``, ``ag_rs``, ``a2a``) and ``symm_a2a`` (with
``symm_kernels`` and ``symm_layout``) the backends; ``combine`` the local merge math.
"""
from __future__ import annotations

from .api import BACKENDS, DcpMerger, available_backends, merge_states, shard_kv_interleaved
from .backend import AUTO_CANDIDATES, RULE_OF_THUMB
from .functional import merge

__all__ = ["merge_states", "merge", "DcpMerger", "shard_kv_interleaved", "available_backends",
           "BACKENDS", "RULE_OF_THUMB", "AUTO_CANDIDATES"]
