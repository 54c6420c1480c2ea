"""``seq_to_head`` / ``head_to_seq``: the Ulysses all-to-all as two functional calls, and the
choice of transport (``all_to_all``, ``ce``, ``auto``) shared with ``UlyssesAttention``.

Ulysses sequence parallelism: DeepSpeed-Ulysses (Jacobs et al., 2023, arXiv:2309.14509) —
attention on whole sequences for a subset of heads, reached by one all-to-all each way.
"""
from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _dist, config
from ..select import Decision
from .._dist import group_key
from . import ce
from .all_to_all import AllToAllTransport
from .ce import CopyEngineTransport
from .layout import head_offsets, head_split, head_to_seq_plan, seq_to_head_plan
from .transport import Transport

__all__ = ["seq_to_head", "head_to_seq", "backend_availability", "get_transport",
           "decide_transport", "reset_transports",
           "BACKENDS", "AUTO_CE_MIN_BYTES"]

BACKENDS = ("all_to_all", "ce", "auto")
_BACKEND_CODES = {"all_to_all": 1, "ce": 2, "auto": 3}
#: ``auto`` takes ``ce`` (when eligible) from this many bytes sent per rank; below it the NCCL
#: kernel's lower fixed cost wins.
AUTO_CE_MIN_BYTES = 1 << 20

#: ``(group_key(group), transport name, device type, timeout_s, ce flags) → Transport``; keyed
#: by the group object itself (``_dist.group_key``), never by ``id(group)``, which a later group
#: can reuse.
_TRANSPORTS: dict = {}


def ce_reason(group, device: torch.device) -> str | None:
    """Why the ``ce`` transport cannot run for ``device`` tensors on ``group`` (None if it can),
    agreed across ranks (collective on first use per group and device type; cached)."""
    return ce.agreed_unavailable_reason(group, device)


def backend_availability(group=None) -> dict:
    """``{backend name: None if it can run here, else the reason}`` for the Ulysses transports,
    for CUDA tensors on ``group`` (collective over ``group`` when torch.distributed is
    initialised; a local check otherwise)."""
    out = {"all_to_all": None if dist.is_available() else "torch.distributed is unavailable"}
    if dist.is_initialized():
        dev = (torch.device("cuda", torch.cuda.current_device())
               if torch.cuda.is_available() else torch.device("cpu"))
        out["ce"] = ce.agreed_unavailable_reason(group, dev)
    else:
        out["ce"] = ce.host_unavailable_reason()
    return out


def _tracing() -> bool:
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:  # noqa: BLE001 - older torch
        return False


def decide_transport(requested: str, ce_reason: str | None, nbytes: int) -> Decision:
    """The transport policy, pure (no communication; the same inputs on every rank give the
    same answer). ``requested`` is ``"ce"`` or ``"auto"``; ``ce_reason`` why ``ce`` cannot run
    (agreed, None if it can); ``nbytes`` the most bytes any rank sends. ``auto`` takes ``ce``
    from ``AUTO_CE_MIN_BYTES`` on (below it NCCL's lower fixed cost wins: a choice, not a
    fallback). Raises ``ValueError`` for an explicit ``ce`` that cannot run."""
    if ce_reason is not None:
        if requested == "ce":
            raise ValueError(f"backend='ce' cannot run here: {ce_reason}")
        return Decision("all_to_all", f"ce not used: {ce_reason}")
    if requested == "auto" and nbytes < AUTO_CE_MIN_BYTES:
        return Decision("all_to_all")
    return Decision("ce")


def get_transport(group, backend: str, device: torch.device, timeout_s: float,
                  plan=None, dtype=None, op: str = "ulysses", owner=None) -> Transport:
    """The transport for this call. ``backend`` is already validated and agreed.

    ``decide_transport`` chooses from the agreed ``ce`` eligibility (``ce_reason``) and the
    message size; ``ce`` then prepares its staging for ``plan`` (collective when it allocates;
    a shape first seen during CUDA graph capture cannot allocate, so ``auto`` falls back). When
    ``auto`` did not take ``ce`` the reason goes to ``owner.fallback_reason`` (``owner``: a
    ``UlyssesAttention``, which clears it at the start of each forward). An explicit ``ce``
    that cannot run raises ``ValueError`` naming ``op``.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    decision = Decision("all_to_all")
    if backend != "all_to_all":
        reason = "torch.compile is tracing" if _tracing() else ce_reason(group, device)
        nbytes = _max_bytes(plan, dtype) if plan is not None else AUTO_CE_MIN_BYTES
        try:
            decision = decide_transport(backend, reason, nbytes)
            if decision.backend == "ce" and plan is not None:
                t = _cached(group, "ce", device, timeout_s, rank, world)
                why = t.prepare(plan, dtype)  # allocates (collectively) if new
                if why is None:
                    return t
                decision = decide_transport(backend, why, nbytes)
        except ValueError as exc:
            raise ValueError(f"{op}: {exc}") from None
    if owner is not None and decision.fallback_reason is not None:
        owner.fallback_reason = decision.fallback_reason
    return _cached(group, decision.backend, device, timeout_s, rank, world)


def _max_bytes(plan, dtype) -> int:
    item = torch.empty((), dtype=dtype).element_size()
    return max(sum(row) for row in plan.numel) * item


def reset_transports(group=None) -> None:
    """Forget this process's transports for ``group`` (e.g. after a ``PeerTimeoutError`` left
    a ``ce`` transport unusable). Call on every rank; the next call builds them anew."""
    for key in [k for k in _TRANSPORTS if k[0] == group_key(group)]:
        del _TRANSPORTS[key]


@_dist.on_release
def _release_transports(key) -> None:
    for k in [k for k in _TRANSPORTS if k[0] == key]:
        _TRANSPORTS.pop(k).close()


def _cached(group, name, device, timeout_s, rank, world) -> Transport:
    flags = config.raw("ATTNCOMM_ULYSSES_CE_FLAGS") if name == "ce" else ""
    key = (group_key(group), name, device.type, timeout_s, flags)
    t = _TRANSPORTS.get(key)
    if t is None:
        if name == "ce":
            t = CopyEngineTransport(group, rank, world, timeout_s, device=device)
        else:
            t = AllToAllTransport(group, rank, world, timeout_s)
        _TRANSPORTS[key] = t
    t.check()
    return t


def resolve_backend(backend: str) -> str:
    """Apply ``ATTNCOMM_ULYSSES_BACKEND`` to ``auto``; ValueError for an unknown name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    return config.env_backend("ATTNCOMM_ULYSSES_BACKEND", backend, BACKENDS)


