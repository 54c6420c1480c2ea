"""``symm_a2a``: the DCP merge over torch SymmetricMemory, one persistent Triton kernel per call.

This module plans and launches the merge and holds the backend class; the kernels and their
protocol (LL and flag, epochs, PDL, scrub, timeouts) are in ``symm_kernels`` beside it, the
slab layout in ``symm_layout``, allocation, rendezvous and error words in the
substrate ``attncomm.symm``. Tuning history and figures: ``benchmarks/results/
symm-a2a-tuning.md`` and ``dcp-kernel-2026-11-30-*.md``.
"""
from __future__ import annotations

import dataclasses

import torch

from ... import _triton
from ... import config as env
from ...compiled_launch import aligned
from ...symm import ll_rows_for, num_warps, plan_blocks, use_ll
from ...symm_regions import Slab
from ..exchange import SymmBackend
from .backend import MERGE_REGISTRY, DcpBackend
from .symm_layout import SlabLayout

if _triton.REASON is None:
    from . import symm_kernels as _k
else:
    _k = None

__all__ = [
    "MergeSlab",
    "SlabLayout",
    "SymmA2ABackend",
    "SymmConfig",
    "launch_merge",
    "ll_rows_for",
    "plan_blocks",
    "use_ll",
]


def _default(field: str):
    """A ``SymmConfig`` field's default: the ``ATTNCOMM_SYMM_<FIELD>`` row of
    ``attncomm.config.VARS`` (read when a config is built)."""
    name = f"ATTNCOMM_SYMM_{field}"
    env.VARS[name]  # noqa: B018 - a KeyError at import for a field without a row
    return dataclasses.field(default_factory=lambda: env.VARS[name].default)


@dataclasses.dataclass(frozen=True)
class SymmConfig:
    """Launch-shape knobs of the ``symm_a2a`` merge (the same on every rank).

    Attributes:
        max_block_rows: rows per block at most (a power of two).
        programs_per_sm: programs per SM in the grid bound (1: persistent, one per SM).
        max_warps: warps per program at most (blocks below ``32 KiB``).
        wide_warps: warps for blocks of ≥ 32 KiB, not capped by ``max_warps`` (0: no
            exception).
        max_programs: cap on the grid (0: none): fewer programs, each looping over several
            pipelined blocks.
        ll_max_bytes: payload per peer up to which the LL protocol is used.
        stagger_min_bytes: payload per peer from which the flag protocol staggers its sends
            (0: never).
        stagger_split: percent of the grid in the first stagger group; below 50 the grid is
            cut into groups of that size, each waiting for the one before (≥ 100: off).
        enable_pdl: programmatic dependent launch: True, False, or None (on where supported,
            capability ≥ 9.0). It pays when merges follow merges or kernels that trigger
            their dependents early; after a producer that does not, it can cost a little.

    The defaults are the ``ATTNCOMM_SYMM_*`` rows' defaults in ``attncomm.config.VARS`` (the
    best measured on 2× H200, 64 heads × 512, bf16; ``benchmarks/results/symm-a2a-tuning.md``),
    except ``enable_pdl``'s None (the row's "unset: on where supported"). ``from_env()``
    reads the variables that are set (how ``DcpMerger`` builds the backend); tests and tools
    pass a config object instead.
    """

    max_block_rows: int = _default("MAX_BLOCK_ROWS")
    programs_per_sm: int = _default("PROGRAMS_PER_SM")
    max_warps: int = _default("MAX_WARPS")
    wide_warps: int = _default("WIDE_WARPS")
    max_programs: int = _default("MAX_PROGRAMS")
    ll_max_bytes: int = _default("LL_MAX_BYTES")
    stagger_min_bytes: int = _default("STAGGER_MIN_BYTES")
    stagger_split: int = _default("STAGGER_SPLIT")
    enable_pdl: bool | None = None

    def __post_init__(self):
        rows = self.max_block_rows
        if rows < 1 or rows & (rows - 1):
            raise ValueError(f"SymmConfig: max_block_rows must be a power of two ≥ 1, got {rows}")
        for name in ("programs_per_sm", "max_warps"):
            if getattr(self, name) < 1:
                raise ValueError(f"SymmConfig: {name} must be ≥ 1, got {getattr(self, name)}")
        for name in ("wide_warps", "max_programs", "ll_max_bytes", "stagger_min_bytes",
                     "stagger_split"):
            if getattr(self, name) < 0:
                raise ValueError(f"SymmConfig: {name} must be ≥ 0, got {getattr(self, name)}")

    @classmethod
    def from_env(cls) -> SymmConfig:
        """The defaults, overridden by the ``ATTNCOMM_SYMM_<FIELD>`` rows of
        ``attncomm.config.VARS`` that are set (``ATTNCOMM_SYMM_PDL`` for ``enable_pdl``;
        ``0`` turns PDL off). ``ValueError`` names a variable whose text is bad."""
        kw = {}
        for f in dataclasses.fields(cls):
            field = "PDL" if f.name == "enable_pdl" else f.name.upper()
            name = f"ATTNCOMM_SYMM_{field}"
            if env.raw(name):
                kw[f.name] = env.get(name)
        return cls(**kw)


