"""The DCP merge's objects: ``merge_states`` (one process), ``DcpMerger``, ``shard_kv_interleaved``,
and the local checks ``dcp.merge`` (``functional``) shares with them.

Decode context parallelism (DCP) shards the KV cache along the sequence (position p on rank
p % W, as in SGLang's and vLLM's DCP); every rank attends all heads of the query over its shard,
and the partial outputs are merged by their log-sum-exp, each rank keeping its head slice for the
head-sharded o_proj.
"""
from __future__ import annotations

import logging
import math

import torch

from ..._dist import device_error
from ..._agree import DTYPE_CODES
from ..exchange import DTYPES, PreallocatedExchange, geometry_error
from . import collective, symm_a2a  # noqa: F401 - each registers its backend class
from .backend import BACKENDS, MERGE_REGISTRY
from .combine import combine

__all__ = ["merge_states", "DcpMerger", "shard_kv_interleaved", "available_backends",
           "BACKENDS", "merge_args_error", "lse_to_e", "empty_result", "LN2"]

log = logging.getLogger("attncomm.dcp")

_OUT_DTYPES = DTYPES
LN2 = math.log(2.0)


def available_backends(device: str | torch.device) -> list[str]:
    """Backend names that apply to ``device`` ("cpu": reference, ag_rs, a2a; "cuda": + symm_a2a).

    Whether symm_a2a can actually run on a given group is decided at ``DcpMerger`` construction.
    """
    names = ["reference", "ag_rs", "a2a"]
    if torch.device(device).type == "cuda":
        names.append("symm_a2a")
    return names


def shard_kv_interleaved(seq_len: int, world_size: int, rank: int) -> torch.Tensor:
    """The token positions this rank holds when position p lives on rank p % W.

    Returns a ``[ceil((seq_len − rank) / W)]`` int64 tensor (empty when ``rank ≥ seq_len``).
    Raises ``ValueError`` for ``seq_len < 0``, ``world_size < 1`` or ``rank ∉ [0, W)``.
    """
    if seq_len < 0 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"shard_kv_interleaved: need seq_len ≥ 0, world_size ≥ 1, "
                         f"0 ≤ rank < world_size; got seq_len={seq_len}, "
                         f"world_size={world_size}, rank={rank}")
    return torch.arange(rank, max(rank, seq_len), world_size, dtype=torch.int64)


def lse_to_e(lse: torch.Tensor, lse_base: str) -> torch.Tensor:
    """``lse`` as contiguous fp32 in base e (``lse`` itself when it already is; else a new
    tensor: the input is never modified)."""
    if lse_base == "e" and lse.dtype == torch.float32 and lse.is_contiguous():
        return lse  # the common case, with no aten call
    lse = lse.float()
    if lse_base == "2":
        lse = lse * LN2
    return lse.contiguous()


def _lse_from_e(lse: torch.Tensor, lse_base: str) -> torch.Tensor:
    return lse / LN2 if lse_base == "2" else lse


def merge_states(outs: torch.Tensor, lses: torch.Tensor, *, lse_base: str = "e",
                 return_lse: bool = False):
    """Merge ``N`` partial attention results of the same queries over disjoint key sets.

    The sources are the first axis. FlashInfer's function of the same name,
    ``flashinfer.merge_states(v, s)`` (``flashinfer/cascade.py``), takes them on the second:
    ``v [T, N, H, D]``, ``s [T, N, H]`` fp32, and always returns ``(v, s)``; to call this one
    with such tensors, pass ``v.transpose(0, 1), s.transpose(0, 1)`` (any strides work).

    Arguments:
        outs: ``[N, T, H, D]`` fp16/bf16/fp32 partial outputs.
        lses: ``[N, T, H]`` their log-sum-exps (any float dtype), base ``lse_base``.
        lse_base: ``"e"`` or ``"2"``.
        return_lse: also return the merged LSE.

    Returns:
        ``[T, H, D]`` in ``outs.dtype`` (and ``[T, H]`` fp32 LSE in ``lse_base``). Rows whose LSE
        is not finite (−inf, +inf or NaN) contribute nothing, whatever their output holds; a row
        empty on every source (or ``N == 0``) gives exactly 0 and LSE −inf; NaN/±inf in a
        contributing row's output propagates (docs/API.md, "Special values"). fp32
        accumulation, one rounding.

    Raises:
        ValueError: shapes that do not match, an unsupported dtype or base.
    """
    err = None
    if lse_base not in ("e", "2"):
        err = f"lse_base must be 'e' or '2', got {lse_base!r}"
    elif outs.dim() != 4 or lses.dim() != 3 or tuple(lses.shape) != tuple(outs.shape[:3]):
        err = (f"expected outs [N, T, H, D] and lses [N, T, H]; got outs {tuple(outs.shape)}, "
               f"lses {tuple(lses.shape)}")
    elif outs.dtype not in _OUT_DTYPES:
        err = f"outs dtype must be fp16/bf16/fp32, got {outs.dtype}"
    elif not lses.is_floating_point():
        err = f"lses must be floating point, got {lses.dtype}"
    if err:
        raise ValueError(f"merge_states: {err}")
    out, lse = combine(outs, lse_to_e(lses, lse_base), outs.dtype)
    return (out, _lse_from_e(lse, lse_base)) if return_lse else out


