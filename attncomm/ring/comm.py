"""The ring's point-to-point exchange: K/V blocks to the next rank, from the previous one.

One step posts, in one ``dist.batch_isend_irecv``, the sends of the blocks this rank holds to rank
``r + 1`` and the receives of the next blocks from rank ``r − 1`` (NCCL coalesces them into one
group call; gloo runs them as separate async ops on CPU ranks). The caller posts step i+1's
transfer before step i's attention and waits after it (double buffering: the block being sent
is the one being attended, read-only; the receive lands in the other buffer of the pair).

Every wait is bounded: on gloo by ``timeout_s`` per wait (``attncomm._dist.wait``), on NCCL by
the process group's timeout (the wait is a stream wait, so the host runs ahead). A peer that does
not answer raises ``PeerTimeoutError`` naming it: the previous rank for a receive, the next one
for a send (ranks in the ring group's numbering).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import _dist, collectives
from ..errors import PeerTimeoutError

__all__ = ["RingComm"]


class RingComm:
    """Sends to the next rank and receives from the previous one on ``group``.

    Arguments:
        group: the ring's process group (None: the default group).
        timeout_s: the bound of every wait, in seconds.
        op: the operation's name, for error messages.
    """

    def __init__(self, group, timeout_s: float, op: str = "ring_attention"):
        self.group = group
        self.timeout_s = timeout_s
        self.op = op
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = (self.rank + 1) % self.world
        self.prev = (self.rank - 1) % self.world
        # P2POp takes global ranks on every torch this package supports.
        self._next_global = dist.get_global_rank(group, self.next) if group is not None \
            else self.next
        self._prev_global = dist.get_global_rank(group, self.prev) if group is not None \
            else self.prev

    def start(self, send: list[torch.Tensor], recv: list[torch.Tensor]) -> list:
        """Post the sends of ``send`` (contiguous tensors) to the next rank and the receives into
        ``recv`` (same shapes, contiguous) from the previous rank; returns the pending works for
        ``wait``. ``c10d.isend``/``c10d.irecv`` are the functions ``P2POp`` accepts."""
        ops = [dist.P2POp(c10d.isend, t, self._next_global, self.group) for t in send]
        ops += [dist.P2POp(c10d.irecv, t, self._prev_global, self.group) for t in recv]
        with _dist.guard_timeout(self.group, self.op + " (post K/V)", self.timeout_s):
            works = collectives.batch_isend_irecv(ops)
        n = len(send)
        if len(works) == len(ops):
            return [(w, "send" if i < n else "receive") for i, w in enumerate(works)]
        return [(w, "exchange") for w in works]  # NCCL: one work for the coalesced group

    def wait(self, pending: list, step: int) -> None:
        """Wait for ``pending`` (from ``start``); step ``step`` for messages."""
        for work, kind in pending:
            peer = {"send": self.next, "receive": self.prev}.get(kind)
            what = f"{self.op} step {step}: K/V {kind}"
            try:
                _dist.wait(work, self.group, what, self.timeout_s)
            except PeerTimeoutError as exc:
                if peer is None:
                    raise
                raise PeerTimeoutError(
                    f"{what} {'to' if kind == 'send' else 'from'} ring rank {peer}: no answer "
                    f"within {self.timeout_s:g} s ({exc.__cause__ or exc})",
                    peer_ranks=[peer], timeout_s=self.timeout_s, op=what) from exc
