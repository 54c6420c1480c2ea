"""One backend-selection layer for every exchange: probe → decide → resolve.

Each exchange (the DCP merge, the DCP query gather, the Ulysses transport) has backends that
may or may not run on a group (CUDA, one host, P2P, Triton) and, among those that can, a choice
to make. The steps, the same for all three:

1. **probe** (``agreed_reasons``): per candidate, why it cannot run on this rank (the
   backend's ``collective_unavailable_reason``, which may itself be collective), agreed across
   ranks (all_reduce(MIN) over the gloo twin, before any allocation): every rank gets the same
   verdict.
2. **build** (``build_agreed``): construct a candidate; a failure on any rank (allocation,
   rendezvous) is agreed, so every rank keeps it or every rank drops it.
3. **decide**: on CUDA, when several candidates are left, ``measure`` times each built instance
   over the caller's cases inside CUDA graphs; every rank contributes to an all_reduce(MAX), so
   each sees the slowest rank's figures; ``fastest`` (pure) takes the lowest geometric mean. On
   CPU (gloo) nothing is timed: the caller's rule-of-thumb order decides.
4. **resolve** (``resolve``): the whole flow, returning a ``Decision`` (backend name, why the
   preferred backend was not taken, the measured figures) **and the instance that was built and
   measured**: nothing is built twice.

The shape follows FlashInfer's ``resolve_ulysses_backend`` → ``UlyssesBackendDecision(backend,
fallback_reason)``. Dependency direction: exchanges import this module; it imports only the
substrate (``_dist``, ``_timing``, ``config``).
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from . import capability, collectives, config
from ._dist import cpu_group
from ._agree import agree_reason
from ._timing import time_graph

__all__ = ["Decision", "token_buckets", "agreed_reasons", "build_agreed", "measure", "fastest",
           "resolve", "graph_timer"]

log = logging.getLogger("attncomm.select")


@dataclasses.dataclass(frozen=True)
class Decision:
    """What a backend selection decided, the same on every rank.

    Attributes:
        backend: the backend name in use.
        fallback_reason: why the preferred backend (the fast single-host one) was not taken, or
            None when it was, or when it was not asked for.
        times_us: per measured candidate, the slowest rank's geometric-mean µs over the cases
            (inf: failed on some rank); None when nothing was measured.
        rule: why the choice followed the rule-of-thumb order instead of timings ("CPU: not
            measured", "shared GPU: time-sliced, not measured"); None when timings could
            decide.
    """

    backend: str
    fallback_reason: str | None = None
    times_us: Mapping[str, float] | None = None
    rule: str | None = None


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts a decode exchange of up to ``max_tokens`` tokens is timed at: 1, 8, 64 and
    ``max_tokens`` (those ≤ ``max_tokens``)."""
    return sorted({t for t in (1, 8, 64) if t <= max_tokens} | {max_tokens})


def agreed_reasons(group, names: Sequence[str],
                   local_reason: Callable[[str], str | None]) -> dict[str, str | None]:
    """``{name: None if every rank can run it, else the reasons, naming each rank}``, the same
    on every rank. ``local_reason(name)`` runs on every rank for every name (it may be
    collective); one all_reduce per name over the gloo twin of ``group``."""
    return {n: agree_reason(group, local_reason(n), n) for n in names}


def build_agreed(group, build: Callable[[], object], what: str):
    """``(instance, None)`` when ``build()`` succeeded on every rank, else ``(None, reason)``
    with the same reason (naming each failing rank) on every rank. ``build`` must not hang when
    a peer failed before reaching it (allocate first, rendezvous in a second agreed step, as
    ``SymmWorkspace.agreed`` does)."""
    return capability.collective_try(group, build, what, discard=_close)


def graph_timer(fn: Callable[[], object]) -> float:
    """µs per call of ``fn``: 4 calls captured in one CUDA graph, median of 5 replays run back
    to back (an engine's graph holds every layer back to back)."""
    times = time_graph(fn, per_graph=4, warmup=1, iters=5, back_to_back=True)
    return sorted(times)[len(times) // 2]


def measure(group, impls: Mapping[str, object], cases: Sequence,
            prepare: Callable[[object, object], Callable[[], object]], *,
            timer: Callable[[Callable[[], object]], float] | None = None) -> dict[str, list[float]]:
    """Time every built candidate over ``cases``, slowest rank.

    Arguments:
        impls: ``{name: instance}``, built on every rank in the same order.
        cases: what to time each instance at (token counts, shapes).
        prepare: ``prepare(instance, case) -> fn``: inputs made once, ``fn()`` the timed call.
        timer: ``timer(fn) -> µs`` (default ``graph_timer``); tests inject their own.

    Returns:
        ``{name: [µs per case]}``, the maximum over ranks; ``inf`` for every case of a candidate
        that failed on any rank (each instance's ``check()`` runs after its timings).
    """
    timer = timer or graph_timer
    names = list(impls)
    scores = torch.full((len(names), len(cases)), math.inf, dtype=torch.float64)
    for i, name in enumerate(names):
        impl = impls[name]
        try:
            for j, case in enumerate(cases):
                scores[i, j] = float(timer(prepare(impl, case)))
            check = getattr(impl, "check", None)
            if check is not None:
                check()
        except Exception as exc:  # noqa: BLE001 - agreed below: the candidate is dropped
            log.warning("timing %s failed: %s", name, exc)
            scores[i] = math.inf
    # inf (failed anywhere) survives MAX, so every rank drops the same candidates.
    collectives.all_reduce(scores, op=dist.ReduceOp.MAX, group=cpu_group(group))
    return {n: row for n, row in zip(names, scores.tolist())}


def _geomean(row: Sequence[float]) -> float:
    if not row or not all(math.isfinite(v) for v in row):
        return math.inf
    return math.exp(sum(math.log(max(v, 1e-3)) for v in row) / len(row))


def fastest(times: Mapping[str, Sequence[float]]) -> tuple[str | None, dict[str, float]]:
    """The candidate with the lowest geometric mean over its cases (None when every candidate
    failed somewhere), and every candidate's mean. Pure: the same input gives the same answer on
    every rank. Ties go to the earlier candidate."""
    means = {n: _geomean(row) for n, row in times.items()}
    best = min(means, key=lambda n: means[n], default=None)
    if best is None or math.isinf(means[best]):
        return None, means
    return best, means


def _close(impl) -> None:
    close = getattr(impl, "close", None)
    if close is not None:
        close()


def _table(means: Mapping[str, float]) -> str:
    return ", ".join(f"{n} {m:.1f} µs" for n, m in means.items())


def resolve(group, *, op: str, requested: str, names: Sequence[str], preferred: str,
            rule_of_thumb: Sequence[str], local_reason: Callable[[str], str | None],
            build: Callable[[str], object], measured: bool,
            cases: Sequence = (), prepare: Callable | None = None,
            env_var: str | None = None, auto_names: Sequence[str] | None = None,
            timer: Callable | None = None, rule: str | None = None) -> tuple[Decision, object]:
    """Choose and build a backend for one exchange object (collective over ``group``).

    Arguments:
        op: the object's name for messages (``"DcpMerger"``).
        requested: a name from ``names`` or ``"auto"`` (already validated).
        names: every backend name. preferred: the fast single-host backend whose absence
            ``fallback_reason`` explains.
        rule_of_thumb: the order to take when nothing is measured (CPU groups, a single
            candidate, or every timing failed).
        local_reason: ``local_reason(name)`` → why ``name`` cannot run on this rank (may be
            collective: called on every rank for the same names).
        build: ``build(name)`` → a new instance (collective).
        measured: time the candidates (the caller passes whether timings say anything here:
            CUDA tensors on ranks with GPUs of their own, ``capability.unmeasured_reason``).
        rule: why nothing is timed when ``measured`` is False (recorded in ``Decision.rule``).
        cases, prepare, timer: what ``measure`` times.
        env_var: a ``config`` variable naming a preferred backend for ``"auto"`` (taken when it
            can run here, else auto chooses and logs why).
        auto_names: the candidates ``auto`` considers (default ``names``).

    Returns:
        ``(Decision, instance)``: the instance is the one that was built (and, when measured,
        timed); other built candidates are closed.

    Raises:
        ValueError (every rank): a requested backend that cannot run or failed to set up.
    """
    name = config.env_backend(env_var, requested, tuple(names)) if env_var else requested
    if requested == "auto" and name != "auto":
        why = agree_reason(group, local_reason(name), f"{op} backend {name}")
        if why is None:
            impl, why = build_agreed(group, lambda: build(name), f"{name} setup")
            if impl is not None:
                return Decision(name), impl
        log.warning("%s: %s=%s cannot run here (%s); choosing automatically", op, env_var,
                    name, why)
        name = "auto"
    if name != "auto":
        why = agree_reason(group, local_reason(name), f"{op} backend {name}")
        if why:
            raise ValueError(f"{op}: backend {name!r} cannot run here: {why}")
        impl, why = build_agreed(group, lambda: build(name), f"{name} setup")
        if why:
            raise ValueError(f"{op}: backend {name!r} failed to set up: {why}")
        return Decision(name), impl

    reasons = agreed_reasons(group, list(auto_names or names), local_reason)
    candidates = [n for n, r in reasons.items() if r is None]
    fallback = reasons.get(preferred)
    if not measured or len(candidates) <= 1:
        for n in [n for n in rule_of_thumb if n in candidates] or candidates:
            impl, why = build_agreed(group, lambda n=n: build(n), f"{n} setup")
            if impl is not None:
                return Decision(n, fallback if n != preferred else None,
                                rule=None if measured else rule), impl
            log.warning("%s: %s setup failed (%s); trying the next backend", op, n, why)
            if n == preferred:
                fallback = f"setup failed: {why}"
        raise ValueError(f"{op}: no backend can run here: {reasons}")

    impls: dict[str, object] = {}
    for n in candidates:
        impl, why = build_agreed(group, lambda n=n: build(n), f"{n} setup")
        if impl is not None:
            impls[n] = impl
        elif n == preferred:
            fallback = f"setup failed: {why}"
    if not impls:
        raise ValueError(f"{op}: no backend could be set up here: {reasons}")
    times = measure(group, impls, cases, prepare, timer=timer) if len(impls) > 1 else {}
    best, means = fastest(times) if times else (next(iter(impls), None), {})
    if best is None:  # every timing failed somewhere: the rule of thumb, never the preferred
        best = next((n for n in rule_of_thumb if n in impls and n != preferred),
                    next(iter(impls)))
        fallback = "every candidate failed while timing on some rank"
    elif best != preferred and preferred in impls:
        fallback = (f"{preferred} failed while timing on some rank"
                    if math.isinf(means[preferred]) else f"measured slower ({_table(means)})")
    for n, impl in impls.items():
        if n != best:
            _close(impl)
    log.info("%s: auto chose %s (%s)", op, best, _table(means) if means else "one candidate")
    return (Decision(best, None if best == preferred else fallback, means or None),
            impls[best])
