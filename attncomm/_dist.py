"""Small helpers over torch.distributed shared by every exchange.

- ``resolve_group``: a ``ProcessGroup``, None (the default group) or an engine's group
  coordinator (an object with ``device_group`` and ``cpu_group``, as vLLM's and SGLang's have)
  → the process group the exchange runs on; a coordinator's ``cpu_group`` serves the host side,
- ``cpu_group``: the gloo twin of a process group (cached per group), for host-side agreement,
- ``agree``: the cross-rank argument check that raises the same ``ValueError`` on every rank;
  ``validate_args``: when a call runs it (``config.validation_mode``: the first call with a
  new signature per group, every call, or never), over one group or a grid of two,
- ``guard_timeout``: turns a process group's timeout into ``PeerTimeoutError``,
- ``on_release`` / ``release``: what the functional calls cache per group, and its end of life.

Names: an argument check is ``validate`` (the word of every call's ``validate=``:
``validate_args``, ``_validate_*``), a function that returns why arguments are wrong is
``*_error``; ``check()`` is only an object's raise of a failure it recorded (a peer timeout).
"""
from __future__ import annotations

import collections

import contextlib
import datetime
import zlib
from typing import Any
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import collectives, config
from .collectives import all_gather_tensor
from .errors import PeerTimeoutError

__all__ = ["cpu_group", "group_lru_get", "clear_cpu_groups", "group_key", "group_device",
           "set_group_device", "as_device", "device_error", "agree", "guard_timeout", "wait",
           "as_bits", "agree_reason", "DTYPE_CODES", "resolve_group", "check_group",
           "validate_args", "on_release", "release", "Lifecycle", "group_name",
           "group_from_name", "on_forget_groups", "agreed_min"]

DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3, torch.float64: 4,
               torch.int64: 5, torch.int32: 6, torch.int16: 7, torch.int8: 8, torch.uint8: 9,
               torch.bool: 10}
_SIG_LEN = 32
_HEAD = 3  # error flag, signature length, op code


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
            _close(lru.popitem(last=False)[1])  # collective: every rank evicts it here
    else:
        lru.move_to_end(key)
    return value


def _close(value) -> None:
    close = getattr(value, "close", None)
    if close is not None:
        close()


#: The device this process's gloo groups carry exchange tensors on (``set_group_device``).
_GLOO_DEVICE: torch.device | None = None


def set_group_device(device) -> None:
    """Declare where this process's gloo groups keep the exchange objects' tensors.

    Ranks that share a GPU run on a gloo group (NCCL refuses two ranks on one device) with CUDA
    tensors: call ``set_group_device("cuda")`` (or ``torch.device("cuda", i)``) on every rank
    after ``init_process_group("gloo", ...)`` and ``torch.cuda.set_device``, and
    ``DcpMerger``, ``DcpQueryGather``, ``MLPSyncBatchInfo`` and the other objects built without
    a device allocate there; collectives of their CUDA tensors go through host copies
    (``attncomm.collectives``). ``attncomm.launch`` does this for the ranks it places on shared
    GPUs. ``None`` (the default) means CPU. A device without an index means the current one.

    Raises ValueError for a device that is neither CPU nor CUDA.
    """
    global _GLOO_DEVICE
    dev = None if device is None else torch.device(device)
    if dev is not None and dev.type not in ("cpu", "cuda"):
        raise ValueError(f"set_group_device: device must be CPU or CUDA, got {dev}")
    if dev is not None and dev.type == "cuda" and dev.index is None:
        if not torch.cuda.is_available():
            raise ValueError("set_group_device: 'cuda' without an index needs CUDA here (this "
                             "torch sees no GPU)")
        dev = as_device(dev)
    _GLOO_DEVICE = None if dev is None or dev.type == "cpu" else dev


