"""The Ulysses exchanges as ``torch.library`` custom ops, for ``torch.compile``.

``seq_to_head``, ``head_to_seq`` and ``UlyssesAttention.forward`` call these ops instead of
their eager bodies while torch.compile traces (``torch.compiler.is_compiling()``), so a
compiled graph holds each exchange as one opaque node (``fullgraph=True``, no graph break) and
its fake implementation gives the result's shape. Eager calls never go through the dispatcher.

- Groups travel by name (``_dist.group_name``), as torch's functional collectives pass them.
- The transport is an argument, decided by an eager call of the shape before tracing
  (``api._traced_decision``); ``UlyssesAttention``'s op names the module, whose plan for the
  shape an eager forward made (``attention._traced_plan``). The op runs the same eager code, so
  the compiled result equals the eager one bit for bit.
- Mutation annotations: the ``*_out`` ops write ``output`` (``mutates_args``); the others
  write nothing their caller passed in (the transports' staging is their own).

Ops: ``attncomm::ulysses_seq_to_head``, ``ulysses_seq_to_head_out``, ``ulysses_head_to_seq``,
``ulysses_head_to_seq_out``, ``ulysses_attention``, ``ulysses_attention_joint`` (with joint rows:
two results).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._dist import group_from_name
from .._plans import lookup, timeout_arg, validate_arg
from . import api
from .layout import head_split

__all__ = ["seq_to_head_op", "seq_to_head_out_op", "head_to_seq_op", "head_to_seq_out_op",
           "attention_op", "attention_joint_op"]


def _kw(seq_lens, backend, timeout_s, validate) -> dict:
    return dict(seq_lens=None if seq_lens is None else tuple(seq_lens), backend=backend,
                timeout_s=timeout_arg(timeout_s), validate=validate_arg(validate))


def _payload(fp8: bool):
    return torch.float8_e4m3fn if fp8 else None


# ------------------------------------------------------------------------------ seq_to_head
@torch.library.custom_op("attncomm::ulysses_seq_to_head", mutates_args=())
def seq_to_head_op(x: torch.Tensor, group_name: str, rank: int, seq_lens: list[int] | None,
                   backend: str, timeout_s: float, validate: int,
                   fp8: bool = False) -> torch.Tensor:
    """``ulysses.seq_to_head(x, group, ...)`` with the group by name, this rank (the result's
    shape depends on it, so it is part of the graph: compiled graphs cached by their content
    are never shared between ranks) and the transport decided (``timeout_s < 0``: None;
    ``validate`` -1/0/1: None/False/True; ``fp8``: the FP8 payload)."""
    return api.seq_to_head(x, group_from_name(group_name), payload_dtype=_payload(fp8),
                           **_kw(seq_lens, backend, timeout_s, validate))


def _seq_to_head_shape(x, group_name, rank, seq_lens):
    world = dist.get_world_size(group_from_name(group_name))
    b, s_r, h, d = x.shape
    s = sum(seq_lens) if seq_lens is not None else s_r * world
    return (b, s, head_split(h, world)[rank], d)


@seq_to_head_op.register_fake
def _(x, group_name, rank, seq_lens, backend, timeout_s, validate, fp8=False):
    return x.new_empty(_seq_to_head_shape(x, group_name, rank, seq_lens))


@torch.library.custom_op("attncomm::ulysses_seq_to_head_out", mutates_args=("output",))
def seq_to_head_out_op(x: torch.Tensor, output: torch.Tensor, group_name: str, rank: int,
                       seq_lens: list[int] | None, backend: str, timeout_s: float,
                       validate: int, fp8: bool = False) -> None:
    """``ulysses.seq_to_head(x, group, ..., output=output)``."""
    api.seq_to_head(x, group_from_name(group_name), output=output, payload_dtype=_payload(fp8),
                    **_kw(seq_lens, backend, timeout_s, validate))


@seq_to_head_out_op.register_fake
def _(x, output, group_name, rank, seq_lens, backend, timeout_s, validate, fp8=False):
    return None


# ------------------------------------------------------------------------------ head_to_seq
@torch.library.custom_op("attncomm::ulysses_head_to_seq", mutates_args=())
def head_to_seq_op(x: torch.Tensor, group_name: str, rank: int, seq_lens: list[int] | None,
                   backend: str, timeout_s: float, validate: int,
                   num_heads: int) -> torch.Tensor:
    """``ulysses.head_to_seq(x, group, ...)`` (``num_heads < 0``: None)."""
    return api.head_to_seq(x, group_from_name(group_name),
                           num_heads=None if num_heads < 0 else num_heads,
                           **_kw(seq_lens, backend, timeout_s, validate))


def _head_to_seq_shape(x, group_name, rank, seq_lens, num_heads):
    world = dist.get_world_size(group_from_name(group_name))
    b, s, h_r, d = x.shape
    s_r = seq_lens[rank] if seq_lens is not None else s // world
    return (b, s_r, num_heads if num_heads >= 0 else h_r * world, d)


@head_to_seq_op.register_fake
def _(x, group_name, rank, seq_lens, backend, timeout_s, validate, num_heads):
    return x.new_empty(_head_to_seq_shape(x, group_name, rank, seq_lens, num_heads))


@torch.library.custom_op("attncomm::ulysses_head_to_seq_out", mutates_args=("output",))
def head_to_seq_out_op(x: torch.Tensor, output: torch.Tensor, group_name: str, rank: int,
                       seq_lens: list[int] | None, backend: str, timeout_s: float,
                       validate: int, num_heads: int) -> None:
    """``ulysses.head_to_seq(x, group, ..., output=output)``."""
    api.head_to_seq(x, group_from_name(group_name), output=output,
                    num_heads=None if num_heads < 0 else num_heads,
                    **_kw(seq_lens, backend, timeout_s, validate))


@head_to_seq_out_op.register_fake
def _(x, output, group_name, rank, seq_lens, backend, timeout_s, validate, num_heads):
    return None


# ------------------------------------------------------------------------------ attention
@torch.library.custom_op("attncomm::ulysses_attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None, module: str, causal: bool,
                 seq_lens: list[int] | None,
                 key_padding_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The forward of the ``UlyssesAttention`` named ``module`` (``rope=(cos, sin)`` when
    given; the key-padding mask a tensor of the op): its eager forward, with the plan an eager
    call of the shape made."""
    rope = None if cos is None else (cos, sin)
    seq = None if seq_lens is None else tuple(seq_lens)
    return lookup(module)._forward(q, k, v, seq, causal, rope, masks=(key_padding_mask, None))


