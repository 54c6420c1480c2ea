"""The one small interface every DCP merge backend implements, and the registry of backends.

The registry names each backend's module and class; ``backend_class`` imports the module on
first use, so the Triton-only ``symm_a2a`` stays optional and this module imports no backend
(the backends import ``DcpBackend`` from here).
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod

import torch

__all__ = ["DcpBackend", "BACKENDS", "REGISTRY", "backend_class"]

# name → (module, class). ``auto`` is not a backend: ``DcpMerger`` resolves it to one of these.
REGISTRY: dict[str, tuple[str, str]] = {
    "reference": ("attncomm.dcp.collective", "ReferenceBackend"),
    "ag_rs": ("attncomm.dcp.collective", "AgRsBackend"),
    "a2a": ("attncomm.dcp.collective", "A2ABackend"),
    "symm_a2a": ("attncomm.dcp.symm_a2a", "SymmA2ABackend"),
}
BACKENDS = (*REGISTRY, "auto")


class DcpBackend(ABC):
    """A preallocated merge of ``out [T, H, D]`` / ``lse [T, H]`` over a group.

    Constructed collectively (every rank of ``group``, same arguments). ``__call__`` takes this
    rank's partial output (dtype ``dtype``, contiguous, ``T ≤ max_tokens``) and its LSE (fp32,
    base e, contiguous) and returns this rank's head slice: ``([T, H/W, D]`` in ``dtype``,
    ``[T, H/W]`` fp32 base-e LSE)``. Inputs are never modified. Backends that allocate per call
    may return fresh tensors; preallocated backends may return views of internal buffers that are
    valid until the next call (the caller copies when needed).
    """

    name: str = "?"
    #: ``__call__`` returns views of internal buffers, valid until the next call (the caller
    #: copies to keep them).
    returns_views: bool = False

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float):
        self.group = group
        self.max_tokens = max_tokens
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.timeout_s = timeout_s

    @classmethod
    def local_unavailable_reason(cls, group, device: torch.device) -> str | None:
        """Why this backend cannot run on this rank (None if it can). Called on every rank of
        ``group`` alike (it may itself be collective, e.g. to learn which hosts the peers are
        on); the caller agrees the verdict across ranks."""
        return None

    @abstractmethod
    def __call__(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call of ``num_tokens`` tokens runs (default: this one)."""
        return self.name

    def check(self) -> None:
        """Raise any timeout recorded on the device since the last check (default: none)."""


def backend_class(name: str) -> type[DcpBackend]:
    """The ``DcpBackend`` subclass registered as ``name``.

    Raises:
        ValueError: ``name`` is not a registered backend.
        ImportError: the backend's optional dependency (Triton for ``symm_a2a``) is missing.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown DCP backend {name!r}; expected one of {list(REGISTRY)}")
    module, cls = REGISTRY[name]
    return getattr(importlib.import_module(module), cls)
