"""What the DCP exchanges' call paths share: the names a traced graph finds their objects by,
how optional arguments travel through a custom op (the warm-up error and the checks and plan
keys of caller-owned destinations, ``output=``, are every exchange's: ``attncomm._plans``).

A ``torch.library`` custom op takes tensors, numbers and strings, never a Python object, so a
compiled graph names a ``DcpMerger`` or ``DcpQueryGather`` by a string given at construction
(``register``) and the op's implementation looks it up (``lookup``). The table holds weak
references: it never keeps an object alive.
"""
from __future__ import annotations

import itertools
import weakref

__all__ = ["register", "lookup", "ANY", "matches", "validate_code", "validate_arg",
           "timeout_code", "timeout_arg"]

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
