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
from collections.abc import Mapping

import torch

from ...symm_regions import ALIGN, Region, RegionLayout, descriptor

__all__ = ["SlabLayout", "ALIGN", "R_O", "R_L", "R_F", "R_LLO", "R_LLL"]

#: The regions' positions in the slab and in the kernels' descriptor (``attncomm.symm_regions``).
R_O, R_L, R_F, R_LLO, R_LLL = range(5)


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
    (int32 flags), ``llo`` (int64 ``[ll_rows, row_words]``), ``lll`` (int64 ``[ll_rows]``);
    ``2·W`` cells each (slot-major).
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

    @functools.cached_property
    def region_layout(self) -> RegionLayout:
        """The regions (``attncomm.symm_regions``), in the order of ``R_O`` … ``R_LLL``."""
        c = self.cells
        return RegionLayout([
            Region("o", c, self.max_rows * self.head_dim * self.itemsize, self.itemsize),
            Region("l", c, self.max_rows * 4, 4),
            Region("f", c, self.max_blocks * 4, 4),
            Region("llo", c, self.ll_rows * self.row_words * 8, 8),
            Region("lll", c, self.ll_rows * 8, 8)])

    def cell_bytes(self) -> dict[str, int]:
        """Bytes of one (slot, source) cell of each region (128-byte aligned)."""
        lay = self.region_layout
        return {r.name: lay.cell(r.name) for r in lay.regions}

    def _cell(self, slot: int, src: int) -> int:
        if slot not in (0, 1) or not 0 <= src < self.world_size:
            raise ValueError(f"SlabLayout: no cell (slot={slot}, src={src}) with "
                             f"world_size={self.world_size}")
        return slot * self.world_size + src

    def region_base(self, region: str) -> int:
        """Byte offset where ``region`` starts."""
        try:
            return self.region_layout.base(region)
        except ValueError:
            raise ValueError(f"SlabLayout: no region {region!r}") from None

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
        return self.region_layout.total_bytes

    @functools.cache  # noqa: B019 - a few frozen layouts per process
    def kernel_strides(self) -> Mapping[str, int]:
        """Region bases and cell strides in elements of each region's type, as kernels index
        them (the descriptor's region words): ``o`` in payload elements, ``l``/``f`` in 4-byte
        words, ``llo``/``lll`` in 8-byte words. Every region is 128-byte aligned, so each base
        is a whole number of its elements."""
        lay = self.region_layout
        out = {}
        for r in lay.regions:
            out[f"{r.name}_base"] = lay.base(r.name) // r.unit
            out[f"{r.name}_cell"] = lay.cell(r.name) // r.unit
        return types.MappingProxyType(out)

    def descriptor(self, peer_ptrs, rank: int, timeout_ns: int, device) -> torch.Tensor:
        """The kernels' descriptor of this layout for ``rank`` (``attncomm.symm_regions``):
        region words, the wait budget ``timeout_ns``, the peer offsets from ``peer_ptrs``
        (every rank's slab address). RuntimeError when the slabs are misaligned."""
        return descriptor(self.region_layout, peer_ptrs, rank, self.itemsize, timeout_ns,
                          device, op="symm_a2a")
