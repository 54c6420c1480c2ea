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
import torch.distributed as dist

from ... import capability, config, select
from ..._dist import (DTYPE_CODES, Lifecycle, agree, as_device, device_error, group_device,
                      resolve_group)
from .. import tracing
from . import collective, symm_a2a  # noqa: F401 - each registers its backend class
from .backend import BACKENDS, backend_class
from .combine import combine

__all__ = ["merge_states", "DcpMerger", "shard_kv_interleaved", "available_backends",
           "BACKENDS", "check_local", "lse_to_e", "empty_result", "LN2"]

log = logging.getLogger("attncomm.dcp")

_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LN2 = math.log(2.0)
#: Signatures a ``DcpMerger`` remembers as checked (it forgets them all past this many).
_ACCEPTED_SIZE = 4096
#: What ``auto`` takes when nothing is measured (CPU groups): one collective (a2a) before two
#: (ag_rs); ``reference`` is never chosen automatically.
RULE_OF_THUMB = ("symm_a2a", "a2a", "ag_rs", "reference")
AUTO_CANDIDATES = ("symm_a2a", "ag_rs", "a2a")


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


def check_local(out, lse, world_size: int, lse_base: str, backend: str) -> str | None:
    """This rank's argument errors, or None (no communication)."""
    if backend not in BACKENDS:
        return f"backend={backend!r} is not one of {list(BACKENDS)}"
    if lse_base not in ("e", "2"):
        return f"lse_base must be 'e' or '2', got {lse_base!r}"
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


class DcpMerger(Lifecycle):
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
    internal buffers until the next call. Under ``torch.compile`` a call is the custom op
    ``attncomm::dcp_merger`` (``dcp/ops.py``), which finds this merger by ``op_name`` and
    returns new tensors of the graph.

    Attributes:
        backend: the backend used for ``max_tokens``; ``backend_for(T)`` for a token count.
        fallback_reason: why "auto" did not take ``symm_a2a`` (None if it did or was not asked).

    Raises:
        ValueError (every rank): bad arguments, or a named backend that cannot run here.
    """

    def __init__(self, group=None, *, max_tokens: int, num_heads: int, head_dim: int,
                 dtype: torch.dtype, backend: str = "auto", lse_base: str = "e",
                 timeout_s: float | None = None, device=None, _agreed: bool = False):
        # _agreed: built by dcp.merge, whose argument check (``_dist.validate_args``) agreed
        # the call's arguments these derive from, device included: not agreed a second time.
        self.group = group = resolve_group(group, "DcpMerger")
        self.device = group_device(group) if device is None else as_device(device)
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = config.timeout_s(timeout_s)
        err = self._check_args(max_tokens, num_heads, head_dim, dtype, backend, lse_base,
                               self.world_size) or device_error(group, self.device)
        sig = [int(max_tokens) if isinstance(max_tokens, int) else -1,
               int(num_heads) if isinstance(num_heads, int) else -1,
               int(head_dim) if isinstance(head_dim, int) else -1,
               DTYPE_CODES.get(dtype, 0), BACKENDS.index(backend) if backend in BACKENDS else -1,
               1 if lse_base == "2" else 0, int(self.device.type == "cuda")]
        if not _agreed:
            agree(group, "DcpMerger", sig, ["max_tokens", "num_heads", "head_dim", "dtype",
                                            "backend", "lse_base", "device is CUDA"], err,
                  self.timeout_s)
        elif err:
            raise ValueError(f"DcpMerger: invalid arguments — rank {self.rank}: {err}")
        self.max_tokens, self.num_heads, self.head_dim = max_tokens, num_heads, head_dim
        self.dtype, self.lse_base = dtype, lse_base
        self.requested_backend = backend
        unmeasured = capability.unmeasured_reason(group, self.device)  # collective on CUDA
        self.decision, self._impl = select.resolve(
            group, op="DcpMerger", requested=backend, names=BACKENDS[:-1],
            preferred="symm_a2a", rule_of_thumb=RULE_OF_THUMB, auto_names=AUTO_CANDIDATES,
            local_reason=self._local_reason,
            build=lambda name: backend_class(name)(group, **self._kwargs()),
            measured=unmeasured is None, rule=unmeasured,
            cases=select.token_buckets(max_tokens),
            prepare=self._timing_case, env_var="ATTNCOMM_DCP_BACKEND")
        self.fallback_reason: str | None = self.decision.fallback_reason
        self.backend = self._impl.name
        self.returns_views = self._impl.returns_views
        self.hs = num_heads // self.world_size
        self._accepted: set = set()
        #: The name a compiled graph's custom op finds this merger by (``dcp.tracing``).
        self.op_name = tracing.register(self)

    @staticmethod
    def _check_args(max_tokens, num_heads, head_dim, dtype, backend, lse_base, world_size):
        if backend not in BACKENDS:
            return f"backend={backend!r} is not one of {list(BACKENDS)}"
        if lse_base not in ("e", "2"):
            return f"lse_base must be 'e' or '2', got {lse_base!r}"
        for label, v in (("max_tokens", max_tokens), ("num_heads", num_heads),
                         ("head_dim", head_dim)):
            if not isinstance(v, int) or v < 1:
                return f"{label} must be an int ≥ 1, got {v!r}"
        if dtype not in _OUT_DTYPES:
            return f"dtype must be fp16/bf16/fp32, got {dtype}"
        if num_heads % world_size:
            return f"num_heads={num_heads} is not divisible by world size W={world_size}"
        return None

    def _kwargs(self):
        return dict(max_tokens=self.max_tokens, num_heads=self.num_heads,
                    head_dim=self.head_dim, dtype=self.dtype, device=self.device,
                    timeout_s=self.timeout_s)

    def _local_reason(self, name: str) -> str | None:
        # Collective (symm_a2a learns where its peers are): every rank calls it for every name.
        try:
            cls = backend_class(name)
        except ImportError as exc:
            return f"{name} is not available: {exc}"
        return cls.collective_unavailable_reason(self.group, self.device)

    def _timing_case(self, impl, num_tokens: int):
        gen = torch.Generator(device=self.device).manual_seed(self.rank)
        out = torch.randn((num_tokens, self.num_heads, self.head_dim), generator=gen,
                          device=self.device).to(self.dtype)
        lse = torch.randn((num_tokens, self.num_heads), generator=gen, device=self.device)
        return lambda: impl(out, lse)

    def backend_for(self, num_tokens: int) -> str:
        """The backend a call with ``num_tokens`` tokens uses."""
        return self._impl.backend_for(num_tokens)

    def _release(self) -> None:
        self._impl.close()

    def check(self) -> None:
        """Raise ``PeerTimeoutError`` for any timeout the device recorded since the last check."""
        self._impl.check()

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
        err = check_local(out, lse, self.world_size, self.lse_base, "auto")
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
        if key is not None and key in self._accepted:
            return
        err = self.local_error(out, lse)
        if err:
            raise ValueError(f"DcpMerger: {err}")
        if len(self._accepted) >= _ACCEPTED_SIZE:
            self._accepted.clear()
        self._accepted.add(key)

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
