"""The slab layout of the ``symm_a2a`` DCP merge: where every region of a rank's symmetric slab
lives (the substrate, ``attncomm.symm.SymmWorkspace``, only allocates the bytes).

Slab layout (bytes, every region 128-byte aligned), for ``W`` source ranks and two parity slots::

    O    [2, W, max_rows, head_dim]  payload dtype   received output rows
    L    [2, W, max_rows]            fp32            received LSE values
    F    [2, W, max_blocks]          int32           one flag per row block (holds the epoch)
    LLO  [2, W, ll_rows, row_words]  int64           low-latency rows: (epoch << 32) | payload
    LLL  [2, W, ll_rows]             int64           low-latency LSE: (epoch << 32) | fp32 bits

``slot`` = ``epoch & 1``; cell ``(slot, src)`` of rank r's slab is written only by rank ``src``.
A "row" is one ``(token, head)`` pair of ``head_dim`` values, so a DCP merge of ``T`` tokens with
``H/W`` heads per rank moves ``T·H/W`` rows to each peer. Flags are sized for one-row blocks (the
finest blocking), so any block size works.
"""
from __future__ import annotations

import dataclasses
import functools
import types
from typing import NamedTuple
from collections.abc import Mapping

import torch

__all__ = ["SlabLayout", "SlabRegions", "ALIGN"]

