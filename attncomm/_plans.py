"""Call plans: what a functional call's checked signature needs on its later calls.

The first call of a signature (per group) resolves the group, checks its arguments and makes its
decisions; it keeps a plan under a key of the call's arguments (``CallPlans``), and a later call
with that key runs the plan alone. A plan that runs on a preallocated object (a DCP merger or
gatherer, kept in a per-group LRU by ``_dist.group_lru_get``) holds it through ``Cached``, which
keeps the LRU's order that of the calls and finds the object again, built anew on every rank
alike, when the LRU evicted (closed) it. ``attncomm.release(group)`` drops a group's plans.

What every exchange's first call of a signature shares lives here too: the warm-up error (a
signature first seen where nothing may be decided) and the check of a caller-owned destination
(``output=``) with its part of the plan key; and how a compiled graph reaches what a custom op
cannot take as an argument: an object by a registered name (``register`` / ``lookup``), the
optional ``validate`` and ``timeout_s`` as numbers (``validate_code`` / ``timeout_code``).
"""
from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable

import torch

from . import config
from ._dist import group_key, group_lru_get, on_release

__all__ = ["CallPlans", "Cached", "warm_up_error", "dest_key", "dest_error", "register",
           "lookup", "validate_code", "validate_arg", "timeout_code", "timeout_arg"]


class CallPlans:
    """Per group argument (as callers pass it: None, a process group or a coordinator), an LRU
    of ``size`` plans by call key. Plans own no buffers: dropping one costs its next call the
    checks again (no collective when the signature was seen: ``_agree.validate_args``)."""

    def __init__(self, size: int = 1024):
        self.size = size
        #: group argument → (``group_key`` of the resolved group, {call key → plan})
        self._by_group: dict = {}
        on_release(self.forget)

    def get(self, group, key):
        """The plan of ``key`` on ``group`` (None: none, or ``key`` is None), moved to the
        LRU's recent end: the plan evicted first is the one called least recently."""
        entry = self._by_group.get(group)
        if entry is None or key is None:
            return None
        plans = entry[1]
        plan = plans.get(key)
        if plan is not None:
            plans.move_to_end(key)
        return plan

    def put(self, group, resolved, key, plan) -> None:
        """Keep ``plan`` for ``key`` on ``group`` (``resolved``: the process group it runs on)."""
        entry = self._by_group.get(group)
        if entry is None:
            entry = self._by_group[group] = (group_key(resolved), collections.OrderedDict())
        entry[1][key] = plan
        while len(entry[1]) > self.size:
            entry[1].popitem(last=False)

    def forget(self, key) -> None:
        """Drop the plans of the group whose ``group_key`` is ``key``."""
        for group in [g for g, (k, _) in self._by_group.items() if k == key]:
            del self._by_group[group]


class Cached:
    """The object a plan runs on: the entry ``key`` of ``store``'s LRU for ``group``, built by
    ``build()`` when missing (``size`` entries per group). ``capture_error()``: the exception
    to raise when it must be built while the current CUDA stream is capturing a graph."""

    __slots__ = ("store", "group", "key", "build", "size", "capture_error", "obj", "lru")

    def __init__(self, store: dict, group, key, build: Callable, size: int,
                 capture_error: Callable[[], Exception]):
        self.store, self.group, self.key, self.build = store, group, key, build
        self.size, self.capture_error = size, capture_error
        self.obj = self._make()

    def get(self):
        """The object, moved to the LRU's recent end; built again if it was evicted."""
        obj = self.obj
        try:
            self.lru.move_to_end(self.key)
        except KeyError:  # evicted (closed) by a newer entry: every rank builds it again
            obj = None
        if obj is None or obj._closed:
            obj = self.obj = self._make()
        return obj

    def _make(self):
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise self.capture_error()
        obj = group_lru_get(self.store, self.group, self.key, self.build, self.size)
        self.lru = self.store[group_key(self.group)]
        return obj


