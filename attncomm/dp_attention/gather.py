"""Moving hidden states between DP attention and the MLP that spans every rank.

Layouts of the global buffer (``n_r`` = DP rank r's token count, ``dp`` DP ranks):

- ``SUM_LEN``: ``[Σn, ...]``, rank r's rows at the exclusive cumsum ``Σ_{q<r} n_q``. Built by an
  all_reduce into a zeroed buffer where each DP rank wrote only its own slot.
- ``MAX_LEN``: ``[max(n)·dp, ...]``, rank r's rows at ``r·max(n)``; the rows after ``n_r`` in a
  slot are padding (zeros here; callers must not rely on them). Built by an all_gather of every
  rank's rows padded to ``max(n)``.

With an attention-TP size ``a > 1`` the group holds ``dp·a`` ranks (DP major) and each DP rank's
rows are replicated over its ``a`` attention-TP ranks: only attention-TP rank 0's copy is written.
The modes and their choice follow SGLang's ``DpPaddingMode`` / ``dp_gather`` /
``dp_scatter`` / ``dp_reduce_scatter_tensor`` (``python/sglang/srt/layers/dp_attention.py``).

Hot path (as the DCP exchanges'): the first ``dp_gather`` / ``dp_reduce_scatter`` call with a
new signature (per group) parses and checks its arguments (locally, then across ranks by the
validation mode) and keeps a plan of the layout under a key of the call's arguments; a later
call with the same key runs the plan: the collective and the copies it needs, nothing else.
Under ``torch.compile`` each is one custom op (``dp_attention/ops.py``: no decision to make,
the layout is the graph's constants); ``dp_scatter`` is plain slicing and traces as it is.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import config
from .._dist import group_name, resolve_group
from .._agree import DTYPE_CODES, validate_args
from ..collectives import all_gather_tensor, all_reduce, reduce_scatter_tensor
from .._plans import CallPlans, dest_error, dest_key
from .._dist import wait as _dist_wait

__all__ = ["DpPaddingMode", "choose_padding_mode", "dp_gather", "dp_scatter",
           "dp_reduce_scatter", "select_cuda_graph_bs", "global_layout"]


class DpPaddingMode(enum.IntEnum):
    """How the global buffer lays out the DP ranks' rows (see the module docstring)."""

    MAX_LEN = 1
    SUM_LEN = 2

    def is_max_len(self) -> bool:
        return self == DpPaddingMode.MAX_LEN

    def is_sum_len(self) -> bool:
        return self == DpPaddingMode.SUM_LEN


def _counts(global_num_tokens, name: str = "global_num_tokens") -> list[int]:
    vals = (global_num_tokens.tolist() if isinstance(global_num_tokens, torch.Tensor)
            else list(global_num_tokens))
    if not vals:
        raise ValueError(f"{name} is empty")
    if any(int(v) != v or v < 0 for v in vals):
        raise ValueError(f"{name} must hold ints ≥ 0, got {vals}")
    return [int(v) for v in vals]


def _mode(mode) -> DpPaddingMode:
    if isinstance(mode, DpPaddingMode):
        return mode
    # a plain dict, not DpPaddingMode.__members__ (torch 2.11's dynamo cannot trace `in` on it)
    by_name = {"MAX_LEN": DpPaddingMode.MAX_LEN, "SUM_LEN": DpPaddingMode.SUM_LEN}
    if isinstance(mode, str) and mode.upper() in by_name:
        return by_name[mode.upper()]
    raise ValueError(f"mode must be a DpPaddingMode (MAX_LEN or SUM_LEN), got {mode!r}")


def choose_padding_mode(global_num_tokens: Sequence[int],
                        is_extend_in_batch: bool) -> DpPaddingMode:
    """SUM_LEN if any rank extends, else MAX_LEN iff ``2·Σn ≥ max(n)·dp`` (padding costs at
    most as much traffic as the all_reduce that SUM_LEN needs), else SUM_LEN."""
    n = _counts(global_num_tokens)
    if is_extend_in_batch:
        return DpPaddingMode.SUM_LEN
    return DpPaddingMode.MAX_LEN if 2 * sum(n) >= max(n) * len(n) else DpPaddingMode.SUM_LEN