ALIGN = 128


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class SlabLayout:
    """Byte offsets of every region of the slab.

    Arguments:
        world_size: number of source ranks ``W`` (≥ 1).
        max_rows: rows per (slot, source) cell (a DCP merge: ``max_tokens · H / W``), ≥ 0.
        head_dim: values per row, ≥ 1.
        itemsize: bytes per payload value (2 for fp16/bf16, 4 for fp32).
        ll_rows: rows per cell of the low-latency (LL) regions, ≤ ``max_rows``; 0 disables them.
            An LL word is 8 bytes, ``(epoch << 32) | 32 bits of payload``, so the receiver polls
            the data itself and the sender needs no fence (NCCL's LL protocol). A row takes
            ``head_dim · itemsize / 4`` payload words plus one LSE word.

    Regions, in order, each cell 128-byte aligned: ``o`` (payload dtype), ``l`` (fp32), ``f``
    (int32 flags), ``llo`` (int64 ``[ll_rows, row_words]``), ``lll`` (int64 ``[ll_rows]``).
    """

    world_size: int
    max_rows: int
    head_dim: int
    itemsize: int
    ll_rows: int = 0

    def __post_init__(self):
        for name in ("world_size", "head_dim", "itemsize"):
            if getattr(self, name) < 1:
                raise ValueError(f"SlabLayout: {name} must be ≥ 1, got {getattr(self, name)}")
        if self.max_rows < 0:
            raise ValueError(f"SlabLayout: max_rows must be ≥ 0, got {self.max_rows}")
        if not 0 <= self.ll_rows <= self.max_rows:
            raise ValueError(f"SlabLayout: ll_rows must be in [0, max_rows={self.max_rows}], "
                             f"got {self.ll_rows}")
        if self.ll_rows and (self.head_dim * self.itemsize) % 4:
            raise ValueError(f"SlabLayout: LL rows need head_dim·itemsize divisible by 4, got "
                             f"{self.head_dim}·{self.itemsize}")

    @property
    def max_blocks(self) -> int:
        """Flags per cell: one per row at the finest blocking (at least one)."""
        return max(self.max_rows, 1)

    @property
    def row_words(self) -> int:
        """32-bit payload words per row (LL rows carry one per 8-byte word)."""
        return self.head_dim * self.itemsize // 4

    @property
    def cells(self) -> int:
        return 2 * self.world_size

    def cell_bytes(self) -> dict[str, int]:
        """Bytes of one (slot, source) cell of each region (128-byte aligned)."""
        return {"o": _align(self.max_rows * self.head_dim * self.itemsize),
                "l": _align(self.max_rows * 4),
                "f": _align(self.max_blocks * 4),
                "llo": _align(self.ll_rows * self.row_words * 8),
                "lll": _align(self.ll_rows * 8)}

    def _cell(self, slot: int, src: int) -> int:
        if slot not in (0, 1) or not 0 <= src < self.world_size:
            raise ValueError(f"SlabLayout: no cell (slot={slot}, src={src}) with "
                             f"world_size={self.world_size}")
        return slot * self.world_size + src

    def region_base(self, region: str) -> int:
        """Byte offset where ``region`` starts."""
        off = 0
        for name, nbytes in self.cell_bytes().items():
            if name == region:
                return off
            off += self.cells * nbytes
        raise ValueError(f"SlabLayout: no region {region!r}")

    def offset(self, region: str, slot: int, src: int) -> int:
        """Byte offset of cell ``(slot, src)`` of ``region``."""
        return self.region_base(region) + self._cell(slot, src) * self.cell_bytes()[region]

    def o_offset(self, slot: int, src: int) -> int:
        """Byte offset of the output rows ``[max_rows, head_dim]`` from ``src`` in ``slot``."""
        return self.offset("o", slot, src)

    def l_offset(self, slot: int, src: int) -> int:
        """Byte offset of the fp32 LSE values ``[max_rows]`` from ``src`` in ``slot``."""
        return self.offset("l", slot, src)

    def f_offset(self, slot: int, src: int) -> int:
        """Byte offset of the int32 flags ``[max_blocks]`` from ``src`` in ``slot``."""
        return self.offset("f", slot, src)

    @property
    def total_bytes(self) -> int:
        return self.cells * sum(self.cell_bytes().values())

    def regions(self, slab: torch.Tensor, dtype: torch.dtype) -> SlabRegions:
        """The region views of ``slab`` (``[total_bytes] uint8``) for payload ``dtype``."""
        if slab.numel() < self.total_bytes or slab.dtype != torch.uint8:
            raise ValueError(f"SlabLayout: slab must be ≥ {self.total_bytes} uint8 bytes, got "
                             f"{slab.numel()} {slab.dtype}")
        if torch.empty((), dtype=dtype).element_size() != self.itemsize:
            raise ValueError(f"SlabLayout: dtype {dtype} is not {self.itemsize} bytes")
        st = self.kernel_strides()
        slab = slab[:self.total_bytes]
        return SlabRegions(
            _region(slab, dtype, 0, st["o_cell"]),
            _region(slab, torch.float32, st["l_base"], st["l_cell"]),
            _region(slab, torch.int32, st["f_base"], st["f_cell"]),
            _region(slab, torch.int64, st["llo_base"], st["llo_cell"]),
            _region(slab, torch.int64, st["lll_base"], st["lll_cell"]),
            st["o_cell"], st["l_cell"], st["f_cell"], st["llo_cell"], st["lll_cell"])

    @functools.cache  # noqa: B019 - a few frozen layouts per process
    def kernel_strides(self) -> Mapping[str, int]:
        """Region bases and cell strides in elements of each region's type, as kernels index
        them: ``o`` in payload elements (base 0), ``l``/``f`` in 4-byte words, ``llo``/``lll``
        in 8-byte words. Every region is 128-byte aligned, so each base is a whole number of
        its elements."""
        cb = self.cell_bytes()
        return types.MappingProxyType({
            "o_cell": cb["o"] // self.itemsize,
            "l_base": self.region_base("l") // 4, "l_cell": cb["l"] // 4,
            "f_base": self.region_base("f") // 4, "f_cell": cb["f"] // 4,
            "llo_base": self.region_base("llo") // 8, "llo_cell": cb["llo"] // 8,
            "lll_base": self.region_base("lll") // 8, "lll_cell": cb["lll"] // 8,
        })


class SlabRegions(NamedTuple):
    """Typed views of one slab at each region's base, and each region's cell stride in
    elements of its type (what the kernels take: base pointers, computed once)."""

    o: torch.Tensor     # payload dtype
    l: torch.Tensor     # fp32
    f: torch.Tensor     # int32
    llo: torch.Tensor   # int64
    lll: torch.Tensor   # int64
    o_cell: int
    l_cell: int
    f_cell: int
    llo_cell: int
    lll_cell: int


def _region(slab: torch.Tensor, dtype: torch.dtype, base: int, cell: int) -> torch.Tensor:
    # An empty region points at the slab's start (never accessed): a pointer one past the end
    # of the allocation may be refused by the launcher.
    typed = slab.view(dtype)
    return typed[base:] if cell else typed
