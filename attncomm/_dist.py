"""Small helpers over torch.distributed shared by every exchange.

- ``resolve_group``: a ``ProcessGroup``, None (the default group) or an engine's group
  coordinator (an object with ``device_group`` and ``cpu_group``, as vLLM's and SGLang's have)
  → the process group the exchange runs on; a coordinator's ``cpu_group`` serves the host side,
- ``cpu_group``: the gloo twin of a process group (cached per group), for host-side agreement,
- agreement across ranks (argument checks, agreed minimums and reasons) is ``attncomm._agree``,
- ``guard_timeout``: turns a process group's timeout into ``PeerTimeoutError``,
- ``on_release`` / ``release``: what the functional calls cache per group, and its end of life.
"""
from __future__ import annotations

import collections

import contextlib
import datetime
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from . import collectives, config
from .collectives import all_gather_tensor
from .errors import PeerTimeoutError

__all__ = ["cpu_group", "group_lru_get", "clear_cpu_groups", "group_key", "group_device",
           "set_group_device", "as_device", "device_error", "guard_timeout", "wait", "as_bits",
           "resolve_group", "validation_group", "on_release", "release", "Lifecycle", "group_name",
           "group_from_name", "on_forget_groups"]


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


def validation_group(group=None, timeout_s: float | None = None):
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
    _require_local_naming(g, budget)
    return dist.new_group(ranks=dist.get_process_group_ranks(g), backend="gloo",
                          timeout=timeout, use_local_synchronization=True)


def _require_local_naming(g, budget: float) -> None:
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