def seq_lens_hash(seq_lens: Sequence[int]) -> int:
    return zlib.crc32(",".join(map(str, seq_lens)).encode()) & 0x7FFFFFFF


def dense(x: torch.Tensor) -> torch.Tensor:
    """``x [B, S, H, D]`` with its last two dims dense (a copy only when they are not)."""
    if x.dim() == 4 and x.stride(3) == 1 and (x.shape[2] <= 1 or x.stride(2) == x.shape[3]):
        return x
    return x.contiguous()


#: seq_lens disagreements print every rank's list up to this many entries (else the hash).
_PRINT_SEQ_LENS = 16


def check_call(group, op, validate, signature, labels, error, timeout_s,
               seq_lens=None) -> None:
    """The argument check (``_dist.check_args``: by default on the first call with a new
    signature per group). A local error with checks off, or on one rank, raises there; with
    checks on every rank raises the same ValueError. When the ranks disagree on ``seq_lens``
    (a hash in the signature) and the lists are short, one more gather puts every rank's list
    in the message (on the error path only)."""
    if dist.get_world_size(group) == 1 or config.validation_mode(validate) == "never":
        if error:
            raise ValueError(f"{op}: invalid arguments — rank {dist.get_rank(group)}: {error}")
        return
    try:
        _dist.check_args(group, op, signature, labels, local_error=error, timeout_s=timeout_s,
                         validate=validate)
    except ValueError as exc:
        msg = str(exc)
        if seq_lens is None or "disagree" not in msg or "seq_lens (hash) =" not in msg:
            raise
        raise ValueError(_with_seq_lens(group, msg, list(seq_lens), timeout_s)) from None


def _with_seq_lens(group, msg: str, seq_lens: list, timeout_s) -> str:
    # Every rank is here (agree raised the same "disagree" message everywhere).
    g = _dist.cpu_group(group)
    lists: list = [None] * dist.get_world_size(g)
    with _dist.guard_timeout(g, "seq_lens check", timeout_s):
        dist.all_gather_object(lists, seq_lens, group=g)
    if max(len(x) for x in lists) > _PRINT_SEQ_LENS:
        return msg
    shown = "seq_lens = " + ", ".join(f"{x} (rank {r})" for r, x in enumerate(lists))
    return re.sub(r"seq_lens \(hash\) = [^;]*", lambda _: shown, msg)


def _seq_lens_error(seq_lens, world) -> str | None:
    if len(seq_lens) != world:
        return f"seq_lens has {len(seq_lens)} entries, the group has {world} ranks"
    if any((not isinstance(s, int)) or s < 0 for s in seq_lens):
        return f"seq_lens must be ints ≥ 0, got {list(seq_lens)}"
    return None


def _norm_seq_lens(seq_lens):
    """``seq_lens`` as a tuple (ints where they are integral); raises ``TypeError`` when it is
    not a sequence."""
    if seq_lens is None:
        return None
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.tolist()
    return tuple(int(s) if isinstance(s, (int,)) or hasattr(s, "__index__") else s
                 for s in seq_lens)


@dataclass
class _Call:
    """What ``seq_to_head`` / ``head_to_seq`` know after their shared local checks."""

    timeout: float
    rank: int
    world: int
    error: str | None
    seq: tuple | None
    backend: str
    shape: tuple      # x's shape, (0, 0, 0, 0) when x is not a 4-D tensor
    dcode: int        # x's dtype code (_dist.DTYPE_CODES), 0 when unknown
    dev: int          # 1 when x is a CUDA tensor


