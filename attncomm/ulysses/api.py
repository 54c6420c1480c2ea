"""``seq_to_head`` / ``head_to_seq``: the Ulysses all-to-all as two functional calls.

Ulysses sequence parallelism: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509) —
attention on whole sequences for a subset of heads, reached by one all-to-all each way.

Hot path: the first call with a new shape (per group) checks its arguments across ranks,
decides the transport and builds the exchange plan (``_ExchangeCall``); a later call with that
shape finds the plan by a key of its arguments and only runs the exchange. Under
``torch.compile`` each call is one custom op (``ulysses/ops.py``) that carries the transport
decided by an earlier eager call of the shape (``_traced_decision``).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from .. import _agree, _dist, config
from .._dist import group_key
from .._plans import (CallPlans, dest_error, dest_key, timeout_code, validate_code,
                      warm_up_error)
from . import fp8, policy
from .fill import FillPart, FillPlan
from .layout import ExchangePlan, head_offsets, head_split, head_to_seq_plan, seq_to_head_plan
from .policy import (AUTO_CE_MIN_BYTES, BACKEND_CODES, BACKENDS, _norm_seq_lens,
                     _seq_lens_error, backend_availability, ce_reason, decide_transport, dense,
                     get_transport, on_forget, reset_transports, resolve_backend, seq_key,
                     seq_lens_detail, seq_lens_hash)
from .transport import Transport

__all__ = ["seq_to_head", "head_to_seq", "backend_availability", "get_transport",
           "decide_transport", "reset_transports", "BACKENDS", "AUTO_CE_MIN_BYTES",
           "ce_reason", "dense", "seq_lens_hash", "resolve_backend"]

#: Call plans kept per group argument (the oldest dropped first; a new one costs one argument
#: check when its signature is new to the group, and the plan). A plan is made with the
#: ``ATTNCOMM_*`` variables of its first call: a change takes effect at the next new plan, or
#: for every call after ``attncomm.release(group)`` / ``reset_transports(group)``.
PLANS_PER_GROUP = 256
_PLANS = CallPlans(PLANS_PER_GROUP)
on_forget(_PLANS.forget)  # the plans hold the group's transports: dropped with them
#: ``(group_key(group), op, shape, dtype, device type, seq_lens, backend, num_heads) →
#: transport name``: the decisions eager calls made, which traced calls reuse.
_DECISIONS: dict = {}


@on_forget
def _forget(key) -> None:
    for k in [k for k in _DECISIONS if k[0] == key]:
        del _DECISIONS[k]


@dataclasses.dataclass
class _ExchangeCall:
    """One call shape of ``seq_to_head`` / ``head_to_seq``, planned once: the exchange plan,
    the transport, the result's layout, and the signature for ``validate=True``."""

    op: str
    group: object
    timeout: float
    plan: ExchangePlan
    transport: Transport
    dtype: torch.dtype
    shape: tuple            # the result's shape
    final: tuple            # the exchange's final buffer as a tensor shape
    direct: bool            # the final buffer is the result (B = 1 / output contiguous)
    every: bool             # validate on every call
    validation: tuple       # validate_args' signature, labels, local error and timeout
    fill: FillPlan | None = None    # the FP8 payload's quantizing fill (seq_to_head)
    wire: tuple | None = None       # the FP8 final buffer's shape [S, B, H_r, D + 4]


def _remember(group, c: _ExchangeCall, key, decision_key) -> None:
    """Keep plan ``c`` for ``key`` (``group``: the group argument as the caller passed it) and
    its transport for traced calls of the shape."""
    if key is not None:
        _PLANS.put(group, c.group, key, c)
        _DECISIONS[decision_key] = c.transport.name