def _options_error(backend, lse_base) -> str | None:
    err = MERGE_REGISTRY.name_error(backend)
    if err is None and lse_base not in ("e", "2"):
        err = f"lse_base must be 'e' or '2', got {lse_base!r}"
    return err


def merge_args_error(out, lse, world_size: int, lse_base: str, backend: str) -> str | None:
    """This rank's argument errors, or None (no communication)."""
    err = _options_error(backend, lse_base)
    if err:
        return err
    if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
        return "out and lse must be tensors"
    if out.dim() != 3:
        return f"out must be [T, H, D], got shape {tuple(out.shape)}"
    if lse.dim() != 2 or tuple(lse.shape) != tuple(out.shape[:2]):
        return f"lse must be [T, H] = {tuple(out.shape[:2])}, got shape {tuple(lse.shape)}"
    if out.dtype not in _OUT_DTYPES:
        return f"out dtype must be fp16/bf16/fp32, got {out.dtype}"
    if lse.dtype not in _OUT_DTYPES:
        return f"lse dtype must be fp32 (fp16/bf16 accepted), got {lse.dtype}"
    if out.device != lse.device:
        return f"out is on {out.device} but lse on {lse.device}"
    H = out.shape[1]
    if H == 0 or out.shape[2] == 0:
        return f"num_heads and head_dim must be ≥ 1, got H={H}, D={out.shape[2]}"
    if H % world_size != 0:
        return f"num_heads H={H} is not divisible by world size W={world_size}"
    return None


