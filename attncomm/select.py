"""The one decision layer: every ``auto`` of the library is probe → decide → agreed result.

Four decisions take this shape: the DCP backends (``DcpMerger``, ``DcpQueryGather``), the
Ulysses transport of each exchange, the Ulysses pipeline depth (``pipeline_groups=-1``) and the
DP sync path (``sync="auto"``). For each:

1. **probe**: the facts the choice depends on, each agreed across ranks before it is used
   (``agree_reason``, ``agreed_min``, or an all_reduce(MAX) of timings over the gloo twin), so
   every rank holds the same facts. The probes that know an exchange's backends live with the
   exchange (``capability``, ``ulysses.policy.transport_facts``, ``ulysses.pipeline_choice``,
   ``dp_attention.rows``); the generic ones here: ``agreed_reasons`` (who can run),
   ``build_agreed`` (a candidate built on every rank or on none), ``measure`` (timings, slowest
   rank).
2. **decide**: one pure function of the facts per decision (``decide_backend``,
   ``decide_transport``, ``decide_depth``, ``decide_sync_path``): no communication, no device
   work, so the same facts give the same answer on every rank and the agreed facts give the
   agreed result. A fact that costs a trial (a build, a forward, a timing) is probed only when
   the cheaper facts leave the choice open: a decide function then returns its pick with what
   it still needs (``decide_depth`` returns None until the trial ran), and the caller probes
   that and decides again.
3. **the result with its reason**: a ``Decision`` (what is taken, why the preferred one was
   not, the measured figures, or the rule that decided without timings) or a
   ``PipelineDecision``; the same on every rank, the reason shown wherever the choice is
   reported (``fallback_reason``, ``attncomm env``, the benches, the errors of an explicit
   request that cannot run).

When: at an object's construction (the DCP objects) or on the first plan of a call signature
(the functional calls, a new forward shape of ``UlyssesAttention``, a ``sync`` value's first use
on a group), eagerly and before any capture. A plan's constructor gets the agreed facts and only
evaluates the pure decision for each exchange; it never probes.

The shape follows FlashInfer's Ulysses backend selection (per-rank topology probe, gathered;
a pure decision over the gathered facts; the decision with its reason). Dependency direction:
exchanges import this module; it imports only the substrate (``_dist``, ``_agree``,
``_timing``, ``capability``, ``collectives``, ``config``).
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

__all__ = ["Decision", "PipelineDecision", "BackendFacts", "DepthFacts", "SyncFacts",
           "TransportFacts", "token_buckets", "agreed_reasons", "build_agreed", "measure",
           "fastest", "resolve", "graph_timer", "decide_backend", "decide_transport",
           "decide_depth", "decide_sync_path", "AUTO_CE_MIN_BYTES", "NOT_MEASURED"]

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


@dataclasses.dataclass(frozen=True)
class PipelineDecision:
    """What ``pipeline_groups=-1`` runs for one signature, the same on every rank.

    Attributes:
        groups: head groups to run: 1 (sequential) or ``candidate_groups``.
        candidate_groups: ``auto_groups``' count, the pipelined variant considered.
        sequential_us, pipelined_us: the slowest rank's median µs per forward of each
            (``inf``: it raised on some rank), or None when nothing was timed.
        fallback_reason: why sequential was kept (not measured on CPU, no split, the outputs
            differ, measured slower, a failure while timing); None when pipelined won.
    """

    groups: int
    candidate_groups: int
    sequential_us: float | None = None
    pipelined_us: float | None = None
    fallback_reason: str | None = None

    @property
    def pipelined(self) -> bool:
        return self.groups > 1


#: ``auto`` takes the Ulysses ``ce`` transport (when eligible) from this many bytes sent per
#: rank; below it the NCCL kernel's lower fixed cost wins.
AUTO_CE_MIN_BYTES = 1 << 20
#: The reason of a choice made without timings on CPU tensors.
NOT_MEASURED = capability.NOT_MEASURED


@dataclasses.dataclass(frozen=True)
class BackendFacts:
    """What ``auto`` knows about an exchange's backends (``decide_backend``), agreed.

    Attributes:
        op: the exchange object's name, for messages.
        preferred: the fast single-host backend whose absence ``fallback_reason`` explains.
        rule_of_thumb: the order taken when nothing is timed.
        reasons: per candidate ``auto`` considers, None when every rank can run it, else why
            not (naming the ranks).
        measured: whether timings say anything here; ``rule`` why not (``Decision.rule``).
        setup: per candidate built so far, None when it was built on every rank, else why
            its setup failed (naming the ranks).
        times: per built candidate, the slowest rank's µs per timed case (``measure``), or
            None when nothing was timed.
    """

    op: str
    preferred: str
    rule_of_thumb: tuple
    reasons: Mapping[str, str | None]
    measured: bool
    rule: str | None = None
    setup: Mapping[str, str | None] = dataclasses.field(default_factory=dict)
    times: Mapping[str, Sequence[float]] | None = None

    @property
    def candidates(self) -> list[str]:
        """The candidates every rank can run, in ``reasons``' order."""
        return [n for n, r in self.reasons.items() if r is None]

    @property
    def timed(self) -> bool:
        """Whether the choice is made by timings: measured, with two candidates or more."""
        return self.measured and len(self.candidates) > 1