def global_layout(global_num_tokens: Sequence[int], mode) -> tuple[int, list[int]]:
    """``(rows of the global buffer, first row of each DP rank's slot)`` for ``mode``."""
    n, mode = _counts(global_num_tokens), _mode(mode)
    if mode is DpPaddingMode.SUM_LEN:
        offsets, acc = [], 0
        for v in n:
            offsets.append(acc)
            acc += v
        return acc, offsets
    m = max(n)
    return m * len(n), [r * m for r in range(len(n))]


def select_cuda_graph_bs(global_num_tokens: Sequence[int],
                         capture_bs: Sequence[int]) -> int | None:
    """The captured batch size every rank replays: the smallest in ``capture_bs`` that is ≥
    ``max(global_num_tokens)`` (the max, never the sum: each rank's graph holds its own rows);
    None when none fits."""
    need = max(_counts(global_num_tokens))
    fits = [int(b) for b in capture_bs if int(b) >= need]
    return min(fits) if fits else None


def _where(global_num_tokens, group, mode, attn_tp_size):
    """Parse the common arguments: (counts, mode, dp_rank, attn_tp_rank, local error)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    try:
        n, mode = _counts(global_num_tokens), _mode(mode)
        if isinstance(attn_tp_size, bool) or int(attn_tp_size) != attn_tp_size \
                or attn_tp_size < 1:
            raise ValueError(f"attn_tp_size must be an int ≥ 1, got {attn_tp_size!r}")
        if len(n) * attn_tp_size != world:
            raise ValueError(f"len(global_num_tokens)·attn_tp_size = {len(n)}·{attn_tp_size} "
                             f"must equal the group size {world}")
    except (ValueError, TypeError) as exc:
        return None, None, 0, 0, str(exc)
    return n, mode, rank // attn_tp_size, rank % attn_tp_size, None


def _signature(x: torch.Tensor, n, mode, attn_tp_size) -> tuple[list[int], list[str]]:
    try:
        dims = list(x.shape[1:])[:4]
        sig = [int(mode or 0), int(attn_tp_size), len(n or []), DTYPE_CODES.get(x.dtype, 0),
               x.dim(), *(dims + [0] * (4 - len(dims))), sum(n or []), max(n or [0]),
               sum((i + 1) * v for i, v in enumerate(n or [])) % (1 << 40)]
    except (TypeError, ValueError, AttributeError):  # a bad argument: a local error already
        sig = [-1] * 12
    labels = ["mode", "attn_tp_size", "len(global_num_tokens)", "dtype", "ndim", "shape[1]",
              "shape[2]", "shape[3]", "shape[4]", "sum(global_num_tokens)",
              "max(global_num_tokens)", "global_num_tokens checksum"]
    return sig, labels


# ---------------------------------------------------------------------------------- plans
@dataclasses.dataclass(eq=False)
class _PaddedRows:
    """A checked call signature of ``dp_gather`` / ``dp_reduce_scatter``: where each DP
    rank's rows sit in the padded buffer (token counts, padding mode, offsets, total) and
    this rank's place in the group."""

    group: object
    n: list
    mode: DpPaddingMode
    dp_rank: int
    tp_rank: int
    attn_tp_size: int
    world: int
    rest: tuple
    dtype: torch.dtype
    device: torch.device
    total: int
    offsets: list
    budget: float


_PLANS = CallPlans(1024)


def _plan(op, x, global_num_tokens, group, mode, attn_tp_size, validate, timeout_s,
          output) -> _PaddedRows:
    """The plan of this call: found by a key of its arguments (``output``'s kind included),
    else made (checks included)."""
    env_t = config.raw("ATTNCOMM_TIMEOUT_S") if timeout_s is None else ""
    env_v = config.raw("ATTNCOMM_VALIDATE") if validate is None else ""
    try:
        counts = (global_num_tokens.tolist() if isinstance(global_num_tokens, torch.Tensor)
                  else global_num_tokens)
        key = (op, x.shape, x.dtype, x.device, tuple(counts), mode, attn_tp_size, validate,
               timeout_s, env_t, env_v, dest_key(output))
        plan = _PLANS.get(group, key)
    except (AttributeError, TypeError):  # not a tensor, unhashable arguments: checks say why
        key = plan = None
    if plan is None:
        plan = _new_plan(op, x, global_num_tokens, group, mode, attn_tp_size, validate,
                         timeout_s, output, key)
    return plan