_DEFAULT = SymmConfig()


def stagger(n_rows: int, n_blocks: int, grid: int, head_dim: int, itemsize: int,
            config: SymmConfig = _DEFAULT) -> int:
    """The flag kernel's STAGGER: the percent of the grid in the first group, or 0 (off).
    Only with one block per program (``n_blocks == grid ≥ 2``)."""
    payload = n_rows * head_dim * itemsize
    on = 0 < config.stagger_min_bytes <= payload and n_blocks == grid >= 2
    return config.stagger_split if on else 0


#: One rank's slab, its descriptor and state words (``symm_regions.Slab``).
MergeSlab = Slab


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch_merge(out, lse, res, res_lse, *, slab: MergeSlab, rank: int, world_size: int,
                 num_heads: int, layout: SlabLayout, n_programs_max: int, pdl: bool = False,
                 config: SymmConfig = _DEFAULT) -> None:
    """Launch one merge (no host sync). ``out [T, H, D]`` (the merger's dtype) and
    ``lse [T, H]`` (fp32), contiguous; ``res``/``res_lse`` contiguous, at least
    ``[T, H/W, D]``/``[T, H/W]``; ``slab`` this rank's ``MergeSlab``. ``pdl``: launch with
    programmatic dependent launch (capability ≥ 9.0 only)."""
    T, H, D = out.shape
    hs = num_heads // world_size
    n_rows = T * hs
    br, n_blocks, grid = plan_blocks(n_rows, n_programs_max, config.max_block_rows)
    if grid == 0:
        return
    args = (out, lse, res, res_lse, slab.slab, slab.desc, slab.state, slab.errors, n_rows)
    if use_ll(n_rows, layout):
        bw = _pow2(layout.row_words)
        _k.merge_ll_kernel[(grid,)](
            *args, RANK=rank, W=world_size, H=H, HS=hs, D=D, BR=br, BW=bw, PDL=pdl,
            num_warps=num_warps(br * bw * 8, config.max_warps, config.wide_warps),
            launch_pdl=pdl)
        return
    bd = _pow2(D)
    item = out.element_size()
    _k.merge_flag_kernel[(grid,)](
        *args, RANK=rank, W=world_size, H=H, HS=hs, D=D, BR=br, BD=bd,
        STAGGER=stagger(n_rows, n_blocks, grid, D, item, config), PDL=pdl,
        num_warps=num_warps(br * bd * item, config.max_warps, config.wide_warps),
        launch_pdl=pdl)


