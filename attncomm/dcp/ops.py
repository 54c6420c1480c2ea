"""The DCP exchanges as ``torch.library`` custom ops, for ``torch.compile``.

``dcp.merge``, ``DcpMerger``, ``dcp.gather_heads`` and ``DcpQueryGather`` (so ``DcpAttention``,
which chains them) call these ops instead of their eager bodies while torch.compile traces
(``torch.compiler.is_compiling()``): a compiled graph holds each exchange as one opaque node
(``fullgraph=True``, no graph break), and eager calls never go through the dispatcher.

- Every op runs the eager code of its call, so the compiled result equals the eager one bit for
  bit; every op writes caller- or graph-allocated destinations and returns nothing, which its
  mutation annotation says (``mutates_args``): the inputs are read only.
- Groups travel by name (``_dist.group_name``), as torch's functional collectives pass them;
  objects by the name they registered at construction (``_plans.register``).
- Decisions are never made in a trace: the functional ops need an eager call of the shape on
  the group first (checked while tracing: the warm-up error), the object ops the object, which
  decided at construction.
- The fake implementations write nothing; they raise ``ValueError`` while tracing where the
  call would fail: the functional ops' when no eager call built the shape's exchange on the
  group (the warm-up error), the object ops' when the object's local checks fail.

Ops: ``attncomm::dcp_merge``, ``dcp_merger``, ``dcp_gather_heads``, ``dcp_query_gather``.
"""
from __future__ import annotations

import torch

from .._dist import group_from_name
from .._plans import lookup, timeout_arg, validate_arg
from .lse_merge.functional import require_warm as require_merge_warm
from .lse_merge.functional import merge
from .query_gather.functional import require_warm as require_gather_warm
from .query_gather.functional import gather_heads

__all__ = ["merge_op", "merger_op", "gather_heads_op", "query_gather_op"]


# ------------------------------------------------------------------------------ dcp.merge
@torch.library.custom_op("attncomm::dcp_merge", mutates_args=("output", "output_lse"))
def merge_op(out: torch.Tensor, lse: torch.Tensor, output: torch.Tensor,
             output_lse: torch.Tensor, group_name: str, backend: str, lse_base: str,
             timeout_s: float, validate: int) -> None:
    """``dcp.merge(out, lse, group, ..., return_lse=True, output=(output, output_lse))`` with
    the group by name (``timeout_s < 0``: None; ``validate`` -1/0/1: None/False/True)."""
    merge(out, lse, group_from_name(group_name), backend=backend, lse_base=lse_base,
          return_lse=True, validate=validate_arg(validate),
          timeout_s=timeout_arg(timeout_s), output=(output, output_lse))


@merge_op.register_fake
def _(out, lse, output, output_lse, group_name, backend, lse_base, timeout_s, validate):
    require_merge_warm(group_name, out, backend, lse_base, timeout_arg(timeout_s))


# ------------------------------------------------------------------------------ DcpMerger
@torch.library.custom_op("attncomm::dcp_merger", mutates_args=("res", "res_lse"))
def merger_op(out: torch.Tensor, lse: torch.Tensor, res: torch.Tensor, res_lse: torch.Tensor,
              name: str) -> None:
    """The ``DcpMerger`` registered as ``name`` merges ``out``/``lse`` into ``res`` /
    ``res_lse`` (the LSE in the merger's base)."""
    merger = lookup(name)
    merger._ensure_open()
    merger.accept(out, lse)
    merger.into(out, lse, res, res_lse)


@merger_op.register_fake
def _(out, lse, res, res_lse, name):
    err = lookup(name).local_error(out, lse)
    if err:
        raise ValueError(f"DcpMerger: {err}")
    return None


# ------------------------------------------------------------------------------ dcp.gather_heads
@torch.library.custom_op("attncomm::dcp_gather_heads", mutates_args=("output",))
def gather_heads_op(q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                    output: torch.Tensor, group_name: str, backend: str, timeout_s: float,
                    validate: int) -> None:
    """``dcp.gather_heads(q, group, ..., rope=(cos, sin) or None, output=output)``."""
    gather_heads(q, group_from_name(group_name), backend=backend,
                 rope=None if cos is None else (cos, sin),
                 validate=validate_arg(validate),
                 timeout_s=timeout_arg(timeout_s), output=output)


@gather_heads_op.register_fake
def _(q, cos, sin, output, group_name, backend, timeout_s, validate):
    require_gather_warm(group_name, q, cos, backend, timeout_arg(timeout_s))


# ------------------------------------------------------------------------------ DcpQueryGather
@torch.library.custom_op("attncomm::dcp_query_gather", mutates_args=("output",))
def query_gather_op(q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                    output: torch.Tensor, name: str) -> None:
    """The ``DcpQueryGather`` registered as ``name`` gathers ``q`` into ``output``."""
    gatherer = lookup(name)
    gatherer._ensure_open()
    rope = None if cos is None else (cos, sin)
    gatherer.accept(q, rope)
    gatherer.into(q, rope, output)


@query_gather_op.register_fake
def _(q, cos, sin, output, name):
    err = lookup(name).local_error(q, None if cos is None else (cos, sin))
    if err:
        raise ValueError(f"DcpQueryGather: {err}")
    return None