@attention_op.register_fake
def _(q, k, v, cos, sin, module, causal, seq_lens, key_padding_mask=None):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


@torch.library.custom_op("attncomm::ulysses_attention_joint", mutates_args=())
def attention_joint_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cos: torch.Tensor | None, sin: torch.Tensor | None, q_j: torch.Tensor,
                       k_j: torch.Tensor, v_j: torch.Tensor, module: str, causal: bool,
                       seq_lens: list[int] | None, front: bool,
                       key_padding_mask: torch.Tensor | None = None,
                       joint_key_padding_mask: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of ``module`` with joint rows ``(q_j, k_j, v_j)`` at the front (``front``)
    or the back, and their masks: ``(out, joint_out)``."""
    rope = None if cos is None else (cos, sin)
    seq = None if seq_lens is None else tuple(seq_lens)
    return lookup(module)._forward(q, k, v, seq, causal, rope, (q_j, k_j, v_j),
                                   "front" if front else "back",
                                   (key_padding_mask, joint_key_padding_mask))


@attention_joint_op.register_fake
def _(q, k, v, cos, sin, q_j, k_j, v_j, module, causal, seq_lens, front, key_padding_mask=None,
      joint_key_padding_mask=None):
    return (q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3])),
            q.new_empty((q.shape[0], q_j.shape[1], q.shape[2], v.shape[3])))