def seq_to_head(x: torch.Tensor, group=None, *, seq_lens=None, backend: str = "auto",
                validate: bool | None = None, timeout_s: float | None = None,
                output: torch.Tensor | None = None,
                payload_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sequence-sharded → head-sharded.

    Arguments:
        x: ``[B, S_r, H, D]`` (any dtype), this rank's sequence shard.
        group: process group (None: default) or an engine's group coordinator.
        seq_lens: every rank's ``S_r`` in rank order (default: every rank has this rank's
            ``S_r``); zeros allowed.
        backend: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (env ``ATTNCOMM_ULYSSES_BACKEND``).
        output: where to write the result (``[B, S, H_r, D]``, ``x``'s dtype and device, any
            strides); None: a new tensor.
        payload_dtype: None (or ``x.dtype``): ``x`` travels as it is; ``torch.float8_e4m3fn``:
            as e4m3 rows with one fp32 scale per (token, head) (``ulysses/fp8.py``: ``D + 4``
            bytes a row, quantized by the fill while it packs), dequantized to ``x.dtype`` on
            arrival (lossy: within ``fp8.roundtrip_bound``). Needs fp16/bf16/fp32 ``x``.

    Returns:
        ``[B, S, H_r, D]`` with ``S = Σ seq_lens`` and ``H_r = head_split(H, W)[r]`` (rank r's
        contiguous heads): ``output`` when given, else a new tensor (bitwise copies of the
        inputs; with the FP8 payload their dequantized rows).

    Raises:
        ValueError (on every rank): not 4-D, ``H < 1``, ``seq_lens`` of the wrong length or
        disagreeing with ``x``, ranks disagreeing on shapes/dtype/backend/payload, a wrong
        ``output`` or ``payload_dtype``; under CUDA graph capture or torch.compile, a shape no
        eager call has seen (the warm-up error).
        PeerTimeoutError: a peer did not take part within ``timeout_s``.
    """
    if torch.compiler.is_compiling():
        return _traced("seq_to_head", x, group, seq_lens, backend, validate, timeout_s, output,
                       payload_dtype=payload_dtype)
    try:
        seq = seq_lens if seq_lens is None or type(seq_lens) is tuple else seq_key(seq_lens)
        key = ("seq_to_head", x.shape, x.dtype, x.device, seq, backend, validate, timeout_s,
               None if output is None else dest_key(output), payload_dtype)
        c = _PLANS.get(group, key)
    except (AttributeError, TypeError):  # not a tensor, unhashable seq_lens: the checks say
        key, c = None, None
    if c is None:
        c = _plan_seq_to_head(x, group, seq_lens, backend, validate, timeout_s, output, key,
                              payload_dtype)
    elif c.every:
        _agree.validate_args(c.group, c.op, *c.validation, validate)
    return _run(c, x, output)


def _run(c: _ExchangeCall, x, output):
    """The exchange of one call with its plan ``c``: a copy-free result where the final buffer
    is the result, else one copy (into ``output`` or, for ``B > 1`` or a result in staging, a
    new tensor)."""
    x = dense(x)
    t, dev = c.transport, x.device
    if c.fill is not None:
        return _run_fp8(c, x, output)
    if c.op == "head_to_seq":
        res = (output if output is not None and c.direct else
               torch.empty(c.shape, dtype=c.dtype, device=dev))
        ex = t.start(c.plan, [x], c.dtype, dev, out=res.view(-1))
        ex.wait()
        ex.release()
        if res is not output and output is not None:
            output.copy_(res)
            return output
        return res
    if output is not None and c.direct:
        ex = t.start(c.plan, [x], c.dtype, dev, out=output.view(-1))
        ex.wait()
        ex.release()
        return output
    ex = t.start(c.plan, [x], c.dtype, dev)
    buf = ex.wait()
    if output is None and c.direct:  # B = 1: the final buffer [S, 1, H_r, D] is the result
        res = buf.view(c.shape)
    else:  # never alias a staging slot; B > 1 to the [B, S, H_r, D] layout
        res = buf.view(c.final).permute(1, 0, 2, 3)
        res = (output.copy_(res) if output is not None else
               res.clone(memory_format=torch.contiguous_format))
    ex.release()
    return res


def _run_fp8(c: _ExchangeCall, x, output):
    """``seq_to_head`` with the FP8 payload: the fill quantizes ``x`` into the transport's send
    buffer, the bytes travel, the final buffer ``[S, B, H_r, D + 4]`` is dequantized into the
    result (``output`` when given)."""
    t, dev = c.transport, x.device
    send = t.send_buffer(c.plan, fp8.WIRE_DTYPE, dev)
    c.fill([x], None, None, send.flat if send.flat is not None else send.regions)
    ex = t.start(c.plan, (), fp8.WIRE_DTYPE, dev, send=send)
    res = output if output is not None else torch.empty(c.shape, dtype=c.dtype, device=dev)
    fp8.dequantize_packed(ex.wait().view(c.wire), c.dtype, out=res.permute(1, 0, 2, 3))
    ex.release()
    return res


def _plan_seq_to_head(x, arg, seq_lens, backend, validate, timeout_s, output, key,
                      payload_dtype=None):
    """Checks (agreed across ranks on a new signature), decision and plan of a new call
    shape (``arg``: the group argument as the caller passed it)."""
    group = _dist.resolve_group(arg, "ulysses.seq_to_head")
    c = _prologue(x, group, seq_lens, backend, timeout_s, "B, S_r, H, D")
    rank, world, error, seq, shape = c.rank, c.world, c.error, c.seq, c.shape
    if error is None and shape[2] < 1:
        error = f"x has {shape[2]} heads; at least one is needed"
    use_fp8 = False
    if error is None:
        try:
            use_fp8 = fp8.is_fp8_payload(payload_dtype, x.dtype)
        except ValueError as exc:
            error = str(exc)
    if seq is None:
        seq = (shape[1],) * world
        default_len = shape[1]
    else:
        default_len = -1
        error = error or _seq_lens_error(seq, world)
        if error is None and seq[rank] != shape[1]:
            error = f"seq_lens[{rank}] = {seq[rank]} but x has S_r = {shape[1]}"
    b, _, h, d = shape
    heads = head_split(h, world) if error is None else [0] * world
    res_shape = (b, sum(seq), heads[rank], d)
    if error is None:
        error = None if output is None else dest_error(output, res_shape, x.dtype, x.device)
    sig = [shape[0], shape[2], shape[3], c.dcode, c.dev, BACKEND_CODES[c.backend], default_len,
           sum(seq) if error is None else -1, seq_lens_hash(seq) if error is None else -1,
           0 if output is None else 1 + int(output.is_contiguous()), int(use_fp8)]
    labels = ["B", "H", "D", "dtype", "device is CUDA", "backend", "S_r (seq_lens=None)",
              "sum(seq_lens)", "seq_lens (hash)", "output (1: strided, 2: contiguous)",
              "payload_dtype fp8"]
    validation = _validate("seq_to_head", x, group, c, sig, labels, error, seq, validate)
    offs = head_offsets(heads)
    ranges = (tuple((offs[p], offs[p] + heads[p]) for p in range(world)),)
    if use_fp8:
        plan, wire = fp8.payload_plan(b, seq, d, ranges), fp8.WIRE_DTYPE
    else:
        plan, wire = seq_to_head_plan(b, seq, d, ranges), x.dtype
    t, _ = get_transport(group, c.backend, x.device, c.timeout, plan, wire, "seq_to_head")
    direct = b == 1 and not t.result_aliases_staging
    if output is not None:
        direct = b == 1 and output.is_contiguous()
    cp = _ExchangeCall("seq_to_head", group, c.timeout, plan, t, x.dtype, res_shape,
                   (sum(seq), b, heads[rank], d), direct,
                   config.validation_mode(validate) == "every", validation)
    if use_fp8:
        cp.fill = FillPlan([FillPart(x, ranges[0])], payload_dtype=payload_dtype)
        cp.wire = (sum(seq), b, heads[rank], fp8.row_bytes(d))
    _remember(arg, cp, key, (group_key(group), "seq_to_head", tuple(shape), x.dtype,
                             x.device.type, seq_key(seq_lens), c.backend, None, payload_dtype))
    return cp


def head_to_seq(x: torch.Tensor, group=None, *, num_heads: int | None = None, seq_lens=None,
                backend: str = "auto", validate: bool | None = None,
                timeout_s: float | None = None,
                output: torch.Tensor | None = None) -> torch.Tensor:
    """Head-sharded → sequence-sharded (the inverse of ``seq_to_head``).

    Arguments:
        x: ``[B, S, H_r, D]``, rank r's heads over the whole sequence.
        num_heads: ``H`` in total (default ``H_r · W``; required when heads do not divide
            evenly). Rank r must hold ``head_split(H, W)[r]`` heads.
        seq_lens: every rank's ``S_r`` (default ``S / W`` each, which must divide).
        output: where to write the result (``[B, S_r, H, D]``, ``x``'s dtype and device, any
            strides); None: a new tensor.

    Returns:
        ``[B, S_r, H, D]``: ``output`` when given, else a new tensor.

    Raises:
        ValueError (on every rank) for inconsistent heads, sequence lengths, shapes or
        ``output``; the warm-up error as ``seq_to_head``; PeerTimeoutError when a peer does not
        take part within ``timeout_s``.
    """
    if torch.compiler.is_compiling():
        return _traced("head_to_seq", x, group, seq_lens, backend, validate, timeout_s, output,
                       num_heads)
    try:
        seq = seq_lens if seq_lens is None or type(seq_lens) is tuple else seq_key(seq_lens)
        key = ("head_to_seq", x.shape, x.dtype, x.device, seq, num_heads, backend, validate,
               timeout_s, None if output is None else dest_key(output))
        c = _PLANS.get(group, key)
    except (AttributeError, TypeError):
        key, c = None, None
    if c is None:
        c = _plan_head_to_seq(x, group, num_heads, seq_lens, backend, validate, timeout_s,
                              output, key)
    elif c.every:
        _agree.validate_args(c.group, c.op, *c.validation, validate)
    return _run(c, x, output)


def _plan_head_to_seq(x, arg, num_heads, seq_lens, backend, validate, timeout_s, output,
                      key):
    """As ``_plan_seq_to_head``, for ``head_to_seq``."""
    group = _dist.resolve_group(arg, "ulysses.head_to_seq")
    c = _prologue(x, group, seq_lens, backend, timeout_s, "B, S, H_r, D")
    rank, world, error, seq = c.rank, c.world, c.error, c.seq
    b, s_total, h_r, d = c.shape
    h = num_heads if num_heads is not None else h_r * world
    if error is None:
        if not isinstance(h, int) or h < 1:
            error = f"num_heads must be ≥ 1, got {h!r} (x has H_r = {h_r} heads)"
        elif head_split(h, world)[rank] != h_r:
            error = (f"x has H_r = {h_r} heads but head_split({h}, {world})[{rank}] = "
                     f"{head_split(h, world)[rank]} (pass num_heads)")
    if seq is None:
        if error is None and s_total % world:
            error = f"S = {s_total} is not divisible by W = {world}: pass seq_lens"
        seq = (s_total // world,) * world
    else:
        error = error or _seq_lens_error(seq, world)
        if error is None and sum(seq) != s_total:
            error = f"sum(seq_lens) = {sum(seq)} but x has S = {s_total}"
    res_shape = (b, seq[rank] if error is None else 0, h if error is None else 0, d)
    if error is None:
        error = None if output is None else dest_error(output, res_shape, x.dtype, x.device)
    ok = error is None
    sig = [b, s_total, d, c.dcode, c.dev, BACKEND_CODES[c.backend], h if ok else -1,
           seq_lens_hash(seq) if ok else -1,
           0 if output is None else 1 + int(output.is_contiguous())]
    labels = ["B", "S", "D", "dtype", "device is CUDA", "backend", "num_heads", "seq_lens (hash)",
              "output (1: strided, 2: contiguous)"]
    validation = _validate("head_to_seq", x, group, c, sig, labels, error, seq, validate)
    heads = head_split(h, world)
    plan = head_to_seq_plan(b, seq, d, tuple(heads), tuple(head_offsets(heads)), h)
    t, _ = get_transport(group, c.backend, x.device, c.timeout, plan, x.dtype, "head_to_seq")
    direct = output is None or output.is_contiguous()
    cp = _ExchangeCall("head_to_seq", group, c.timeout, plan, t, x.dtype, res_shape, res_shape,
                   direct, config.validation_mode(validate) == "every", validation)
    _remember(arg, cp, key, (group_key(group), "head_to_seq", tuple(c.shape), x.dtype,
                             x.device.type, seq_key(seq_lens), c.backend, num_heads, None))
    return cp


@dataclasses.dataclass
class _Args:
    """What ``seq_to_head`` / ``head_to_seq`` know after their shared local checks."""

    timeout: float
    rank: int
    world: int
    error: str | None
    seq: tuple | None
    backend: str
    shape: tuple      # x's shape, (0, 0, 0, 0) when x is not a 4-D tensor
    dcode: int        # x's dtype code (_agree.DTYPE_CODES), 0 when unknown
    dev: int          # 1 when x is a CUDA tensor


def _prologue(x, group, seq_lens, backend: str, timeout_s, dims: str) -> _Args:
    """The local checks both exchanges start with (no communication): backend name, ``x`` a
    4-D tensor (``dims`` names its axes in the message), ``seq_lens`` a sequence."""
    timeout = config.timeout_s(timeout_s)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error, seq = None, None
    try:
        backend = resolve_backend(backend)
    except ValueError as exc:
        error, backend = str(exc), "auto"
    try:
        seq = _norm_seq_lens(seq_lens)
    except TypeError:
        error = error or f"seq_lens must be a sequence of ints, got {seq_lens!r}"
    is_tensor = isinstance(x, torch.Tensor)
    shape = tuple(x.shape) if is_tensor else ()
    if not is_tensor or x.dim() != 4:
        what = f"shape {list(shape)}" if is_tensor else type(x).__name__
        error = error or f"x must be a 4-D tensor [{dims}], got {what}"
        shape = (0, 0, 0, 0)
    dcode = _agree.DTYPE_CODES.get(x.dtype, 0) if is_tensor else 0
    dev = 1 if is_tensor and x.is_cuda else 0
    return _Args(timeout, rank, world, error, seq, backend, shape, dcode, dev)


def _validate(op, x, group, c: _Args, sig, labels, error, seq, validate) -> tuple:
    """A new call shape's warm-up check (``x`` inside CUDA graph capture: the warm-up error,
    nothing decided) and its argument check (``_agree.validate_args``, every rank's seq_lens in
    the message when they disagree); returns what a plan keeps for ``validate=True``."""
    if policy.capturing(x):
        raise warm_up_error(f"ulysses.{op}", f"x {list(c.shape)} {x.dtype}")
    validation = (sig, labels, error, c.timeout)
    _agree.validate_args(group, op, *validation, validate,
                        detail=seq_lens_detail(group, seq, c.timeout))
    return validation


# ------------------------------------------------------------------------------ traced path
@torch.compiler.assume_constant_result
def _traced_decision(op: str, group, shape: tuple, dtype, device_type: str, seq_lens,
                     backend: str, num_heads, payload_dtype=None) -> tuple:
    """``(group name, rank, transport)`` for a traced call: run by torch.compile while it traces and
    taken as a constant, so the graph holds the decision an eager call of this shape made (an
    explicit ``all_to_all`` needs none). Raises the warm-up error when there is none: nothing
    is decided, and nothing falls back, while tracing."""
    group = _dist.resolve_group(group, f"ulysses.{op}")
    backend = resolve_backend(backend)
    name = backend
    if backend != "all_to_all":
        name = _DECISIONS.get((group_key(group), op, shape, dtype, device_type,
                               seq_key(seq_lens), backend, num_heads, payload_dtype))
        if name is None:
            raise warm_up_error(f"ulysses.{op}",
                                f"x {list(shape)} {dtype} with backend={backend!r}")
    return _dist.group_name(group), dist.get_rank(group), name


def _traced(op, x, group, seq_lens, backend, validate, timeout_s, output, num_heads=None,
            payload_dtype=None):
    """The traced call: one custom op (``ulysses/ops.py``) with the decided transport."""
    name, rank, transport = _traced_decision(op, group, tuple(x.shape), x.dtype, x.device.type,
                                             seq_lens, backend, num_heads, payload_dtype)
    seq = None if seq_lens is None else [int(s) for s in seq_lens]
    args = (name, rank, seq, transport, timeout_code(timeout_s), validate_code(validate))
    if op == "head_to_seq":
        args = args + (-1 if num_heads is None else int(num_heads),)
    else:
        args = args + (payload_dtype == fp8.FP8_DTYPE,)
    ops = torch.ops.attncomm
    if output is None:
        fn = ops.ulysses_seq_to_head if op == "seq_to_head" else ops.ulysses_head_to_seq
        return fn(x, *args)
    fn = ops.ulysses_seq_to_head_out if op == "seq_to_head" else ops.ulysses_head_to_seq_out
    fn(x, output, *args)
    return output
