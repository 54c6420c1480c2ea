"""``symm``: the DCP query gather over torch SymmetricMemory, one persistent Triton kernel per call.

Each rank stores its slice of the query heads, already rotated, straight into every peer's
persistent buffer over NVLink (vLLM's direct query gather and b12x's push into peers' staging
slots do the same): LL words (payload and epoch in one 8-byte word) up to 256 KiB per peer,
rows plus a flag per block above (``attncomm.dcp.query_gather.symm_kernels`` holds the kernels and
the epoch, parity and ordering rules). The result is a view of ``OUT [max_tokens, H, D]`` in
this rank's slab: a fixed address, so a captured graph's readers keep pointing at it.

Slab layout (bytes, every region 128-byte aligned)::

    OUT    [max_tokens, H, D]          out dtype     the gathered query (the result; FP8: bytes)
    F      [2, W, max_blocks]          int32         one flag per row block (holds the epoch)
    LL     [2, W, ll_rows, row_words]  int64         LL words: (epoch << 32) | payload
    READY  [W]                         int32         READY[q]: the last call q has started

Cells ``(slot, src)`` of F and LL, and ``READY[src]``, are written only by rank ``src``; OUT's
heads ``[src·H/W, (src+1)·H/W)`` only by rank ``src``.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from ... import capability
from ...symm import SymmWorkspace, agreed_min, ll_rows_for, peer_deltas, use_ll
from . import symm_kernels as kern
from .backend import QueryGatherBackend, register

__all__ = ["GatherLayout", "SymmGatherBackend", "launch_gather", "ll_rows_for", "use_ll"]

_ALIGN = 128
_TL_DTYPE_SIZES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4,
                   torch.float8_e4m3fn: 1}


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


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

    def region_bytes(self) -> dict[str, int]:
        W = self.world_size
        return {"out": _align(self.max_tokens * self.num_heads * self.head_dim * self.itemsize),
                "f": 2 * W * _align(self.max_rows * 4),
                "ll": 2 * W * _align(self.ll_rows * self.row_words * 8),
                "ready": _align(W * 4)}

    @property
    def total_bytes(self) -> int:
        return sum(self.region_bytes().values())

    def base(self, region: str) -> int:
        off = 0
        for name, n in self.region_bytes().items():
            if name == region:
                return off
            off += n
        raise ValueError(f"GatherLayout: no region {region!r}")

    @functools.cached_property
    def kernel_strides(self) -> dict[str, int]:
        """Bases and cell strides as the kernels index them: F and READY in int32 words, LL in
        int64 words (OUT is at offset 0)."""
        return {"f_base": self.base("f") // 4, "f_cell": _align(self.max_rows * 4) // 4,
                "ll_base": self.base("ll") // 8,
                "ll_cell": _align(self.ll_rows * self.row_words * 8) // 8,
                "ready_base": self.base("ready") // 4}


def _num_warps(nbytes: int) -> int:
    return max(1, min(16, nbytes // (32 * 16)))


# Elements of one [block rows, column block] tile of the flag kernel at most, so that the
# tile stays in registers on sm_90 (tests/test_gather_symm_cpu.py checks ptxas's spill count
# for the tiles column_block picks).
TILE_ELEMENTS = 4096


def column_block(head_dim: int, block_rows: int) -> int:
    """The flag kernel's column block for rows of ``head_dim`` elements in blocks of
    ``block_rows``: the widest power of two that covers ``head_dim`` (or, when that tile would
    exceed ``TILE_ELEMENTS``, the widest that fits it, ≥ 32), so that a block takes as few
    column steps as its registers allow."""
    cover = 1 << max(head_dim - 1, 0).bit_length()
    fit = 1 << max(1, TILE_ELEMENTS // max(block_rows, 1)).bit_length() - 1
    return max(min(cover, fit), min(cover, 32))


def launch_gather(q, cos, sin, *, slab, delta_o, delta_w, delta_q, state, errors, rank: int,
                  layout: GatherLayout, n_programs_max: int, timeout_ns: int,
                  ordered: bool = False, q_scale=None, column_block_override=None) -> None:
    """Launch one gather (no host sync). ``q [T, H/W, D]`` contiguous; ``cos, sin [T, R]`` fp32
    contiguous or None; ``slab`` the local symmetric uint8 slab (``layout``); ``delta_*`` the
    ``[W]`` int64 peer offsets in 16-element units of the output dtype, 4-byte and 8-byte
    words; ``state`` the ``[4]`` int32 ``[epoch, count, 0, 0]``; ``errors`` the ``[W]`` int32
    error word; ``q_scale`` the ``[H]`` fp32 scales for FP8 output (the layout's itemsize is
    1), else None; ``column_block_override``: the flag kernel's column block (a power of two),
    for tests and tuning runs only (None: ``column_block``)."""
    c = column_block_override
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1 or c & (c - 1)):
        raise ValueError(f"launch_gather: column_block_override must be a power of two ≥ 1, "
                         f"got {c!r}")
    T, hs, D = q.shape
    W, H = layout.world_size, layout.num_heads
    n_rows = T * hs
    br, n_blocks, grid = kern.plan_blocks(n_rows, n_programs_max)
    if grid == 0:
        return
    R = 0 if cos is None else cos.shape[-1]
    if cos is None:
        cos = sin = q  # never read (ROT is off)
    fp8 = layout.itemsize == 1
    if fp8 != (q_scale is not None):
        raise ValueError("launch_gather: FP8 output (itemsize 1) needs q_scale, and only it")
    scale = q_scale if fp8 else q  # never read without FP8
    st = layout.kernel_strides
    common = dict(RANK=rank, W=W, BR=br, ROT=R > 0, FP8=fp8, enable_fp_fusion=False)
    if use_ll(n_rows, layout):
        dw = layout.row_words
        bw = 1 << max(dw - 1, 0).bit_length()
        kern.gather_ll_kernel[(grid,)](
            q, cos, sin, scale, slab.view(torch.int32), slab.view(torch.int64), delta_w, delta_q,
            state.view(torch.int64), errors, n_rows, n_blocks, grid, timeout_ns, H, hs, D, R,
            dw, st["f_base"], st["f_cell"], st["ll_base"], st["ll_cell"], st["ready_base"],
            BW=bw, PACK=4 // layout.itemsize, num_warps=_num_warps(br * bw * 8), **common)
        return
    bd = column_block_override or column_block(D, br)
    kern.gather_flag_kernel[(grid,)](
        q, cos, sin, scale, slab if fp8 else slab.view(q.dtype), slab.view(torch.int32),
        delta_o, delta_w,
        state.view(torch.int64), errors, n_rows, n_blocks, grid, timeout_ns, H, hs, D, R,
        st["f_base"], st["f_cell"], st["ll_base"], st["ll_cell"], st["ready_base"],
        BD=bd, ORDERED=bool(ordered), num_warps=_num_warps(br * bd * q.element_size()),
        **common)


def _n_programs_max(device: torch.device) -> int:
    return max(1, torch.cuda.get_device_properties(device).multi_processor_count)


@register
class SymmGatherBackend(QueryGatherBackend):
    """The symmetric-memory query gather (see the module docstring).

    Construction is collective and host-blocking (allocation, rendezvous, each agreed across
    ranks; then one warm-up gather per kernel variant, so JIT compilation and the first P2P
    stores happen before any capture; a timeout there raises on construction). Calls are
    graph-capturable and make no host sync: a call reads the pinned host error words its
    kernels write (no CUDA call), so a wait that timed out raises ``PeerTimeoutError`` at the
    next call or at ``check()``.

    Returns a view of ``OUT[:T]`` (``[T, H, D]``), valid until this rank's next call is
    enqueued. Constraints: CUDA, every rank on one host with P2P between every pair, torch
    SymmetricMemory, Triton; issue the calls of one group on one stream.
    """

    name = "symm"

    def __init__(self, group, **kw):
        super().__init__(group, **kw)
        if kern.triton is None:
            raise RuntimeError("symm gather needs Triton")
        itemsize = _TL_DTYPE_SIZES[self.out_dtype]
        max_rows = self.max_tokens * self.hs
        self.layout = GatherLayout(self.world_size, self.max_tokens, self.num_heads,
                                   self.head_dim, itemsize,
                                   ll_rows_for(max_rows, self.head_dim, itemsize))
        if self.layout.total_bytes >= 2 ** 31:
            raise RuntimeError(f"symm gather: slab of {self.layout.total_bytes} bytes exceeds "
                               f"the kernel's 32-bit offsets; lower max_tokens")
        self.ordered = self.ordered_by_caller
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.ws = SymmWorkspace.agreed(group, self.layout, self.device, op="dcp.gather[symm]",
                                       timeout_s=self.timeout_s)
        self._setup_tables(itemsize)
        self.out = self.ws.slab[:self.layout.region_bytes()["out"]].view(self.out_dtype)[
            :self.max_tokens * self.num_heads * self.head_dim].view(
            self.max_tokens, self.num_heads, self.head_dim)
        self._warm_up()

    @classmethod
    def collective_unavailable_reason(cls, group, device: torch.device) -> str | None:
        reason = capability.symm_unavailable_reason(group, device)  # collective: always call
        if reason is None and kern.triton is None:
            return "Triton is not importable"
        return reason

    def _setup_tables(self, itemsize: int) -> None:
        self.delta_o, self.delta_w, self.delta_q = peer_deltas(
            self.ws.handle.buffer_ptrs, self.rank, itemsize, self.device, op="symm gather")
        self.n_programs_max = agreed_min(
            self.group, _n_programs_max(self.device) if self.device.type == "cuda" else 3)

    def _warm_up(self) -> None:
        # One gather per kernel variant (block size, protocol) up to max_tokens: compiles
        # before any capture and proves the P2P path (a timeout here raises on construction).
        seen = set()
        R = self.rope_dim
        for t in range(1, self.max_tokens + 1):
            n = t * self.hs
            key = (kern.plan_blocks(n, self.n_programs_max)[0], use_ll(n, self.layout))
            if key in seen:
                continue
            seen.add(key)
            q = torch.zeros((t, self.hs, self.head_dim), dtype=self.dtype, device=self.device)
            cs = torch.zeros((t, R), dtype=torch.float32, device=self.device) if R else None
            self(q, cs, cs)
        self.ws.sync_check()

    def __call__(self, q, cos, sin, into=None):
        self.ws.ensure_usable()
        T = q.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"symm gather: T={T} exceeds max_tokens={self.max_tokens}")
        launch_gather(q, cos, sin, slab=self.ws.slab, delta_o=self.delta_o,
                      delta_w=self.delta_w, delta_q=self.delta_q, state=self.ws.state,
                      errors=self.ws.errors, rank=self.rank, layout=self.layout,
                      n_programs_max=self.n_programs_max, timeout_ns=self.timeout_ns,
                      ordered=self.ordered, q_scale=self.q_scale if self.fp8 else None)
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.ws.check()
        return self.out[:T] if into is None else into.copy_(self.out[:T])

    def check(self) -> None:
        self.ws.check()

    def close(self) -> None:
        """Collective: free the slab once every rank got here (``SymmWorkspace.close``)."""
        self.ws.close()