def _prologue(x, group, seq_lens, backend: str, timeout_s, dims: str) -> _Call:
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
    dcode = _dist.DTYPE_CODES.get(x.dtype, 0) if is_tensor else 0
    dev = 1 if is_tensor and x.is_cuda else 0
    return _Call(timeout, rank, world, error, seq, backend, shape, dcode, dev)


def seq_to_head(x: torch.Tensor, group=None, *, seq_lens=None, backend: str = "auto",
                validate: bool | None = None, timeout_s: float | None = None) -> torch.Tensor:
    """Sequence-sharded → head-sharded.

    Arguments:
        x: ``[B, S_r, H, D]`` (any dtype), this rank's sequence shard.
        group: process group (None: default).
        seq_lens: every rank's ``S_r`` in rank order (default: every rank has this rank's
            ``S_r``); zeros allowed.
        backend: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (env ``ATTNCOMM_ULYSSES_BACKEND``).

    Returns:
        ``[B, S, H_r, D]`` with ``S = Σ seq_lens`` and ``H_r = head_split(H, W)[r]`` (rank r's
        contiguous heads), a new tensor (bitwise copies of the inputs).

    Raises:
        ValueError (on every rank): not 4-D, ``H < 1``, ``seq_lens`` of the wrong length or
        disagreeing with ``x``, ranks disagreeing on shapes/dtype/backend.
        PeerTimeoutError: a peer did not take part within ``timeout_s``.
    """
    group = _dist.resolve_group(group, "ulysses.seq_to_head")
    c = _prologue(x, group, seq_lens, backend, timeout_s, "B, S_r, H, D")
    rank, world, error, seq, shape = c.rank, c.world, c.error, c.seq, c.shape
    if error is None and shape[2] < 1:
        error = f"x has {shape[2]} heads; at least one is needed"
    if seq is None:
        seq = (shape[1],) * world
        default_len = shape[1]
    else:
        default_len = -1
        error = error or _seq_lens_error(seq, world)
        if error is None and seq[rank] != shape[1]:
            error = f"seq_lens[{rank}] = {seq[rank]} but x has S_r = {shape[1]}"
    sig = [shape[0], shape[2], shape[3], c.dcode, c.dev, _BACKEND_CODES[c.backend], default_len,
           sum(seq) if error is None else -1, seq_lens_hash(seq) if error is None else -1]
    labels = ["B", "H", "D", "dtype", "device is CUDA", "backend", "S_r (seq_lens=None)",
              "sum(seq_lens)", "seq_lens (hash)"]
    check_call(group, "seq_to_head", validate, sig, labels, error, c.timeout, seq_lens=seq)
    b, _, h, d = shape
    heads = head_split(h, world)
    offs = head_offsets(heads)
    ranges = (tuple((offs[p], offs[p] + heads[p]) for p in range(world)),)
    plan = seq_to_head_plan(b, seq, d, ranges)
    x = dense(x)
    t = get_transport(group, c.backend, x.device, c.timeout, plan, x.dtype, "seq_to_head")
    ex = t.start(plan, [x], x.dtype, x.device)
    buf = ex.wait()
    out = buf.view(sum(seq), b, heads[rank], d).permute(1, 0, 2, 3)
    if t.result_aliases_staging or b > 1:
        out = out.clone(memory_format=torch.contiguous_format)  # never alias a staging slot
    ex.release()
    return out


def head_to_seq(x: torch.Tensor, group=None, *, num_heads: int | None = None, seq_lens=None,
                backend: str = "auto", validate: bool | None = None,
                timeout_s: float | None = None) -> torch.Tensor:
    """Head-sharded → sequence-sharded (the inverse of ``seq_to_head``).

    Arguments:
        x: ``[B, S, H_r, D]``, rank r's heads over the whole sequence.
        num_heads: ``H`` in total (default ``H_r · W``; required when heads do not divide
            evenly). Rank r must hold ``head_split(H, W)[r]`` heads.
        seq_lens: every rank's ``S_r`` (default ``S / W`` each, which must divide).

    Returns:
        ``[B, S_r, H, D]``, a new tensor.

    Raises:
        ValueError (on every rank) for inconsistent heads, sequence lengths or shapes;
        PeerTimeoutError when a peer does not take part within ``timeout_s``.
    """
    group = _dist.resolve_group(group, "ulysses.head_to_seq")
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
    ok = error is None
    sig = [b, s_total, d, c.dcode, c.dev, _BACKEND_CODES[c.backend], h if ok else -1,
           seq_lens_hash(seq) if ok else -1]
    labels = ["B", "S", "D", "dtype", "device is CUDA", "backend", "num_heads", "seq_lens (hash)"]
    check_call(group, "head_to_seq", validate, sig, labels, error, c.timeout, seq_lens=seq)
    heads = head_split(h, world)
    plan = head_to_seq_plan(b, seq, d, tuple(heads), tuple(head_offsets(heads)), h)
    x = dense(x)
    out = torch.empty(b, seq[rank], h, d, dtype=x.dtype, device=x.device)
    t = get_transport(group, c.backend, x.device, c.timeout, plan, x.dtype, "head_to_seq")
    ex = t.start(plan, [x], x.dtype, x.device, out=out.view(-1))
    ex.wait()
    ex.release()
    return out
