"""The cross-rank argument check of ``ring_attention``, ``RingAttention`` and ``USPAttention``:
one place decides whether it runs (``validation_on``), so a package-wide change of the policy
lands here once.

- ``check_call``: one group — local errors and the call's signature agreed over the gloo twin
  (``attncomm._dist.agree``); a mismatch or a local error raises the same ``ValueError`` on every
  rank.
- ``check_call_2d``: two groups that tile a grid (USP: the Ulysses group and the ring group of
  every rank) — agreed over the first, then the second (carrying the first's verdict), then the
  first again (carrying the second's), so a bad argument on any rank of the grid raises
  ``ValueError`` on every rank of it, not only on the ranks that share a group with it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import _dist, config

__all__ = ["validation_on", "check_call", "check_call_2d"]


def validation_on(validate: bool | None, device_tensor=None) -> bool:
    """Whether the cross-rank check runs for this call: ``validate`` if given, else env
    ``ATTNCOMM_VALIDATE``, else on — except while a CUDA graph is being captured."""
    capturing = (isinstance(device_tensor, torch.Tensor) and device_tensor.is_cuda
                 and torch.cuda.is_current_stream_capturing())
    return config.validate_enabled(validate, default=not capturing)


def _local(group, op: str, error: str | None) -> None:
    if error:
        raise ValueError(f"{op}: invalid arguments — rank {dist.get_rank(group)}: {error}")


def check_call(group, op: str, validate: bool | None, signature, labels, error: str | None,
               timeout_s: float, device_tensor=None) -> None:
    """Agree ``signature`` (ints, ``labels`` name them) and share ``error`` (this rank's local
    error or None) over ``group``'s gloo twin when validation is on; otherwise raise a local
    error on this rank only. Raises ``ValueError``; ``PeerTimeoutError`` when a peer does not
    take part within ``timeout_s``."""
    if validation_on(validate, device_tensor) and dist.get_world_size(group) > 1:
        _dist.agree(group, op, signature, labels, local_error=error, timeout_s=timeout_s)
    else:
        _local(group, op, error)


def check_call_2d(first, second, op: str, validate: bool | None, signature, labels,
                  error: str | None, timeout_s: float, device_tensor=None) -> None:
    """``check_call`` over a grid tiled by the groups ``first`` and ``second`` (every rank's
    two groups): three small collectives, each rank's verdict carried into the next."""
    if not validation_on(validate, device_tensor):
        _local(first, op, error)
        return
    verdict, message = error, None
    for group in (first, second):
        if dist.get_world_size(group) > 1:
            try:
                _dist.agree(group, op, signature, labels, local_error=verdict,
                            timeout_s=timeout_s)
            except ValueError as exc:
                verdict = message = str(exc)
    if dist.get_world_size(first) > 1 and dist.get_world_size(second) > 1:
        reason = _dist.agree_reason(first, verdict, op)
        if reason and message is None:
            message = f"{op}: invalid arguments on another rank of the grid — {reason}"
    if message:
        raise ValueError(message)
    _local(first, op, verdict)
