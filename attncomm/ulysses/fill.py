"""The Ulysses fill: this rank's sequence shard of q, k, v → the destination-major send buffer of
the q/k/v exchange, with RMSNorm + RoPE of q and k applied on the way (one read, one write).

Send buffer of one exchange (the parts that travel together: same dtype and head_dim), flat::

    [ region of rank 0 | region of rank 1 | ... ]     region p: [S_r, B, htot_p, D]

where region ``p`` holds, along its head axis, part 0's heads for ``p`` (``ranges[0][p]``), then
part 1's, ... (``htot_p`` heads in all): exactly the rows rank ``p``'s receive buffer
``[S, B, htot_p, D]`` holds from this rank, so a transport moves each region as one block
(``layout.packed_seq_to_head_plan``) and ``all_to_all_single`` sends the buffer as it is.

Two implementations, bitwise equal (the kernel runs the torch reference's arithmetic in the same
order, in fp32, rounded once):

- ``fill_torch`` (CPU tensors, any head_dim, and the reference): ``rms_norm_rope`` per part,
  then strided copies into the regions.
- the Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``; head_dim a power of two; the
  kernel is ``fill_kernels``'s, its geometry in a descriptor built once per layout): one
  program per (block of rows, run of consecutive heads of one part bound for one destination,
  batch) loads ``[rows, heads, D]`` once, 16-byte vectors in and out, and stores it into that
  destination's region (a KV head shared by several ranks under GQA is in one run per rank),
  with FMA contraction off so that ``a * b + c`` rounds twice as in torch.

FP8 payload (``payload_dtype=torch.float8_e4m3fn``): each part's rows are
normed and rotated as above and rounded to the parts' dtype (the bits the bf16 path sends), then
quantized by ``fp8``'s rule (one fp32 scale per (token, head) row, amax / 448) and written in its
wire layout: elements are bytes and a row is ``fp8.row_bytes(D) = D + 4`` of them (the ``D``
e4m3 bytes, then the scale), so region ``p`` is ``[S_r, B, htot_p, D + 4]`` uint8 and
``send_layout(B, S_r, D + 4, ranges)`` gives its size. ``fill_torch`` calls
``fp8.quantize_pack``; the kernel quantizes in its epilogue (one pass: no extra read).

RMSNorm (Zhang & Sennrich, 2019) over ``D``: ``x · (1 / sqrt(mean(x²) + eps)) · w`` with the
mean a pairwise sum in a fixed order (adjacent elements added, recursively) and IEEE-rounded
``sqrt`` and division (not ``rsqrt``, whose approximation differs between CPU, CUDA and
Triton; the torch path takes the fp32 square root through fp64, which rounds it correctly on
the CPU too); RoPE rotate-half (NeoX, Su et al., 2021): ``x · cos + rotate_half(x) · sin``
over global positions.

``FillPlan`` is the fill's one entry point: prepared once per layout (checks, implementation,
norm weights, descriptors), called with the tensors; on CUDA its launches go through
``compiled_launch.LaunchCache`` once Triton compiled a specialization.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

import torch

from .. import _triton
from ..compiled_launch import LaunchCache, aligned, alignment_key, check_block
from . import fp8 as _fp8
from .fill_descriptor import Desc, descriptor, spec_code, usable
from .fill_reference import (FillPart, _new_send_buffer, _regions, _torch_fill, _validate_out,
                             _validate_parts, fill_torch, rms_norm_rope, send_layout)

if _triton.REASON is None:
    from . import fill_kernels as _fk
else:
    _fk = None

__all__ = ["FillPart", "FillPlan", "rms_norm_rope", "send_layout", "fill_torch", "fill",
           "fill_triton", "triton_fill_reason", "default_block_s", "LAUNCH_OPTIONS"]


def triton_fill_reason(parts: Sequence[FillPart], device: torch.device,
                       payload_dtype: torch.dtype | None = None) -> str | None:
    """Why the fill kernel cannot run these parts (None when it can)."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"tensors are on {device.type} (the kernel needs CUDA or TRITON_INTERPRET=1)"
    if _fk is None:
        return _triton.REASON
    d = parts[0].x.shape[3]
    if d < 2 or d & (d - 1):
        return f"head_dim {d} is not a power of two ≥ 2"
    if parts[0].x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {parts[0].x.dtype} is not fp16/bf16/fp32"
    if payload_dtype is not None and payload_dtype == _fp8.FP8_DTYPE and d % 4:
        return f"head_dim {d} is not a multiple of 4 (the FP8 row's fp32 scale is stored aligned)"
    return None


