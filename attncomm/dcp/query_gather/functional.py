"""``dcp.gather_heads``: the functional DCP query gather, and its hot path.

As ``dcp.merge`` (``lse_merge/functional.py``): the first call with a new signature (per group)
resolves the group, checks the arguments locally and across ranks, finds or builds the
preallocated ``DcpQueryGather`` of its token bucket and keeps a plan under a key of the call's
arguments; a later call with the same key only runs the plan (the exchange's own collectives,
nothing else). The result goes into the caller's ``output=`` or a new tensor, with one copy at
most out of an internal buffer (``symm``'s kernel stores into its own buffer: a new result is a
clone of it, a given ``output=`` a copy; a non-contiguous ``output=`` of either backend gets a
copy of the call's view, no temporary). Under ``torch.compile`` the call is one custom op
(``attncomm::dcp_gather_heads``) that runs this eager code, with the gatherer an eager call
built before tracing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import config
from ..._dist import device_error, group_from_name, group_name, resolve_group
from ..._agree import DTYPE_CODES, validate_args
from ..._plans import (Cached, CallPlans, dest_error, dest_key, timeout_code, validate_code,
                       warm_up_error)
from .. import tracing
from ..exchange import ObjectCache
from .api import DcpQueryGather, gather_args_error, rope_key
from .backend import GATHER_BACKENDS

__all__ = ["gather_heads", "require_warm"]

_CACHE_SIZE = 8
#: Plans kept per group (least recently used dropped first; they own no buffers).
_PLANS_SIZE = 1024


def gather_heads(q: torch.Tensor, group=None, *, backend: str = "auto", rope=None,
                 validate: bool | None = None, timeout_s: float | None = None,
                 output: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather this rank's query heads with every other rank's (DCP's query gather).

    Arguments:
        q: ``[T, H/W, D]`` fp16/bf16/fp32, this rank's heads ``[r·H/W, (r+1)·H/W)``.
        group: process group of W ranks (None: the default group), or an engine's group
            coordinator (``device_group`` + ``cpu_group``).
        backend: "all_gather", "symm" or "auto" (env ``ATTNCOMM_DCP_GATHER_BACKEND`` names a
            preferred backend for "auto", taken when it can run here; read when the call's
            gatherer is built).
        rope: ``(cos, sin)``, each ``[T, R]``, R even, R ≤ D: rotate the last R dims of every
            head first (``rotate_tail``: rotate-half, fp32, one rounding), as MLA rotates only
            ``q_pe``. None: no rotation.
        validate: check that every rank passed the same T, H/W, D, dtype and rope dim (one
            small all_gather on a gloo group): None → env ``ATTNCOMM_VALIDATE`` (unset: on the
            first call with a new signature per group; "1": every call; "0": never), True every
            call, False never.
        timeout_s: wait budget (None → ``ATTNCOMM_TIMEOUT_S``, 60 s).
        output: the caller-owned destination, a ``[T, H, D]`` tensor of ``q``'s dtype and
            device (written and returned; contiguous ones are written by the exchange itself,
            others through one copy). None: a new tensor.

    Returns:
        ``[T, H, D]`` in ``q.dtype`` (``output``, or a new tensor): every rank's slice in rank
        order, bit for bit what the ranks passed (rotated when ``rope`` is given: equal to
        ``rotate_tail`` then the gather). ``q`` is never modified. ``T == 0`` works.

    Raises:
        ValueError: bad arguments (a wrong ``output`` included), or ranks that disagree on
            them (on every rank alike when validation is on); a named backend that cannot run
            here. Under torch.compile: a shape no eager call made on this group.
        PeerTimeoutError: a peer did not answer within ``timeout_s``.
    """
    if torch.compiler.is_compiling():
        return _traced_gather(q, group, backend, rope, validate, timeout_s, output)
    env_t = config.raw("ATTNCOMM_TIMEOUT_S") if timeout_s is None else ""
    env_v = config.raw("ATTNCOMM_VALIDATE") if validate is None else ""
    try:
        key = (q.shape, q.dtype, q.device, rope_key(rope), backend, validate, timeout_s, env_t,
               env_v, dest_key(output))
    except (AttributeError, TypeError, IndexError, ValueError):  # the checks say why
        key = None
    plan = _PLANS.get(group, key)
    if plan is None:
        plan = _new_plan(q, group, backend, rope, validate, timeout_s, output, key)
    return plan(q, rope, output)


# ---------------------------------------------------------------------------------- plans
_PLANS = CallPlans(_PLANS_SIZE)


class _GatherCall:
    """A checked call signature: its gatherer (through ``Cached``) and the result's
    geometry."""

    __slots__ = ("shape", "dtype", "device", "gatherer")

    def __init__(self, shape, dtype, device, gatherer: Cached | None = None):
        self.shape, self.dtype, self.device, self.gatherer = shape, dtype, device, gatherer

    def __call__(self, q, rope, output):
        # ``output`` was checked when the plan was made (its kind is part of the plan's key).
        if self.shape[0] == 0:
            return output if output is not None else torch.empty(
                self.shape, dtype=self.dtype, device=self.device)
        return self.gatherer.get().into(q, rope, output)