def device_error(group, device: torch.device) -> str | None:
    """Why an exchange object on ``group`` cannot keep its tensors on ``device`` (None: it
    can): an NCCL group takes the rank's current CUDA device only; a gloo group takes CPU or
    CUDA tensors (the latter through host copies, ``attncomm.collectives``)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        want = torch.device("cuda", torch.cuda.current_device())
        if device != want:
            return f"an NCCL group takes tensors on this rank's current device {want}, not {device}"
    elif backend == "gloo" and device.type not in ("cpu", "cuda"):
        return f"a gloo group takes CPU or CUDA tensors, not {device}"
    return None


def as_device(device) -> torch.device:
    """``device`` as a ``torch.device``; a CUDA device without an index is the current one."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def group_device(group=None) -> torch.device:
    """The device an exchange object on ``group`` allocates on: the current CUDA device for
    NCCL groups; for gloo groups the device ``set_group_device`` declared (CPU unless set)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo" and _GLOO_DEVICE is not None:
        return _GLOO_DEVICE
    return torch.device("cpu")


_CPU_GROUPS: dict[Any, Any] = {}
_CHECK_GROUPS: dict[Any, Any] = {}


def _is_coordinator(group) -> bool:
    return (not isinstance(group, dist.ProcessGroup) and hasattr(group, "device_group")
            and hasattr(group, "cpu_group"))


def resolve_group(group=None, op: str = "attncomm", *, one_process: str | None = None):
    """The process group an exchange runs on.

    Arguments:
        group: a ``torch.distributed.ProcessGroup``, None (the default group), or an engine's
            group coordinator: an object with ``device_group`` (the group collectives run on)
            and ``cpu_group`` (a gloo group over the same ranks), as vLLM's and SGLang's
            ``GroupCoordinator`` have. The coordinator's ``cpu_group`` then serves every
            host-side agreement and argument check on its ``device_group`` (no second gloo group
            is created for it).
        op: the caller's name, for the error message.
        one_process: what to call instead in a single process (named in the message).

    Returns:
        ``group`` itself, None for the default group, or the coordinator's ``device_group``.

    Raises:
        ValueError: ``group`` is None and torch.distributed is not initialised (the message says
            what to do: ``attncomm.launch``, ``init_process_group``, or the one-process call).
    """
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            alt = f", or {one_process} in a single process" if one_process else ""
            raise ValueError(
                f"{op}: no process group: torch.distributed is not initialised. Start the ranks "
                f"with attncomm.launch(fn, world_size) (it spawns them and sets up gloo on CPU or "
                f"NCCL on GPUs), or call torch.distributed.init_process_group(...) first (as "
                f"under torchrun), or pass group=...{alt}")
        return None
    if _is_coordinator(group):
        device, host = group.device_group, group.cpu_group
        key = group_key(device)
        if host is not None and host is not device:
            if dist.get_backend(device) != "gloo":
                _CPU_GROUPS.setdefault(key, host)
            _CHECK_GROUPS.setdefault(key, host)
        return device
    return group


def group_name(group=None) -> str:
    """The registered name of ``group`` (None: the default group), as torch's functional
    collectives pass groups into traced graphs; ``group_from_name`` resolves it back. Custom
    ops take groups this way (a ``str`` argument: a graph holds no process-group object)."""
    g = group if group is not None else dist.group.WORLD
    return g.group_name


def group_from_name(name: str):
    """The process group registered as ``name`` (``group_name``); the default group comes back
    as itself, so ``group_key`` of the result matches the caller's caches."""
    return c10d._resolve_process_group(name)


def cpu_group(group=None, *, world_collective: bool = False, timeout_s: float | None = None):
    """The gloo group over the same ranks as ``group`` (``None``: the default group).

    On a gloo group this is the group itself. Otherwise the first call creates the gloo twin
    (a coordinator's ``cpu_group`` is taken as the twin of its ``device_group``):

    - default group: collective over every rank (``launch`` does it at start-up);
    - a subgroup, ``world_collective=False`` (how the library calls it, lazily): collective over
      the group's members only. torch names such a group from its ranks and the number of
      groups each member already has, so it works when every member belongs to the same number
      of process groups (the usual TP / DP / CP grids) and raises ``ValueError`` on every member
      otherwise, instead of waiting for a rendezvous that cannot happen;
    - a subgroup, ``world_collective=True``: call it on every rank of the default group (members
      or not, in the same order, like ``dist.new_group``) right after creating the subgroup;
      works for any layout. Non-members get None.

    ``timeout_s`` bounds the creation (None: ``ATTNCOMM_TIMEOUT_S``): a member that does not
    arrive raises ``PeerTimeoutError`` within it. The group's collectives get the default
    timeout afterwards where torch can set a group's timeout (``ProcessGroup.set_timeout``);
    elsewhere they keep the creating call's budget.
    """
    group = resolve_group(group, "attncomm.cpu_group") if _is_coordinator(group) else group
    g = group if group is not None else dist.group.WORLD
    if g is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if dist.get_backend(g) == "gloo":
        return g
    key = group_key(group)
    pg = _CPU_GROUPS.get(key)
    if pg is None:
        pg = _CPU_GROUPS[key] = _gloo_twin(group, g, world_collective, timeout_s)
    return pg


def check_group(group=None, timeout_s: float | None = None):
    """The gloo group the cross-rank argument checks run on: never the exchange's own group.

    A rank whose check was skipped (its signature seen before) may already be inside the
    exchange while a peer with a new signature is inside the check; on one gloo group the two
    collectives would meet each other (a size mismatch aborts the process inside gloo). On two
    groups each waits for the other until its timeout and raises ``PeerTimeoutError``. For a
    device group this is its gloo twin (``cpu_group``); for a gloo group a second gloo group over
    the same ranks, created on first use like a twin (collective over the group's members;
    ``timeout_s`` bounds the creation as ``cpu_group``'s).
    """
    g = group if group is not None else dist.group.WORLD
    if dist.get_backend(g) != "gloo":
        return cpu_group(group, timeout_s=timeout_s)
    key = group_key(group)
    pg = _CHECK_GROUPS.get(key)
    if pg is None:
        pg = _CHECK_GROUPS[key] = _gloo_twin(group, g, False, timeout_s)
    return pg


