"""The DP sync's row exchange: one small interface (``RowExchange``), four paths.

Every path moves one int64 row of ``ROW`` values per rank and hands back every rank's row back to
back (rank r's field f at ``ROW·r + f``):

- ``shm``: host shared memory (``ShmRowExchange``), for groups on one host;
- ``hier``: shared memory inside each host and one gloo all_gather between host leaders
  (``hier.HierExchange``), for groups that span hosts;
- ``cpu``: an all_gather over the group's gloo twin;
- ``device``: an all_gather over the device group, with at most one device→host copy (which
  also carries a device-resident active mask).

``resolve_sync`` decides which path a ``sync`` argument means on a group (once per group and
value, agreed across ranks; ``auto`` is ``select.decide_sync_path`` over the agreed facts, and
``sync_decision`` also says why it did not take ``shm``);
``rows_for(plan, path, device)`` is the exchange object the caller uses, the same way for every
path.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, replace
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group, group_device, guard_timeout, wait
from .._agree import agree, agree_reason
from ..collectives import all_gather_tensor
from ..capability import HostLayout, group_hosts
from ..errors import PeerTimeoutError
from ..select import Decision, SyncFacts, build_agreed, decide_sync_path
from . import hier as _hier
from . import shm as _shm
from .hier import UNSENT

__all__ = ["RowExchange", "ShmRows", "HierRows", "GatherRows", "resolve_sync", "sync_decision",
           "auto_path", "exchange_rows", "close_shm_channels", "rows_for", "plan_for",
           "SYNC_CHOICES", "ROW", "UNSENT"]

log = logging.getLogger("attncomm.dp_attention")

SYNC_CHOICES = ("auto", "shm", "cpu", "device", "hier")
ROW = 6


class RowExchange(ABC):
    """One step: this rank's row out, every rank's rows back (``W · ROW`` ints, rank order).

    ``exchange(row, timeout_s, mask=None)`` → ``(rows, mask_values)``: ``mask`` is an optional
    device-resident tensor whose values come back with the rows (None when not given). Raises
    ``ValueError`` for a row that is not ints in the int64 range (on this rank, before anything
    is sent) and ``PeerTimeoutError`` naming the ranks whose row did not arrive in time."""

    path: str = "?"

    @abstractmethod
    def exchange(self, row: Sequence[int], timeout_s: float | None,
                 mask: torch.Tensor | None = None) -> tuple[Sequence[int], list | None]:
        ...

    def close(self) -> None:
        return None


class ShmRows(RowExchange):
    """The ``shm`` path: a host shared-memory segment of the group (``ShmRowExchange``)."""

    path = "shm"

    def __init__(self, cg, timeout_s: float | None):
        self.channel = _shm.ShmRowExchange(cg, ROW, timeout_s=timeout_s)

    def exchange(self, row, timeout_s, mask=None):
        vals = self.channel.exchange_flat(row, timeout_s=timeout_s)
        return vals, (None if mask is None else [int(v) for v in mask.view(-1).tolist()])

    def close(self) -> None:
        self.channel.close()


class HierRows(RowExchange):
    """The ``hier`` path: each host's shared memory plus the host leaders' gloo group
    (``hier.HierExchange``; collective construction over the group's members)."""

    path = "hier"

    def __init__(self, group, timeout_s: float | None):
        self.ex = _hier.HierExchange(group, ROW, timeout_s=timeout_s)

    def exchange(self, row, timeout_s, mask=None):
        vals = self.ex.exchange_flat(row, timeout_s)
        return vals, (None if mask is None else [int(v) for v in mask.view(-1).tolist()])

    def close(self) -> None:
        self.ex.close()


class GatherRows(RowExchange):
    """The ``cpu`` and ``device`` paths: an all_gather over ``group`` of tensors on ``device``.

    The receive buffer is filled with ``UNSENT`` first: a row that still holds it after the wait
    did not arrive (an aborted NCCL exchange can return with the buffer unwritten, and a reused
    block would otherwise hand back an older step's rows) → ``PeerTimeoutError`` naming those
    ranks."""

    def __init__(self, path: str, group, world: int, device: torch.device):
        self.path, self.group, self.world, self.device = path, group, world, device
        self.op = f"dp_attention sync ({path})"

    def exchange(self, row, timeout_s, mask=None):
        world, dev, op = self.world, self.device, self.op
        try:
            local = torch.tensor(row, dtype=torch.int64, device=dev)
        except (RuntimeError, OverflowError, TypeError, ValueError):  # the error path only
            raise ValueError(_shm.bad_value_message(row)) from None
        out = torch.full((world * ROW,), UNSENT, dtype=torch.int64, device=dev)
        t = config.timeout_s(timeout_s)
        wait(all_gather_tensor(out, local, self.group, async_op=True), self.group, op, t)
        if mask is not None:
            out = torch.cat([out, mask.to(device=dev, dtype=torch.int64).view(-1)])
        flat = out.tolist()  # the one device→host copy on the device path
        flat, mask_vals = ((flat[:world * ROW], flat[world * ROW:]) if mask is not None
                           else (flat, None))
        if UNSENT in flat[5::ROW]:
            missing = [r for r in range(world) if flat[r * ROW + 5] == UNSENT]
            raise PeerTimeoutError(f"{op}: the exchange returned without the rows of rank(s) "
                                   f"{missing} (aborted or timed out)", peer_ranks=missing,
                                   timeout_s=t, op=op)
        return flat, mask_vals


@dataclass
class SyncPlan:
    """What one group's sync needs, looked up once (the per-step path does no group queries)."""

    group: object
    world: int
    cg: object
    device: torch.device
    auto: str | None = None        # the path "auto" takes, once decided
    why: str | None = None         # why "auto" did not take "shm" (None when it did)
    layout: HostLayout | None = None
    shm_why: str | None = None     # why some rank cannot run the shm protocol at all
    hier_why: str | None = None    # why the hier path failed to set up
    rows: dict = field(default_factory=dict)     # (path, device) → RowExchange
    paths: dict = field(default_factory=dict)    # sync argument → path it resolved to
    per_dp: dict = field(default_factory=dict)   # valid (dp, tp, cp) → tp·cp


_PLANS: dict[int, SyncPlan] = {}


def plan_for(group) -> SyncPlan:
    g = dist.group.WORLD if group is None else group
    p = _PLANS.get(id(g))
    if p is None or p.group is not g:  # identity check: an id can be reused by a new group
        p = SyncPlan(g, dist.get_world_size(g), cpu_group(group), group_device(group))
        _PLANS[id(g)] = p
    return p


def auto_path(layout: HostLayout, shm_reason: str | None) -> tuple[str, str | None]:
    """The rule of ``sync="auto"``, pure: ``(path, why not "shm")``
    (``select.decide_sync_path`` of these facts)."""
    d = decide_sync_path(SyncFacts(layout, shm_reason))
    return d.backend, d.fallback_reason


def _plan_auto(p: SyncPlan, timeout_s: float | None) -> None:
    """Collective over the group: the facts (where its ranks are, ``group_hosts``; whether
    every rank can run the shm protocol), then ``select.decide_sync_path``; when it takes
    "hier", the hier path is built (agreed) and a failure is one more fact. The same on every
    rank."""
    with guard_timeout(p.cg, "dp_attention sync (host check)", timeout_s):
        p.layout = group_hosts(p.group)
        p.shm_why = agree_reason(p.cg, _shm.shm_supported()[1], "dp_attention shm sync")
    facts = SyncFacts(p.layout, p.shm_why)
    d = decide_sync_path(facts)
    if d.backend == "hier":
        failed = _build_hier(p, timeout_s)
        if failed is not None:
            d = decide_sync_path(replace(facts, hier_failed=failed))
    p.auto, p.why = d.backend, d.fallback_reason
    if p.why is not None:
        log.info("dp_attention sync: auto takes %s on this group, not shm: %s", p.auto, p.why)


def _build_hier(p: SyncPlan, timeout_s: float | None) -> str | None:
    """Build the hier exchange on every rank (agreed: every rank keeps it or none does); None
    when it runs, else why not (the same on every rank)."""
    if ("hier", None) in p.rows:
        return None
    if p.hier_why is None:
        impl, p.hier_why = build_agreed(p.cg, lambda: HierRows(p.group, timeout_s),
                                        "dp_attention hier sync setup")
        if impl is not None:
            p.rows[("hier", None)] = impl
    return p.hier_why


def resolve(p: SyncPlan, sync: str, timeout_s: float | None) -> str:
    """``resolve_sync`` on a plan (decided once per plan and argument)."""
    path = p.paths.get(sync) if isinstance(sync, str) else None
    if path is None:  # decided once per plan and argument (an error is never cached)
        _agree_sync(p, sync, timeout_s)
        path = _decide(p, sync, timeout_s)
        p.paths[sync] = path
    return path


def _agree_sync(p: SyncPlan, sync, timeout_s: float | None) -> None:
    """On the first use of a ``sync`` value on a group: one small collective over the gloo twin
    checks that every rank passed the same valid value (ranks on different paths would each wait
    for the others until the timeout). Raises the same ValueError on every rank, naming each
    rank's value. Later steps with that value skip it; a rank that changes its value alone runs
    it while its peers exchange rows, and both sides time out (PeerTimeoutError)."""
    ok = isinstance(sync, str) and sync in SYNC_CHOICES
    code = SYNC_CHOICES.index(sync) if ok else -1
    err = None if ok else f"sync must be one of {list(SYNC_CHOICES)}, got {sync!r}"
    agree(p.group, "dp_attention sync", [code],
          [f"sync (index into {list(SYNC_CHOICES)}; -1: invalid)"], local_error=err,
          timeout_s=config.timeout_s(timeout_s))


def _decide(p: SyncPlan, sync: str, timeout_s: float | None) -> str:
    if sync == "cpu" or sync == "device":
        return sync
    if p.auto is None:
        _plan_auto(p, timeout_s)
    if sync == "shm" and p.auto != "shm":
        raise ValueError(f"sync='shm' cannot run on this group: {p.why}")
    if sync == "hier":
        why = p.shm_why or _build_hier(p, timeout_s)
        if why is not None:
            raise ValueError(f"sync='hier' cannot run on this group: {why}")
        return "hier"
    return p.auto


def resolve_sync(sync: str, group=None, *, timeout_s: float | None = None) -> str:
    """The sync path ``sync`` means on ``group``: "shm", "hier", "cpu" or "device".

    "auto" (``auto_path``) → "shm" when every rank of the group is on this host; on a group
    that spans hosts, "hier" (shared memory inside each host, gloo between host leaders) when
    some host holds two ranks or more, else "cpu"; decided once per group by collectives over
    its gloo twin (``sync_decision`` says why "shm" was not taken). An explicit "shm" or "hier"
    that cannot run raises ``ValueError`` on every rank, saying why (the decision is shared, so
    it is the same everywhere). Collective on a value's first use on a group (every rank must
    call it then; a value that is invalid or differs between ranks raises ``ValueError`` on
    every rank).
    """
    return resolve(plan_for(group), sync, timeout_s)


def sync_decision(sync: str = "auto", group=None, *,
                  timeout_s: float | None = None) -> Decision:
    """``resolve_sync`` with its reason: ``Decision(path, fallback_reason)``, where
    ``fallback_reason`` says why "auto" did not take "shm" (the group spans hosts, or a rank
    cannot run the shm protocol); None when it did, or for an explicit path. Collective as
    ``resolve_sync``."""
    p = plan_for(group)
    path = resolve(p, sync, timeout_s)
    return Decision(path, p.why if sync == "auto" else None)


def close_shm_channels() -> None:
    """Unmap every cached shm segment (they are also released at exit), forget the plans and
    the hier path's per-host and leader groups (call it on every rank: the next use builds them
    anew, collectively)."""
    for p in _PLANS.values():
        for ex in p.rows.values():
            ex.close()
    _PLANS.clear()
    _hier.forget_groups()


def rows_for(p: SyncPlan, path: str, device=None, timeout_s: float | None = None) -> RowExchange:
    """The exchange object of ``path`` ("shm", "hier", "cpu" or "device") on plan ``p`` (built
    on first use: the shm path maps its segment then, collectively; the hier path is built when
    it is decided; ``device`` only for "device", None → the group's device)."""
    dev = None if path != "device" else (torch.device(device) if device is not None
                                         else p.device)
    ex = p.rows.get((path, dev))
    if ex is None:
        if path == "hier":
            why = _build_hier(p, timeout_s)
            if why is not None:
                raise ValueError(f"sync='hier' cannot run on this group: {why}")
            return p.rows[(path, dev)]
        if path == "shm":
            ex = ShmRows(p.cg, timeout_s)
        elif path == "cpu":
            ex = GatherRows("cpu", p.cg, p.world, torch.device("cpu"))
        else:
            ex = GatherRows("device", p.group, p.world, dev)
        p.rows[(path, dev)] = ex
    return ex


def exchange_rows(row: Sequence[int], group=None, *, sync: str, device=None,
                  timeout_s: float | None = None) -> list[list[int]]:
    """Every group rank's row (``W`` lists of 6 ints, rank order) through path ``sync``
    ("auto", "shm", "hier", "cpu" or "device"); at most one device→host copy.

    A low-level helper, collective like every exchange (a ``sync`` value's first use on the
    group adds a check that every rank passed the same one). A row that is not 6 ints in the
    int64 range raises ``ValueError`` on this rank only (before the exchange); field 5 must not
    be ``-2**63`` (on the gloo/NCCL paths that value marks a row that did not arrive →
    ``PeerTimeoutError``).
    """
    vals = [int(v) for v in row]
    if len(vals) != ROW:
        raise ValueError(f"exchange_rows: a row is {ROW} int64 values, got {len(vals)}")
    p = plan_for(group)
    flat, _ = rows_for(p, resolve(p, sync, timeout_s), device, timeout_s).exchange(vals,
                                                                                  timeout_s)
    return [list(flat[i:i + ROW]) for i in range(0, len(flat), ROW)]