def _new_plan(q, group, backend, rope, validate, timeout_s, output, key):
    """The first call of a signature: checks (local, ``output`` included, then across ranks
    by the validation mode), the gatherer, and the plan, kept unless every call is checked."""
    g = resolve_group(group, "dcp.gather_heads")
    W = dist.get_world_size(g)
    budget = config.timeout_s(timeout_s)
    local_error = gather_args_error(q, W, rope, backend)
    if local_error is None:
        T, h, D = q.shape
        local_error = ((None if output is None else
                        dest_error(output, (T, h * W, D), q.dtype, q.device, "output"))
                       or device_error(g, q.device))
    sig, labels = _signature(q, rope, backend)
    agreed = validate_args(g, "dcp.gather_heads", sig, labels, local_error, budget, validate)
    T, h, D = q.shape
    shape = torch.Size((T, h * W, D))
    R = 0 if rope is None else rope[0].shape[-1]
    plan = _GatherCall(shape, q.dtype, q.device, None if T == 0 else _cached_gatherer(
        g, T, h * W, D, q.dtype, backend, R, budget, q.device, agreed))
    if key is not None and config.validation_mode(validate) != "every":
        _PLANS.put(group, g, key, plan)
    return plan


def _signature(q, rope, backend):
    shape = list(q.shape) if isinstance(q, torch.Tensor) and q.dim() == 3 else [-1, -1, -1]
    r = -1
    if rope is not None:
        try:
            r = int(rope[0].shape[-1])
        except Exception:  # noqa: BLE001 - a bad rope is a local error already
            r = -2
    sig = shape + [DTYPE_CODES.get(getattr(q, "dtype", None), 0),
                   0 if rope is None else 1, r if rope is not None else 0,
                   GATHER_BACKENDS.index(backend) if backend in GATHER_BACKENDS else -1,
                   int(bool(getattr(q, "is_cuda", False)))]
    return sig, ["T (tokens)", "H/W (heads per rank)", "D (head_dim)", "dtype", "rope",
                 "rope dim R", "backend", "device is CUDA"]


# ------------------------------------------------------------------------------ gatherers
_OBJECTS = ObjectCache(_CACHE_SIZE)
_GATHERERS = _OBJECTS.store  # per group: an LRU of gatherers


def _cached_gatherer(group, T, H, D, dtype, backend, R, budget, device,
                     agreed: bool = False) -> Cached:
    """The gatherer of this shape and token bucket (built by the first call) on the call's
    device, as a plan holds it; ``agreed`` as ``ObjectCache.cached``."""
    return _OBJECTS.cached(
        group, T, (H, D, dtype, backend, R, budget, device),
        lambda max_tokens, skip: DcpQueryGather(
            group, max_tokens=max_tokens, num_heads=H, head_dim=D, dtype=dtype, backend=backend,
            rope_dim=R, timeout_s=budget, device=device, _agreed=skip),
        lambda: warm_up_error(
            "dcp.gather_heads", f"the token bucket of T={T} (H={H}, D={D}, {dtype})"), agreed)


# ------------------------------------------------------------------------------ traced path
@torch.compiler.assume_constant_result
def _traced_group(group) -> tuple:
    """``(group name, W)``: run by torch.compile while it traces, a constant of the graph."""
    g = resolve_group(group, "dcp.gather_heads")
    return group_name(g), dist.get_world_size(g)


def require_warm(group_name_: str, q, cos, backend: str, timeout_s) -> None:
    """While tracing (the op's fake implementation): raise the warm-up error unless an eager
    call built the gatherer of this call's shape on the group (a symbolic dim matches any)."""
    g = group_from_name(group_name_)
    W = dist.get_world_size(g)
    T, h, D = (d if isinstance(d, int) else tracing.ANY for d in q.shape)
    R = 0 if cos is None else cos.shape[-1]
    R = R if isinstance(R, int) else tracing.ANY
    H = tracing.ANY if h is tracing.ANY else h * W
    if _OBJECTS.warm(g, T, (H, D, q.dtype, backend, R, config.timeout_s(timeout_s), q.device)):
        return
    shape = ", ".join("?" if d is tracing.ANY else str(d) for d in (T, h, D))
    raise warm_up_error("dcp.gather_heads", f"q [{shape}] {q.dtype} (rope dim "
                                                    f"{'?' if R is tracing.ANY else R}) with "
                                                    f"backend={backend!r}")


def _traced_gather(q, group, backend, rope, validate, timeout_s, output):
    """The traced call: the destination allocated in the graph (or the caller's), one
    ``attncomm::dcp_gather_heads`` that runs the eager call into it (its fake implementation
    runs ``require_warm``)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        group = group.device_group  # an engine's group coordinator
    name, W = _traced_group(group)
    T, h, D = q.shape
    cos, sin = (None, None) if rope is None else rope
    out = q.new_empty((T, h * W, D)) if output is None else output
    torch.ops.attncomm.dcp_gather_heads(q, cos, sin, out, name, backend,
                                        timeout_code(timeout_s),
                                        validate_code(validate))
    return out
