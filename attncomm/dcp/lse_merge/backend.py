"""The one small interface every DCP merge backend implements, and the registry of backends.

Dependency direction: the backends (``collective``, ``symm_a2a``) import this module and
register their class here (``@MERGE_REGISTRY.register``); the facade (``api``) imports the
backends, so every backend is registered before a name is resolved. This module imports no
backend.
"""
from __future__ import annotations

from abc import abstractmethod

import torch

from ..exchange import ExchangeBackend, Registry

__all__ = ["DcpBackend", "BACKENDS", "MERGE_REGISTRY", "RULE_OF_THUMB", "AUTO_CANDIDATES"]

#: Every backend name, in the order messages list them. ``auto`` is not a backend: ``DcpMerger``
#: resolves it to one of the others.
BACKENDS = ("reference", "ag_rs", "a2a", "symm_a2a", "auto")
#: What ``auto`` takes when nothing is measured (CPU groups): one collective (a2a) before two
#: (ag_rs); ``reference`` is never chosen automatically.
RULE_OF_THUMB = ("symm_a2a", "a2a", "ag_rs", "reference")
AUTO_CANDIDATES = ("symm_a2a", "ag_rs", "a2a")
#: The merge's backends (each backend's module registers its class).
MERGE_REGISTRY = Registry(BACKENDS, "DCP backend", "BACKENDS", preferred="symm_a2a",
                          rule_of_thumb=RULE_OF_THUMB, auto_names=AUTO_CANDIDATES,
                          env_var="ATTNCOMM_DCP_BACKEND")


class DcpBackend(ExchangeBackend):
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

    #: ``__call__`` returns views of internal buffers, valid until the next call (the caller
    #: copies to keep them).
    returns_views: bool = False

    @abstractmethod
    def __call__(self, out: torch.Tensor, lse: torch.Tensor, res: torch.Tensor | None = None,
                 res_lse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        ...

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call of ``num_tokens`` tokens runs (default: this one)."""
        return self.name
