"""What the DCP exchanges' traced call paths share beyond every exchange's (``attncomm._plans``:
the warm-up error, the names a compiled graph finds objects by, ``validate`` and ``timeout_s``
as op arguments): the check that an eager call built the cache entry a traced shape needs,
where a dim is symbolic while tracing (``ANY`` in a ``matches`` pattern).
"""
from __future__ import annotations

__all__ = ["ANY", "matches"]

#: In a ``matches`` pattern: any value (a dim that is symbolic while tracing).
ANY = object()


def matches(key: tuple, pattern: tuple) -> bool:
    """Whether a cache ``key`` equals ``pattern`` where the pattern is not ``ANY``."""
    return len(key) == len(pattern) and all(p is ANY or k == p for k, p in zip(key, pattern))
