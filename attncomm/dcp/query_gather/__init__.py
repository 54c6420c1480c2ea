"""DCP's query-head all-gather before attention.

``api`` is the facade (``gather_heads``, ``DcpQueryGather``); ``backend`` the interface every
backend implements and the registry; ``all_gather`` and ``symm`` (with ``symm_kernels``) the
backends; ``query_math`` the RoPE and FP8 rules every backend computes bit for bit.
"""
from __future__ import annotations

from .api import DcpQueryGather, gather_heads
from .backend import GATHER_BACKENDS
from .query_math import FP8_DTYPE, FP8_MAX, quantize_e4m3, rotate_tail

__all__ = ["gather_heads", "DcpQueryGather", "GATHER_BACKENDS", "rotate_tail", "quantize_e4m3",
           "FP8_DTYPE", "FP8_MAX"]
