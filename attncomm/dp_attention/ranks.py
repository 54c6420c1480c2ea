"""Where a rank sits in the DP-attention layout."""
from __future__ import annotations

__all__ = ["compute_dp_attention_world_info"]


def compute_dp_attention_world_info(tp_rank: int, tp_size: int, dp_size: int,
                                    cp_size: int = 1) -> tuple[int, int, int]:
    """``(attn_tp_rank, attn_tp_size, attn_dp_rank)`` of global TP rank ``tp_rank``.

    ``tp_size`` is the full TP group (every rank of the MLP); the layout is DP major, then
    attention CP, then attention TP (fastest): ``tp_rank = d·cp·attn_tp + c·attn_tp + t``, so
    ``attn_tp_size = tp_size // dp_size // cp_size``, ``attn_tp_rank = tp_rank % attn_tp_size``,
    ``attn_dp_rank = tp_rank // (attn_tp_size · cp_size)``. As in SGLang's
    ``compute_dp_attention_world_info`` (``python/sglang/srt/layers/dp_attention.py``).

    Raises:
        ValueError when a size is < 1, ``dp_size·cp_size`` does not divide ``tp_size``, or
        ``tp_rank`` is outside ``[0, tp_size)``.
    """
    for name, v in (("tp_size", tp_size), ("dp_size", dp_size), ("cp_size", cp_size)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an int ≥ 1, got {v!r}")
    if tp_size % (dp_size * cp_size) != 0:
        raise ValueError(f"tp_size={tp_size} is not divisible by dp_size·cp_size = "
                         f"{dp_size}·{cp_size}")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank={tp_rank} is outside [0, tp_size={tp_size})")
    attn_tp_size = tp_size // dp_size // cp_size
    return tp_rank % attn_tp_size, attn_tp_size, tp_rank // (attn_tp_size * cp_size)
