"""DCP's query-head all-gather before attention.

``functional`` is the facade's call (``gather_heads``, its hot path and traced path), ``api``
the object (``DcpQueryGather``); ``backend`` the interface every backend implements and the
registry; ``all_gather`` and ``symm`` (with ``symm_kernels``) the
backends; ``query_math`` the RoPE and FP8 rules every backend computes bit for bit.
"""
from __future__ import annotations

from .api import DcpQueryGather
from .backend import GATHER_BACKENDS
from .functional import gather_heads
from .query_math import FP8_DTYPE, FP8_MAX, quantize_e4m3, rotate_tail

__all__ = ["gather_heads", "DcpQueryGather", "GATHER_BACKENDS", "rotate_tail", "quantize_e4m3",
           "FP8_DTYPE", "FP8_MAX"]