def _new_plan(op, x, global_num_tokens, group, mode, attn_tp_size, validate, timeout_s,
              output, key):
    g = resolve_group(group, op)
    budget = config.timeout_s(timeout_s)
    n, mode, dp_rank, tp_rank, err = _where(global_num_tokens, g, mode, attn_tp_size)
    if err is None:
        err = _local_error(op, x, n, mode, dp_rank)
    if err is None and output is not None:
        rows = global_layout(n, mode)[0] if op == "dp_gather" else n[dp_rank]
        err = dest_error(output, (rows, *x.shape[1:]), x.dtype, x.device)
    _validate(op, g, x, n, mode, attn_tp_size, err, validate, budget)
    total, offsets = global_layout(n, mode)
    plan = _PaddedRows(g, n, mode, dp_rank, tp_rank, int(attn_tp_size), dist.get_world_size(g),
                 tuple(x.shape[1:]), x.dtype, x.device, total, offsets, budget)
    if key is not None and config.validation_mode(validate) != "every":
        _PLANS.put(group, g, key, plan)
    return plan


def _local_error(op, x, n, mode, dp_rank) -> str | None:
    name = "local" if op == "dp_gather" else "global_partial"
    if not isinstance(x, torch.Tensor) or x.dim() < 1:
        return f"{name} must be a tensor of ≥ 1 dims, got {getattr(x, 'shape', type(x))}"
    if op == "dp_gather":
        if x.shape[0] != n[dp_rank]:
            return (f"local has shape {tuple(x.shape)} but global_num_tokens[{dp_rank}] = "
                    f"{n[dp_rank]}")
        return None
    total, _ = global_layout(n, mode)
    if x.shape[0] != total:
        return (f"global_partial has shape {tuple(x.shape)}, the {mode.name} layout of {n} "
                f"needs {total} rows")
    return None


def _validate(op, group, x, n, mode, attn_tp_size, err, validate, timeout_s) -> None:
    sig, labels = _signature(x, n, mode, attn_tp_size)
    validate_args(group, op, sig, labels, err, timeout_s, validate)


# ------------------------------------------------------------------------------ the calls
def dp_gather(local: torch.Tensor, global_num_tokens: Sequence[int], group=None, *, mode,
              attn_tp_size: int = 1, validate: bool | None = None,
              timeout_s: float | None = None, output: torch.Tensor | None = None) -> torch.Tensor:
    """Gather every DP rank's rows into the global buffer the MLP runs on.

    Arguments:
        local: ``[n_r, ...]`` this DP rank's rows (any dtype the group's collectives take).
        global_num_tokens: ``n`` per DP rank (list of ints, ``dp`` entries, same on every rank;
            a tensor costs a ``tolist()`` per call, and cannot be traced by torch.compile).
        group: the ``dp·attn_tp_size`` ranks of the MLP (DP major).
        mode: ``DpPaddingMode`` (or "max_len" / "sum_len").
        attn_tp_size: attention-TP ranks per DP rank; only attention-TP rank 0's copy is used.
        validate, timeout_s: as every functional call's (``attncomm._agree.validate_args``).
        output: the caller-owned destination, the global buffer's shape, ``local``'s dtype and
            device (contiguous ones receive the collective directly, others one copy).

    Returns:
        ``[Σn, ...]`` (SUM_LEN) or ``[max(n)·dp, ...]`` (MAX_LEN), ``local``'s dtype and device
        (``output`` when given).

    Raises:
        ValueError (every rank when validation is on) when ``local.shape[0] != n_r``, the group
        size is not ``dp·attn_tp_size``, or the ranks' arguments differ; a wrong ``output``;
        PeerTimeoutError.
    """
    if torch.compiler.is_compiling():
        return _traced("dp_gather", local, global_num_tokens, group, mode, attn_tp_size,
                       validate, timeout_s, output)
    p = _plan("dp_gather", local, global_num_tokens, group, mode, attn_tp_size, validate,
              timeout_s, output)
    if p.mode is DpPaddingMode.SUM_LEN:
        return _gather_sum(p, local, output)
    m = max(p.n)
    if m == 0:
        return output if output is not None else local.new_empty((0, *p.rest))
    mine = p.n[p.dp_rank]
    if mine == m and local.is_contiguous():
        block = local
    else:
        block = local.new_empty((m, *p.rest))
        block[:mine].copy_(local)
        block[mine:].zero_()
    direct = p.attn_tp_size == 1 and (output is None or output.is_contiguous())
    full = output if direct and output is not None else local.new_empty((p.world * m, *p.rest))
    _dist_wait(all_gather_tensor(full, block, p.group, async_op=True), p.group, "dp_gather",
               p.budget)
    if direct:
        return full
    if p.attn_tp_size > 1:
        full = full.view(len(p.n), p.attn_tp_size, m, *p.rest)[:, 0].reshape(len(p.n) * m,
                                                                             *p.rest)
    return full if output is None else output.copy_(full)