def warm_up_error(op: str, what: str) -> ValueError:
    """The error for a call signature first seen inside CUDA graph capture or torch.compile
    tracing: its decisions (backend or transport, plan, preallocated buffers) take collectives
    and may allocate, which neither a capture nor a trace may do, and nothing falls back there.
    ``what`` names the signature. (Dynamo re-raises it wrapped, its message starting with
    ``ValueError:``.)"""
    return ValueError(
        f"{op}: {what} is seen for the first time inside CUDA graph capture or torch.compile "
        f"tracing, where its backend, plan and buffers cannot be decided (that takes "
        f"collectives and may allocate): call {op} once eagerly with this shape on every rank "
        f"first (a warm-up), then capture or compile")


def dest_key(output):
    """What the checks of a caller-owned destination depend on (None, a tensor's shape, dtype,
    device and contiguity, or a tuple of those): part of a call plan's key, so a destination
    of a new kind is checked once. Raises ``AttributeError`` for what is not a tensor."""
    if output is None:
        return None
    if isinstance(output, (tuple, list)):
        return tuple(dest_key(t) for t in output)
    return (output.shape, output.dtype, output.device, output.is_contiguous())


def dest_error(t, shape, dtype, device, what: str = "output",
               contiguous: bool = False) -> str | None:
    """Why ``t`` cannot receive a ``shape`` result of ``dtype`` on ``device`` (None if it can;
    ``contiguous``: it must be). ``what`` names it in the message."""
    if isinstance(t, torch.Tensor) and t.shape == tuple(shape) and t.dtype == dtype \
            and t.device == device and (t.is_contiguous() or not contiguous):
        return None
    got = (f"{tuple(t.shape)} {t.dtype} on {t.device}"
           + ("" if t.is_contiguous() else ", not contiguous")
           if isinstance(t, torch.Tensor) else type(t).__name__)
    return (f"{what} must be a{' contiguous' if contiguous else ''} {list(shape)} {dtype} "
            f"tensor on {device}, got {got}")


# ------------------------------------------------------------------------------ traced graphs
# A ``torch.library`` custom op takes tensors, numbers and strings, never a Python object: a
# compiled graph names a module or exchange object by a string given at construction and the
# op's implementation looks it up. The table holds weak references: it keeps nothing alive.
_OBJECTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(obj) -> str:
    """A new name for ``obj`` (``"<class name>#<n>"``), found by ``lookup`` while it lives."""
    name = f"{type(obj).__name__}#{next(_IDS)}"
    _OBJECTS[name] = obj
    return name


def lookup(name: str, missing_ok: bool = False):
    """The object registered as ``name`` (``missing_ok``: None when there is none).

    Raises:
        RuntimeError: it no longer exists (a compiled graph outlived the object it was traced
            from).
    """
    obj = _OBJECTS.get(name)
    if obj is None and not missing_ok:
        raise RuntimeError(f"{name} no longer exists (a compiled graph outlived the object it "
                           f"was traced from)")
    return obj


_VALIDATE = {None: -1, False: 0, True: 1}
_VALIDATE_BACK = {-1: None, 0: False, 1: True}


def validate_code(validate: bool | None) -> int:
    """``validate`` (None / False / True) as the int a custom op takes (-1 / 0 / 1)."""
    return _VALIDATE[None if validate is None else bool(validate)]


def validate_arg(code: int) -> bool | None:
    """The inverse of ``validate_code``."""
    return _VALIDATE_BACK[int(code)]


def timeout_code(timeout_s: float | None) -> float:
    """``timeout_s`` as the float a custom op takes (None → -1). Raises ``ValueError`` for a
    budget that is not > 0 (``config.timeout_s``), as the eager call does: -1 means None."""
    return -1.0 if timeout_s is None else config.timeout_s(timeout_s)


def timeout_arg(code: float) -> float | None:
    """The inverse of ``timeout_code``."""
    return None if code < 0 else float(code)
