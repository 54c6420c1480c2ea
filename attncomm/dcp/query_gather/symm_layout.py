"""The slab layout of the ``symm`` query gather: where every region of a rank's symmetric slab
lives (the substrate, ``attncomm.symm.SymmWorkspace``, only allocates the bytes; the region
arithmetic is ``attncomm.symm_regions``'s, as for the merge's slab).

Slab layout (bytes, every region 128-byte aligned)::

    OUT    [max_tokens, H, D]          out dtype     the gathered query (the result; FP8: bytes)
    F      [2, W, max_blocks]          int32         one flag per row block (holds the epoch)
    LL     [2, W, ll_rows, row_words]  int64         LL words: (epoch << 32) | payload
    READY  [W]                         int32         READY[q]: the last call q has started

``OUT`` is at offset 0 (the result is a view of the slab's start). Cells ``(slot, src)`` of F and
LL, and ``READY[src]``, are written only by rank ``src``; OUT's heads ``[src·H/W, (src+1)·H/W)``
only by rank ``src``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ...symm_regions import Region, RegionLayout, descriptor

__all__ = ["GatherLayout", "R_OUT", "R_F", "R_LL", "R_READY"]

#: The regions' positions in the slab and in the kernels' descriptor (``attncomm.symm_regions``).
R_OUT, R_F, R_LL, R_READY = range(4)


@dataclasses.dataclass(frozen=True)
class GatherLayout:
    """Byte offsets of the gather slab's regions (see the module docstring).

    Arguments:
        world_size: W ≥ 1. max_tokens: T bound ≥ 1. num_heads: H (divisible by W).
        head_dim: D. itemsize: bytes per output value (1: FP8, 2 or 4). ll_rows: rows per LL
            cell (≤ the rows per rank, ``max_tokens·H/W``); 0 disables LL.
    """

    world_size: int
    max_tokens: int
    num_heads: int
    head_dim: int
    itemsize: int
    ll_rows: int = 0

    def __post_init__(self):
        if self.world_size < 1 or self.max_tokens < 1 or self.head_dim < 1 \
                or self.num_heads % self.world_size or self.itemsize not in (1, 2, 4):
            raise ValueError(f"GatherLayout: bad geometry {self}")
        if not 0 <= self.ll_rows <= self.max_rows:
            raise ValueError(f"GatherLayout: ll_rows must be in [0, {self.max_rows}], got "
                             f"{self.ll_rows}")
        if self.ll_rows and (self.head_dim * self.itemsize) % 4:
            raise ValueError("GatherLayout: LL rows need head_dim·itemsize divisible by 4")

    @property
    def max_rows(self) -> int:
        """Rows a rank sends per call at most: ``max_tokens · H/W``."""
        return self.max_tokens * (self.num_heads // self.world_size)

    @property
    def row_words(self) -> int:
        return self.head_dim * self.itemsize // 4

    @functools.cached_property
    def region_layout(self) -> RegionLayout:
        """The regions (``attncomm.symm_regions``), in the order of ``R_OUT`` … ``R_READY``."""
        W, item = self.world_size, self.itemsize
        return RegionLayout([
            Region("out", 1, self.max_tokens * self.num_heads * self.head_dim * item, item),
            Region("f", 2 * W, self.max_rows * 4, 4),
            Region("ll", 2 * W, self.ll_rows * self.row_words * 8, 8),
            Region("ready", 1, W * 4, 4)])

    def region_bytes(self) -> dict[str, int]:
        """Bytes of each region (all its cells)."""
        lay = self.region_layout
        return {r.name: r.cells * lay.cell(r.name) for r in lay.regions}

    @property
    def total_bytes(self) -> int:
        return self.region_layout.total_bytes

    def base(self, region: str) -> int:
        """Byte offset where ``region`` starts."""
        try:
            return self.region_layout.base(region)
        except ValueError:
            raise ValueError(f"GatherLayout: no region {region!r}") from None

    @functools.cached_property
    def kernel_strides(self) -> dict[str, int]:
        """Bases and cell strides as the kernels index them (the descriptor's region words):
        F and READY in int32 words, LL in int64 words (OUT is at offset 0)."""
        lay = self.region_layout
        return {"f_base": lay.base("f") // 4, "f_cell": lay.cell("f") // 4,
                "ll_base": lay.base("ll") // 8, "ll_cell": lay.cell("ll") // 8,
                "ready_base": lay.base("ready") // 4}

    def descriptor(self, peer_ptrs, rank: int, timeout_ns: int, device) -> torch.Tensor:
        """The kernels' descriptor of this layout for ``rank`` (``attncomm.symm_regions``):
        region words, the wait budget ``timeout_ns``, the peer offsets from ``peer_ptrs``
        (every rank's slab address; table 0 in output elements). RuntimeError when the slabs
        are misaligned."""
        return descriptor(self.region_layout, peer_ptrs, rank, self.itemsize, timeout_ns,
                          device, op="symm gather")
