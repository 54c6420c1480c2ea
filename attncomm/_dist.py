"""Small helpers over torch.distributed shared by every exchange.

- ``cpu_group``: the gloo twin of a process group (cached per group), for host-side agreement,
- version shims for collectives renamed between torch 2.11 and 2.13,
- ``agree``: the cross-rank argument check that raises the same ``ValueError`` on every rank,
- ``guard_timeout``: turns a process group's timeout into ``PeerTimeoutError``.
"""
from __future__ import annotations

import collections

import contextlib
import datetime
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import config
from .errors import PeerTimeoutError

__all__ = ["cpu_group", "group_lru_get", "clear_cpu_groups", "all_gather_tensor",
           "reduce_scatter_tensor", "group_key", "group_device", "agree", "guard_timeout", "wait",
           "as_bits", "agree_reason", "DTYPE_CODES"]

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
               torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
               torch.bool: 10}
_SIG_LEN = 32


def all_gather_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                      async_op: bool = False):
    """``output [W·n, ...]`` ← every rank's ``input [n, ...]`` in rank order (torch 2.13 calls
    it ``all_gather_single``, torch 2.11 ``all_gather_into_tensor``). Returns the work handle
    when ``async_op``."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, group=None,
                          async_op: bool = False):
    """``output [n, ...]`` ← rank r's chunk of the sum over ranks of ``input [W·n, ...]``
    (``reduce_scatter_single`` / ``reduce_scatter_tensor``)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=group, async_op=async_op)


def group_key(group=None):
    """A cache key for ``group`` that cannot be reused by another group: the group object itself
    (held, so its id is never recycled while the key lives), ``"world"`` for the default group."""
    if group is None or group is dist.group.WORLD:
        return "world"
    return group


def group_lru_get(store: dict, group, key, make, size: int):
    """``store``'s per-group LRU entry for ``key``, built by ``make()`` when missing (evicting the
    least recently used past ``size``). Every rank of a group makes the same agreed calls, so
    every rank evicts the same entry; calls on other groups never touch this group's LRU."""
    lru = store.setdefault(group_key(group), collections.OrderedDict())
    value = lru.get(key)
    if value is None:
        value = lru[key] = make()
        while len(lru) > size:
            lru.popitem(last=False)
    else:
        lru.move_to_end(key)
    return value