@dataclasses.dataclass(frozen=True)
class TransportFacts:
    """What the Ulysses transport choice knows about a group (``decide_transport``), agreed.

    Attributes:
        requested: ``"all_to_all"``, ``"ce"`` or ``"auto"`` (validated, agreed).
        ce_reason: why ``ce`` cannot run for these tensors on the group (None if it can).
        shared_gpu: why sizes say nothing here (ranks share a GPU), or None.
    """

    requested: str
    ce_reason: str | None = None
    shared_gpu: str | None = None


@dataclasses.dataclass(frozen=True)
class DepthFacts:
    """What ``pipeline_groups=-1`` knows about a signature (``decide_depth``), agreed.

    Attributes:
        candidate: ``auto_groups``' head-group count.
        unmeasured: why nothing is timed (CPU, ranks that share a GPU), or None.
        fits: whether every rank has room for two of the candidate groups' working sets.
        compared: whether the pipelined and sequential outputs were compared (a trial: one
            forward of each); ``mismatch``: None when they are the same bits on every rank,
            else what differed (naming the ranks).
        sequential_us, pipelined_us: the slowest rank's µs per forward (inf: it raised on
            some rank), or None until timed.
    """

    candidate: int
    unmeasured: str | None = None
    fits: bool = True
    mismatch: str | None = None
    compared: bool = False
    sequential_us: float | None = None
    pipelined_us: float | None = None


@dataclasses.dataclass(frozen=True)
class SyncFacts:
    """What ``sync="auto"`` knows about a DP group (``decide_sync_path``), agreed.

    Attributes:
        layout: where the group's ranks are (``capability.group_hosts``).
        shm_reason: why some rank cannot run the shm protocol at all, or None.
        hier_failed: why the hier path could not be set up, or None (not tried, or built).
    """

    layout: capability.HostLayout
    shm_reason: str | None = None
    hier_failed: str | None = None


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


# ------------------------------------------------------------------ the pure decisions
def decide_backend(f: BackendFacts) -> Decision:
    """``auto``'s backend from the facts, pure.

    Timed (``f.timed``): among the built candidates, the fastest geometric mean over the cases
    (``fastest``); when every timing failed somewhere, the rule of thumb (never the preferred);
    when one candidate was built, that one. Not timed: the first of ``rule_of_thumb`` (else of
    the candidates) whose setup has not failed; the caller builds it (a new ``setup`` fact) and
    decides again when it is not built yet. ``fallback_reason`` says why ``preferred`` was not
    taken: it cannot run, its setup failed, it failed while timing, or it measured slower.

    Raises ``ValueError`` (the same on every rank) when no candidate is left.
    """
    fallback = f.reasons.get(f.preferred)
    if f.setup.get(f.preferred) is not None:
        fallback = f"setup failed: {f.setup[f.preferred]}"
    cands = f.candidates
    if not f.timed:
        for n in [n for n in f.rule_of_thumb if n in cands] or cands:
            if f.setup.get(n) is None:
                return Decision(n, None if n == f.preferred else fallback,
                                rule=None if f.measured else f.rule)
        raise ValueError(f"{f.op}: no backend can run here: {dict(f.reasons)}")
    built = [n for n in cands if n in f.setup and f.setup[n] is None]
    if not built:
        raise ValueError(f"{f.op}: no backend could be set up here: {dict(f.reasons)}")
    best, means = fastest(f.times) if f.times else (built[0], {})
    if best is None:  # every timing failed somewhere: the rule of thumb, never the preferred
        best = next((n for n in f.rule_of_thumb if n in built and n != f.preferred), built[0])
        fallback = "every candidate failed while timing on some rank"
    elif best != f.preferred and f.preferred in built:
        fallback = (f"{f.preferred} failed while timing on some rank"
                    if math.isinf(means[f.preferred]) else f"measured slower ({_table(means)})")
    return Decision(best, None if best == f.preferred else fallback, means or None)


def decide_transport(requested: str, ce_reason: str | None, nbytes: int,
                     shared_gpu: str | None = None) -> Decision:
    """The Ulysses transport of one exchange, pure. ``requested`` is ``"ce"`` or ``"auto"``;
    ``ce_reason`` why ``ce`` cannot run (agreed, None if it can); ``nbytes`` the most bytes any
    rank sends; ``shared_gpu`` why sizes say nothing here (ranks that share a GPU:
    ``all_to_all`` goes through host copies there, so ``auto`` takes ``ce`` at every size, by
    rule). ``auto`` takes ``ce`` from ``AUTO_CE_MIN_BYTES`` on (below it NCCL's lower fixed
    cost wins: a choice, not a fallback). Raises ``ValueError`` for an explicit ``ce`` that
    cannot run."""
    if ce_reason is not None:
        if requested == "ce":
            raise ValueError(f"backend='ce' cannot run here: {ce_reason}")
        return Decision("all_to_all", f"ce not used: {ce_reason}")
    if shared_gpu is not None:
        return Decision("ce", rule=shared_gpu)
    if requested == "auto" and nbytes < AUTO_CE_MIN_BYTES:
        return Decision("all_to_all")
    return Decision("ce")


