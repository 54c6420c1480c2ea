"""Where the regions of a symmetric slab lie, and the int64 descriptor the push kernels read
them from (the substrate's layout half; ``attncomm.symm`` allocates the bytes).

A slab is a sequence of regions, each a number of equal cells (e.g. ``2·W``: parity slot ×
source rank) whose sizes are rounded up to ``ALIGN`` bytes, one region after the other
(``RegionLayout``). The DCP merge (``attncomm.dcp.lse_merge.symm_layout``) and the query gather
(``attncomm.dcp.query_gather.symm``) describe their slabs this way.

A kernel takes one pointer to the slab and one small int64 tensor, the descriptor, built once
per layout and peer set (``descriptor``); its words:

    [DESC_TIMEOUT]            the bounded waits' budget in ns
    [DESC_REGIONS + 2·i]      region i's base, in elements of region i's unit
    [DESC_REGIONS + 2·i + 1]  region i's cell stride, in the same elements
    [DESC_PEERS + k·W + q]    peer q's slab minus this rank's, in ``DELTA_UNIT`` elements of
                              ``itemsize`` (k = 0), 4-byte (k = 1) and 8-byte (k = 2) words

Every base and cell stride is a multiple of 16 of its elements (cells are 128-byte aligned and
units at most 8 bytes), which the kernels tell the compiler (``symm_device.region``), so the
loads and stores of a region stay vectorised as with pointer arguments.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch

from .symm import DELTA_UNIT

__all__ = ["ALIGN", "Region", "RegionLayout", "descriptor", "DESC_TIMEOUT", "DESC_REGIONS",
           "DESC_PEERS", "MAX_REGIONS", "PEER_UNITS"]

#: Every cell starts at a multiple of this many bytes.
ALIGN = 128
#: Descriptor word of the wait budget (ns).
DESC_TIMEOUT = 0
#: Descriptor word of region 0's base; region i's base and cell stride follow at 2·i, 2·i + 1.
DESC_REGIONS = 1
#: Descriptor word where the peer offset tables start.
DESC_PEERS = 16
#: Regions a descriptor can hold.
MAX_REGIONS = (DESC_PEERS - DESC_REGIONS) // 2
#: Peer table k counts in ``DELTA_UNIT`` elements of ``(itemsize, 4, 8)[k]`` bytes.
PEER_UNITS = 3


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True)
class Region:
    """One region: ``cells`` cells of ``cell_bytes`` bytes each (before alignment), indexed by
    the kernels in elements of ``unit`` bytes (1, 2, 4 or 8)."""

    name: str
    cells: int
    cell_bytes: int
    unit: int

    def __post_init__(self):
        if self.cells < 1 or self.cell_bytes < 0 or self.unit not in (1, 2, 4, 8):
            raise ValueError(f"Region: bad region {self}")


class RegionLayout:
    """Regions one after the other, every cell ``ALIGN``-byte aligned.

    Arguments:
        regions: the regions in slab order (at most ``MAX_REGIONS``, names distinct).
    """

    def __init__(self, regions: Sequence[Region]):
        names = [r.name for r in regions]
        if len(set(names)) != len(names) or len(names) > MAX_REGIONS:
            raise ValueError(f"RegionLayout: region names must be distinct and at most "
                             f"{MAX_REGIONS}, got {names}")
        self.regions = tuple(regions)
        self._index = {r.name: i for i, r in enumerate(self.regions)}
        self._cell, self._base, off = {}, {}, 0
        for r in self.regions:
            self._cell[r.name] = align(r.cell_bytes)
            self._base[r.name] = off
            off += r.cells * self._cell[r.name]
        self.total_bytes = off

    def _region(self, name: str) -> Region:
        try:
            return self.regions[self._index[name]]
        except KeyError:
            raise ValueError(f"RegionLayout: no region {name!r}") from None

    def index(self, name: str) -> int:
        """The region's position (its descriptor words are ``DESC_REGIONS + 2·index``)."""
        self._region(name)
        return self._index[name]

    def base(self, name: str) -> int:
        """Byte offset where region ``name`` starts."""
        self._region(name)
        return self._base[name]

    def cell(self, name: str) -> int:
        """Bytes of one cell of region ``name`` (aligned)."""
        self._region(name)
        return self._cell[name]

    def offset(self, name: str, cell: int) -> int:
        """Byte offset of cell ``cell`` of region ``name``."""
        r = self._region(name)
        if not 0 <= cell < r.cells:
            raise ValueError(f"RegionLayout: region {name!r} has no cell {cell} "
                             f"(it has {r.cells})")
        return self._base[name] + cell * self._cell[name]

    def fields(self) -> list[int]:
        """Base and cell stride of every region, in elements of its unit, in slab order (the
        descriptor's region words)."""
        out = []
        for r in self.regions:
            out += [self._base[r.name] // r.unit, self._cell[r.name] // r.unit]
        return out


def descriptor(layout: RegionLayout, peer_ptrs: Sequence[int], rank: int, itemsize: int,
               timeout_ns: int, device, *, op: str) -> torch.Tensor:
    """The kernels' descriptor of ``layout`` for this rank (see the module docstring): int64
    ``[DESC_PEERS + 3·W]`` on ``device``. ``peer_ptrs``: every rank's slab address (group rank
    order); ``itemsize``: bytes of the payload unit of peer table 0.

    Raises RuntimeError (naming ``op``) when the peers' slabs are not ``DELTA_UNIT · 8``-byte
    aligned relative to each other (the kernels could not reach them in their units)."""
    words = [0] * DESC_PEERS
    words[DESC_TIMEOUT] = int(timeout_ns)
    fields = layout.fields()
    words[DESC_REGIONS:DESC_REGIONS + len(fields)] = fields
    return torch.tensor(words + peer_offsets(peer_ptrs, rank, itemsize, op=op),
                        dtype=torch.int64, device=device)


def peer_offsets(peer_ptrs: Sequence[int], rank: int, itemsize: int, *, op: str) -> list[int]:
    """Every rank's slab address minus this rank's, in ``DELTA_UNIT`` elements of ``itemsize``
    bytes, then of 4-byte and of 8-byte words (``3·W`` ints)."""
    units = _units(itemsize)
    deltas = [int(p) - int(peer_ptrs[rank]) for p in peer_ptrs]
    if any(dl % u for dl in deltas for u in units):
        raise RuntimeError(f"{op}: peer slabs are not {max(units)}-byte aligned relative to "
                           f"each other: {deltas}")
    return [dl // u for u in units for dl in deltas]


@functools.cache
def _units(itemsize: int) -> tuple[int, int, int]:
    return DELTA_UNIT * itemsize, DELTA_UNIT * 4, DELTA_UNIT * 8
