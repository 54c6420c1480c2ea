"""Agreement across ranks, over a process group's gloo twin (``_dist.cpu_group`` /
``validation_group``): host tensors only, each wait bounded.

- ``agree``: the cross-rank argument check that raises the same ``ValueError`` on every rank;
  ``validate_args``: when a call runs it (``config.validation_mode``: the first call with a
  new signature per group, every call, or never), over one group or a grid of two,
- ``agreed_min``: the smallest of one int over the ranks (a launch bound, a yes/no),
- ``agree_reason``: whether something can run everywhere, with every rank's reason against it.

Names: an argument check is ``validate`` (the word of every call's ``validate=``:
``validate_args``, ``_validate_*``), a function that returns why arguments are wrong is
``*_error``; ``check()`` is only an object's raise of a failure it recorded (a peer timeout).
"""
from __future__ import annotations

import collections
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from . import collectives, config
from ._dist import validation_group, cpu_group, group_key, guard_timeout, on_forget_groups, \
    on_release, wait
from .collectives import all_gather_tensor

__all__ = ["DTYPE_CODES", "agree", "validate_args", "agreed_min", "agree_reason"]

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
               torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
               torch.bool: 10}
_SIG_LEN = 32
_HEAD = 3  # error flag, signature length, op code


def agree(group, op: str, signature: Sequence[int], labels: Sequence[str],
          local_error: str | None = None, timeout_s: float | None = None) -> None:
    """Check that every rank called ``op`` with the same arguments, and share local errors.

    Arguments:
        group: the process group (the check runs on ``validation_group(group)``, a gloo group).
        op: the operation's name, for messages.
        signature: up to 29 ints that must be equal on every rank (shapes, dtype codes, flags).
        labels: one name per signature entry, for messages.
        local_error: this rank's local validation error, or None.

    Raises:
        ValueError on every rank when the ranks are in different calls (a divergence that
        slipped past the first-sight check: naming each rank's call), any rank has a local
        error (naming each such rank and its message) or the signatures differ (naming the
        differing fields and ranks).
    """
    if len(signature) > _SIG_LEN - _HEAD:
        raise ValueError(f"signature too long ({len(signature)} > {_SIG_LEN - _HEAD})")
    # Over a gloo group: host tensors, no device round trip, and a wait bounded by timeout_s.
    g = validation_group(group, timeout_s)
    world = dist.get_world_size(g)
    row = torch.zeros(_SIG_LEN, dtype=torch.int64)
    row[0] = 1 if local_error else 0
    row[1] = len(signature)
    row[2] = zlib.crc32(op.encode()) & 0x7FFFFFFF  # which call this rank is in
    try:
        row[_HEAD:_HEAD + len(signature)] = torch.tensor(list(signature), dtype=torch.int64)
    except (OverflowError, RuntimeError, TypeError):  # still take part: peers are waiting
        local_error = local_error or f"arguments out of the int64 range: {list(signature)}"
        row[0] = 1
    rows = torch.empty(world * _SIG_LEN, dtype=torch.int64)
    wait(all_gather_tensor(rows, row, group=g, async_op=True), g, op + " (argument check)",
         timeout_s)
    rows = rows.view(world, _SIG_LEN)
    if not bool((rows[:, 2] == rows[0, 2]).all()):
        ops: list = [None] * world
        with guard_timeout(g, op + " (argument check)", timeout_s):
            dist.all_gather_object(ops, op, group=g)
        where = ", ".join(f"rank {r} in {o}" for r, o in enumerate(ops))
        raise ValueError(f"{op}: the ranks are in different calls ({where}): their calls "
                         f"diverged before this check (a call whose arguments differed across "
                         f"ranks after its signature was first seen is not checked by default; "
                         f"validate=True or ATTNCOMM_VALIDATE=1 checks every call)")
    if bool(rows[:, 0].any()):
        errors: list = [None] * world
        with guard_timeout(g, op + " (argument check)", timeout_s):
            dist.all_gather_object(errors, local_error, group=g)
        parts = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
        raise ValueError(f"{op}: invalid arguments — " + "; ".join(parts))
    if not bool((rows == rows[0]).all()):
        n = int(rows[:, 1].max())
        diffs = []
        for i in range(n):
            col = rows[:, _HEAD + i]
            if not bool((col == col[0]).all()):
                label = labels[i] if i < len(labels) else f"arg{i}"
                diffs.append(f"{label} = " + ", ".join(
                    f"{int(v)} (rank {r})" for r, v in enumerate(col.tolist())))
        if not diffs:
            diffs.append("argument count differs: " + ", ".join(
                f"{int(v)} (rank {r})" for r, v in enumerate(rows[:, 1].tolist())))
        raise ValueError(f"{op}: ranks disagree on the call's arguments: " + "; ".join(diffs))


#: Per group (``group_key``): the (op, signature) pairs every rank agreed on, least recently
#: used first. Every rank makes the same calls, so every rank holds the same entries.
_SEEN: dict = {}
_SEEN_SIZE = 4096


