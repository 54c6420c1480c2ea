"""Exceptions shared by every exchange."""
from __future__ import annotations

__all__ = ["PeerTimeoutError", "ranks_text"]


def ranks_text(peers) -> str:
    """``"rank 3"`` or ``"ranks [0, 2]"`` for messages naming peers."""
    return f"rank {peers[0]}" if len(peers) == 1 else f"ranks {list(peers)}"


class PeerTimeoutError(RuntimeError):
    """A peer rank did not answer within the time budget.

    Raised on every rank that waited. ``peer_ranks`` lists the ranks (in the group's numbering)
    that did not answer, when known; ``timeout_s`` is the budget in seconds; ``op`` names the
    exchange step that waited.
    """

    def __init__(self, message: str, *, peer_ranks: list[int] | None = None,
                 timeout_s: float | None = None, op: str | None = None):
        super().__init__(message)
        self.peer_ranks = list(peer_ranks) if peer_ranks is not None else None
        self.timeout_s = timeout_s
        self.op = op

    def __reduce__(self):
        return (_rebuild_peer_timeout, (str(self), self.peer_ranks, self.timeout_s, self.op))


def _rebuild_peer_timeout(message, peer_ranks, timeout_s, op):
    return PeerTimeoutError(message, peer_ranks=peer_ranks, timeout_s=timeout_s, op=op)