class DcpMerger(PreallocatedExchange):
    """A preallocated, CUDA-graph-capturable DCP merge for up to ``max_tokens`` tokens.

    Arguments:
        group: process group of W ranks (None: default group) or an engine's group coordinator
            (``device_group`` + ``cpu_group``). Construction is collective; so is ``close()``
            (or the end of a ``with`` block), which frees the buffers after a barrier.
        max_tokens: largest T a call may pass (≥ 1).
        num_heads: H, divisible by W. head_dim: D. dtype: fp16/bf16/fp32 of ``out``.
        backend: "reference", "ag_rs", "a2a", "symm_a2a" or "auto" (decided here, eagerly, before
            any capture; env ``ATTNCOMM_DCP_BACKEND`` names a preferred backend for "auto", taken
            when it can run here, else auto chooses and logs why).
        lse_base: "e" or "2". timeout_s: wait budget (None → ``ATTNCOMM_TIMEOUT_S``).
        device: where the buffers live and the calls' tensors must be (None: the group's
            device, ``attncomm._dist.group_device``: CUDA for NCCL; for gloo CPU unless
            ``attncomm.set_group_device`` says otherwise, as on ranks that share a GPU).

    ``merger(out [T, H, D], lse [T, H], return_lse=False)`` → ``[T, H/W, D]`` (+ ``[T, H/W]`` fp32
    LSE). Per-call checks are local only (no collective; once per signature of shapes, dtypes
    and devices), so calls can be captured. Outputs of a backend with ``returns_views`` alias
    internal buffers until the next call (the same view objects on every call of a token
    count: change their values, never their shape or strides in place, and copy them before an
    in-place op that autograd records). Under
    ``torch.compile`` a call is the custom op ``attncomm::dcp_merger`` (``dcp/ops.py``), which
    finds this merger by ``op_name`` and returns new tensors of the graph.

    Attributes:
        backend: the backend used for ``max_tokens``; ``backend_for(T)`` for a token count.
        fallback_reason: why "auto" did not take ``symm_a2a`` (None if it did or was not asked).

    Raises:
        ValueError (every rank): bad arguments, or a named backend that cannot run here.
    """

    op, registry = "DcpMerger", MERGE_REGISTRY

    def __init__(self, group=None, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, backend: str = "auto", lse_base: str = "e",
                 timeout_s: float | None = None, device=None, _agreed: bool = False):
        # _agreed: built by dcp.merge, its arguments agreed by the call (``_agree``).
        self._open(group, device, timeout_s)
        err = self._args_error(max_tokens, num_heads, head_dim, dtype, backend, lse_base,
                               self.world_size) or device_error(self.group, self.device)
        sig = [v if isinstance(v, int) else -1 for v in (max_tokens, num_heads, head_dim)]
        self._agree(sig + [DTYPE_CODES.get(dtype, 0), MERGE_REGISTRY.code(backend),
                           1 if lse_base == "2" else 0],
                    ["max_tokens", "num_heads", "head_dim", "dtype", "backend", "lse_base"],
                    err, _agreed)
        self.max_tokens, self.num_heads, self.head_dim = max_tokens, num_heads, head_dim
        self.dtype, self.lse_base = dtype, lse_base
        self._resolve(backend)
        self.returns_views = self._impl.returns_views
        self.hs = num_heads // self.world_size

    @staticmethod
    def _args_error(max_tokens, num_heads, head_dim, dtype, backend, lse_base, world_size):
        return _options_error(backend, lse_base) or geometry_error(
            max_tokens, num_heads, head_dim, dtype, world_size)

    def _timing_inputs(self, impl, num_tokens: int, gen):
        out = torch.randn((num_tokens, self.num_heads, self.head_dim), generator=gen,
                          device=self.device).to(self.dtype)
        return out, torch.randn((num_tokens, self.num_heads), generator=gen, device=self.device)

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call with ``num_tokens`` tokens uses."""
        return self._impl.backend_for(num_tokens)

    def __call__(self, out: torch.Tensor, lse: torch.Tensor, return_lse: bool = False):
        self._ensure_open()
        if torch.compiler.is_compiling():
            return self._traced(out, lse, return_lse)
        self.accept(out, lse)
        if out.shape[0] == 0:
            return empty_result(out, self.hs, return_lse)
        o, l = self._impl(out.contiguous(), lse_to_e(lse, self.lse_base))
        return (o, _lse_from_e(l, self.lse_base)) if return_lse else o

    def local_error(self, out, lse) -> str | None:
        """Why this rank cannot merge ``out``/``lse`` with this merger (None if it can)."""
        err = merge_args_error(out, lse, self.world_size, self.lse_base, "auto")
        if err is None:
            T, H, D = out.shape
            if T > self.max_tokens or H != self.num_heads or D != self.head_dim \
                    or out.dtype != self.dtype or out.device != self.device:
                err = (f"got out {tuple(out.shape)} {out.dtype} on {out.device}; this merger "
                       f"takes T ≤ {self.max_tokens}, H={self.num_heads}, D={self.head_dim}, "
                       f"{self.dtype} on {self.device}")
        return err

    def accept(self, out, lse) -> None:
        """The local checks of a call, run once per signature (shapes, dtypes, devices): a
        signature seen before passed them. Raises ``ValueError`` naming the merger."""
        try:
            key = (out.shape, out.dtype, lse.shape, lse.dtype, out.device, lse.device)
        except AttributeError:  # not tensors: the checks say so
            key = None
        self._accept(key, out, lse)

    def into(self, out: torch.Tensor, lse: torch.Tensor, res: torch.Tensor,
             res_lse: torch.Tensor | None = None):
        """Merge into caller-owned destinations (the call's arguments already ``accept``-ed):
        ``res`` contiguous ``[T, H/W, D]`` in ``dtype``, ``res_lse`` contiguous ``[T, H/W]`` fp32
        in base ``lse_base``, or None when the LSE is not wanted (it goes to a scratch or
        internal buffer). Returns ``(res, res_lse)``."""
        if out.shape[0] == 0:
            return res, res_lse
        lse_e = lse_to_e(lse, self.lse_base)
        if self.lse_base == "e" or res_lse is None:
            self._impl(out.contiguous(), lse_e, res, res_lse)
            return res, res_lse
        _, l = self._impl(out.contiguous(), lse_e, res, None)
        return res, torch.div(l, LN2, out=res_lse)

    def _traced(self, out, lse, return_lse):
        # torch.compile: one custom op (attncomm/dcp/ops.py) that runs ``into`` on this merger,
        # found by name; its fake implementation runs the local checks.
        T = out.shape[0]
        res = out.new_empty((T, self.hs, self.head_dim))
        res_lse = out.new_empty((T, self.hs), dtype=torch.float32)
        torch.ops.attncomm.dcp_merger(out, lse, res, res_lse, self.op_name)
        return (res, res_lse) if return_lse else res


def empty_result(out: torch.Tensor, hs: int, return_lse: bool):
    """The result of a merge of ``T == 0`` tokens: ``[0, H/W, D]`` (and ``[0, H/W]`` fp32)."""
    o = torch.empty((0, hs, out.shape[2]), dtype=out.dtype, device=out.device)
    lse = torch.empty((0, hs), dtype=torch.float32, device=out.device)
    return (o, lse) if return_lse else o
