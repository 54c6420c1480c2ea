"""The one small interface every DCP query-gather backend implements, and the registry.

Dependency direction: the backends (``all_gather``, ``symm``) import this module and register
their class here (``@register``); the facade (``api``) imports the backends, so every backend is
registered before a name is resolved. This module imports no backend.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from .query_math import FP8_DTYPE

__all__ = ["QueryGatherBackend", "GATHER_BACKENDS", "REGISTRY", "backend_class", "register"]

#: Every backend name. ``auto`` is not a backend: ``DcpQueryGather`` resolves it.
GATHER_BACKENDS = ("all_gather", "symm", "auto")
#: name → class, filled by ``register`` when a backend's module is imported.
REGISTRY: dict[str, type] = {}


class QueryGatherBackend(ABC):
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

    name: str = "?"

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, rope_dim: int, device: torch.device, timeout_s: float,
                 out_dtype: torch.dtype | None = None, q_scale: torch.Tensor | None = None,
                 ordered_by_caller: bool = False):
        self.group = group
        self.ordered_by_caller = bool(ordered_by_caller)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.max_tokens, self.num_heads, self.head_dim = max_tokens, num_heads, head_dim
        self.hs = num_heads // self.world_size
        self.dtype, self.rope_dim = dtype, rope_dim
        self.device, self.timeout_s = device, timeout_s
        self.out_dtype = out_dtype if out_dtype is not None else dtype
        self.fp8 = self.out_dtype == FP8_DTYPE
        if self.fp8 and q_scale is None:
            raise ValueError(f"{type(self).__name__}: FP8 output needs q_scale [H] fp32")
        self.q_scale = q_scale

    @classmethod
    def collective_unavailable_reason(cls, group, device: torch.device) -> str | None:
        """Why this backend cannot run on this rank (None if it can). A collective call: every
        rank of ``group`` calls it alike (it may learn which hosts the peers are on); the caller
        agrees the verdict across ranks (``attncomm.select``)."""
        return None

    @abstractmethod
    def __call__(self, q: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None,
                 into: torch.Tensor | None = None) -> torch.Tensor:
        ...

    def check(self) -> None:
        """Raise any timeout recorded on the device since the last check (default: none)."""

    def close(self) -> None:
        """Free what the backend holds (collective when it holds symmetric memory: a barrier
        first, so no peer still writes into it). Default: nothing to free."""


def register(cls: type[QueryGatherBackend]) -> type[QueryGatherBackend]:
    """Class decorator: register a backend under its ``name`` (one of ``GATHER_BACKENDS``)."""
    if cls.name not in GATHER_BACKENDS[:-1]:
        raise ValueError(f"unknown gather backend name {cls.name!r}; declare it in "
                         f"GATHER_BACKENDS")
    REGISTRY[cls.name] = cls
    return cls


def backend_class(name: str) -> type[QueryGatherBackend]:
    """The ``QueryGatherBackend`` subclass registered as ``name``.

    Raises:
        ValueError: ``name`` is not a backend, or its module was not imported (the facade
        imports every backend module).
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown gather backend {name!r}; expected one of "
                         f"{list(GATHER_BACKENDS[:-1])}")
    return REGISTRY[name]
