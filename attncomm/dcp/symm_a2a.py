"""``symm_a2a``: the DCP merge over torch SymmetricMemory, one persistent Triton kernel per call.

Each rank stores, for every peer ``q``, the rows of its partial output and LSE that belong to
``q``'s head slice straight into ``q``'s slab (P2P stores over NVLink), publishes every row block
with a release store of the epoch into ``q``'s flag for that block, then waits (acquire, bounded
by ``%globaltimer``) for every source's flag of each of its own row blocks and combines by LSE.
Its own contribution is read from its input in place, never copied.

- Epoch: ``state[0]`` on the device. Every program reads it at start (``e = state[0] + 1``);
  the last program to finish (a done counter) writes ``e`` back, so graph replays advance it
  without a host step. ``e & 1`` selects the parity slot; flags hold the full epoch (int32,
  wrapping), so a stale flag never matches. A fast rank never overwrites what a slow rank reads:
  it can only start call ``e+2`` (same slot as ``e``) after every peer has published ``e+1``,
  which each peer does only after its call ``e`` finished (stream order).
- Deadlock freedom: the grid is at most one program per SM (persistent programs loop over row
  blocks), every program publishes all of its blocks before it waits, so no spinning program
  waits on a program that cannot become resident.
- Timeouts: a wait past ``timeout_s`` sets ``errors[src] = 1`` and the program skips that block;
  the host reads the word after every eager call and in ``check()`` (after graph replays), and
  raises ``PeerTimeoutError`` naming ``src``.

The merge rule is the one in ``attncomm.dcp.combine`` (NaN LSE → −inf, ``m := 0`` when all are
−inf, zero-weight sources never read, guarded divide, fp32 accumulation, one rounding).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import capability
from ..symm import SlabLayout, SymmWorkspace
from .backend import DcpBackend

try:
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 - the backend reports itself unavailable
    triton = None
    tl = None

__all__ = ["SymmA2ABackend", "plan_blocks", "launch_merge"]

# Largest rows per block, and programs per SM; private knobs for tuning on a device.
_MAX_BLOCK_ROWS = int(os.environ.get("ATTNCOMM_SYMM_MAX_BLOCK_ROWS", "8"))
_PROGRAMS_PER_SM = int(os.environ.get("ATTNCOMM_SYMM_PROGRAMS_PER_SM", "1"))
_DELTA_UNIT = 16  # peer offsets are passed in units of 16 elements (keeps stores vectorised)


if triton is not None:

    @triton.jit
    def _now_ns():
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                         is_pure=False, pack=1)

    @triton.jit
    def _dispatch(out_ptr, lse_ptr, slab_o, slab_l, slab_f, delta_o, delta_w, rank, e, slot,
                  n_rows, n_blocks, grid_size, H, HS, D, o_cell, l_base, l_cell, f_base, f_cell,
                  W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
        # Store this rank's rows for every peer's head slice into that peer's slab, then
        # publish each block with a release store of the epoch into the peer's flag.
        pid = tl.program_id(0)
        r = tl.arange(0, BR)
        d = tl.arange(0, BD)
        dmask = d < D
        b = pid  # a while loop: the interpreter cannot range() over a program id
        while b < n_blocks:
            rows = b * BR + r
            rmask = rows < n_rows
            t = rows // HS
            hl = rows % HS
            m2 = rmask[:, None] & dmask[None, :]
            for q in tl.static_range(W):
                if q != rank:
                    src = t * H + q * HS + hl
                    vals = tl.load(out_ptr + src[:, None] * D + d[None, :], mask=m2)
                    lv = tl.load(lse_ptr + src, mask=rmask)
                    cell = slot * W + rank
                    po = slab_o + tl.load(delta_o + q) * 16 + cell * o_cell
                    tl.store(po + rows[:, None] * D + d[None, :], vals, mask=m2)
                    dw = tl.load(delta_w + q) * 16
                    tl.store(slab_l + dw + l_base + cell * l_cell + rows, lv, mask=rmask)
                    tl.debug_barrier()  # every thread's stores precede the release below
                    tl.atomic_xchg(slab_f + dw + f_base + cell * f_cell + b, e, sem="release",
                                   scope="sys")
            b += grid_size

    @triton.jit
    def _combine_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, rank, slot,
                       rows, rmask, t, hl, H, HS, D, o_cell, l_base, l_cell,
                       W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
        d = tl.arange(0, BD)
        m2 = rmask[:, None] & (d < D)[None, :]
        own = t * H + rank * HS + hl
        m = tl.full([BR], float("-inf"), tl.float32)
        for q in tl.static_range(W):
            if q == rank:
                l = tl.load(lse_ptr + own, mask=rmask, other=float("-inf"))
            else:
                l = tl.load(slab_l + l_base + (slot * W + q) * l_cell + rows, mask=rmask,
                            other=float("-inf"), cache_modifier=".cg")
            m = tl.maximum(m, tl.where(l == l, l, float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)
        s = tl.zeros([BR], tl.float32)
        acc = tl.zeros([BR, BD], tl.float32)
        for q in tl.static_range(W):
            if q == rank:
                l = tl.load(lse_ptr + own, mask=rmask, other=float("-inf"))
            else:
                l = tl.load(slab_l + l_base + (slot * W + q) * l_cell + rows, mask=rmask,
                            other=float("-inf"), cache_modifier=".cg")
            w = tl.exp(tl.where(l == l, l, float("-inf")) - m)
            live = m2 & (w > 0)[:, None]  # a zero-weight source is never read
            if q == rank:
                o = tl.load(out_ptr + own[:, None] * D + d[None, :], mask=live, other=0.0)
            else:
                o = tl.load(slab_o + (slot * W + q) * o_cell + rows[:, None] * D + d[None, :],
                            mask=live, other=0.0, cache_modifier=".cg")
            acc += w[:, None] * o.to(tl.float32)
            s += w
        s_safe = tl.where(s > 0, s, 1.0)
        res = acc / s_safe[:, None]
        tl.store(res_ptr + rows[:, None] * D + d[None, :], res.to(res_ptr.dtype.element_ty),
                 mask=m2)
        tl.store(res_lse_ptr + rows, tl.where(s > 0, tl.log(s_safe) + m, float("-inf")),
                 mask=rmask)

    @triton.jit(do_not_specialize=["rank", "n_rows", "n_blocks", "grid_size", "timeout_ns"])
    def _symm_a2a_kernel(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, slab_f,
                         delta_o, delta_w, state_ptr, err_ptr,
                         rank, n_rows, n_blocks, grid_size, timeout_ns,
                         H, HS, D, o_cell, l_base, l_cell, f_base, f_cell,
                         W: tl.constexpr, BR: tl.constexpr, BD: tl.constexpr):
        """One DCP merge. ``out [T, H, D]``, ``lse [T, H]`` fp32 → ``res [T, HS, D]``,
        ``res_lse [T, HS]`` fp32; rows are ``(t, h_local)`` pairs, ``n_rows = T·HS``."""
        pid = tl.program_id(0)
        e = tl.load(state_ptr) + 1
        slot = e & 1
        _dispatch(out_ptr, lse_ptr, slab_o, slab_l, slab_f, delta_o, delta_w, rank, e, slot,
                  n_rows, n_blocks, grid_size, H, HS, D, o_cell, l_base, l_cell, f_base,
                  f_cell, W, BR, BD)
        # The clock is read only when a flag is not there yet (keeps the interpreter path free
        # of inline asm); one deadline per program bounds all of its waits together.
        deadline = timeout_ns.to(tl.int64) * 0
        r = tl.arange(0, BR)
        b = pid
        while b < n_blocks:
            rows = b * BR + r
            rmask = rows < n_rows
            bad = tl.full([], 0, tl.int32)
            for q in tl.static_range(W):
                if q != rank:
                    fp = slab_f + f_base + (slot * W + q) * f_cell + b
                    v = tl.atomic_add(fp, 0, sem="acquire", scope="sys")
                    while v != e:
                        now = _now_ns()
                        if deadline == 0:
                            deadline = now + timeout_ns.to(tl.int64)
                        if now > deadline:
                            tl.atomic_xchg(err_ptr + q, 1)
                            bad = 1
                            v = e
                        else:
                            v = tl.atomic_add(fp, 0, sem="acquire", scope="sys")
            tl.debug_barrier()
            if bad == 0:
                _combine_block(out_ptr, lse_ptr, res_ptr, res_lse_ptr, slab_o, slab_l, rank,
                               slot, rows, rmask, rows // HS, rows % HS, H, HS, D, o_cell,
                               l_base, l_cell, W, BR, BD)
            b += grid_size
        # The last program to finish advances the epoch (every program has read it by then).
        tl.debug_barrier()
        done = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if done == grid_size - 1:
            tl.store(state_ptr + 1, 0)
            tl.store(state_ptr, e)


def plan_blocks(n_rows: int, n_programs_max: int, max_block_rows: int = _MAX_BLOCK_ROWS):
    """Rows per block (a power of two ≤ ``max_block_rows``) and grid size for ``n_rows`` rows:
    enough rows per block that the blocks roughly fill ``n_programs_max`` programs.

    Returns ``(block_rows, n_blocks, grid)``; the same on every rank for the same inputs."""
    if n_rows <= 0:
        return 1, 0, 0
    per = -(-n_rows // max(n_programs_max, 1))
    br = 1
    while br < per and br < max_block_rows:
        br *= 2
    n_blocks = -(-n_rows // br)
    return br, n_blocks, min(n_blocks, n_programs_max)


def _num_warps(block_rows: int, block_d: int, itemsize: int) -> int:
    # about one 16-byte vector per thread and row chunk; 1..8 warps
    nbytes = block_rows * block_d * itemsize
    return max(1, min(8, nbytes // (32 * 16)))


def launch_merge(out, lse, res, res_lse, *, slab_o, slab_l, slab_f, delta_o, delta_w, state,
                 errors, rank: int, world_size: int, num_heads: int, layout: SlabLayout,
                 n_programs_max: int, timeout_ns: int) -> None:
    """Launch one merge (no host sync). Tensors as in ``_symm_a2a_kernel``; ``out [T, H, D]`` and
    ``lse [T, H]`` fp32 contiguous; ``res``/``res_lse`` at least ``[T, H/W, D]``/``[T, H/W]``."""
    T, H, D = out.shape
    hs = num_heads // world_size
    n_rows = T * hs
    br, n_blocks, grid = plan_blocks(n_rows, n_programs_max)
    if grid == 0:
        return
    bd = triton.next_power_of_2(D)
    st = layout.kernel_strides()
    _symm_a2a_kernel[(grid,)](
        out, lse, res, res_lse, slab_o, slab_l, slab_f, delta_o, delta_w, state, errors,
        rank, n_rows, n_blocks, grid, timeout_ns,
        H, hs, D, st["o_cell"], st["l_base"], st["l_cell"], st["f_base"], st["f_cell"],
        W=world_size, BR=br, BD=bd, num_warps=_num_warps(br, bd, out.element_size()))


def _n_programs_max(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return max(1, props.multi_processor_count * max(1, _PROGRAMS_PER_SM))


class SymmA2ABackend(DcpBackend):
    """The symmetric-memory DCP merge (see the module docstring).

    Construction is collective and host-blocking (allocation, then rendezvous, each agreed across
    ranks; then one warm-up merge per kernel variant so that JIT compilation and the first P2P
    stores happen here, before any capture). Calls are graph-capturable; outside capture every
    call reads the device error word (a host sync) and raises ``PeerTimeoutError`` at once; inside
    graphs call ``check()`` after replays.

    Returns views of internal buffers (``[T, H/W, D]`` in ``dtype``, ``[T, H/W]`` fp32), valid
    until the next call.

    Constraints: CUDA tensors, every rank on one host with P2P between every pair of GPUs, torch
    SymmetricMemory (CUDA backend), Triton. Two mergers whose calls run concurrently on
    different streams can starve each other of SMs (each spins until its peer arrives); issue
    merges of one group on one stream.
    """

    name = "symm_a2a"
    returns_views = True

    def __init__(self, group, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, timeout_s: float):
        super().__init__(group, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim,
                         dtype=dtype, device=device, timeout_s=timeout_s)
        if triton is None:
            raise RuntimeError("symm_a2a needs Triton")
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.hs = num_heads // self.world_size
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.layout = SlabLayout(self.world_size, max_tokens * self.hs, head_dim, itemsize)
        if self.layout.total_bytes >= 2 ** 31:
            raise RuntimeError(f"symm_a2a: slab of {self.layout.total_bytes} bytes exceeds the "
                               f"kernel's 32-bit offsets; lower max_tokens")
        self.timeout_ns = int(timeout_s * 1e9)
        ws, reason = capability.collective_try(
            group, lambda: SymmWorkspace(group, self.layout, device, op="dcp.merge[symm_a2a]",
                                         timeout_s=timeout_s, rendezvous=False),
            "symm_a2a allocation")
        if reason:
            raise RuntimeError(f"symm_a2a: allocation failed: {reason}")
        _, reason = capability.collective_try(group, ws.rendezvous, "symm_a2a rendezvous")
        if reason:
            raise RuntimeError(f"symm_a2a: rendezvous failed: {reason}")
        self.ws = ws
        self._setup_tables(itemsize)
        self.res = torch.empty((max_tokens, self.hs, head_dim), dtype=dtype, device=device)
        self.res_lse = torch.empty((max_tokens, self.hs), dtype=torch.float32, device=device)
        self._warm_up()

    @classmethod
    def local_unavailable_reason(cls, group, device: torch.device) -> str | None:
        if triton is None:
            return "Triton is not importable"
        return capability.symm_unavailable_reason(group, device)

    def _setup_tables(self, itemsize: int) -> None:
        ptrs = [int(p) for p in self.ws.handle.buffer_ptrs]
        me = ptrs[self.rank]
        unit_o, unit_w = _DELTA_UNIT * itemsize, _DELTA_UNIT * 4
        deltas = [p - me for p in ptrs]
        if any(dl % unit_o or dl % unit_w for dl in deltas):
            raise RuntimeError(f"symm_a2a: peer slabs are not {max(unit_o, unit_w)}-byte "
                               f"aligned relative to each other: {deltas}")
        dev = self.device
        self.delta_o = torch.tensor([dl // unit_o for dl in deltas], dtype=torch.int64,
                                    device=dev)
        self.delta_w = torch.tensor([dl // unit_w for dl in deltas], dtype=torch.int64,
                                    device=dev)
        self.slab_o = self.ws.slab.view(self.dtype)
        self.slab_l = self.ws.slab.view(torch.float32)
        self.slab_f = self.ws.slab.view(torch.int32)
        # Grid bound agreed across ranks: block plans must match everywhere.
        n = torch.tensor([_n_programs_max(dev)], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=_cpu_group(self.group))
        self.n_programs_max = int(n.item())

    def _warm_up(self) -> None:
        # One merge per kernel variant (block size) up to max_tokens: compiles before any
        # capture and proves the P2P path; a timeout here raises on construction.
        seen = set()
        for t in range(1, self.max_tokens + 1):
            br, _, _ = plan_blocks(t * self.hs, self.n_programs_max)
            if br in seen:
                continue
            seen.add(br)
            out = torch.zeros((t, self.num_heads, self.head_dim), dtype=self.dtype,
                              device=self.device)
            lse = torch.zeros((t, self.num_heads), dtype=torch.float32, device=self.device)
            self(out, lse)

    def _launch(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        launch_merge(out, lse, self.res, self.res_lse, slab_o=self.slab_o, slab_l=self.slab_l,
                     slab_f=self.slab_f, delta_o=self.delta_o, delta_w=self.delta_w,
                     state=self.ws.state, errors=self.ws.errors, rank=self.rank,
                     world_size=self.world_size, num_heads=self.num_heads, layout=self.layout,
                     n_programs_max=self.n_programs_max, timeout_ns=self.timeout_ns)

    def __call__(self, out: torch.Tensor, lse: torch.Tensor):
        """``out [T, H, D]`` (``dtype``, contiguous, CUDA), ``lse [T, H]`` fp32 base e →
        (``[T, H/W, D]``, ``[T, H/W]`` fp32) views, valid until the next call."""
        self.ws.ensure_usable()
        T = out.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"symm_a2a: T={T} exceeds max_tokens={self.max_tokens}")
        if lse.dtype != torch.float32 or not lse.is_contiguous():
            lse = lse.float().contiguous()
        self._launch(out.contiguous(), lse)
        if not torch.cuda.is_current_stream_capturing():
            self.ws.check()
        return self.res[:T], self.res_lse[:T]

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for a wait that timed out since the last check (host
        sync)."""
        self.ws.check()


def _cpu_group(group):
    from ..launch import cpu_group
    return cpu_group(group)
