"""attncomm: the communication around parallel attention in inference.

Three exchanges, engine-agnostic, on any number of ranks:

- ``attncomm.dcp``: the DCP merge of per-rank partial attention outputs by their LSE,
- ``attncomm.ulysses``: the Ulysses sequence↔head all-to-all around attention,
- ``attncomm.dp_attention``: the per-step agreement of DP-attention ranks before the MLP.
"""
from __future__ import annotations

import importlib

from . import config
from ._dist import cpu_group
from .errors import PeerTimeoutError
from .launch import RankPool, launch

config.default_safe_env()

__version__ = "0.1.0"
__all__ = ["launch", "RankPool", "cpu_group", "PeerTimeoutError", "dcp", "ulysses",
           "dp_attention", "__version__"]


def __getattr__(name):
    # Subpackages load on first use so `import attncomm` stays light.
    if name in ("dcp", "ulysses", "dp_attention"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attncomm' has no attribute {name!r}")
