"""What the DCP exchanges' call paths share: the names a traced graph finds their objects by,
the warm-up error, how optional arguments travel through a custom op, and the checks and plan
keys of caller-owned destinations (``output=``).

A ``torch.library`` custom op takes tensors, numbers and strings, never a Python object, so a
compiled graph names a ``DcpMerger`` or ``DcpQueryGather`` by a string given at construction
(``register``) and the op's implementation looks it up (``lookup``). The table holds weak
references: it never keeps an object alive.
"""
from __future__ import annotations

import itertools
import weakref

import torch

__all__ = ["register", "lookup", "warm_up_error", "ANY", "matches", "validate_code",
           "validate_arg", "timeout_code", "timeout_arg", "dest_key", "dest_error"]

_OBJECTS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_IDS = itertools.count()


def register(obj) -> str:
    """A new name for ``obj`` (``"<class name>#<n>"``), found by ``lookup`` while it lives."""
    name = f"{type(obj).__name__}#{next(_IDS)}"
    _OBJECTS[name] = obj
    return name


def lookup(name: str):
    """The object registered as ``name``.

    Raises:
        RuntimeError: it no longer exists (a compiled graph outlived the object it was traced
            from).
    """
    obj = _OBJECTS.get(name)
    if obj is None:
        raise RuntimeError(f"{name} no longer exists (a compiled graph outlived the object it "
                           f"was traced from)")
    return obj


def warm_up_error(op: str, what: str) -> ValueError:
    """The error for a call whose decisions (backend, preallocated buffers) no eager call made:
    torch.compile traces the call, and a decision takes collectives and may allocate, which a
    traced graph must not do. ``what`` names the call's shape. (Dynamo re-raises it wrapped,
    its message starting with ``ValueError:``.)"""
    return ValueError(
        f"{op}: {what} was never called eagerly on this group, so its backend and buffers are "
        f"not decided; torch.compile reuses the decisions of eager calls and makes none while "
        f"tracing: call {op} once eagerly with this shape on every rank first (a warm-up), "
        f"then compile")


#: In a ``matches`` pattern: any value (a dim that is symbolic while tracing).
ANY = object()


def matches(key: tuple, pattern: tuple) -> bool:
    """Whether a cache ``key`` equals ``pattern`` where the pattern is not ``ANY``."""
    return len(key) == len(pattern) and all(p is ANY or k == p for k, p in zip(key, pattern))


_VALIDATE = {None: -1, False: 0, True: 1}
_VALIDATE_BACK = {-1: None, 0: False, 1: True}


def validate_code(validate: bool | None) -> int:
    """``validate`` (None / False / True) as the int a custom op takes (-1 / 0 / 1)."""
    return _VALIDATE[None if validate is None else bool(validate)]


def validate_arg(code: int) -> bool | None:
    """The inverse of ``validate_code``."""
    return _VALIDATE_BACK[int(code)]


def timeout_code(timeout_s: float | None) -> float:
    """``timeout_s`` as the float a custom op takes (None → -1)."""
    return -1.0 if timeout_s is None else float(timeout_s)


def timeout_arg(code: float) -> float | None:
    """The inverse of ``timeout_code``."""
    return None if code < 0 else float(code)


def dest_key(output):
    """What the checks of a caller-owned destination depend on (None, a tensor's shape, dtype,
    device and contiguity, or a tuple of those): part of a call plan's key, so a destination
    of a new kind is checked once. Raises ``AttributeError`` for what is not a tensor."""
    if output is None:
        return None
    if isinstance(output, (tuple, list)):
        return tuple(dest_key(t) for t in output)
    return (output.shape, output.dtype, output.device, output.is_contiguous())


def dest_error(t, shape, dtype, device, what: str, contiguous: bool = False) -> str | None:
    """Why ``t`` cannot receive a ``shape`` result of ``dtype`` on ``device`` (None if it can)."""
    if isinstance(t, torch.Tensor) and t.shape == tuple(shape) and t.dtype == dtype \
            and t.device == device and (t.is_contiguous() or not contiguous):
        return None
    got = (f"{tuple(t.shape)} {t.dtype} on {t.device}"
           + ("" if t.is_contiguous() else ", not contiguous")
           if isinstance(t, torch.Tensor) else type(t).__name__)
    return (f"{what} must be a{' contiguous' if contiguous else ''} {list(shape)} {dtype} "
            f"tensor on {device}, got {got}")
