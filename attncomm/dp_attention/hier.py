"""The ``hier`` sync path: the DP-attention rows of a group that spans hosts, in shared memory
inside each host and over gloo between one leader per host.

A flat gloo all_gather over W ranks costs W-fold connections and messages; the rows of the
ranks of one host can instead meet in host shared memory (the ``shm`` protocol) and only the
host leaders (each host's lowest group rank) talk over the network. Per step, H hosts, host h
holding ``L_h`` ranks:

1. every rank publishes its row in its host's segment (``ShmRowExchange`` over the host's
   ranks) and waits for the rows of its host;
2. each leader sends its host's rows, padded to ``max L_h`` rows, in one all_gather over the gloo
   group of the leaders, and puts the W rows in group rank order;
3. the leader writes the W rows into its segment's result area, and the other ranks of its host
   read them there. Every rank returns the same W rows, so every decision made from them is
   the same everywhere.

Result area (int64 words, after the ``shm`` slots): ``[seq, status, count, words...]``. The
leader writes the words, then ``status`` (0: rows; 1: the exchange between leaders timed out,
the words name the silent group ranks; 2: it failed otherwise), then ``seq`` = the step, last
(the ordering argument of ``shm``: x86-64 stores in program order). One buffer is enough: the
leader writes step s+1's result only after step s+1's rows of every rank of its host arrived,
and a rank publishes its step-s+1 row only after it read step s's result.

Failures: a rank whose host rows do not arrive names the silent ranks of its host; a leader
whose exchange with the other leaders fails (a dead or silent leader: gloo's timeout, or its
connection closed) raises ``PeerTimeoutError`` naming those leaders' group ranks and first writes
the failure into its result area, so the ranks of its host raise the same error at once instead
of waiting for their own bound; a rank whose leader is gone raises naming its leader once its
bound (``timeout_s`` plus a grace, ``_grace``: the leader's own wait is bounded by
``timeout_s``) has passed. After a failure ``close_shm_channels()`` on every rank starts afresh.

Groups: the per-host and the leaders' gloo groups are made by ``host_groups``, collectively over
the group's members and cached per group; see its docstring for torch's naming rule.
"""
from __future__ import annotations

import datetime
import operator
import os
import struct
import time
from dataclasses import dataclass
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import config
from .._dist import cpu_group, group_key, guard_timeout, wait
from ..collectives import all_gather_tensor
from ..capability import HostLayout, group_hosts
from ..errors import PeerTimeoutError
from . import shm as _shm

__all__ = ["HostGroups", "host_groups", "forget_groups", "HostChannel", "HierExchange",
           "UNSENT"]

# Fills the receive buffer of a gloo/NCCL exchange before it: no rank sends it in the last field
# of a row (a sent mode is a ForwardMode or a negative marker > -2**63), so a row still holding
# it after the wait never arrived.
UNSENT = -(1 << 63)
_OK, _PEERS_SILENT, _FAILED = 0, 1, 2
_RESULT_HEAD = 3  # seq, status, count


def _grace(timeout_s: float) -> float:
    """Seconds past ``timeout_s`` that a rank waits for its leader's result: the leader's own
    wait is bounded by ``timeout_s``, and its failure report must reach its host before the
    others give up on it (a quarter of ``timeout_s``, between 0.25 s and 5 s)."""
    return min(5.0, max(0.25, 0.25 * timeout_s))


# -- the groups -------------------------------------------------------------------------------

@dataclass(frozen=True)
class HostGroups:
    """The gloo groups of a hierarchical exchange on one group, as seen by this rank.

    Attributes:
        layout: the group's ``HostLayout``.
        host: the gloo group of this rank's host (its ranks in ascending global rank).
        leaders: the gloo group of the host leaders on a leader, else None.
        local_ranks: ``local_ranks[h]``: host h's group ranks in the order of its host group.
        leader_hosts: the host index of each rank of the leaders' group.
    """

    layout: HostLayout
    host: object
    leaders: object | None
    local_ranks: tuple[tuple[int, ...], ...]
    leader_hosts: tuple[int, ...]


_GROUPS: dict = {}  # group_key(group) → HostGroups


