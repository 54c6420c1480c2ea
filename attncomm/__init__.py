"""attncomm: the communication around parallel attention in inference.

Three exchanges, engine-agnostic, on any number of ranks:

- ``attncomm.dcp``: the DCP merge of per-rank partial attention outputs by their LSE,
- ``attncomm.ulysses``: the Ulysses sequence↔head all-to-all around attention,
- ``attncomm.dp_attention``: the per-step agreement of DP-attention ranks before the MLP,

and beyond one node ``attncomm.ring`` (ring attention: K/V blocks around the ranks, online LSE
merge) and ``attncomm.usp`` (Ulysses inside a node × ring across nodes).
"""
from __future__ import annotations

from . import config

config.default_safe_env()  # before anything below can start NCCL or symmetric memory

from . import dcp, dp_attention, ring, ulysses, usp  # noqa: E402
from ._dist import cpu_group, release, set_group_device  # noqa: E402
from .errors import PeerTimeoutError  # noqa: E402
from .launch import RankPool, launch  # noqa: E402

__version__ = "0.1.0"
__all__ = ["launch", "RankPool", "cpu_group", "release", "set_group_device", "PeerTimeoutError",
           "dcp", "ulysses", "dp_attention", "ring", "usp", "__version__"]

