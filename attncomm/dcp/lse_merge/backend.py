"""The one small interface every DCP merge backend implements, and the registry of backends.

Dependency direction: the backends (``collective``, ``symm_a2a``) import this module and
register their class here (``@register``); the facade (``api``) imports the backends, so every
backend is registered before a name is resolved. This module imports no backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

__all__ = ["DcpBackend", "BACKENDS", "REGISTRY", "backend_class", "register"]

#: Every backend name, in the order messages list them. ``auto`` is not a backend: ``DcpMerger``
#: resolves it to one of the others.
BACKENDS = ("reference", "ag_rs", "a2a", "symm_a2a", "auto")
#: name → class, filled by ``register`` when a backend's module is imported.
REGISTRY: dict[str, type] = {}


class DcpBackend(ABC):
    """A preallocated merge of ``out [T, H, D]`` / ``lse [T, H]`` over a group.

    Constructed collectively (every rank of ``group``, same arguments). ``__call__(out, lse,
    res=None, res_lse=None)`` takes this rank's partial output (dtype ``dtype``, contiguous,
    ``T ≤ max_tokens``) and its LSE (fp32, base e, contiguous) and returns this rank's head
    slice: ``([T, H/W, D]`` in ``dtype``, ``[T, H/W]`` fp32 base-e LSE)``. ``res`` /
    ``res_lse``, when given (contiguous, exactly those shapes and dtypes, on the backend's
    device), receive the result and are returned: a caller-owned destination, written with
    the bits a fresh result would hold. Without them, backends that allocate per call return
    fresh tensors; preallocated backends may return views of internal buffers that are valid
    until the next call (the caller copies when needed). Inputs are never modified.
    """

    name: str = "?"
    #: ``__call__`` returns views of internal buffers, valid until the next call (the caller
    #: copies to keep them).
    returns_views: bool = False

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.max_tokens = max_tokens
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.timeout_s = timeout_s

    @classmethod
    def collective_unavailable_reason(cls, group, device: torch.device) -> str | None:
        """Why this backend cannot run on this rank (None if it can). A collective call: every
        rank of ``group`` calls it alike (it may learn which hosts the peers are on); the caller
        agrees the verdict across ranks (``attncomm.select``)."""
        return None

    @abstractmethod
    def __call__(self, out: torch.Tensor, lse: torch.Tensor, res: torch.Tensor | None = None,
                 res_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call of ``num_tokens`` tokens runs (default: this one)."""
        return self.name

    def check(self) -> None:
        """Raise any timeout recorded on the device since the last check (default: none)."""

    def close(self) -> None:
        """Free what the backend holds (collective when it holds symmetric memory: a barrier
        first, so no peer still writes into it). Default: nothing to free."""


def register(cls: type[DcpBackend]) -> type[DcpBackend]:
    """Class decorator: register a backend under its ``name`` (one of ``BACKENDS``)."""
    if cls.name not in BACKENDS[:-1]:
        raise ValueError(f"unknown DCP backend name {cls.name!r}; declare it in BACKENDS")
    REGISTRY[cls.name] = cls
    return cls


def backend_class(name: str) -> type[DcpBackend]:
    """The ``DcpBackend`` subclass registered as ``name``.

    Raises:
        ValueError: ``name`` is not a backend, or its module was not imported (the facade
        imports every backend module).
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown DCP backend {name!r}; expected one of {list(BACKENDS[:-1])}")
    return REGISTRY[name]