def _naming_reason(cg) -> str | None:
    """Why the members of ``cg`` cannot create groups among themselves lazily: torch names a
    group made with ``use_local_synchronization=True`` from its ranks and the number of groups
    its creator already has, so members with different counts would wait under different names
    (collective over ``cg``; the same answer on every rank)."""
    names = getattr(getattr(c10d, "_world", None), "pg_names", None)
    if names is None:  # a torch that names groups otherwise: nothing to check
        return None
    counts: list = [None] * dist.get_world_size(cg)
    dist.all_gather_object(counts, len(names), group=cg)
    if len(set(counts)) == 1:
        return None
    return (f"the group's ranks belong to different numbers of process groups ({counts}), so "
            f"the per-host and leader groups cannot be created among them")


def host_groups(group=None, timeout_s: float | None = None) -> HostGroups:
    """The per-host and leaders' gloo groups of ``group`` (cached per group).

    Collective over the members of ``group`` on its first use (every member calls it; ranks
    outside the group do not). torch's rule for ``new_group``: every rank of the default group
    calls it in the same order, unless ``use_local_synchronization=True``, where only the
    members call it and the group is named from its ranks and the number of groups each member
    already has. The group's members are the only ranks in this call, so the groups are made the
    second way, after checking that every member has the same count (else ``ValueError`` on
    every rank), and every member makes exactly two: its host's group, then the leaders' group
    on a leader or a group of itself alone on the others. So every member still has the same
    count afterwards, and later lazy groups among them (``cpu_group`` of a subgroup) keep
    working.

    Raises:
        ValueError (every rank) when the members' group counts differ; PeerTimeoutError when a
        member does not take part within ``timeout_s``.
    """
    key = group_key(group)
    hg = _GROUPS.get(key)
    if hg is None:
        hg = _GROUPS[key] = _create(group, config.timeout_s(timeout_s))
    return hg


def _create(group, t: float) -> HostGroups:
    cg = cpu_group(group)
    op = "dp_attention sync (hier groups)"
    with guard_timeout(cg, op, t):
        layout = group_hosts(group)
        why = _naming_reason(cg)
    if why is not None:
        raise ValueError(f"{op}: {why}")
    rank, world = dist.get_rank(cg), dist.get_world_size(cg)
    glob = [dist.get_global_rank(cg, r) for r in range(world)]
    # a host's ranks in ascending global rank (new_group's order); its first is the leader
    local = tuple(tuple(sorted(rs, key=glob.__getitem__)) for rs in layout.ranks)
    by_global = sorted(range(layout.num_hosts), key=lambda h: glob[local[h][0]])
    leaders = [glob[local[h][0]] for h in by_global]
    mine = layout.host_of[rank]
    leader = rank == local[mine][0]
    # the groups' own timeout is the default budget, as for the gloo twins (``cpu_group``); each
    # exchange bounds its wait by the call's ``timeout_s``
    td = datetime.timedelta(seconds=config.timeout_s())
    with guard_timeout(cg, op, t):
        host = dist.new_group([glob[r] for r in local[mine]], backend="gloo", timeout=td,
                              use_local_synchronization=True)
        role = dist.new_group(leaders if leader else [glob[rank]], backend="gloo", timeout=td,
                              use_local_synchronization=True)
    if dist.get_process_group_ranks(host) != [glob[r] for r in local[mine]] or (
            leader and dist.get_process_group_ranks(role) != leaders):
        raise RuntimeError(f"{op}: a new group's rank order is not ascending global rank")
    return HostGroups(layout, host, role if leader else None, local, tuple(by_global))


def forget_groups() -> None:
    """Forget every group's cached per-host and leaders' groups (the next hierarchical exchange
    makes new ones; ``close_shm_channels`` calls it, on every rank)."""
    _GROUPS.clear()


# -- the host's segment ------------------------------------------------------------------------

