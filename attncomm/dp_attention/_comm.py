"""Bounded waits on torch.distributed work handles (shared by the sync and the gathers)."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .. import config
from .._dist import guard_timeout

__all__ = ["wait_work"]


def wait_work(work, group, op: str, timeout_s: float | None) -> None:
    """Wait for an ``async_op=True`` collective, bounded by ``timeout_s`` (None → env).

    On gloo the host wait itself is bounded; on NCCL ``wait`` only orders the current stream
    and the communicator's own timeout (``ATTNCOMM_TIMEOUT_S`` at init) bounds the operation.
    A timeout becomes ``PeerTimeoutError`` (naming every other rank: gloo cannot say which).
    """
    t = config.timeout_s(timeout_s)
    with guard_timeout(group, op, t):
        if dist.get_backend(group) == "gloo":
            work.wait(timeout=datetime.timedelta(seconds=t))
        else:
            work.wait()
