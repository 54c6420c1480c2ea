"""``dcp.merge``: the functional DCP merge, and its hot path.

The first call with a new signature (per group) does everything: resolves the group, checks the
arguments locally and across ranks (``_agree.validate_args``), finds or builds the preallocated
``DcpMerger`` of its token bucket, and keeps a **plan** under a key of the call's arguments
(shapes, dtypes, devices, options, and the text of the ``ATTNCOMM_VALIDATE`` /
``ATTNCOMM_TIMEOUT_S`` variables it read). A later call with the same key only runs the plan:
the checks it would repeat passed for exactly these arguments, so a steady-state call makes the
exchange's own collectives and nothing else (``validate=True`` / ``ATTNCOMM_VALIDATE=1`` keep no
plan: every call checks). The result is written where the caller says (``output=``) or into a
new tensor, never cloned from an internal buffer.

Under ``torch.compile`` the call is one custom op (``attncomm::dcp_merge``, ``dcp/ops.py``) that
runs this same eager code; the decisions it needs (the group's merger for the shape) come from
an eager call made before tracing (checked while tracing: ``require_warm``), never from the
trace.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import config
from ..._dist import device_error, group_from_name, group_name, resolve_group
from ..._agree import DTYPE_CODES, validate_args
from ..._plans import (Cached, CallPlans, dest_error, dest_key, timeout_code, validate_code,
                       warm_up_error)
from ...errors import PeerTimeoutError
from .. import tracing
from ..exchange import ObjectCache
from .api import DcpMerger, merge_args_error, empty_result
from .backend import BACKENDS

__all__ = ["merge", "require_warm"]

_CACHE_SIZE = 8
#: Plans kept per group (least recently used dropped first; they own no buffers).
_PLANS_SIZE = 1024


def merge(out: torch.Tensor, lse: torch.Tensor, group=None, *, backend: str = "auto",
          lse_base: str = "e", return_lse: bool = False, validate: bool | None = None,
          timeout_s: float | None = None, output=None):
    """Merge this rank's partial attention with every other rank's; keep this rank's head slice.

    Arguments:
        out: ``[T, H, D]`` fp16/bf16/fp32, this rank's partial attention over its KV shard.
        lse: ``[T, H]`` fp32 (fp16/bf16 accepted), its log-sum-exp in base ``lse_base``; −inf,
            +inf or NaN for an empty shard (its ``out`` rows are then never read).
        group: process group of W ranks (None: the default group), or an engine's group
            coordinator (``device_group`` + ``cpu_group``).
        backend: "reference", "ag_rs", "a2a", "symm_a2a" or "auto" (env
            ``ATTNCOMM_DCP_BACKEND`` names a preferred backend for "auto", taken when it can run
            here; read when the call's merger is built).
        lse_base: "e" or "2".
        return_lse: also return the merged LSE.
        validate: check that all ranks passed the same shapes/arguments (one small all_gather
            on a gloo group): None → env ``ATTNCOMM_VALIDATE`` (unset: on the first call with
            a new signature per group; "1": every call; "0": never), True every call, False
            never (``attncomm._agree.validate_args``).
        timeout_s: wait budget (None → ``ATTNCOMM_TIMEOUT_S``, 60 s).
        output: the caller-owned destination: a ``[T, H/W, D]`` tensor of ``out``'s dtype and
            device (written and returned; contiguous ones are written in place by the
            exchange, others through one copy), or, with ``return_lse``, a pair of it and a
            ``[T, H/W]`` fp32 tensor for the LSE (or ``(tensor, None)``). None: new tensors.

    Returns:
        ``[T, H/W, D]`` in ``out.dtype``: heads ``[r·H/W, (r+1)·H/W)`` merged over all ranks (and
        ``[T, H/W]`` fp32 LSE in ``lse_base``); ``output`` when given. Never a view of an
        internal buffer. Inputs are never modified. ``T == 0`` works.

    Raises:
        ValueError: bad arguments (``H % W != 0``, shapes, dtypes, unknown backend, a named
            backend that cannot run here, a wrong ``output``), on every rank alike when
            validation is on. Under torch.compile: a shape no eager call made on this group.
        PeerTimeoutError: a peer did not answer within ``timeout_s``.
    """
    if torch.compiler.is_compiling():
        return _traced_merge(out, lse, group, backend, lse_base, return_lse, validate,
                             timeout_s, output)
    env_t = config.raw("ATTNCOMM_TIMEOUT_S") if timeout_s is None else ""
    env_v = config.raw("ATTNCOMM_VALIDATE") if validate is None else ""
    try:
        key = (out.shape, out.dtype, lse.shape, lse.dtype, out.device, lse.device, backend,
               lse_base, bool(return_lse), validate, timeout_s, env_t, env_v,
               dest_key(output))
    except (AttributeError, TypeError):  # not tensors: the checks say so
        key = None
    plan = _PLANS.get(group, key)
    if plan is None:
        plan = _new_plan(out, lse, group, backend, lse_base, return_lse, validate, timeout_s,
                         output, key)
    return plan(out, lse, return_lse, output)


# ---------------------------------------------------------------------------------- plans
_PLANS = CallPlans(_PLANS_SIZE)


class _MergeCall:
    """What a checked call signature needs on later calls: its merger (a token bucket's
    ``DcpMerger``, through ``Cached``) and the result's geometry."""

    __slots__ = ("T", "hs", "D", "dtype", "device", "merger")

    def __init__(self, out, hs, merger: Cached | None = None):
        self.hs, self.merger = hs, merger
        self.T, _, self.D = out.shape
        self.dtype, self.device = out.dtype, out.device

    def __call__(self, out, lse, return_lse, output):
        # ``output`` was checked when the plan was made (its shape, dtype, device and layout
        # are part of the plan's key).
        o = l = None
        if output is not None:
            o, l = output if isinstance(output, (tuple, list)) else (output, None)
        if l is None and return_lse:
            l = torch.empty((self.T, self.hs), dtype=torch.float32, device=self.device)
        if self.T == 0:
            o = empty_result(out, self.hs, False) if o is None else o
            return (o, l) if return_lse else o
        merger = self.merger.get()
        dest = o if o is not None and o.is_contiguous() else torch.empty(
            (self.T, self.hs, self.D), dtype=self.dtype, device=self.device)
        res, res_lse = merger.into(out, lse, dest, l)
        if o is not None and dest is not o:
            res = o.copy_(res)
        return (res, res_lse) if return_lse else res

def _dest_error(output, shape, dtype, device) -> str | None:
    """What is wrong with ``output`` for a result ``shape`` of ``dtype`` on ``device`` (None:
    nothing)."""
    if output is None:
        return None
    pair = isinstance(output, (tuple, list))
    if pair and len(output) != 2:
        return f"output must be a tensor or an (out, lse) pair, got {len(output)} items"
    o, l = output if pair else (output, None)
    return dest_error(o, shape, dtype, device, "output") or (
        None if l is None else dest_error(l, shape[:2], torch.float32, device,
                                                  "output LSE", contiguous=True))


def _new_plan(out, lse, group, backend, lse_base, return_lse, validate, timeout_s, output,
              key):
    """The first call of a signature: checks (local, ``output`` included, then across ranks
    by the validation mode), the merger, and the plan, kept unless every call is checked."""
    g = resolve_group(group, "dcp.merge", one_process="attncomm.dcp.merge_states")
    W = dist.get_world_size(g)
    budget = config.timeout_s(timeout_s)
    local_error = merge_args_error(out, lse, W, lse_base, backend)
    if local_error is None:
        T, H, D = out.shape
        local_error = (_dest_error(output, (T, H // W, D), out.dtype, out.device)
                       or device_error(g, out.device))
    sig, labels = _signature(out, lse, backend, lse_base, return_lse)
    agreed = validate_args(g, "dcp.merge", sig, labels, local_error, budget, validate)
    T, H, D = out.shape
    plan = _MergeCall(out, H // W, None if T == 0 else _cached_merger(
        g, T, H, D, out.dtype, backend, lse_base, budget, out.device, agreed))
    if key is not None and config.validation_mode(validate) != "every":
        _PLANS.put(group, g, key, plan)
    return plan


def _signature(out, lse, backend, lse_base, return_lse):
    ok = isinstance(out, torch.Tensor) and out.dim() == 3
    shape = list(out.shape) if ok else [-1, -1, -1]
    sig = shape + [DTYPE_CODES.get(getattr(out, "dtype", None), 0),
                   DTYPE_CODES.get(getattr(lse, "dtype", None), 0),
                   BACKENDS.index(backend) if backend in BACKENDS else -1,
                   1 if lse_base == "2" else 0, int(bool(return_lse)),
                   int(bool(getattr(out, "is_cuda", False)))]
    labels = ["T (tokens)", "H (heads)", "D (head_dim)", "out dtype", "lse dtype", "backend",
              "lse_base", "return_lse", "device is CUDA"]
    return sig, labels


# ------------------------------------------------------------------------------ mergers
_OBJECTS = ObjectCache(_CACHE_SIZE)
_MERGERS = _OBJECTS.store  # per group: an LRU of mergers


def _cached_merger(group, T, H, D, dtype, backend, lse_base, budget, device,
                   agreed: bool = False) -> Cached:
    """The merger of this shape and token bucket (built by the first call) on the call's
    device, as a plan holds it; ``agreed`` as ``ObjectCache.cached``."""

    def build(max_tokens: int, skip: bool) -> DcpMerger:
        try:
            return DcpMerger(group, max_tokens=max_tokens, num_heads=H, head_dim=D, dtype=dtype,
                             backend=backend, lse_base=lse_base, timeout_s=budget,
                             device=device, _agreed=skip)
        except (PeerTimeoutError, ValueError) as exc:
            raise _as_merge_error(exc) from exc

    return _OBJECTS.cached(group, T, (H, D, dtype, backend, lse_base, budget, device), build,
                           lambda: warm_up_error(
                               "dcp.merge", f"the token bucket of T={T} (H={H}, D={D}, "
                                            f"{dtype}, backend={backend!r})"), agreed)


def _as_merge_error(exc):
    # The caller called dcp.merge: its errors name dcp.merge, not the merger it builds inside.
    msg = str(exc)
    msg = ("dcp.merge" + msg[len("DcpMerger"):] if msg.startswith("DcpMerger")
           else f"dcp.merge: {msg}")
    if isinstance(exc, PeerTimeoutError):
        return PeerTimeoutError(msg, peer_ranks=exc.peer_ranks, timeout_s=exc.timeout_s,
                                op="dcp.merge")
    return ValueError(msg)


# ------------------------------------------------------------------------------ traced path
@torch.compiler.assume_constant_result
def _traced_group(group) -> tuple:
    """``(group name, W)``: run by torch.compile while it traces, a constant of the graph."""
    g = resolve_group(group, "dcp.merge", one_process="attncomm.dcp.merge_states")
    return group_name(g), dist.get_world_size(g)


def require_warm(group_name_: str, out, backend: str, lse_base: str, timeout_s) -> None:
    """While tracing (the op's fake implementation): raise the warm-up error unless an eager
    call built the merger of this call's shape on the group (a symbolic dim matches any; the
    compiled call finds its token bucket's merger when it runs, as an eager call would).
    Nothing is decided, and nothing falls back, while tracing."""
    T, H, D = (d if isinstance(d, int) else tracing.ANY for d in out.shape)
    if _OBJECTS.warm(group_from_name(group_name_), T, (H, D, out.dtype, backend, lse_base,
                                                       config.timeout_s(timeout_s), out.device)):
        return
    shape = ", ".join("?" if d is tracing.ANY else str(d) for d in (T, H, D))
    raise warm_up_error("dcp.merge", f"out [{shape}] {out.dtype} with "
                                             f"backend={backend!r}")


def _traced_merge(out, lse, group, backend, lse_base, return_lse, validate, timeout_s, output):
    """The traced call: the destinations allocated in the graph, one ``attncomm::dcp_merge``
    that runs the eager call into them (its fake implementation runs ``require_warm``)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = group.device_group  # an engine's group coordinator
    name, W = _traced_group(group)
    T, H, D = out.shape
    o = l = None
    if output is not None:
        o, l = tuple(output) if isinstance(output, (tuple, list)) else (output, None)
    o = out.new_empty((T, H // W, D)) if o is None else o
    l = out.new_empty((T, H // W), dtype=torch.float32) if l is None else l
    torch.ops.attncomm.dcp_merge(out, lse, o, l, name, backend, lse_base,
                                 timeout_code(timeout_s),
                                 validate_code(validate))
    return (o, l) if return_lse else o