class HostChannel(_shm.ShmRowExchange):
    """``ShmRowExchange`` over the ranks of one host, with a result area that host rank 0 (the
    leader) writes after each step and the others read (layout and ordering: module
    docstring).

    Arguments:
        group: the host's gloo group. row_len: values per row (1..7).
        result_words: int64 values of a result (W · row_len).
        timeout_s: bound for the setup collectives.
    """

    def __init__(self, group, row_len: int, result_words: int, *,
                 timeout_s: float | None = None):
        self.result_words = result_words
        super().__init__(group, row_len, timeout_s=timeout_s)
        self._res = super()._segment_words()
        self._result_fmt = struct.Struct(f"{result_words}q")

    def _segment_words(self) -> int:
        return super()._segment_words() + _RESULT_HEAD + self.result_words

    def publish(self, words: Sequence[int]) -> None:
        """Leader: this step's result (``result_words`` ints), then the step number."""
        off = self._res
        self._result_fmt.pack_into(self._mm, 8 * (off + _RESULT_HEAD), *words)
        self._words[off + 1] = _OK
        self._words[off + 2] = len(words)
        self._words[off] = self.step  # last: a reader that sees it sees the words

    def fail(self, peer_ranks: Sequence[int] | None) -> None:
        """Leader: this step failed; ``peer_ranks`` (group ranks) did not answer, or None when
        it failed otherwise."""
        off, n = self._res, len(peer_ranks or ())
        if n:
            struct.pack_into(f"{n}q", self._mm, 8 * (off + _RESULT_HEAD), *peer_ranks)
        self._words[off + 1] = _PEERS_SILENT if peer_ranks else _FAILED
        self._words[off + 2] = n
        self._words[off] = self.step

    def receive(self, timeout_s: float) -> tuple[int, tuple[int, ...]]:
        """The others: ``(status, words)`` of this step's result, waiting up to ``timeout_s``
        (``status`` 0: the rows; else ``words`` holds the silent peers). Raises
        ``PeerTimeoutError`` (peer: host rank 0) when the step's result does not come."""
        words, off, step = self._words, self._res, self.step
        if words[off] != step:
            self._wait_result(step, timeout_s)
        status, n = words[off + 1], words[off + 2]
        vals = self._result_fmt.unpack_from(self._mm, 8 * (off + _RESULT_HEAD))
        if words[off] != step:  # impossible by the one-buffer argument: fail loudly
            raise RuntimeError(f"hier sync: the step-{step} result changed while read; are the "
                               f"ranks' calls out of step?")
        return status, (vals if status == _OK else vals[:n])

    def _wait_result(self, step: int, timeout_s: float) -> None:
        # the phases of shm's wait: spin, then yield the core, then sleep with back-off
        words, off = self._words, self._res
        start = time.perf_counter()
        sleep = 20e-6
        while words[off] != step:
            now = time.perf_counter()
            waited = now - start
            if waited < _shm._SPIN_S:
                continue
            if waited > timeout_s:
                if words[off] == step:
                    return
                op = "dp_attention sync (hier)"
                raise PeerTimeoutError(f"{op}: no step-{step} result from the host leader "
                                       f"within {timeout_s:g} s", peer_ranks=[0],
                                       timeout_s=timeout_s, op=op)
            if waited < _shm._YIELD_S:
                os.sched_yield()
            else:
                time.sleep(sleep)
                sleep = min(sleep * 2, _shm._MAX_SLEEP_S)


# -- the exchange ---------------------------------------------------------------------------------

def _renamed(exc: PeerTimeoutError, ranks: Sequence[int], what: str,
             t: float) -> PeerTimeoutError:
    """``exc`` (from a subgroup whose rank i is group rank ``ranks[i]``) with its peers named
    in group ranks: ``what`` formats them (``{peers}``); the subgroup's own error, in its own
    numbering, stays on ``__cause__`` and its transport error (a closed connection) is quoted."""
    peers = sorted({ranks[p] for p in exc.peer_ranks}) if exc.peer_ranks is not None else None
    op = "dp_attention sync (hier)"
    cause = exc.__cause__
    return PeerTimeoutError(f"{op}: no answer from {what.format(peers=peers)} within {t:g} s"
                            + (f" ({str(cause).splitlines()[0][:200]})" if cause else ""),
                            peer_ranks=peers, timeout_s=t, op=op)


