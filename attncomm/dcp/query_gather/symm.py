"""``symm``: the DCP query gather over torch SymmetricMemory, one persistent Triton kernel per call.

Each rank stores its slice of the query heads, already rotated, straight into every peer's
persistent buffer over NVLink (vLLM's direct query gather and b12x's push into peers' staging
slots do the same): LL words (payload and epoch in one 8-byte word) up to 256 KiB per peer,
rows plus a flag per block above (``attncomm.dcp.query_gather.symm_kernels`` holds the kernels and
the epoch, parity and ordering rules). The result is a view of ``OUT [max_tokens, H, D]`` in
this rank's slab: a fixed address, so a captured graph's readers keep pointing at it.

The slab's regions (OUT, flags, LL words, READY) are ``symm_layout.GatherLayout``'s.
"""
from __future__ import annotations

import torch

from ... import _triton
from ...compiled_launch import aligned, capturing, check_block
from ...symm import ll_rows_for, num_warps, plan_blocks, use_ll
from ...symm_regions import Slab
from ..exchange import SymmBackend
from .backend import GATHER_REGISTRY, QueryGatherBackend
from .symm_layout import GatherLayout

if _triton.REASON is None:
    from . import symm_kernels as _k
else:
    _k = None

__all__ = ["GatherLayout", "GatherSlab", "SymmGatherBackend", "launch_gather", "ll_rows_for",
           "use_ll"]

_TL_DTYPE_SIZES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4,
                   torch.float8_e4m3fn: 1}


#: One rank's slab, its descriptor and state words (``symm_regions.Slab``).
GatherSlab = Slab


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


def launch_gather(q, cos, sin, *, slab: GatherSlab, rank: int, layout: GatherLayout,
                  n_programs_max: int, ordered: bool = False, q_scale=None,
                  column_block_override=None) -> None:
    """Launch one gather (no host sync). ``q [T, H/W, D]`` contiguous; ``cos, sin [T, R]`` fp32
    contiguous or None; ``slab`` this rank's ``GatherSlab`` (``layout``); ``q_scale`` the
    ``[H]`` fp32 scales for FP8 output (the layout's itemsize is 1), else None;
    ``column_block_override``: the flag kernel's column block (a power of two), for tests and
    tuning runs only (None: ``column_block``)."""
    check_block("launch_gather", "column_block_override", column_block_override)
    T, hs, D = q.shape
    n_rows = T * hs
    br, _, grid = plan_blocks(n_rows, n_programs_max)
    if grid == 0:
        return
    R = 0 if cos is None else cos.shape[-1]
    if cos is None:
        cos = sin = q  # never read (R = 0)
    fp8 = layout.itemsize == 1
    if fp8 != (q_scale is not None):
        raise ValueError("launch_gather: FP8 output (itemsize 1) needs q_scale, and only it")
    scale = q_scale if fp8 else q  # never read without FP8
    args = (q, cos, sin, scale, slab.slab, slab.desc, slab.state, slab.errors, n_rows)
    shape = dict(RANK=rank, W=layout.world_size, H=layout.num_heads, HS=hs, D=D, R=R, BR=br,
                 FP8=fp8, enable_fp_fusion=False)
    if use_ll(n_rows, layout):
        bw = 1 << max(layout.row_words - 1, 0).bit_length()
        _k.gather_ll_kernel[(grid,)](*args, BW=bw, PACK=4 // layout.itemsize,
                                     num_warps=num_warps(br * bw * 8), **shape)
        return
    bd = column_block_override or column_block(D, br)
    _k.gather_flag_kernel[(grid,)](*args, BD=bd, ORDERED=bool(ordered),
                                   num_warps=num_warps(br * bd * q.element_size()), **shape)


@GATHER_REGISTRY.register
class SymmGatherBackend(SymmBackend, QueryGatherBackend):
    """The symmetric-memory query gather (see the module docstring).

    Construction is collective and host-blocking (allocation, rendezvous, each agreed across
    ranks; then one warm-up gather per kernel variant, so JIT compilation and the first P2P
    stores happen before any capture; a timeout there raises on construction). Calls are
    graph-capturable and make no host sync: a call reads the pinned host error words its
    kernels write (no CUDA call), so a wait that timed out raises ``PeerTimeoutError`` at the
    next call or at ``check()``.

    Returns a view of ``OUT[:T]`` (``[T, H, D]``), valid until this rank's next call is
    enqueued; the same view object on every call of a token count. Constraints: CUDA, every
    rank on one host with P2P between every pair, torch SymmetricMemory, Triton; issue the calls
    of one group on one stream.
    """

    name = "symm"
    label = "symm gather"
    kernels = _k

    def __init__(self, group, **kw):
        super().__init__(group, **kw)
        self._require_kernels()
        itemsize = _TL_DTYPE_SIZES[self.out_dtype]
        max_rows = self.max_tokens * self.hs
        self._map_slab(GatherLayout(self.world_size, self.max_tokens, self.num_heads,
                                    self.head_dim, itemsize,
                                    ll_rows_for(max_rows, self.head_dim, itemsize)),
                       "dcp.gather[symm]", (_k.gather_ll_kernel, _k.gather_flag_kernel))
        self.ordered = self.ordered_by_caller
        self.out = self.ws.slab[:self.layout.region_bytes()["out"]].view(self.out_dtype)[
            :self.max_tokens * self.num_heads * self.head_dim].view(
            self.max_tokens, self.num_heads, self.head_dim)
        #: token count → the view of ``out`` a call returns or copies from (made once: a slice
        #: is an aten call)
        self._views: dict = {}
        self._warm_up()

    def _warm_up(self) -> None:
        # One gather per kernel variant (block size, protocol) up to max_tokens: compiles
        # before any capture and proves the P2P path (a timeout here raises on construction).
        seen = set()
        R = self.rope_dim
        for t in range(1, self.max_tokens + 1):
            n = t * self.hs
            key = (plan_blocks(n, self.n_programs_max)[0], use_ll(n, self.layout))
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
        scale = self.q_scale if self.fp8 else None
        # The tensors ``launch_gather`` passes first (q stands in for what is not read); the
        # first call of a token count and alignment launches through it and Triton's JIT,
        # later ones through the kernel it compiled (``compiled_launch``), with the addresses
        # read once for the key and the launch; replayed only when every one is a CUDA address
        # (the kernel takes it as it is).
        c = q if cos is None else cos
        s = q if sin is None else sin
        k = q if scale is None else scale
        ptrs = (q.data_ptr(), c.data_ptr(), s.data_ptr(), k.data_ptr())
        key = (T, *aligned(ptrs))
        if not (q.is_cuda and c.is_cuda and s.is_cuda and k.is_cuda
                and self._launches.replay(key, ptrs)):
            self._launches.launch(
                key,
                lambda: launch_gather(q, cos, sin, slab=self.slab, rank=self.rank,
                                      layout=self.layout, n_programs_max=self.n_programs_max,
                                      ordered=self.ordered, q_scale=scale), (q, c, s, k))
        # A wait of an earlier call that timed out raises here, after this call's launch,
        # unless the stream is capturing (then at the next eager call or ``check()``); whether
        # it captures is asked only when there is something to raise.
        if self.ws.failures.failed() and not capturing(q):
            self.ws.check()
        view = self._views.get(T)
        if view is None:
            view = self._views[T] = self.out[:T]
        return view if into is None else into.copy_(view)

    def into_new(self, q, cos, sin):
        """``QueryGatherBackend.into_new``: a clone of the call's view of ``OUT``."""
        return self(q, cos, sin).clone()