def pdl_supported(device: torch.device) -> bool:
    """Whether programmatic dependent launch can run on ``device`` (CUDA, capability ≥ 9.0)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@MERGE_REGISTRY.register
class SymmA2ABackend(SymmBackend, DcpBackend):
    """The symmetric-memory DCP merge (see ``attncomm.dcp.lse_merge.symm_kernels``).

    Construction is collective and host-blocking (allocation, then rendezvous, each agreed across
    ranks; then one warm-up merge per kernel variant so that JIT compilation and the first P2P
    stores happen here, before any capture). Calls are graph-capturable and make no host sync:
    a wait that timed out is recorded in the workspace's error word, and the next call (or
    ``check()``, e.g. after graph replays) raises ``PeerTimeoutError`` naming the peer.

    Arguments (beyond ``DcpBackend``'s):
        config: launch knobs (None: ``SymmConfig.from_env()``), the same on every rank.
        enable_pdl: programmatic dependent launch (None: ``config.enable_pdl``, where None
            means on where supported).

    Returns views of internal buffers (``[T, H/W, D]`` in ``dtype``, ``[T, H/W]`` fp32), valid
    until the next call; the same view objects on every call of a token count.

    Constraints: CUDA tensors, every rank on one host with P2P between every pair of GPUs, torch
    SymmetricMemory (CUDA backend), Triton. Two mergers whose calls run concurrently on
    different streams can starve each other of SMs (each spins until its peer arrives); issue
    merges of one group on one stream.
    """

    name = "symm_a2a"
    label = "symm_a2a"
    kernels = _k
    returns_views = True

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float,
                 config: SymmConfig | None = None, enable_pdl: bool | None = None):
        super().__init__(group, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim,
                         dtype=dtype, device=device, timeout_s=timeout_s)
        self._require_kernels()
        self.config = config if config is not None else SymmConfig.from_env()
        itemsize = torch.empty((), dtype=dtype).element_size()
        max_rows = max_tokens * self.hs
        pdl = enable_pdl if enable_pdl is not None else self.config.enable_pdl
        self.pdl = pdl_supported(device) if pdl is None else bool(pdl and pdl_supported(device))
        self._map_slab(SlabLayout(self.world_size, max_rows, head_dim, itemsize,
                                  ll_rows_for(max_rows, head_dim, itemsize,
                                              self.config.ll_max_bytes)),
                       "dcp.merge[symm_a2a]", (_k.merge_ll_kernel, _k.merge_flag_kernel),
                       self.config.programs_per_sm, self.config.max_programs)
        self.res = torch.empty((max_tokens, self.hs, head_dim), dtype=dtype, device=device)
        self.res_lse = torch.empty((max_tokens, self.hs), dtype=torch.float32, device=device)
        #: token count → the views of ``res`` / ``res_lse`` a call returns (made once: a slice
        #: is an aten call)
        self._views: dict = {}
        self._warm_up()

    def _warm_up(self) -> None:
        # One merge per kernel variant (block size, protocol, staggering) up to max_tokens:
        # compiles before any capture and proves the P2P path; a timeout here raises on
        # construction.
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        seen = set()
        for t in range(1, self.max_tokens + 1):
            n = t * self.hs
            br, n_blocks, grid = plan_blocks(n, self.n_programs_max, self.config.max_block_rows)
            ll = use_ll(n, self.layout)
            key = (br, ll, 0 if ll else stagger(n, n_blocks, grid, self.head_dim, itemsize,
                                                self.config))
            if key in seen:
                continue
            seen.add(key)
            out = torch.zeros((t, self.num_heads, self.head_dim), dtype=self.dtype,
                              device=self.device)
            lse = torch.zeros((t, self.num_heads), dtype=torch.float32, device=self.device)
            self(out, lse)
        self.ws.sync_check()

    def __call__(self, out: torch.Tensor, lse: torch.Tensor, res: torch.Tensor | None = None,
                 res_lse: torch.Tensor | None = None):
        """``out [T, H, D]`` (``dtype``, contiguous, CUDA), ``lse [T, H]`` fp32 base e,
        contiguous (``DcpBackend``'s contract: the caller converts, this call does not check)
        → (``[T, H/W, D]``, ``[T, H/W]`` fp32): ``res`` / ``res_lse`` when given (the kernel
        stores there), else views of internal buffers, valid until the next call (the same
        view objects on every call of a token count: change their values, never their shape
        or strides in place).

        Raises ``PeerTimeoutError`` when an earlier call's wait timed out (the workspace is
        unusable from then on: its ranks' epochs no longer agree)."""
        self.ws.check()
        T = out.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"symm_a2a: T={T} exceeds max_tokens={self.max_tokens}")
        if res is None or res_lse is None:
            views = self._views.get(T)
            if views is None:
                views = self._views[T] = (self.res[:T], self.res_lse[:T])
            o = views[0] if res is None else res
            l = views[1] if res_lse is None else res_lse
        else:
            o, l = res, res_lse
        # The first call of a token count and alignment launches through ``launch_merge`` and
        # Triton's JIT; later ones through the kernel it compiled (``compiled_launch``), with
        # the addresses read once for the key and the launch; replayed only when every one is
        # a CUDA address (the kernel takes it as it is).
        ptrs = (out.data_ptr(), lse.data_ptr(), o.data_ptr(), l.data_ptr())
        key = (T, *aligned(ptrs))
        if out.is_cuda and lse.is_cuda and o.is_cuda and l.is_cuda \
                and self._launches.replay(key, ptrs):
            return o, l
        dyn = (out, lse, o, l)
        self._launches.launch(
            key,
            lambda: launch_merge(*dyn, slab=self.slab, rank=self.rank,
                                 world_size=self.world_size, num_heads=self.num_heads,
                                 layout=self.layout, n_programs_max=self.n_programs_max,
                                 pdl=self.pdl, config=self.config), dyn)
        return o, l