class HierExchange:
    """One hierarchical exchange of ``row_len`` int64 values per rank on ``group`` (collective
    construction over the group's members: ``host_groups`` then each host's segment).

    ``exchange_flat(row, timeout_s)`` → every rank's row back to back (group rank order).
    Raises ValueError for a row that is not ``row_len`` ints in the int64 range (this rank only,
    before anything is sent) and PeerTimeoutError naming silent group ranks (module docstring).
    """

    def __init__(self, group, row_len: int, *, timeout_s: float | None = None):
        hg = host_groups(group, timeout_s)
        layout = hg.layout
        self.row_len, self.world = row_len, len(layout.host_of)
        self.rank = dist.get_rank(cpu_group(group))
        mine = layout.host_of[self.rank]
        self.host_ranks = hg.local_ranks[mine]
        self.leader = self.host_ranks[0]
        self.leaders_group = hg.leaders
        self.channel = (HostChannel(hg.host, row_len, self.world * row_len, timeout_s=timeout_s)
                        if len(self.host_ranks) > 1 else None)
        self.single_host = layout.num_hosts == 1
        width = max(len(r) for r in hg.local_ranks)
        self._block = width * row_len
        # the leaders' ranks in group numbering, and where each group rank's values sit in the
        # leaders' all_gather (or, on one host, in the host's rows)
        self.leader_ranks = [hg.local_ranks[h][0] for h in hg.leader_hosts]
        slot = {}
        for k, h in enumerate(hg.leader_hosts):
            for j, r in enumerate(hg.local_ranks[h]):
                slot[r] = k * width + j
        self._take = operator.itemgetter(*[slot[r] * row_len + f for r in range(self.world)
                                           for f in range(row_len)])
        self.op = "dp_attention sync (hier)"

    def exchange_flat(self, row: Sequence[int], timeout_s: float | None) -> tuple[int, ...]:
        t = config.timeout_s(timeout_s)
        if self.channel is not None:
            try:
                rows = self.channel.exchange_flat(row, timeout_s=t)
            except PeerTimeoutError as exc:
                raise _renamed(exc, self.host_ranks, "rank(s) {peers} of this host", t) from exc
        else:  # alone on its host
            rows = tuple(row)
            if len(rows) != self.row_len:
                raise ValueError(f"row has {len(rows)} values, expected {self.row_len}")
            try:
                struct.pack(f"{self.row_len}q", *rows)
            except struct.error:
                raise ValueError(_shm.bad_value_message(rows)) from None
        if self.single_host:
            return self._take(rows)
        if self.rank != self.leader:
            return self._result(t)
        try:
            flat = self._across(rows, t)
        except PeerTimeoutError as exc:
            if self.channel is not None:
                self.channel.fail(exc.peer_ranks)
            raise
        except BaseException:
            if self.channel is not None:
                self.channel.fail(None)
            raise
        if self.channel is not None:
            self.channel.publish(flat)
        return flat

    def _result(self, t: float) -> tuple[int, ...]:
        try:
            status, vals = self.channel.receive(t + _grace(t))
        except PeerTimeoutError as exc:
            raise _renamed(exc, self.host_ranks, "the host leader (rank(s) {peers})",
                           t + _grace(t)) from exc
        if status == _OK:
            return vals
        if status == _PEERS_SILENT:
            raise PeerTimeoutError(f"{self.op}: the host leader (rank {self.leader}) got no rows "
                                   f"from host leader rank(s) {list(vals)} within {t:g} s",
                                   peer_ranks=list(vals), timeout_s=t, op=self.op)
        raise RuntimeError(f"{self.op}: the host leader (rank {self.leader}) failed in its "
                           f"exchange with the other hosts (its own error says why)")

    def _across(self, rows: Sequence[int], t: float) -> tuple[int, ...]:
        """The leaders' all_gather of their hosts' rows, in group rank order."""
        g = self.leaders_group
        try:
            local = torch.tensor(list(rows) + [0] * (self._block - len(rows)), dtype=torch.int64)
        except (RuntimeError, OverflowError, TypeError, ValueError):  # the error path only
            raise ValueError(_shm.bad_value_message(rows)) from None
        out = torch.full((len(self.leader_ranks) * self._block,), UNSENT, dtype=torch.int64)
        try:
            wait(all_gather_tensor(out, local, g, async_op=True), g, self.op, t)
        except PeerTimeoutError as exc:
            raise _renamed(exc, self.leader_ranks, "host leader rank(s) {peers}", t) from exc
        vals = out.tolist()
        n, b = self.row_len, self._block
        # a host's first row is always real: its last field still UNSENT → nothing arrived
        if UNSENT in vals[n - 1::b]:
            missing = [self.leader_ranks[k] for k in range(len(self.leader_ranks))
                       if vals[k * b + n - 1] == UNSENT]
            raise PeerTimeoutError(f"{self.op}: the exchange returned without the rows of host "
                                   f"leader rank(s) {missing} (aborted or timed out)",
                                   peer_ranks=missing, timeout_s=t, op=self.op)
        return self._take(vals)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
