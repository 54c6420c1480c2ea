"""DCP's query-head all-gather: ``DcpQueryGather`` and the checks ``gather_heads``
(``functional``) shares with it.

In DCP decode each rank holds the query heads of its slice ``[r·H/W, (r+1)·H/W)`` (its share of
the head-sharded q projection) but attends all heads over its own KV shard, so before attention
the group all-gathers the queries (vLLM's DCP, SGLang's Shared-DCP); after it ``dcp.merge``
merges the partial outputs. MLA (DeepSeek, Kimi-K2.5) rotates only the last R dims of a query
head (``q_pe``: D = 512 + 64, R = 64); the rotation is applied here, by the producer, before the
exchange, so the gathered query is ready for attention.

Backends (one interface, ``QueryGatherBackend``):

- ``all_gather``: the process group's ``all_gather_into_tensor`` (NCCL or gloo) into a staging
  buffer, then a local permute into ``[T, H, D]``;
- ``symm``: every rank stores its (rotated) slice straight into every peer's persistent buffer
  (``attncomm.dcp.query_gather.symm``; CUDA, one host, P2P);
- ``auto``: ``symm`` when it can run and measures faster at construction, else ``all_gather``.

Every backend returns exactly the bits the ranks passed (after the rotation, which is
elementwise and fixed in its operation order, so rotating before or after the exchange, in torch
or in a kernel, gives the same bits).
"""
from __future__ import annotations

import logging
import zlib

import torch

from ..._dist import device_error
from ..._agree import DTYPE_CODES
from ..exchange import DTYPES, PreallocatedExchange, geometry_error
from . import all_gather, symm  # noqa: F401 - each registers its backend class
from .backend import GATHER_BACKENDS, GATHER_REGISTRY
from .query_math import FP8_DTYPE, FP8_MAX, _scale_error, _scale_f32, quantize_e4m3, rotate_tail

__all__ = ["DcpQueryGather", "rotate_tail", "quantize_e4m3", "GATHER_BACKENDS", "FP8_DTYPE",
           "FP8_MAX", "gather_args_error", "rope_key"]

log = logging.getLogger("attncomm.dcp")


def _rope_error(rope, T: int, D: int, device) -> str | None:
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2
            and all(isinstance(t, torch.Tensor) for t in rope)):
        return "rope must be a (cos, sin) pair of tensors"
    cos, sin = rope
    if cos.dim() != 2 or tuple(sin.shape) != tuple(cos.shape) or cos.shape[0] != T:
        return (f"rope cos and sin must both be [T={T}, R]; got cos {tuple(cos.shape)}, "
                f"sin {tuple(sin.shape)}")
    R = cos.shape[1]
    if R < 2 or R % 2 or R > D:
        return f"rope dim R={R} must be even, ≥ 2 and ≤ head_dim D={D}"
    if not cos.is_floating_point() or not sin.is_floating_point():
        return f"rope cos/sin must be floating point, got {cos.dtype}, {sin.dtype}"
    if cos.device != device or sin.device != device:
        return f"rope cos/sin are on {cos.device}/{sin.device}, q on {device}"
    return None


def gather_args_error(q, world_size: int, rope, backend: str) -> str | None:
    """This rank's argument errors for ``gather_heads`` (no communication), or None."""
    err = GATHER_REGISTRY.name_error(backend)
    if err:
        return err
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        return f"q must be a [T, H/W, D] tensor, got {getattr(q, 'shape', type(q).__name__)}"
    if q.dtype not in DTYPES:
        return f"q dtype must be fp16/bf16/fp32, got {q.dtype}"
    if q.shape[1] < 1 or q.shape[2] < 1:
        return f"heads per rank H/W and head_dim D must be ≥ 1, got {tuple(q.shape[1:])}"
    if rope is not None:
        return _rope_error(rope, q.shape[0], q.shape[2], q.device)
    return None


def rope_key(rope):
    """What the checks of ``rope`` depend on (None for no rope), hashable; raises
    ``AttributeError``/``TypeError``/``IndexError``/``ValueError`` for a malformed ``rope``."""
    if rope is None:
        return None
    cos, sin = rope
    return (cos.shape, cos.dtype, cos.device, sin.shape, sin.dtype, sin.device)


