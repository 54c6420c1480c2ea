"""Triton, optional: the one place attncomm finds out whether it imports.

Every Triton kernel lives in a module that imports ``triton`` at its top (``*_kernels.py``); a
wrapper imports that module only through this check, the one pattern used across the package::

    from .. import _triton
    if _triton.REASON is None:
        from . import fill_kernels as _k
    else:
        _k = None

and a path that needs Triton reports ``REASON`` when it cannot run (CPU-only installs, where the
torch paths and the collective backends still work).
"""
from __future__ import annotations

__all__ = ["ERROR", "REASON", "VERSION"]

try:
    import triton
except Exception as exc:  # noqa: BLE001 - any failure to import means no Triton path
    #: The import's error (None when Triton imports).
    ERROR: str | None = f"{type(exc).__name__}: {exc}"
    #: Why there is no Triton path, as a sentence (None when Triton imports).
    REASON: str | None = f"Triton is not importable ({ERROR})"
    #: Triton's version (None without it).
    VERSION: str | None = None
else:
    ERROR = REASON = None
    VERSION = triton.__version__
