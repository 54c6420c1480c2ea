"""Real-model glue for the demo: all-MiniLM-L6-v2 run layer by layer, and attention cores that
replace its attention (one-process reference, DCP over a group)."""
from __future__ import annotations

from .attention import dcp_attention, full_attention, gather_heads, partial_attention
from .minilm import (AttendFn, LoadedMiniLM, MiniLM, MiniLMInfo, default_model_dir, load_minilm,
                     mean_pool)

__all__ = ["MiniLM", "MiniLMInfo", "LoadedMiniLM", "AttendFn", "load_minilm",
           "default_model_dir", "mean_pool", "partial_attention", "full_attention",
           "dcp_attention", "gather_heads"]