def _gather_sum(p: _PaddedRows, local, output):
    direct = output is None or output.is_contiguous()
    out = output if direct and output is not None else local.new_empty((p.total, *p.rest))
    out.zero_()
    mine, off = p.n[p.dp_rank], p.offsets[p.dp_rank]
    if p.tp_rank == 0 and mine:
        out[off:off + mine].copy_(local)
    if out.numel():
        _dist_wait(all_reduce(out, group=p.group, async_op=True), p.group, "dp_gather",
                   p.budget)
    return out if direct else output.copy_(out)


def dp_scatter(global_buf: torch.Tensor, global_num_tokens: Sequence[int], dp_rank: int, *,
               mode, output: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """DP rank ``dp_rank``'s rows of a global buffer (local; no communication).

    Arguments:
        global_buf: ``[Σn, ...]`` (SUM_LEN) or ``[max(n)·dp, ...]`` (MAX_LEN).
        global_num_tokens: ``n`` per DP rank.
        dp_rank: which DP rank's slot, in ``[0, dp)``.
        mode: the layout of ``global_buf``.
        output: optional ``[n_r, ...]`` tensor to copy the rows into (``out``: its former
            name, still taken).

    Returns:
        ``[n_r, ...]``: a view into ``global_buf`` (or ``output`` when given). Plain slicing:
        it traces as it is under torch.compile.

    Raises:
        ValueError for a ``global_buf`` whose row count does not match the layout, a
        ``dp_rank`` out of range, or an ``output`` of the wrong shape (or both ``output`` and
        ``out``).
    """
    what = "output"
    if out is not None:
        if output is not None:
            raise ValueError("dp_scatter: pass output= (out= is its former name), not both")
        output, what = out, "out"
    n, mode = _counts(global_num_tokens), _mode(mode)
    if not 0 <= int(dp_rank) < len(n):
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {len(n)})")
    total, offsets = global_layout(n, mode)
    if global_buf.dim() < 1 or global_buf.shape[0] != total:
        raise ValueError(f"dp_scatter: global_buf has shape {tuple(global_buf.shape)}, the "
                         f"{mode.name} layout of {n} needs {total} rows")
    rows = global_buf[offsets[dp_rank]:offsets[dp_rank] + n[dp_rank]]
    if output is None:
        return rows
    if tuple(output.shape) != tuple(rows.shape):
        raise ValueError(f"dp_scatter: {what} has shape {tuple(output.shape)}, expected "
                         f"{tuple(rows.shape)}")
    return output.copy_(rows)


