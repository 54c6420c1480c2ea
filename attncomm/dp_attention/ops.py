"""``dp_gather`` and ``dp_reduce_scatter`` as ``torch.library`` custom ops, for torch.compile.

Both call these ops instead of their eager bodies while torch.compile traces
(``torch.compiler.is_compiling()``); eager calls never go through the dispatcher. Each op runs
the eager call into ``output`` (allocated in the graph, or the caller's), so the compiled result
equals the eager one bit for bit; it writes only ``output`` (``mutates_args``). Groups travel by
name, as torch's functional collectives pass them; the counts, mode and attention-TP size are
the graph's constants (a change of counts is a new trace, as for any Python int argument).
``dp_scatter`` is plain slicing and needs no op.

Ops: ``attncomm::dp_gather``, ``attncomm::dp_reduce_scatter``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._dist import group_from_name
from .gather import DpPaddingMode, dp_gather, dp_reduce_scatter, global_layout

__all__ = ["dp_gather_op", "dp_reduce_scatter_op"]

_VALIDATE = {-1: None, 0: False, 1: True}


def _kw(mode: int, attn_tp_size: int, timeout_s: float, validate: int) -> dict:
    return dict(mode=DpPaddingMode(mode), attn_tp_size=attn_tp_size,
                timeout_s=None if timeout_s < 0 else timeout_s, validate=_VALIDATE[validate])


def _validate_rows(op: str, x, output, group_name: str, n, mode: int, attn_tp_size: int) -> None:
    # While tracing: the row counts the eager call would refuse, as ValueError.
    rank = dist.get_rank(group_from_name(group_name))
    total, _ = global_layout(n, DpPaddingMode(mode))
    mine = n[rank // attn_tp_size] if rank // attn_tp_size < len(n) else -1
    want_in, want_out = (mine, total) if op == "dp_gather" else (total, mine)
    if x.dim() < 1 or x.shape[0] != want_in or output.shape[0] != want_out:
        raise ValueError(f"{op}: input {tuple(x.shape)} and output {tuple(output.shape)} do "
                         f"not fit global_num_tokens={list(n)} ({DpPaddingMode(mode).name}) on "
                         f"rank {rank}: {want_in} and {want_out} rows")


@torch.library.custom_op("attncomm::dp_gather", mutates_args=("output",))
def dp_gather_op(local: torch.Tensor, output: torch.Tensor, global_num_tokens: list[int],
                 group_name: str, padding_mode: int, attn_tp_size: int,
                 timeout_s: float, validate: int) -> None:
    """``dp_gather(local, global_num_tokens, group, ..., output=output)`` (``timeout_s < 0``:
    None; ``validate`` -1/0/1: None/False/True)."""
    dp_gather(local, global_num_tokens, group_from_name(group_name), output=output,
              **_kw(padding_mode, attn_tp_size, timeout_s, validate))


@dp_gather_op.register_fake
def _(local, output, global_num_tokens, group_name, padding_mode, attn_tp_size, timeout_s,
      validate):
    _validate_rows("dp_gather", local, output, group_name, global_num_tokens, padding_mode,
                attn_tp_size)


@torch.library.custom_op("attncomm::dp_reduce_scatter", mutates_args=("output",))
def dp_reduce_scatter_op(global_partial: torch.Tensor, output: torch.Tensor,
                         global_num_tokens: list[int], group_name: str,
                         padding_mode: int, attn_tp_size: int, timeout_s: float,
                         validate: int) -> None:
    """``dp_reduce_scatter(global_partial, global_num_tokens, group, ..., output=output)``."""
    dp_reduce_scatter(global_partial, global_num_tokens, group_from_name(group_name),
                      output=output, **_kw(padding_mode, attn_tp_size, timeout_s, validate))


@dp_reduce_scatter_op.register_fake
def _(global_partial, output, global_num_tokens, group_name, padding_mode, attn_tp_size,
      timeout_s, validate):
    _validate_rows("dp_reduce_scatter", global_partial, output, group_name, global_num_tokens,
                padding_mode, attn_tp_size)