def group_device(group=None) -> torch.device:
    """The device a collective on ``group`` takes: CUDA for NCCL groups, else CPU."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_CPU_GROUPS: dict[Any, Any] = {}


def cpu_group(group=None, *, world_collective: bool = False):
    """The gloo group over the same ranks as ``group`` (``None``: the default group).

    On a gloo group this is the group itself. Otherwise the first call creates the gloo twin:

    - default group: collective over every rank (``launch`` does it at start-up);
    - a subgroup, ``world_collective=False`` (how the library calls it, lazily): collective over
      the group's members only. torch names such a group from its ranks and the number of
      groups each member already has, so it works when every member belongs to the same number
      of process groups (the usual TP / DP / CP grids) and raises ``ValueError`` on every member
      otherwise, instead of waiting for a rendezvous that cannot happen;
    - a subgroup, ``world_collective=True``: call it on every rank of the default group (members
      or not, in the same order, like ``dist.new_group``) right after creating the subgroup;
      works for any layout. Non-members get None.
    """
    g = group if group is not None else dist.group.WORLD
    if g is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if dist.get_backend(g) == "gloo":
        return g
    key = group_key(group)
    pg = _CPU_GROUPS.get(key)
    if pg is None:
        if group is None:
            pg = dist.new_group(backend="gloo", timeout=_default_timeout())
        elif world_collective:
            pg = dist.new_group(ranks=dist.get_process_group_ranks(g), backend="gloo",
                                timeout=_default_timeout())
        else:
            _check_local_naming(g)
            pg = dist.new_group(ranks=dist.get_process_group_ranks(g), backend="gloo",
                                timeout=_default_timeout(), use_local_synchronization=True)
        _CPU_GROUPS[key] = pg
    return pg


def _check_local_naming(g) -> None:
    # A group made with use_local_synchronization=True is named sha1(ranks, number of groups
    # this rank has): members with different counts would rendezvous under different names.
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None:  # a torch that names groups otherwise: nothing to check
        return
    counts: list = [None] * dist.get_world_size(g)
    dist.all_gather_object(counts, len(names), group=g)
    if len(set(counts)) > 1:
        raise ValueError(
            f"attncomm.cpu_group: the members of group {dist.get_process_group_ranks(g)} belong "
            f"to different numbers of process groups ({counts}), so its gloo twin cannot be "
            f"created lazily; call attncomm.cpu_group(group, world_collective=True) on every "
            f"rank right after creating the group")


def clear_cpu_groups() -> None:
    """Forget every cached gloo twin (a rank calls it before destroying its process groups)."""
    _CPU_GROUPS.clear()


def _default_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=config.timeout_s())


_PEER_FAILURE_WORDS = ("timed out", "timeout", "deadline", "connection closed",
                       "connection reset", "broken pipe", "closed by peer")


def _is_peer_failure(exc: BaseException) -> bool:
    """A collective failed because a peer did not answer: it timed out or its connection went
    away (a dead peer)."""
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or any(w in text for w in _PEER_FAILURE_WORDS)


@contextlib.contextmanager
def guard_timeout(group, op: str, timeout_s: float | None = None):
    """Re-raise a process group's collective timeout, or a lost connection to a peer, as
    ``PeerTimeoutError``.

    A gloo/NCCL timeout does not say which peer is missing; the error names every other rank of
    the group (exact at W=2).
    """
    try:
        yield
    except PeerTimeoutError:
        raise
    except RuntimeError as exc:
        if not _is_peer_failure(exc):
            raise
        me = dist.get_rank(group)
        peers = [r for r in range(dist.get_world_size(group)) if r != me]
        raise PeerTimeoutError(
            f"{op}: no answer from peer rank(s) {peers} within the timeout"
            + (f" of {timeout_s:g} s" if timeout_s else "") + f" ({exc})",
            peer_ranks=peers, timeout_s=timeout_s, op=op) from exc


def agree(group, op: str, signature: Sequence[int], labels: Sequence[str],
          local_error: str | None = None, timeout_s: float | None = None) -> None:
    """Check that every rank called ``op`` with the same arguments, and share local errors.

    Arguments:
        group: the process group (the exchange runs on its gloo twin, ``cpu_group(group)``).
        op: the operation's name, for messages.
        signature: up to 30 ints that must be equal on every rank (shapes, dtype codes, flags).
        labels: one name per signature entry, for messages.
        local_error: this rank's local validation error, or None.

    Raises:
        ValueError on every rank when any rank has a local error (naming each such rank and its
        message) or the signatures differ (naming the differing fields and ranks).
    """
    if len(signature) > _SIG_LEN - 2:
        raise ValueError(f"signature too long ({len(signature)} > {_SIG_LEN - 2})")
    # Over the gloo twin: host tensors, no device round trip, and a wait bounded by timeout_s.
    g = cpu_group(group)
    world = dist.get_world_size(g)
    row = torch.zeros(_SIG_LEN, dtype=torch.int64)
    row[0] = 1 if local_error else 0
    row[1] = len(signature)
    try:
        row[2:2 + len(signature)] = torch.tensor(list(signature), dtype=torch.int64)
    except (OverflowError, RuntimeError, TypeError):  # still take part: peers are waiting
        local_error = local_error or f"arguments out of the int64 range: {list(signature)}"
        row[0] = 1
    rows = torch.empty(world * _SIG_LEN, dtype=torch.int64)
    wait(all_gather_tensor(rows, row, group=g, async_op=True), g, op + " (argument check)",
         timeout_s)
    rows = rows.view(world, _SIG_LEN)
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
            col = rows[:, 2 + i]
            if not bool((col == col[0]).all()):
                label = labels[i] if i < len(labels) else f"arg{i}"
                diffs.append(f"{label} = " + ", ".join(
                    f"{int(v)} (rank {r})" for r, v in enumerate(col.tolist())))
        if not diffs:
            diffs.append("argument count differs: " + ", ".join(
                f"{int(v)} (rank {r})" for r, v in enumerate(rows[:, 1].tolist())))
        raise ValueError(f"{op}: ranks disagree on the call's arguments: " + "; ".join(diffs))


def wait(work, group, op: str, timeout_s: float | None) -> None:
    """Wait for an async collective's ``work``, bounded by ``timeout_s`` on CPU (gloo) groups.

    NCCL work is waited for on the stream (graph-capturable); its bound is the group's timeout.
    """
    with guard_timeout(group, op, timeout_s):
        if timeout_s is not None and dist.get_backend(group) == "gloo":
            work.wait(datetime.timedelta(seconds=timeout_s))
        else:
            work.wait()


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as bytes (last dim × element size): every process-group backend moves uint8
    (gloo has no int16 and no bf16 for some collectives). ``t`` needs a unit last stride."""
    return t.view(torch.uint8)


def agree_reason(group, local_reason: str | None, what: str = "") -> str | None:
    """Agree across ranks whether something can run: every rank gets None if no rank has a
    reason against it, else the same message naming each rank's reason.

    Uses an all_reduce(MIN) of an ok-flag over the gloo twin of ``group`` (no device work, safe
    before any allocation), plus an object all_gather only when some rank said no.
    """
    g = cpu_group(group)
    if dist.get_world_size(g) == 1:
        return f"rank 0: {local_reason}" if local_reason else None
    flag = torch.tensor([0 if local_reason else 1], dtype=torch.int64)
    with guard_timeout(g, f"agree {what}".strip()):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=g)
    if int(flag.item()) == 1:
        return None
    reasons: list = [None] * dist.get_world_size(g)
    with guard_timeout(g, f"agree {what}".strip()):
        dist.all_gather_object(reasons, local_reason, group=g)
    return "; ".join(f"rank {r}: {x}" for r, x in enumerate(reasons) if x)