def dp_reduce_scatter(global_partial: torch.Tensor, global_num_tokens: Sequence[int],
                      group=None, *, mode, attn_tp_size: int = 1, validate: bool | None = None,
                      timeout_s: float | None = None,
                      output: torch.Tensor | None = None) -> torch.Tensor:
    """This DP rank's rows of the sum over the group of ``global_partial`` (the MLP's partial
    sums), in place of an all_reduce followed by ``dp_scatter``.

    MAX_LEN with ``attn_tp_size == 1`` is one reduce_scatter (each rank receives its padded
    slot); SUM_LEN, or ``attn_tp_size > 1`` (every attention-TP rank needs the whole of its DP
    rank's rows), is an all_reduce of a copy followed by the slice — as SGLang does for SUM_LEN.

    Arguments:
        global_partial: ``[Σn, ...]`` or ``[max(n)·dp, ...]`` per ``mode``; not modified.
        global_num_tokens, group, mode, attn_tp_size, validate, timeout_s: as in ``dp_gather``.
        output: the caller-owned destination ``[n_r, ...]`` of ``global_partial``'s dtype and
            device (MAX_LEN receives the reduce_scatter directly when it is contiguous and
            ``n_r = max(n)``; otherwise one copy).

    Returns:
        ``[n_r, ...]`` in ``global_partial``'s dtype (summed in that dtype by the collective);
        ``output`` when given.

    Raises:
        ValueError (every rank when validation is on) for a row count that does not match the
        layout or differing arguments; a wrong ``output``; PeerTimeoutError.
    """
    if torch.compiler.is_compiling():
        return _traced("dp_reduce_scatter", global_partial, global_num_tokens, group, mode,
                       attn_tp_size, validate, timeout_s, output)
    p = _plan("dp_reduce_scatter", global_partial, global_num_tokens, group, mode,
              attn_tp_size, validate, timeout_s, output)
    mine = p.n[p.dp_rank]
    if p.total == 0:
        return output if output is not None else global_partial.new_empty((0, *p.rest))
    if p.mode is DpPaddingMode.MAX_LEN and p.attn_tp_size == 1:
        m = max(p.n)
        direct = output is not None and mine == m and output.is_contiguous()
        out = output if direct else global_partial.new_empty((m, *p.rest))
        work = reduce_scatter_tensor(out, global_partial.contiguous(), p.group, async_op=True)
        _dist_wait(work, p.group, "dp_reduce_scatter", p.budget)
        if direct:
            return out
        return out[:mine] if output is None else output.copy_(out[:mine])
    buf = global_partial.clone(memory_format=torch.contiguous_format)
    _dist_wait(all_reduce(buf, group=p.group, async_op=True), p.group, "dp_reduce_scatter",
               p.budget)
    rows = buf[p.offsets[p.dp_rank]:p.offsets[p.dp_rank] + mine]
    return rows.clone() if output is None else output.copy_(rows)


# ------------------------------------------------------------------------------ traced path
@torch.compiler.assume_constant_result
def _traced_group(group, op: str) -> tuple:
    """``(group name, rank, world size)`` of ``group``: run by torch.compile while it traces,
    a constant of the graph."""
    g = resolve_group(group, op)
    return group_name(g), dist.get_rank(g), dist.get_world_size(g)


def _traced(op, x, global_num_tokens, group, mode, attn_tp_size, validate, timeout_s, output):
    """The traced call: the result allocated in the graph (or the caller's ``output``), one
    ``attncomm::dp_gather`` / ``dp_reduce_scatter`` that runs the eager call into it. Nothing
    is decided: the layout follows from the (constant) counts."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = group.device_group  # an engine's group coordinator
    name, rank, _ = _traced_group(group, op)
    n, mode = [int(v) for v in global_num_tokens], _mode(mode)
    rows = global_layout(n, mode)[0] if op == "dp_gather" else n[rank // int(attn_tp_size)]
    if output is None:
        output = x.new_empty((rows, *x.shape[1:]))
    ops = torch.ops.attncomm
    fn = ops.dp_gather if op == "dp_gather" else ops.dp_reduce_scatter
    fn(x, output, n, name, int(mode), int(attn_tp_size),
       -1.0 if timeout_s is None else float(timeout_s),
       {None: -1, False: 0, True: 1}[None if validate is None else bool(validate)])
    return output
