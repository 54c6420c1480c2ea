"""What ``seq_to_head``, ``head_to_seq`` and ``UlyssesAttention`` share: the transport choice's
facts (``all_to_all``, ``ce``, ``auto``; the pure choice is ``select.decide_transport``), the
process-wide transports, the argument checks, and the rules for calls inside CUDA graph capture.

Decisions are made once per call shape, outside any traced or captured region: the functional
calls keep a plan per shape (``api``), ``UlyssesAttention`` one per forward shape
(``forward_plan``, given the facts ``transport_facts`` probed before it is built); both are
dropped with the group's transports (``reset_transports``, ``attncomm.release``).
"""
from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .. import _dist, capability, config
from ..select import AUTO_CE_MIN_BYTES, Decision, TransportFacts, decide_transport
from .._dist import group_key
from ..compiled_launch import capturing
from . import ce
from .all_to_all import AllToAllTransport
from .ce import CopyEngineTransport
from .transport import Transport, dense

__all__ = ["BACKENDS", "AUTO_CE_MIN_BYTES", "ce_reason", "backend_availability",
           "decide_transport", "transport_facts", "TransportFacts", "get_transport",
           "reset_transports", "resolve_backend",
           "seq_lens_hash", "dense", "seq_lens_detail", "capturing", "on_forget", "named_transport",
           "BACKEND_CODES"]

BACKENDS = ("all_to_all", "ce", "auto")
#: ``backend`` as the int an argument check agrees on.
BACKEND_CODES = {"all_to_all": 1, "ce": 2, "auto": 3}

#: ``(group_key(group), transport name, device type, timeout_s, ce flags) → Transport``; keyed
#: by the group object itself (``_dist.group_key``), never by ``id(group)``, which a later group
#: can reuse.
_TRANSPORTS: dict = {}
#: Callbacks ``fn(key)`` that drop what was planned for the group whose ``group_key`` is
#: ``key`` (the call plans, the modules' forward plans): they hold its transports.
_FORGET: list = []

def on_forget(fn):
    """Register ``fn(key)``: drop plans made for the group with ``group_key`` ``key``."""
    _FORGET.append(fn)
    return fn


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


def transport_facts(group, backend: str, device: torch.device) -> TransportFacts:
    """The agreed facts the transport choice of ``backend`` (validated, agreed) takes for
    ``device`` tensors on ``group``: whether ``ce`` can run (``ce_reason``) and whether sizes
    say anything (``capability.unmeasured_reason``). Collective on first use per group and
    device type (both cached); nothing is probed for ``all_to_all``. Made on the first plan of
    a signature, before any plan is built (``select``: probe, then decide)."""
    if backend == "all_to_all":
        return TransportFacts(backend)
    why = ce_reason(group, device)
    shared = None if why is not None else capability.unmeasured_reason(group, device)
    return TransportFacts(backend, why, shared)


def get_transport(group, backend: str, device: torch.device, timeout_s: float,
                  plan=None, dtype=None, op: str = "ulysses",
                  facts: TransportFacts | None = None) -> tuple[Transport, Decision]:
    """The transport for an exchange of ``plan`` and the ``Decision`` behind it. ``backend``
    is already validated and agreed; ``facts`` are ``transport_facts``' for it (probed here
    when None). Called when a plan is made (eagerly, never while tracing or capturing: the
    callers raise ``_plans.warm_up_error`` first).

    ``select.decide_transport`` chooses from the facts and the message size; ``ce`` then
    prepares its staging for ``plan`` (collective when it allocates): an allocation that fails
    on some rank is one more agreed fact, and the choice is made again with it. An explicit
    ``ce`` that cannot run raises ``ValueError`` naming ``op``.
    """
    decision = Decision("all_to_all")
    if backend != "all_to_all":
        nbytes = _max_bytes(plan, dtype) if plan is not None else AUTO_CE_MIN_BYTES
        try:
            f = facts if facts is not None else transport_facts(group, backend, device)
            decision = decide_transport(f.requested, f.ce_reason, nbytes, f.shared_gpu)
            if decision.backend == "ce" and plan is not None:
                t = named_transport(group, "ce", device, timeout_s)
                why = t.prepare(plan, dtype)  # allocates (collectively) if new
                if why is None:
                    return t, decision
                decision = decide_transport(f.requested, why, nbytes)
        except ValueError as exc:
            raise ValueError(f"{op}: {exc}") from None
    return named_transport(group, decision.backend, device, timeout_s), decision


def _max_bytes(plan, dtype) -> int:
    return max(sum(row) for row in plan.numel) * dtype.itemsize


def reset_transports(group=None) -> None:
    """Forget this process's transports for ``group`` (e.g. after a ``PeerTimeoutError`` left
    a ``ce`` transport unusable), and the plans that use them. Call on every rank; the next
    call builds them anew."""
    key = group_key(group)
    for fn in _FORGET:
        fn(key)
    for k in [k for k in _TRANSPORTS if k[0] == key]:
        del _TRANSPORTS[k]


@_dist.on_release
def _release_transports(key) -> None:
    for fn in _FORGET:
        fn(key)
    for k in [k for k in _TRANSPORTS if k[0] == key]:
        _TRANSPORTS.pop(k).close()


def named_transport(group, name: str, device: torch.device, timeout_s: float) -> Transport:
    """The process-wide transport ``name`` (``"all_to_all"`` or ``"ce"``, no decision) for
    ``device`` tensors on ``group``, built on first use (``ce``: collective; its flag mode read
    from ``ATTNCOMM_ULYSSES_CE_FLAGS`` then). Raises ``PeerTimeoutError`` when it is broken."""
    flags = config.raw("ATTNCOMM_ULYSSES_CE_FLAGS") if name == "ce" else ""
    key = (group_key(group), name, device.type, timeout_s, flags)
    t = _TRANSPORTS.get(key)
    if t is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
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


#: seq_lens disagreements print every rank's list up to this many entries (else the hash).
_PRINT_SEQ_LENS = 16


def seq_lens_detail(group, seq_lens, timeout_s):
    """``_agree.validate_args``' ``detail`` for a signature that holds a hash of ``seq_lens``:
    when the ranks disagree on it and the lists are short, one more gather (on the error path
    only, on every rank: the message is the same everywhere) puts every rank's list in the
    message."""
    def detail(msg: str) -> str:
        if "seq_lens (hash) =" not in msg:
            return msg
        return _with_seq_lens(group, msg, list(seq_lens), timeout_s)
    return detail


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


def seq_key(seq_lens):
    """``seq_lens`` as it enters a plan key: None, or a tuple (a list or tensor converted;
    anything else as it is, for the checks to name)."""
    if seq_lens is None or type(seq_lens) is tuple:
        return seq_lens
    try:
        return _norm_seq_lens(seq_lens)
    except TypeError:
        return ("<not a sequence>", repr(seq_lens))
