"""``backend="auto"`` for the DCP merge: choose among the backends that can run here.

``DcpMerger`` has already agreed which backends are eligible on every rank (``candidates``) and
applied ``ATTNCOMM_DCP_BACKEND``. Here:

- on CPU (gloo) ranks nothing is timed: the rule of thumb is ``a2a`` (one collective) over
  ``ag_rs`` (two), ``reference`` last;
- on CUDA each candidate is built on the real group and timed inside a CUDA graph over token
  buckets up to ``max_tokens`` (1, 8, 64 and ``max_tokens`` when smaller or equal); every rank
  contributes its times to an all_reduce(MAX) over the gloo group, so every rank sees the same
  slowest-rank figures and picks the same backend: the lowest geometric mean over the buckets.
  A candidate that fails on any rank (setup or timing) is dropped on every rank.

Runs eagerly at construction, before any capture the caller makes.
"""
from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from .._dist import cpu_group
from .._timing import time_graph
from .backend import backend_class

__all__ = ["choose_backend", "token_buckets", "RULE_OF_THUMB"]

log = logging.getLogger("attncomm.dcp")

RULE_OF_THUMB = ("symm_a2a", "a2a", "ag_rs", "reference")
_PER_GRAPH = 4
_REPLAYS = 5


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts timed for a merger of ``max_tokens``: 1, 8, 64 and ``max_tokens``."""
    return sorted({t for t in (1, 8, 64) if t <= max_tokens} | {max_tokens})


def _rule_of_thumb(candidates: list[str]) -> str:
    for name in RULE_OF_THUMB:
        if name in candidates:
            return name
    return candidates[0]


def _time_graph(impl, out, lse) -> float:
    """µs per merge: ``_PER_GRAPH`` merges captured in one graph, median of ``_REPLAYS``."""
    times = time_graph(lambda: impl(out, lse), per_graph=_PER_GRAPH, warmup=1, iters=_REPLAYS,
                       back_to_back=True)
    impl.check()
    return sorted(times)[len(times) // 2]


def _measure(name, group, buckets, kw) -> list[float]:
    impl = backend_class(name)(group, **kw)
    rank = dist.get_rank(group)
    gen = torch.Generator(device=kw["device"]).manual_seed(rank)
    times = []
    for T in buckets:
        out = torch.randn((T, kw["num_heads"], kw["head_dim"]), generator=gen,
                          device=kw["device"]).to(kw["dtype"])
        lse = torch.randn((T, kw["num_heads"]), generator=gen, device=kw["device"])
        times.append(_time_graph(impl, out, lse))
    del impl
    return times


def choose_backend(group, candidates: list[str], *, max_tokens: int, num_heads: int,
                   head_dim: int, dtype: torch.dtype, device: torch.device,
                   timeout_s: float) -> tuple[str, str | None]:
    """Pick the backend for a ``DcpMerger`` (collective over ``group``).

    Arguments:
        candidates: backends every rank agreed can run here (in preference order).
        max_tokens, num_heads, head_dim, dtype, device, timeout_s: the merger's geometry.

    Returns:
        ``(name, why_not_symm)``: the chosen backend, and why ``symm_a2a`` was not taken when it
        was a candidate (None otherwise). The same on every rank.

    Raises:
        ValueError: no candidates.
    """
    if not candidates:
        raise ValueError("choose_backend: no DCP backend can run here")
    if torch.device(device).type != "cuda" or len(candidates) == 1:
        return _rule_of_thumb(candidates), None
    kw = dict(max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim, dtype=dtype,
              device=device, timeout_s=timeout_s)
    buckets = token_buckets(max_tokens)
    scores = torch.full((len(candidates), len(buckets)), float("inf"), dtype=torch.float64)
    errors = {}
    for i, name in enumerate(candidates):
        try:
            scores[i] = torch.tensor(_measure(name, group, buckets, kw), dtype=torch.float64)
        except Exception as exc:  # noqa: BLE001 - agreed below: the candidate is dropped
            errors[name] = f"{type(exc).__name__}: {exc}"
    # inf (failed anywhere) survives MAX, so every rank drops the same candidates.
    dist.all_reduce(scores, op=dist.ReduceOp.MAX, group=cpu_group(group))
    means = [math.exp(sum(math.log(max(v, 1e-3)) for v in row) / len(row))
             if all(math.isfinite(v) for v in row) else math.inf for row in scores.tolist()]
    if all(math.isinf(m) for m in means):
        name = _rule_of_thumb([c for c in candidates if c != "symm_a2a"] or candidates)
        return name, "every candidate failed while timing: " + "; ".join(
            f"{k}: {v}" for k, v in errors.items())
    best = min(range(len(candidates)), key=lambda i: means[i])
    name = candidates[best]
    table = ", ".join(f"{c} {m:.1f} µs" for c, m in zip(candidates, means))
    log.info("dcp auto: geometric-mean latency over tokens %s: %s → %s", buckets, table, name)
    why = None
    if "symm_a2a" in candidates and name != "symm_a2a":
        i = candidates.index("symm_a2a")
        why = ("symm_a2a failed while timing on some rank" if math.isinf(means[i])
               else f"measured slower ({table})")
    return name, why
