"""The one small interface every Ulysses transport implements."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from .layout import ExchangePlan, Piece

__all__ = ["Transport", "Exchange", "source_view"]


def source_view(parts: Sequence[torch.Tensor], piece: Piece) -> torch.Tensor:
    """The ``[rows, cols]`` view of ``parts[piece.part]`` (``[B, S, H, D]``, last two dims
    dense) that ``piece`` sends: rows are sequence positions, columns ``heads × D``."""
    x = parts[piece.part]
    d = x.shape[3]
    heads = piece.cols // d
    v = x[piece.b, piece.src_row0:piece.src_row0 + piece.rows,
          piece.src_head0:piece.src_head0 + heads]
    return v.reshape(piece.rows, piece.cols)


class Exchange(ABC):
    """An exchange in flight. ``wait()`` returns this rank's final buffer (flat, ``[numel]``)
    once every source's data is there; ``release()`` says the caller is done reading it (a
    transport with staging buffers may reuse them afterwards; the default does nothing)."""

    @abstractmethod
    def wait(self) -> torch.Tensor:
        ...

    def release(self) -> None:
        return None


class Transport(ABC):
    """Moves the pieces of an ``ExchangePlan`` between the ranks of a group.

    ``start(plan, parts, dtype, out=None)`` is called on every rank in the same order with the
    same plan. ``parts`` are this rank's source tensors (``[B, S, H, D]``, last two dims dense,
    dtype ``dtype``). ``out`` (optional, flat, ``recv_numel[rank]`` elements) is where the final
    buffer should live; without it the transport chooses (it may be a staging buffer that is
    valid until ``release()``).
    """

    name: str = "?"

    def __init__(self, group, rank: int, world_size: int, timeout_s: float):
        self.group = group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s

    @abstractmethod
    def start(self, plan: ExchangePlan, parts: Sequence[torch.Tensor], dtype: torch.dtype,
              device: torch.device, out: torch.Tensor | None = None) -> Exchange:
        ...

    def check(self) -> None:
        """Raise any timeout recorded on the device since the last check (default: none)."""
        return None
