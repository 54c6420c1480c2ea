# attncomm/symm.py as of commit a91b3cd (SlabLayout, SymmWorkspace), imported by
# symm_a2a_a91b3cd.py for the one-GPU A/B. Verbatim but for its imports, made absolute.
"""Symmetric workspace: one torch SymmetricMemory slab per exchange object, its layout, the
device epoch, the peer pointer table and the device error word.

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

The epoch and the error word are ordinary (local) device memory: ``state [4] int32`` holds
``[epoch, done_counter, 0, 0]``; ``errors [W] int32`` is set to 1 at ``src`` when a wait for
``src`` ran out of time. The kernels advance the epoch themselves (graph replays need no host
step); the host only reads the error word (``check``).
"""
from __future__ import annotations

import dataclasses
import functools
import types
import warnings
from typing import Mapping

import torch
import torch.distributed as dist

from attncomm.errors import PeerTimeoutError

__all__ = ["SlabLayout", "SymmWorkspace", "ALIGN"]

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

    @functools.lru_cache(maxsize=None)  # noqa: B019 - a few frozen layouts per process
    def kernel_strides(self) -> Mapping[str, int]:
        """Region bases and cell strides in elements of each region's type, as kernels index
        them: ``o`` in payload elements (base 0), ``l``/``f`` in 4-byte words, ``llo``/``lll``
        in 8-byte words. Every region is 128-byte aligned, so each base is a whole number of
        its elements. Computed once per layout (every merge launch reads it)."""
        cb = self.cell_bytes()
        return types.MappingProxyType({
            "o_cell": cb["o"] // self.itemsize,
            "l_base": self.region_base("l") // 4, "l_cell": cb["l"] // 4,
            "f_base": self.region_base("f") // 4, "f_cell": cb["f"] // 4,
            "llo_base": self.region_base("llo") // 8, "llo_cell": cb["llo"] // 8,
            "lll_base": self.region_base("lll") // 8, "lll_cell": cb["lll"] // 8,
        })


def _group_or_world(group):
    return group if group is not None else dist.group.WORLD


class SymmWorkspace:
    """A rendezvoused symmetric slab plus its epoch, pointer table and error word.

    Collective: every rank of ``group`` constructs it with the same layout (host-blocking; do it
    before any CUDA graph capture). Two workspaces are fully independent.

    Attributes:
        slab: the local ``[total_bytes] uint8`` symmetric tensor (zeroed at construction).
        ptrs: ``[W] int64`` device tensor, the slab's address on every rank (group rank order).
        state: ``[4] int32`` device tensor, ``[epoch, done_counter, 0, 0]``.
        errors: ``[W] int32`` device tensor, 1 at ``src`` after a wait for ``src`` timed out.

    Raises:
        RuntimeError (or whatever torch raises) when allocation or rendezvous fails; the caller
        agrees across ranks and falls back.
    """

    def __init__(self, group, layout: SlabLayout, device: torch.device, *, op: str = "symm",
                 timeout_s: float | None = None, rendezvous: bool = True):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = _group_or_world(group)
        self.layout = layout
        self.device = torch.device(device)
        self.op = op
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if self.world_size != layout.world_size:
            raise ValueError(f"{op}: layout for {layout.world_size} ranks, group has "
                             f"{self.world_size}")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group.group_name)
        self.slab = symm_mem.empty(layout.total_bytes, dtype=torch.uint8, device=self.device)
        self.slab.zero_()
        self.state = torch.zeros(4, dtype=torch.int32, device=self.device)
        self.errors = torch.zeros(self.world_size, dtype=torch.int32, device=self.device)
        self.handle = None
        self.broken: str | None = None
        if rendezvous:
            self.rendezvous()

    def rendezvous(self) -> None:
        """Collective: exchange slab handles with every rank (host-blocking; before capture)."""
        import torch.distributed._symmetric_memory as symm_mem

        # The zeroing must land before any peer can write: finish it, then rendezvous (which
        # returns only once every rank has arrived).
        torch.cuda.synchronize(self.device)
        self.handle = symm_mem.rendezvous(self.slab, self.group)

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` if a kernel recorded a timed-out wait since the last check.

        Host-blocking (reads the error word). After a timeout the ranks' epochs no longer agree,
        so the workspace is marked broken and later calls raise ``RuntimeError``."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        flags = self.errors.cpu().tolist()
        if any(flags):
            peers = [i for i, f in enumerate(flags) if f]
            self.errors.zero_()
            self.broken = (f"{self.op}: unusable after a timeout waiting for rank(s) {peers}; "
                           f"construct a new one on every rank")
            raise PeerTimeoutError(
                f"{self.op}: rank {self.rank} waited for source rank(s) {peers} past the "
                f"timeout" + (f" of {self.timeout_s:g} s" if self.timeout_s else "")
                + "; the peer did not signal", peer_ranks=peers, timeout_s=self.timeout_s,
                op=self.op)

    def ensure_usable(self) -> None:
        if self.broken is not None:
            raise RuntimeError(self.broken)