def decide_depth(f: DepthFacts) -> PipelineDecision | None:
    """The head-group count of ``pipeline_groups=-1`` from the facts, pure: sequential when
    nothing is timed, when ``auto_groups`` found no split, when some rank lacks the memory,
    when the outputs differ, or when pipelined is not faster (a tie keeps sequential; a
    forward that raised counts as inf); else the candidate count. None while the facts leave
    it open: the caller compares the outputs (``compared``, ``mismatch``), then times both
    (``sequential_us``, ``pipelined_us``), and decides again."""
    g = f.candidate
    if f.unmeasured is not None:
        return PipelineDecision(1, g, fallback_reason=f.unmeasured)
    if g < 2:
        return PipelineDecision(1, g, fallback_reason=f"auto_groups found no split (G = {g})")
    if not f.fits:
        return PipelineDecision(1, g, fallback_reason=f"some rank lacks memory for two of {g} "
                                                      f"head groups' working sets")
    if not f.compared:
        return None
    if f.mismatch is not None:
        return PipelineDecision(1, g, fallback_reason=f"pipelined (G = {g}) and sequential "
                                                      f"outputs differ: {f.mismatch}")
    if f.sequential_us is None or f.pipelined_us is None:
        return None
    seq_us, pipe_us = f.sequential_us, f.pipelined_us
    best, _ = fastest({"sequential": [seq_us], "pipelined": [pipe_us]})
    if best == "pipelined":
        return PipelineDecision(g, g, seq_us, pipe_us)
    figures = f"sequential {seq_us:.1f} µs, pipelined (G = {g}) {pipe_us:.1f} µs"
    if math.isinf(pipe_us):
        reason = f"the pipelined forward failed while timing on some rank ({figures})"
    else:
        reason = f"measured slower or equal ({figures})"
    return PipelineDecision(1, g, seq_us, pipe_us, reason)


def decide_sync_path(f: SyncFacts) -> Decision:
    """The path of ``sync="auto"`` from the facts, pure: ``Decision(path, why not "shm")``.

    One host: "shm" when every rank can run the shm protocol, else "cpu". Several hosts: "shm"
    never (its segment lives in one host's memory); "hier" when every rank can run the shm
    protocol and some host holds two ranks or more (and its setup did not fail), else "cpu".
    """
    hosts = f.layout.reason()
    if f.shm_reason is not None:
        return Decision("cpu", "; ".join(w for w in (hosts, f.shm_reason) if w))
    if hosts is None:
        return Decision("shm")
    if max(len(r) for r in f.layout.ranks) == 1:
        return Decision("cpu", f"{hosts}; every host holds one rank of the group, so no rows "
                               f"meet in shared memory")
    if f.hier_failed is not None:
        return Decision("cpu", f"{hosts}; the hier path could not be set up: {f.hier_failed}")
    return Decision("hier", hosts)


# ------------------------------------------------------------------ the DCP backends' flow
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

    ``auto`` probes who can run (``agreed_reasons``), builds (``build_agreed``) and, when the
    choice is timed, measures; ``decide_backend`` chooses from those facts.

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

    facts = BackendFacts(op, preferred, tuple(rule_of_thumb),
                         agreed_reasons(group, list(auto_names or names), local_reason),
                         measured, rule)
    impls: dict[str, object] = {}
    setup: dict[str, str | None] = {}

    def probe_setup(n: str) -> None:
        impl, setup[n] = build_agreed(group, lambda: build(n), f"{n} setup")
        if impl is not None:
            impls[n] = impl
        else:
            log.warning("%s: %s setup failed (%s)", op, n, setup[n])

    if facts.timed:  # every candidate built, then timed when two or more are left
        for n in facts.candidates:
            probe_setup(n)
        facts = dataclasses.replace(facts, setup=dict(setup))
        if len(impls) > 1:
            facts = dataclasses.replace(facts, times=measure(group, impls, cases, prepare,
                                                             timer=timer))
    decision = decide_backend(facts)
    while decision.backend not in impls:  # not timed: build the choice; a failure is a fact
        probe_setup(decision.backend)
        facts = dataclasses.replace(facts, setup=dict(setup))
        decision = decide_backend(facts)
    for n, impl in impls.items():
        if n != decision.backend:
            _close(impl)
    if facts.timed:
        log.info("%s: auto chose %s (%s)", op, decision.backend,
                 _table(decision.times_us) if decision.times_us else "one candidate")
    return decision, impls[decision.backend]
