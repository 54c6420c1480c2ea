"""The one small interface every DCP query-gather backend implements, and the registry.

Dependency direction: the backends (``all_gather``, ``symm``) import this module and register
their class here (``@GATHER_REGISTRY.register``); the facade (``api``) imports the backends, so
every backend is registered before a name is resolved. This module imports no backend.
"""
from __future__ import annotations

from abc import abstractmethod

import torch

from ..exchange import ExchangeBackend, Registry
from .query_math import FP8_DTYPE

__all__ = ["QueryGatherBackend", "GATHER_BACKENDS", "GATHER_REGISTRY", "RULE_OF_THUMB"]

#: Every backend name. ``auto`` is not a backend: ``DcpQueryGather`` resolves it.
GATHER_BACKENDS = ("all_gather", "symm", "auto")
#: What ``auto`` takes when nothing is measured (CPU groups, one candidate).
RULE_OF_THUMB = ("symm", "all_gather")
#: The gather's backends (each backend's module registers its class).
GATHER_REGISTRY = Registry(GATHER_BACKENDS, "gather backend", "GATHER_BACKENDS",
                           preferred="symm", rule_of_thumb=RULE_OF_THUMB,
                           env_var="ATTNCOMM_DCP_GATHER_BACKEND")


class QueryGatherBackend(ExchangeBackend):
    """The one interface every query-gather backend implements.

    Constructed collectively (every rank of ``group``, same arguments). ``__call__(q, cos,
    sin, into=None)`` takes this rank's ``[T, H/W, D]`` slice (``dtype``, contiguous,
    ``T ≤ max_tokens``) and, when ``rope_dim > 0``, fp32 contiguous ``cos, sin [T, rope_dim]``;
    it returns ``[T, H, D]`` in ``out_dtype``, a view of a persistent buffer (see each backend
    for how long it stays valid), or ``into`` (a caller-owned contiguous ``[T, H, D]`` tensor of
    ``out_dtype``) written with the same bits. ``q`` is never modified. With ``out_dtype ==
    FP8_DTYPE``, ``q_scale`` is the ``[H]`` fp32 device tensor of per-head scales and the
    result is ``quantize_e4m3`` of the rotated fp32 query, bit for bit. ``ordered_by_caller``:
    the caller promises a cross-rank dependency between a result's readers and the next call on
    every rank (``DcpQueryGather`` says what that allows); a backend whose results are local
    memory ignores it.
    """

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, rope_dim: int, device: torch.device, timeout_s: float,
                 out_dtype: torch.dtype | None = None, q_scale: torch.Tensor | None = None,
                 ordered_by_caller: bool = False):
        super().__init__(group, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim,
                         dtype=dtype, device=device, timeout_s=timeout_s)
        self.ordered_by_caller = bool(ordered_by_caller)
        self.rope_dim = rope_dim
        self.out_dtype = out_dtype if out_dtype is not None else dtype
        self.fp8 = self.out_dtype == FP8_DTYPE
        if self.fp8 and q_scale is None:
            raise ValueError(f"{type(self).__name__}: FP8 output needs q_scale [H] fp32")
        self.q_scale = q_scale

    @abstractmethod
    def __call__(self, q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        ...

    def into_new(self, q: torch.Tensor, cos: torch.Tensor | None,
                 sin: torch.Tensor | None) -> torch.Tensor:
        """The call's result in a new contiguous ``[T, H, D]`` tensor of ``out_dtype`` (the
        arguments as ``__call__``'s). By default the call into a new empty tensor; a backend
        whose call copies out of its own buffer anyway returns a clone of that buffer instead
        (the same allocation, copy and bits, in one call into torch)."""
        return self(q, cos, sin, into=torch.empty((q.shape[0], self.num_heads, self.head_dim),
                                                  dtype=self.out_dtype, device=self.device))