def _gloo_twin(group, g, world_collective: bool, timeout_s: float | None):
    # Collective over the group's members: a member that never arrives is a peer timeout
    # within the caller's budget (every step of a first call honours it; the group then gets
    # the default timeout for its life).
    budget = config.timeout_s(timeout_s)
    op = "attncomm: creating a gloo group over the ranks of a process group"
    with guard_timeout(g, op, budget):
        pg = _new_gloo_twin(group, g, world_collective, budget)
    set_timeout = getattr(pg, "set_timeout", None)
    if set_timeout is not None and budget != config.timeout_s():
        set_timeout(_default_timeout())
    return pg


def _new_gloo_twin(group, g, world_collective: bool, budget: float):
    timeout = datetime.timedelta(seconds=budget)
    if group is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    if world_collective:
        return dist.new_group(ranks=dist.get_process_group_ranks(g), backend="gloo",
                              timeout=timeout)
    _check_local_naming(g, budget)
    return dist.new_group(ranks=dist.get_process_group_ranks(g), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)


def _check_local_naming(g, budget: float) -> None:
    # A group made with use_local_synchronization=True is named sha1(ranks, number of groups
    # this rank has): members with different counts would rendezvous under different names.
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None:  # a torch that names groups otherwise: nothing to check
        return
    # One int per member over the group itself, bounded by the budget: on NCCL a CUDA tensor
    # (the group's own device: not group_device, which for gloo is the declared device).
    world = dist.get_world_size(g)
    dev = torch.device("cuda", torch.cuda.current_device()) \
        if dist.get_backend(g) == "nccl" and torch.cuda.is_available() else torch.device("cpu")
    mine = torch.tensor([len(names)], dtype=torch.int64, device=dev)
    out = torch.empty(world, dtype=torch.int64, device=dev)
    wait(all_gather_tensor(out, mine, group=g, async_op=True), g,
         "attncomm: creating a gloo group (group count check)", budget)
    counts = out.tolist()
    if len(set(counts)) > 1:
        raise ValueError(
            f"attncomm.cpu_group: the members of group {dist.get_process_group_ranks(g)} belong "
            f"to different numbers of process groups ({counts}), so its gloo twin cannot be "
            f"created lazily; call attncomm.cpu_group(group, world_collective=True) on every "
            f"rank right after creating the group")


#: Callbacks ``fn()`` that forget what a module caches per process group (``on_forget_groups``).
_FORGETTERS: list = []


def on_forget_groups(fn):
    """Register ``fn()``: forget every per-group fact a module keeps (``clear_cpu_groups``
    calls it; the default group's key, ``"world"``, names a new group after a re-init)."""
    _FORGETTERS.append(fn)
    return fn


def clear_cpu_groups() -> None:
    """Forget every cached gloo twin and check group, and every per-group fact modules keep
    (a rank calls it before destroying its process groups)."""
    _CPU_GROUPS.clear()
    _CHECK_GROUPS.clear()
    _SEEN.clear()
    collectives._GLOO.clear()
    for fn in _FORGETTERS:
        fn()


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
        group: the process group (the check runs on ``check_group(group)``, a gloo group).
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
    g = check_group(group, timeout_s)
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
    (``check_group``): both raise ``PeerTimeoutError`` naming ``op`` within ``timeout_s``. Two
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


# ------------------------------------------------------------------------------ lifecycle
_RELEASERS: list = []


def on_release(fn):
    """Register ``fn(key)``: free what a module caches for the group whose ``group_key`` is
    ``key`` (``release`` calls it, collectively, on every rank)."""
    _RELEASERS.append(fn)
    return fn


def release(group=None) -> None:
    """Free what the functional calls (``dcp.merge``, ``dcp.gather_heads``, ``ulysses.*``)
    cached for ``group``: their preallocated objects, symmetric memory (after a barrier: no
    peer writes into memory being freed), transports and the argument-check record. Collective:
    every rank of the group calls it at the same point. The next call builds anew."""
    group = resolve_group(group, "attncomm.release")
    key = group_key(group)
    for fn in list(_RELEASERS):
        fn(key)
    _SEEN.pop(key, None)


class Lifecycle:
    """``close()`` and ``with obj:`` for an exchange object that holds buffers (symmetric memory
    that peers write into, staging, workspaces). ``close()`` is collective when the object holds
    peer-mapped memory (it ends with a barrier before freeing); it is idempotent; a call after it
    raises ``RuntimeError`` naming the object. Subclasses free in ``_release()`` and call
    ``_ensure_open()`` at the top of their calls."""

    _closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    def _release(self) -> None:
        return None

    def _ensure_open(self) -> None:
        if self._closed:
            raise self.closed_error(type(self).__name__)

    @staticmethod
    def closed_error(kind: str) -> RuntimeError:
        """The error a call on a closed ``kind`` object raises."""
        return RuntimeError(f"{kind} is closed (close() or the end of its with-block freed its "
                            f"buffers); build a new one")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
