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
"""
from __future__ import annotations

import enum
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import config
from .._dist import (DTYPE_CODES, all_gather_tensor, check_args, reduce_scatter_tensor,
                     resolve_group)
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
    if isinstance(mode, str) and mode.upper() in DpPaddingMode.__members__:
        return DpPaddingMode[mode.upper()]
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
        if int(attn_tp_size) != attn_tp_size or attn_tp_size < 1:
            raise ValueError(f"attn_tp_size must be an int ≥ 1, got {attn_tp_size!r}")
        if len(n) * attn_tp_size != world:
            raise ValueError(f"len(global_num_tokens)·attn_tp_size = {len(n)}·{attn_tp_size} "
                             f"must equal the group size {world}")
    except ValueError as exc:
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


def _check(op, group, x, n, mode, attn_tp_size, err, validate, timeout_s) -> None:
    sig, labels = _signature(x, n, mode, attn_tp_size)
    check_args(group, op, sig, labels, err, timeout_s, validate)


def dp_gather(local: torch.Tensor, global_num_tokens: Sequence[int], group=None, *, mode,
              attn_tp_size: int = 1, validate: bool | None = None,
              timeout_s: float | None = None) -> torch.Tensor:
    """Gather every DP rank's rows into the global buffer the MLP runs on.

    Arguments:
        local: ``[n_r, ...]`` this DP rank's rows (any dtype the group's collectives take).
        global_num_tokens: ``n`` per DP rank (list of ints, ``dp`` entries, same on every rank).
        group: the ``dp·attn_tp_size`` ranks of the MLP (DP major).
        mode: ``DpPaddingMode`` (or "max_len" / "sum_len").
        attn_tp_size: attention-TP ranks per DP rank; only attention-TP rank 0's copy is used.

    Returns:
        ``[Σn, ...]`` (SUM_LEN) or ``[max(n)·dp, ...]`` (MAX_LEN), ``local``'s dtype and device.

    Raises:
        ValueError (every rank when validation is on) when ``local.shape[0] != n_r``, the group
        size is not ``dp·attn_tp_size``, or the ranks' arguments differ; PeerTimeoutError.
    """
    group = resolve_group(group, "dp_gather")
    n, mode, dp_rank, tp_rank, err = _where(global_num_tokens, group, mode, attn_tp_size)
    if err is None and (local.dim() < 1 or local.shape[0] != n[dp_rank]):
        err = (f"local has shape {tuple(local.shape)} but global_num_tokens[{dp_rank}] = "
               f"{n[dp_rank]}")
    _check("dp_gather", group, local, n, mode, attn_tp_size, err, validate, timeout_s)
    rest, mine = tuple(local.shape[1:]), n[dp_rank]
    total, offsets = global_layout(n, mode)
    if mode is DpPaddingMode.SUM_LEN:
        out = local.new_zeros((total, *rest))
        if tp_rank == 0 and mine:
            out[offsets[dp_rank]:offsets[dp_rank] + mine].copy_(local)
        if out.numel():
            _dist_wait(dist.all_reduce(out, group=group, async_op=True), group, "dp_gather",
                       config.timeout_s(timeout_s))
        return out
    m = max(n)
    if m == 0:
        return local.new_empty((0, *rest))
    if mine == m and local.is_contiguous():
        block = local
    else:
        block = local.new_empty((m, *rest))
        block[:mine].copy_(local)
        block[mine:].zero_()
    world = dist.get_world_size(group)
    full = local.new_empty((world * m, *rest))
    _dist_wait(all_gather_tensor(full, block, group, async_op=True), group, "dp_gather",
               config.timeout_s(timeout_s))
    if attn_tp_size == 1:
        return full
    return full.view(len(n), attn_tp_size, m, *rest)[:, 0].reshape(len(n) * m, *rest)


def dp_scatter(global_buf: torch.Tensor, global_num_tokens: Sequence[int], dp_rank: int, *,
               mode, out: torch.Tensor | None = None) -> torch.Tensor:
    """DP rank ``dp_rank``'s rows of a global buffer (local; no communication).

    Arguments:
        global_buf: ``[Σn, ...]`` (SUM_LEN) or ``[max(n)·dp, ...]`` (MAX_LEN).
        global_num_tokens: ``n`` per DP rank.
        dp_rank: which DP rank's slot, in ``[0, dp)``.
        mode: the layout of ``global_buf``.
        out: optional ``[n_r, ...]`` tensor to copy the rows into.

    Returns:
        ``[n_r, ...]``: a view into ``global_buf`` (or ``out`` when given).

    Raises:
        ValueError for a ``global_buf`` whose row count does not match the layout, a
        ``dp_rank`` out of range, or an ``out`` of the wrong shape.
    """
    n, mode = _counts(global_num_tokens), _mode(mode)
    if not 0 <= int(dp_rank) < len(n):
        raise ValueError(f"dp_rank={dp_rank} is outside [0, {len(n)})")
    total, offsets = global_layout(n, mode)
    if global_buf.dim() < 1 or global_buf.shape[0] != total:
        raise ValueError(f"dp_scatter: global_buf has shape {tuple(global_buf.shape)}, the "
                         f"{mode.name} layout of {n} needs {total} rows")
    rows = global_buf[offsets[dp_rank]:offsets[dp_rank] + n[dp_rank]]
    if out is None:
        return rows
    if tuple(out.shape) != tuple(rows.shape):
        raise ValueError(f"dp_scatter: out has shape {tuple(out.shape)}, expected "
                         f"{tuple(rows.shape)}")
    return out.copy_(rows)


def dp_reduce_scatter(global_partial: torch.Tensor, global_num_tokens: Sequence[int],
                      group=None, *, mode, attn_tp_size: int = 1, validate: bool | None = None,
                      timeout_s: float | None = None) -> torch.Tensor:
    """This DP rank's rows of the sum over the group of ``global_partial`` (the MLP's partial
    sums), in place of an all_reduce followed by ``dp_scatter``.

    MAX_LEN with ``attn_tp_size == 1`` is one reduce_scatter (each rank receives its padded
    slot); SUM_LEN, or ``attn_tp_size > 1`` (every attention-TP rank needs the whole of its DP
    rank's rows), is an all_reduce of a copy followed by the slice — as SGLang does for SUM_LEN.

    Arguments:
        global_partial: ``[Σn, ...]`` or ``[max(n)·dp, ...]`` per ``mode``; not modified.
        global_num_tokens, group, mode, attn_tp_size: as in ``dp_gather``.

    Returns:
        ``[n_r, ...]`` in ``global_partial``'s dtype (summed in that dtype by the collective).

    Raises:
        ValueError (every rank when validation is on) for a row count that does not match the
        layout or differing arguments; PeerTimeoutError.
    """
    group = resolve_group(group, "dp_reduce_scatter")
    n, mode, dp_rank, _, err = _where(global_num_tokens, group, mode, attn_tp_size)
    if err is None:
        total, _ = global_layout(n, mode)
        if global_partial.dim() < 1 or global_partial.shape[0] != total:
            err = (f"global_partial has shape {tuple(global_partial.shape)}, the {mode.name} "
                   f"layout of {n} needs {total} rows")
    _check("dp_reduce_scatter", group, global_partial, n, mode, attn_tp_size, err, validate,
           timeout_s)
    rest, mine = tuple(global_partial.shape[1:]), n[dp_rank]
    total, offsets = global_layout(n, mode)
    if total == 0:
        return global_partial.new_empty((0, *rest))
    if mode is DpPaddingMode.MAX_LEN and attn_tp_size == 1:
        out = global_partial.new_empty((max(n), *rest))
        work = reduce_scatter_tensor(out, global_partial.contiguous(), group, async_op=True)
        _dist_wait(work, group, "dp_reduce_scatter", config.timeout_s(timeout_s))
        return out[:mine]
    buf = global_partial.clone(memory_format=torch.contiguous_format)
    _dist_wait(dist.all_reduce(buf, group=group, async_op=True), group, "dp_reduce_scatter",
               config.timeout_s(timeout_s))
    return buf[offsets[dp_rank]:offsets[dp_rank] + mine].clone()