def validate_args(group, op: str, signature: Sequence[int], labels: Sequence[str],
                  local_error: str | None = None, timeout_s: float | None = None,
                  validate: bool | None = None, *, grid=None, detail=None) -> bool:
    """The cross-rank argument check of every call, by ``config.validation_mode``; returns
    whether the ranks agreed the arguments in this call (False: skipped, or a group of one).

    ``"first"`` (the default): ``agree`` runs on the first call with a new ``(op, signature)``
    on this group and whenever this rank has a local error; a steady-state call makes no
    collective beyond the exchange's own. ``"every"``: ``agree`` on every call. ``"never"``:
    only local errors, raised on this rank; so in a group of one. A mismatch that slips past
    the first-sight check (one rank repeats a seen signature while a peer brings a new one)
    leaves the first rank in the exchange and the peer in the check, on different groups
    (``validation_group``): both raise ``PeerTimeoutError`` naming ``op`` within ``timeout_s``. Two
    ranks repeating two different seen signatures are not checked: that needs
    ``validate=True``.

    Arguments:
        grid: a second group that tiles a grid with ``group`` (every rank's two groups, as
            USP's Ulysses and ring groups): agreed over ``group``, then ``grid`` (carrying the
            first verdict), then ``group`` again (carrying the second's), so a bad argument on
            any rank of the grid raises on every rank of it.
        detail: ``detail(message) -> message`` for a disagreement on the signature: run on
            every rank (it may be collective) to put more in the message (e.g. every rank's
            list where the signature holds its hash).

    Raises:
        ValueError: a local error (every rank alike unless the mode is ``"never"``) or ranks
            that disagree on the signature.
        PeerTimeoutError: a peer did not take part in the check within ``timeout_s``.
    """
    mode = config.validation_mode(validate)
    if mode != "never":
        key = (op, tuple(signature))
        seen = _SEEN.get(group_key(group))
        if mode == "first" and local_error is None and seen is not None and key in seen:
            seen.move_to_end(key)
            return False
        if dist.get_world_size(group) > 1 or (grid is not None
                                              and dist.get_world_size(grid) > 1):
            try:
                if grid is None:
                    agree(group, op, signature, labels, local_error, timeout_s)
                else:
                    _agree_grid(group, grid, op, signature, labels, local_error, timeout_s)
            except ValueError as exc:
                if detail is None or "disagree" not in str(exc):
                    raise
                raise ValueError(detail(str(exc))) from None
            if seen is None:
                seen = _SEEN.setdefault(group_key(group), collections.OrderedDict())
            seen[key] = True
            seen.move_to_end(key)
            while len(seen) > _SEEN_SIZE:
                seen.popitem(last=False)
            return True
    if local_error:
        raise ValueError(f"{op}: invalid arguments — rank {dist.get_rank(group)}: "
                         f"{local_error}")
    return False


def _agree_grid(first, second, op, signature, labels, local_error, timeout_s) -> None:
    """``agree`` over a grid tiled by ``first`` and ``second``: three small collectives, each
    rank's verdict carried into the next."""
    verdict, message = local_error, None
    for group in (first, second):
        if dist.get_world_size(group) > 1:
            try:
                agree(group, op, signature, labels, local_error=verdict, timeout_s=timeout_s)
            except ValueError as exc:
                verdict = message = str(exc)
    if dist.get_world_size(first) > 1 and dist.get_world_size(second) > 1:
        reason = agree_reason(first, verdict, op)
        if reason and message is None:
            message = f"{op}: invalid arguments on another rank of the grid — {reason}"
    if message:
        raise ValueError(message)
    if verdict:
        raise ValueError(f"{op}: invalid arguments — rank {dist.get_rank(first)}: {verdict}")


def agreed_min(group, value: int, op: str = "attncomm agreement") -> int:
    """The smallest ``value`` over the group's ranks: one all_reduce(MIN) over its gloo twin
    (none in a group of one). For what every rank must plan with alike (a launch bound, a
    yes/no as 1/0). A peer that never joins: ``PeerTimeoutError`` (``op`` names the step) at
    the gloo twin's timeout."""
    g = cpu_group(group)
    if dist.get_world_size(g) == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64)
    with guard_timeout(g, op):
        collectives.all_reduce(t, op=dist.ReduceOp.MIN, group=g)
    return int(t.item())


def agree_reason(group, local_reason: str | None, what: str = "") -> str | None:
    """Agree across ranks whether something can run: every rank gets None if no rank has a
    reason against it, else the same message naming each rank's reason.

    Uses an all_reduce(MIN) of an ok-flag over the gloo twin of ``group`` (no device work, safe
    before any allocation), plus an object all_gather only when some rank said no.
    """
    g = cpu_group(group)
    if dist.get_world_size(g) == 1:
        return f"rank 0: {local_reason}" if local_reason else None
    with guard_timeout(g, f"agree {what}".strip()):
        if agreed_min(g, 0 if local_reason else 1) == 1:
            return None
    reasons: list = [None] * dist.get_world_size(g)
    with guard_timeout(g, f"agree {what}".strip()):
        dist.all_gather_object(reasons, local_reason, group=g)
    return "; ".join(f"rank {r}: {x}" for r, x in enumerate(reasons) if x)


@on_release
def _forget_seen(key) -> None:
    _SEEN.pop(key, None)


@on_forget_groups
def _forget_all_seen() -> None:
    _SEEN.clear()