def _hw_e4m3(device: torch.device) -> bool:
    """Whether the fill kernel's FP8 epilogue converts with the hardware's e4m3 instruction
    (CUDA compute capability 8.9 and later); elsewhere it rounds in integer arithmetic, with
    the same bits (``fill_epilogue`` says why)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_epilogue(device: torch.device, rounds: bool) -> dict:
    """The FP8 epilogue's constexprs for a fill on ``device`` whose rows are normed or rotated
    (``rounds``: they must be rounded to the parts' dtype before quantizing): ``HW_E4M3``
    (``_hw_e4m3``); ``EXACT``, the rows hold the parts' values as loaded; ``PTX``, the common
    case (every row of a block finite, no tiny scale) runs as PTX, rounding to bf16 next to the
    quotients (``fill_epilogue._ptx_split_bytes`` for 16-bit parts, ``_ptx_bytes`` for fp32):
    on a GPU (the interpreter runs no PTX), for a fill that rounds. The plain FP8 fill keeps the
    Triton ops, which ran faster there on an H200
    (benchmarks/results/fill-ptx-ab-2026-12-03-nvidia-h200.md)."""
    hw = _hw_e4m3(device)
    return dict(HW_E4M3=hw, EXACT=not rounds, PTX=rounds and hw and device.type == "cuda")


#: Launch options of the fill kernel: FMA contraction off (torch rounds ``a * b`` and ``+ c``
#: separately); read by tests/_fill_ptx.py, which checks the PTX.
LAUNCH_OPTIONS = {"num_warps": 4, "enable_fp_fusion": False}
#: Rows and heads per program (``default_block_s``, ``HEADS_PER_PROGRAM``): chosen from the
#: launch shapes ``bench ulysses --fill`` tries (benchmarks/results/ulysses-fill-*.md).
HEADS_PER_PROGRAM = 2
#: cos/sin loaded through pointers broadcast over the program's heads (in the layout of the
#: rows they multiply) rather than loaded once as ``[rows, D]`` and broadcast in registers
#: (a layout conversion through shared memory): see benchmarks/results/ulysses-fill-*.md.
ROPE_BCAST = True

#: The register cap of a capped launch (``_LaunchLayout.capped``) by whether its blocks are
#: full (the kernel's ``FULL``, no masks). Unmasked, the loads issue earlier and hold more
#: registers: 64 spills 40-48 bytes there and runs the bf16 norm fill 34 % slower than 72, the
#: least with no spill (benchmarks/results/fill-grid-full-ab-2026-12-03-nvidia-h200.md and
#: fill-grid-full-regs-2026-12-03-sm90.md).
_MAXNREG = {False: 64, True: 72}


def default_block_s(head_dim: int) -> int:
    """Rows per program: about 2048 elements per head and program."""
    return max(1, min(64, 2048 // head_dim))


class _LaunchLayout:
    """What a fill launch keeps for one layout (the parts' shapes, dtype, head ranges, norm
    weights, RoPE, eps, payload, launch shape): everything but the tensors' addresses and
    strides."""

    def __init__(self, parts: Sequence[FillPart], eps: float, rope: bool,
                 block_s: int | None = None, heads_per_program: int | None = None,
                 num_warps: int | None = None, payload_dtype: torch.dtype | None = None):
        x0 = parts[0].x
        (self.b, self.s_r, self.row), htot, _, _, self.fp8 = _validate_parts(parts, None,
                                                                          payload_dtype)
        d = x0.shape[3]
        self.device = x0.device
        self.ranges = tuple(p.ranges for p in parts)
        self.htot = tuple(htot)
        self.hb = heads_per_program or HEADS_PER_PROGRAM
        self.eps = float(eps)
        self.rope = rope
        self.flags = sum(((p.weight is not None) << (2 * i)) | ((p.rope and rope) << (2 * i + 1))
                         for i, p in enumerate(parts))
        self.ws = _kernel_weights(parts, x0.device)
        self.pad = 3 - len(parts)
        self.block_s = block_s or default_block_s(d)
        half = d // 2
        self.consts = dict(LAUNCH_OPTIONS, num_warps=num_warps or LAUNCH_OPTIONS["num_warps"],
                           HALF=half, LEVELS=half.bit_length() - 1, BLOCK_S=self.block_s,
                           HB=self.hb, ANY_NORM=any(p.weight is not None for p in parts),
                           ANY_ROPE=rope and any(p.rope for p in parts), ROPE_BCAST=ROPE_BCAST,
                           FP8=self.fp8)
        normed = self.consts["ANY_NORM"] or self.consts["ANY_ROPE"]
        default_shape = ((self.block_s, self.hb, self.consts["num_warps"])
                         == (default_block_s(d), HEADS_PER_PROGRAM, LAUNCH_OPTIONS["num_warps"]))
        self.capped = False
        if (normed and default_shape and x0.device.type == "cuda"
                and torch.cuda.get_device_capability(x0.device) == (9, 0)):
            # At the default launch shape the compiler gives the masked norm/RoPE fills 76
            # (bf16 payload) and 72 (FP8) registers per thread on sm_90; a 64 cap leaves room
            # for 32 warps per SM and spills 8 bytes. On an H200 it made them 4-9 % faster
            # (benchmarks/results/fill-regs64-ab-2026-12-03-nvidia-h200.md, measured with the
            # grid's row blocks fastest, where it spilled nothing). The unmasked ones
            # get 89 and 72, capped at 72 (_MAXNREG). Other shapes, and other GPUs, where it
            # is not measured, keep what the compiler picks: a cap there may spill more.
            self.capped = True
        if self.fp8:
            self.consts.update(_fp8_epilogue(x0.device, normed))
        # bf16 rows widened by one instruction per element on a GPU where they are normed or
        # rotated (a plain fill keeps Triton's widening, which the compiler folds away with
        # the narrowing of its store)
        self.consts["PTX_WIDEN"] = normed and x0.device.type == "cuda"
        #: the kernel's ``SHFL_NORM`` is possible (the norm's tree by warp shuffles, in PTX
        #: written for one register layout): a norm, D = 128, the default launch shape, a GPU
        #: (tests/test_ulysses_fill.py finds the layout on sm_80, sm_90 and sm_100); ``_launch``
        #: adds what the layout also needs of the tensors
        self.shfl_norm = (self.consts["ANY_NORM"] and x0.device.type == "cuda" and d == 128
                          and default_shape)
        self._descs: dict = {}
        #: the compiled kernel per specialization, replayed (``_launch``)
        self.launches = LaunchCache((_fk.fill_kernel,))
        #: a CUDA call's launch (its strides, dtypes, alignment) → (``launches``' key or None
        #: for nothing to launch, the descriptor, kept with its table's source): ``_launch``
        self.replays: dict = {}

    def desc(self, starts: tuple, strides: tuple, rope_strides: tuple) -> Desc:
        """The descriptor for regions at ``starts`` and these strides (kept per layout: a
        transport hands out a few buffers in turn, a caller passes a few layouts)."""
        key = (starts, strides, rope_strides)
        desc = self._descs.get(key)
        if desc is not None and not usable(desc, self.device):
            # derived inside capture, and this call is eager: an uploaded descriptor of its
            # own (the derived one stays, for the graph)
            key = (*key, "eager")
            desc = self._descs.get(key)
        if desc is None:
            desc = descriptor(self.device, self.ranges, self.htot, starts, self.b, self.row,
                               self.hb, self.s_r, self.eps, self.flags, strides, rope_strides)
            if len(self._descs) > 16:
                self._descs.clear()
            self._descs[key] = desc
        return desc


def _launch(lay: _LaunchLayout, xs: Sequence, base: torch.Tensor, starts: tuple, cos,
            sin) -> None:
    """One launch of the fill kernel for ``lay`` with sources ``xs`` (``[B, S_r, H, D]``, any
    strides), destination ``base`` (regions at ``starts`` elements from it): through Triton's
    JIT the first time a specialization is seen, then through the compiled kernel it returned
    (``compiled_launch.LaunchCache``: the same kernel, arguments and bits).

    A call whose tensors are all on CUDA is first looked up in ``lay.replays`` by what fixes
    its launch (the region starts, the tensors' strides, dtypes and 16-byte alignment): a hit
    gives the ``LaunchCache`` key and the descriptor, and the compiled kernel is launched with
    the addresses read for that lookup; anything else takes the path below, which fills the
    entry."""
    if lay.s_r == 0 or lay.b == 0:
        return
    x0, x1, x2 = xs if not lay.pad else (*xs, *[xs[0]] * lay.pad)
    c, s = (cos, sin) if lay.rope else (x0, x0)
    w0, w1, w2 = lay.ws
    # the arguments that change (all but the descriptor) as the launcher takes them; None for
    # a tensor off CUDA (the interpreter, or a caller's mistake: the path below, which the
    # launcher or Triton's JIT refuses)
    ptrs = [t.data_ptr() if t.is_cuda else None for t in (x0, x1, x2, base, w0, w1, w2, c, s)]
    fast = None if None in ptrs else (
        starts, x0.stride(), x1.stride(), x2.stride(),
        (c.stride(), s.stride()) if lay.rope else None, x0.dtype, x1.dtype, x2.dtype,
        base.dtype, c.dtype, s.dtype, aligned(ptrs))
    if fast is not None:
        got = lay.replays.get(fast)
        if got is not None:
            key, desc = got
            if key is None or lay.launches.replay(key, (*ptrs[:4], desc.table.data_ptr(),
                                                        *ptrs[4:])):
                return
    desc = lay.desc(starts, (x0.stride(), x1.stride(), x2.stride()),
                    (*c.stride(), *s.stride()) if lay.rope else (0, 0, 0, 0))
    key = None
    if desc.entries:
        args = (x0, x1, x2, base, desc.table, w0, w1, w2, c, s)
        grid = (triton_cdiv(lay.s_r, lay.block_s) * desc.entries, lay.b)
        # every region base and pitch, and the buffer itself, 16-element aligned
        rows16 = desc.aligned and base.data_ptr() % 16 == 0
        full = desc.full and lay.s_r % lay.block_s == 0
        cap = {"maxnreg": _MAXNREG[full]} if lay.capped else {}
        # the loads give each thread 8 consecutive elements of a half-row: 16-bit parts,
        # 16-byte aligned, element stride 1 and the other strides multiples of 16 elements
        shfl_norm = (lay.shfl_norm and desc.spec & 0xFF == _ROWS_SPEC
                     and all(x.dtype in _HALF_DTYPES for x in (x0, x1, x2))
                     and all(alignment_key((x0, x1, x2))))
        # in that layout a thread holds runs of 4 consecutive FP8 bytes of a row, stored as
        # 32-bit words from its registers rather than converted to Triton's store layout
        # through shared memory first (fill_epilogue._store_words)
        reg_store = shfl_norm and lay.consts.get("PTX", False)

        def launch() -> None:
            _fk.fill_kernel[grid](*args, ALIGNED=rows16, SPEC=desc.spec, ENTRIES=desc.entries,
                                  FULL=full, SHFL_NORM=shfl_norm, REG_STORE=reg_store,
                                  **lay.consts, **cap)

        # What Triton specializes the changing arguments on (each pointer's dtype and 16-byte
        # alignment), the descriptor's specialization and the grid (the rest is fixed per
        # layout). The sources' and destination's dtypes belong to the layout, but a caller
        # can hand over others: in the key, they get a kernel of their own instead of one
        # compiled for the first.
        key = (desc.spec, desc.entries, rows16, alignment_key(args), x0.dtype, x1.dtype,
               x2.dtype, base.dtype, c.dtype, s.dtype)
        lay.launches.launch(key, launch, args)
    # Not for a descriptor derived inside capture (its table is written only when the graph
    # replays; _LaunchLayout.desc): an eager call must not take it.
    if fast is not None and desc.source is None:
        if len(lay.replays) >= 64:
            lay.replays.clear()
        lay.replays[fast] = (key, desc)


#: ``SPEC``'s low byte for parts whose batch, row and head strides are multiples of 16 and
#: whose element stride is 1
_ROWS_SPEC = sum(spec_code(st) << (2 * k) for k, st in enumerate((16, 16, 16, 1)))
_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _base_pointer(out, regions, starts, fp8: bool):
    """``(base, starts)``: the tensor the kernel writes through and each region's first
    element from it (regions in separate allocations: the lowest one, the others at their
    offsets). FP8: every region starts on a 4-byte boundary (its rows' scales are stored as
    fp32), else ``ValueError``."""
    base, starts = out, list(starts[:-1])
    if regions is not None:
        live = [r for r in regions if r.numel()] or [regions[0]]
        base = min(live, key=lambda r: r.data_ptr())
        item = base.element_size()
        starts = [(r.data_ptr() - base.data_ptr()) // item for r in regions]
    if fp8 and (base.data_ptr() % 4 or any(st % 4 for st in starts)):
        raise ValueError(f"fill: FP8 regions must start on 4-byte boundaries, got base "
                         f"address {base.data_ptr()} and offsets {starts}")
    return base, starts


def _kernel_weights(parts: Sequence[FillPart], device) -> list:
    """The three weight pointers of a launch, one pointer type for all (the kernel picks one
    by part): the weights as they are when they share one float dtype and are contiguous (the
    kernel widens each value to fp32, exactly as ``Tensor.to`` does), else fp32 copies; a
    part without a weight gets another part's (never read)."""
    given = [p.weight for p in parts if p.weight is not None]
    native = (len({w.dtype for w in given}) <= 1
              and all(w.is_contiguous() and w.dtype in _WEIGHT_DTYPES for w in given))
    ws = [p.weight if p.weight is None or native else p.weight.to(torch.float32).contiguous()
          for p in parts]
    dummy = next((w for w in ws if w is not None), None)
    if dummy is None:
        dummy = _dummy(device)
    return [w if w is not None else dummy for w in ws] + [dummy] * (3 - len(ws))


_WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.cache
def _dummy(device) -> torch.Tensor:
    return torch.empty(1, dtype=torch.float32, device=device)


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class FillPlan:
    """The fill prepared once for one layout, for a caller that fills many times (a forward
    per layer and step): the checks, the implementation choice, the norm weights and the
    kernel's descriptors are worked out here, so a call only passes the tensors.

    Arguments:
        parts: the exchange's parts (same ``B``, ``S_r``, ``D``, dtype; at most 3 for the
            kernel); their ``x`` fix the layout (shapes and dtype); later calls pass tensors
            of the same shapes and dtype, any strides.
        eps, rope: RMSNorm epsilon for the parts with a weight; whether cos/sin are passed
            (the parts' ``rope`` apply).
        impl: ``"triton"`` (the kernel: CUDA or ``TRITON_INTERPRET=1``, head_dim a power of
            two; ``triton_fill_reason`` says why not), ``"torch"`` (``fill_torch``), or
            ``"auto"`` (the kernel where it can run). The two give the same bits.
        payload_dtype: None (the parts' values) or ``torch.float8_e4m3fn`` (the FP8 payload:
            uint8 regions, ``D + 4`` bytes per (token, head); the module docstring).
        block_s, heads_per_program, num_warps: the kernel's launch shape (None: the default;
            powers of two), which never changes the bits.

    ``plan(xs, cos, sin, out)``: ``xs`` one tensor per part; ``cos``, ``sin`` ``[S_r, D]`` rows
    of this shard's global positions (with ``rope``); ``out`` a flat destination-major send
    buffer (``send_layout``'s size, the parts' dtype or uint8) or one flat tensor per
    destination region (descriptors are kept per region address, so pass stable buffers).

    Raises ``ValueError`` at construction for parts that disagree on B, S_r, D or dtype, a
    launch shape that is not a power of two, an unknown ``impl``, ``impl="triton"`` where the
    kernel cannot run, more than 3 parts for the kernel; at a call, for a wrong ``out`` (FP8:
    regions not on 4-byte boundaries).
    """

    def __init__(self, parts: Sequence[FillPart], eps: float = 0.0, rope: bool = False,
                 impl: str = "auto", payload_dtype: torch.dtype | None = None, *,
                 block_s: int | None = None, heads_per_program: int | None = None,
                 num_warps: int | None = None):
        if impl not in ("auto", "triton", "torch"):
            raise ValueError(f"fill: impl must be 'auto', 'triton' or 'torch', got {impl!r}")
        for name, v in (("block_s", block_s), ("heads_per_program", heads_per_program),
                        ("num_warps", num_warps)):
            check_block("fill", name, v)
        dims, self.htot, starts, _, self.fp8 = _validate_parts(parts, None, payload_dtype)
        self.dims = dims
        self.wire = _fp8.WIRE_DTYPE if self.fp8 else parts[0].x.dtype
        why = (None if impl == "torch" else
               triton_fill_reason(parts, parts[0].x.device, payload_dtype))
        if impl == "triton" and why is not None:
            raise ValueError(f"fill: impl='triton' cannot run: {why}")
        if why is None and impl != "torch" and len(parts) > 3:
            raise ValueError(f"fill: the kernel takes at most 3 parts per exchange, got "
                             f"{len(parts)}")
        self.templates = [dataclasses.replace(p, x=None) for p in parts]
        self.eps = float(eps)
        self.payload_dtype = payload_dtype
        self.starts = list(starts)
        self.flat_starts = tuple(starts[:-1])
        self.layout = (_LaunchLayout(parts, eps, rope, block_s, heads_per_program, num_warps,
                               payload_dtype) if why is None and impl != "torch" else None)

    def __call__(self, xs: Sequence[torch.Tensor], cos=None, sin=None, out=None) -> None:
        lay = self.layout
        if lay is None:
            _validate_out(out, self.starts, len(self.htot), self.wire)
            _torch_fill(self.templates, xs, self.eps, cos, sin,
                        _regions(out, self.starts, self.htot, *self.dims), self.fp8)
            return
        if isinstance(out, torch.Tensor) and not lay.fp8:
            _launch(lay, xs, out, self.flat_starts, cos, sin)
            return
        regions = None if isinstance(out, torch.Tensor) else out
        base, starts = _base_pointer(out, regions, self.starts, lay.fp8)
        _launch(lay, xs, base, tuple(starts), cos, sin)


def fill(parts: Sequence[FillPart], eps: float = 0.0, cos: torch.Tensor | None = None,
         sin: torch.Tensor | None = None, out=None, impl: str = "auto", *,
         payload_dtype: torch.dtype | None = None, **launch):
    """One fill, planned for this call: ``FillPlan(parts, eps, rope, impl, payload_dtype,
    **launch)`` run once on the parts' tensors. Returns ``out`` (flat, or one flat tensor per
    region), a new flat send buffer when None. Arguments, errors and bits as ``FillPlan``'s;
    a caller that fills the same layout again keeps the plan instead (the exchanges do)."""
    plan = FillPlan(parts, eps, cos is not None, impl, payload_dtype, **launch)
    if out is None:
        _, _, starts, _, fp8 = _validate_parts(parts, None, payload_dtype)
        out = _new_send_buffer(parts, starts, fp8)
    plan([p.x for p in parts], cos, sin, out)
    return out


def fill_triton(parts: Sequence[FillPart], eps: float = 0.0, cos: torch.Tensor | None = None,
                sin: torch.Tensor | None = None, out=None, *,
                payload_dtype: torch.dtype | None = None, **launch):
    """``fill(..., impl="triton")``: the kernel at a launch shape of powers of two
    (``block_s``, ``heads_per_program``, ``num_warps``; None: the default); CUDA or
    ``TRITON_INTERPRET=1``."""
    return fill(parts, eps, cos, sin, out, "triton", payload_dtype=payload_dtype, **launch)