class DcpQueryGather(PreallocatedExchange):
    """A preallocated, CUDA-graph-capturable query-head all-gather for up to ``max_tokens``.

    Arguments:
        group: process group of W ranks (None: default group). Construction is collective.
        max_tokens: largest T a call may pass (≥ 1).
        num_heads: H, divisible by W (each rank passes H/W heads). head_dim: D.
        dtype: fp16/bf16/fp32 of the query.
        backend: "all_gather", "symm" or "auto" (decided here, eagerly, before any capture:
            ``symm`` when every rank can run it and it measures faster over token buckets up to
            ``max_tokens``; env ``ATTNCOMM_DCP_GATHER_BACKEND`` names a preference for "auto").
        rope_dim: R: every call rotates the last R dims (0: no rotation; else even, ≤ D).
        out_dtype: None or ``dtype`` (the query's dtype, bit for bit), or
            ``torch.float8_e4m3fn``: FP8 output for FP8 attention kernels, with ``q_scale``.
        q_scale: with FP8 output, the per-head dequantization scale: ``[H]`` (any float dtype,
            converted to fp32; finite, > 0) or one float for every head; the same on every rank
            (checked). Static, given by the caller (a calibrated scale, as vLLM's ``q_scale``
            or FlashInfer's ``q_scale``), not computed per call: a per-call amax needs every
            token of a head before the first byte is sent, a grid-wide pass the one-pass push
            kernel avoids. Value ``(T, h, d)`` of the result is ``quantize_e4m3`` of the rotated
            fp32 query divided by ``q_scale[h]`` (IEEE division, saturation to ±448, round to
            nearest even, NaN → 0x7F): ``q ≈ float(q8) · q_scale[h]``. The attention kernel
            multiplies head ``h``'s scores by ``q_scale[h]`` (fold it into head ``h``'s softmax
            scale; a per-tensor scale is all ``H`` entries equal, FA3's ``descale_q [B, H_kv]``
            the heads of a KV group equal). The quantization happens before the exchange, so a
            value crosses the wire as one byte.
        timeout_s: wait budget (None → ``ATTNCOMM_TIMEOUT_S``).

    ``gather(q [T, H/W, D], rope=None)`` → ``[T, H, D]`` in ``out_dtype``, a view of a
    persistent buffer (with ``symm`` the same view object on every call of a token count: change
    its values, never its shape or strides in place, and copy it before an in-place op that
    autograd records); ``rope=(cos, sin)`` each ``[T, rope_dim]`` is required iff ``rope_dim >
    0``. Per-call checks are local (no collective; once per signature), so calls can be
    captured. Under ``torch.compile`` a call is the custom op ``attncomm::dcp_query_gather``
    (``dcp/ops.py``): a new tensor of the graph, copied from the buffer.

    Ordering rule (the view is valid until this rank's next call is enqueued): enqueue every
    reader of a result on the gather's stream before the next call. The ``symm`` backend keeps
    peers from overwriting a result a slow rank still reads on its own (see
    ``query_gather.symm``); with ``ordered_by_caller=True`` it leaves that to the caller,
    who promises a cross-rank dependency between a result's readers and the next call on every
    rank (``DcpAttention``: the DCP merge that follows attention).

    Attributes:
        backend: the backend in use; fallback_reason: why "auto" did not take ``symm`` (None if
            it did or was not asked).
        out_dtype: the result's dtype. q_scale: with FP8 output, the ``[H]`` fp32 device tensor
            every call reads (pass it to the attention kernel; rewriting it in place between
            calls, with the same values on every rank, changes the scale of later calls).

    ``close()`` (or the end of a ``with`` block) frees the buffers, collectively (a barrier
    first: peers store into them).

    Raises:
        ValueError (every rank): bad arguments, or a named backend that cannot run here.
    """

    op, registry = "DcpQueryGather", GATHER_REGISTRY

    def __init__(self, group=None, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, backend: str = "auto", rope_dim: int = 0,
                 out_dtype: torch.dtype | None = None, timeout_s: float | None = None,
                 ordered_by_caller: bool = False, q_scale=None, device=None,
                 _agreed: bool = False):
        # _agreed: built by dcp.gather_heads, its arguments agreed by the call (``_agree``).
        self._open(group, device, timeout_s)
        err = self._args_error(max_tokens, num_heads, head_dim, dtype, backend, rope_dim,
                               out_dtype, self.world_size) or device_error(self.group, self.device)
        fp8 = out_dtype == FP8_DTYPE
        if err is None and fp8:
            err = _scale_error(q_scale, num_heads)
        scale_crc = zlib.crc32(_scale_f32(q_scale, num_heads).numpy().tobytes()) \
            if fp8 and err is None else -1
        ints = [v if isinstance(v, int) else -1 for v in (max_tokens, num_heads, head_dim,
                                                          rope_dim)]
        self._agree(ints + [DTYPE_CODES.get(dtype, 0), GATHER_REGISTRY.code(backend),
                            int(bool(ordered_by_caller)), int(fp8), scale_crc],
                    ["max_tokens", "num_heads", "head_dim", "rope_dim", "dtype", "backend",
                     "ordered_by_caller", "FP8 output", "q_scale (crc32 of its fp32 bits)"], err,
                    _agreed)
        self.max_tokens, self.num_heads, self.head_dim = max_tokens, num_heads, head_dim
        self.dtype, self.rope_dim = dtype, rope_dim
        self.out_dtype = FP8_DTYPE if fp8 else dtype
        self.q_scale = _scale_f32(q_scale, num_heads).to(self.device) if fp8 else None
        self.ordered_by_caller = bool(ordered_by_caller)
        self._resolve(backend)

    @staticmethod
    def _args_error(max_tokens, num_heads, head_dim, dtype, backend, rope_dim, out_dtype,
                    world_size):
        err = GATHER_REGISTRY.name_error(backend) or geometry_error(
            max_tokens, num_heads, head_dim, dtype, world_size)
        if err:
            return err
        if not isinstance(rope_dim, int) or rope_dim < 0 or rope_dim % 2 or rope_dim > head_dim:
            return f"rope_dim must be 0 or an even int ≤ head_dim={head_dim}, got {rope_dim!r}"
        if out_dtype is not None and out_dtype not in (dtype, FP8_DTYPE):
            return (f"out_dtype must be None, the query dtype {dtype} or torch.float8_e4m3fn, "
                    f"got {out_dtype}")
        return None

    def _kwargs(self):
        return dict(super()._kwargs(), rope_dim=self.rope_dim, out_dtype=self.out_dtype,
                    q_scale=self.q_scale, ordered_by_caller=self.ordered_by_caller)

    def _timing_inputs(self, impl, num_tokens: int, gen):
        q = torch.randn((num_tokens, impl.hs, self.head_dim), generator=gen,
                        device=self.device).to(self.dtype)
        cs = (torch.randn((num_tokens, self.rope_dim), generator=gen, device=self.device)
              if self.rope_dim else None)
        return q, cs, cs

    def __call__(self, q: torch.Tensor, rope=None) -> torch.Tensor:
        self._ensure_open()
        if torch.compiler.is_compiling():
            return self._traced(q, rope)
        self.accept(q, rope)
        if q.shape[0] == 0:
            return self._empty(q)
        return self._impl(q.contiguous(), *self._rope_f32(rope))

    def local_error(self, q, rope) -> str | None:
        """Why this rank cannot gather ``q`` (with ``rope``) with this object (None if it can)."""
        err = gather_args_error(q, self.world_size, rope, "auto")
        if err is None:
            T, h, D = q.shape
            if T > self.max_tokens or h * self.world_size != self.num_heads \
                    or D != self.head_dim or q.dtype != self.dtype or q.device != self.device:
                err = (f"got q {tuple(q.shape)} {q.dtype} on {q.device}; this gather takes "
                       f"T ≤ {self.max_tokens}, H/W={self.num_heads // self.world_size}, "
                       f"D={self.head_dim}, {self.dtype} on {self.device}")
            elif (rope is None) != (self.rope_dim == 0) or (
                    rope is not None and rope[0].shape[-1] != self.rope_dim):
                got = "none" if rope is None else f"R={rope[0].shape[-1]}"
                err = f"rope_dim={self.rope_dim} needs (cos, sin) of [T, {self.rope_dim}]; " \
                      f"got {got}"
        return err

    def accept(self, q, rope) -> None:
        """The local checks of a call, run once per signature (shapes, dtypes, devices of ``q``
        and ``rope``): a signature seen before passed them. Raises ``ValueError``."""
        try:
            key = (q.shape, q.dtype, q.device, rope_key(rope))
        except (AttributeError, TypeError, IndexError, ValueError):  # the checks say why
            key = None
        self._accept(key, q, rope)

    def into(self, q: torch.Tensor, rope, dest: torch.Tensor | None = None) -> torch.Tensor:
        """Gather into ``dest``, a caller-owned ``[T, H, D]`` tensor of ``out_dtype`` on the
        device (contiguous: the backend writes it; any other layout: the call's view is copied
        into it), or (None) into a new contiguous one; the call's arguments already
        ``accept``-ed, ``dest`` checked by the caller. Returns it. Bit for bit the view a call
        returns."""
        if q.shape[0] == 0:
            return self._empty(q) if dest is None else dest
        q, (cos, sin) = q.contiguous(), self._rope_f32(rope)
        if dest is None:
            return self._impl.into_new(q, cos, sin)
        if dest.is_contiguous():
            return self._impl(q, cos, sin, into=dest)
        return dest.copy_(self._impl(q, cos, sin))

    @staticmethod
    def _rope_f32(rope):
        # ``(cos, sin)`` as the backends take them: fp32, contiguous. The caller's own tensors
        # when they already are, tested on their attributes (``to`` and ``contiguous`` would
        # return them too, through four calls into torch); else new tensors.
        if rope is None:
            return None, None
        cos, sin = rope
        if cos.dtype == torch.float32 and sin.dtype == torch.float32 and cos.is_contiguous() \
                and sin.is_contiguous():
            return cos, sin
        return cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()

    def _empty(self, q):
        return torch.empty((0, self.num_heads, self.head_dim), dtype=self.out_dtype,
                           device=q.device)

    def _traced(self, q, rope):
        # torch.compile: one custom op (attncomm/dcp/ops.py) that runs ``into`` on this object,
        # found by name, into a tensor of the graph (never a view of the persistent buffer);
        # its fake implementation runs the local checks.
        dest = q.new_empty((q.shape[0], self.num_heads, self.head_dim), dtype=self.out_dtype)
        cos, sin = (None, None) if rope is None else rope
        torch.ops.attncomm.dcp_query_gather(q, cos, sin, dest, self.op_name)
        return dest
