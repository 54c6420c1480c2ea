"""``pipeline_groups=-1`` decided by measurement, and the head-group count it considers.

Head-group pipelining (``UlyssesAttention``, G ≥ 2) overlaps group g+1's exchange with group
g's attention; whether that beats one sequential exchange depends on the shape, the transport
and the machine, so it is measured on the machine itself, once per shape, as the DCP merge's
``auto`` measures its backends. The choice is ``select.decide_depth`` over agreed facts
(``attncomm.select``: probe, then decide); the probes, in the order they cost, are here:

1. On CPU, on ranks that share a GPU (time-sliced: ``capability.unmeasured_reason``), or with
   ``measured=False``, nothing is timed: sequential, the reason in ``fallback_reason``.
2. ``auto_groups``' count G < 2: sequential (nothing to pipeline).
3. One sequential and one pipelined forward, their outputs compared bit for bit (pipelined and
   sequential compute the same attention; a difference means the pipelined path is wrong for
   this shape) and the verdict agreed across ranks: a mismatch on any rank keeps sequential,
   naming the ranks and what differed.
4. Both timed on every rank (``timer``: by default a warm-up, then a few forwards between CUDA
   events, median), through ``select.measure``: an all_reduce(MAX) over the group's gloo twin,
   so every rank sees the slowest rank's figures and ``select.fastest`` picks the same one
   everywhere (a tie keeps sequential; a forward that raised on any rank counts as inf).
5. The ``PipelineDecision`` is cached per (group, signature): the next call with that
   signature returns it without running anything. ``attncomm.release(group)`` drops the
   group's decisions.

``auto_groups`` is the count considered (from the SM count agreed across ranks); ``fits``
agrees, before any allocation, that every rank has room for two groups' working sets;
``choose_groups`` is what ``UlyssesAttention`` calls for a new forward shape: the cached
decision, else the rule (memory, then measurement) with the plans it builds.

Every rank must call ``decide_pipeline`` at the same point with the same signature (the
caller's agreed signature) and ``groups``: it is collective whenever it is not cached.
Dependency direction: this module imports ``select`` and the substrate, never the attention
module that calls it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist

from .. import _agree, _dist, capability
from .._timing import time_eager
from ..select import NOT_MEASURED, DepthFacts, PipelineDecision, decide_depth, measure
from .layout import head_split

__all__ = ["PipelineDecision", "decide_pipeline", "cached_decision", "event_timer",
           "CACHE_SIZE", "NOT_MEASURED", "auto_groups", "choose_groups", "fits", "MAX_GROUPS",
           "MIN_WAVES"]

#: ``auto_groups`` bounds: at most this many groups (each adds launches and flag waits)...
MAX_GROUPS = 8
#: ... and each group's attention at least this many waves of 128-row query blocks over the
#: SMs (a group's last, partial wave leaves SMs idle; G groups pay that tail G times).
MIN_WAVES = 1.5
_BLOCK_M = 128

#: Decisions kept per group (least recently used dropped first).
CACHE_SIZE = 64
_DECISIONS: dict = {}


def event_timer(fn: Callable[[], object], *, warmup: int = 2, iters: int = 5,
                barrier: Callable[[], None] | None = None) -> float:
    """µs per call of ``fn``: ``warmup`` calls, then ``iters`` calls each between two CUDA
    events (after ``barrier``, so ranks start each forward together), median."""
    return statistics.median(time_eager(fn, warmup=warmup, iters=iters, device="cuda",
                                        barrier=barrier))


def cached_decision(group, signature: Hashable) -> PipelineDecision | None:
    """The decision cached for (``group``, ``signature``), or None (no collective)."""
    return _DECISIONS.get(_dist.group_key(group), {}).get(signature)


def decide_pipeline(group, signature: Hashable, sequential: Callable[[], object],
                    pipelined: Callable[[], object], groups: int, *,
                    timer: Callable[[Callable[[], object]], float] | None = None,
                    measured: bool | None = None,
                    device: torch.device | None = None,
                    rule: str | None = None) -> PipelineDecision:
    """Choose sequential or ``groups`` head groups for ``signature`` (the module docstring).

    Arguments:
        group: the Ulysses process group (collective over it unless cached).
        signature: hashable, equal on every rank: what the decision is for (shapes, dtypes,
            sequence lengths, transport...).
        sequential, pipelined: ``() -> output`` (a tensor or a tuple/list of tensors): one
            forward each, on the caller's inputs; pipelined with ``groups`` head groups.
        groups: ``auto_groups``' count.
        timer: ``timer(fn) -> µs`` (default ``event_timer`` with a barrier on the group's gloo
            twin); tests inject their own.
        measured: time the variants (default: when ``device`` is CUDA).
        device: where the forwards run (default: the group's device).
        rule: why nothing is timed when ``measured`` is False (the decision's
            ``fallback_reason``; default ``NOT_MEASURED``).

    Returns the ``PipelineDecision`` (cached per (group, signature)).
    """
    key = _dist.group_key(group)
    lru = _DECISIONS.setdefault(key, {})
    hit = lru.pop(signature, None)
    if hit is None:
        if measured is None:
            measured = (device or _dist.group_device(group)).type == "cuda"
        hit = _decide(group, sequential, pipelined, groups, timer, measured, rule)
    lru[signature] = hit  # most recent last
    while len(lru) > CACHE_SIZE:
        lru.pop(next(iter(lru)))
    return hit


def _decide(group, sequential, pipelined, groups, timer, measured, rule) -> PipelineDecision:
    # The facts in the order they cost: the rule, then one forward of each (compared), then
    # the timings; ``select.decide_depth`` says after each whether it needs the next.
    facts = DepthFacts(groups, unmeasured=None if measured else rule or NOT_MEASURED)
    decision = decide_depth(facts)
    if decision is None:
        facts = dataclasses.replace(facts, compared=True,
                                    mismatch=_agreed_mismatch(group, sequential, pipelined))
        decision = decide_depth(facts)
    if decision is None:
        if timer is None:
            g = _dist.cpu_group(group)
            timer = functools.partial(event_timer, barrier=lambda: dist.barrier(group=g))
        impls = {"sequential": sequential, "pipelined": pipelined}
        times = measure(group, impls, [None], lambda fn, _case: fn, timer=timer)
        decision = decide_depth(dataclasses.replace(  # one case each
            facts, sequential_us=times["sequential"][0], pipelined_us=times["pipelined"][0]))
    return decision


def _agreed_mismatch(group, sequential, pipelined) -> str | None:
    """Run each forward once and compare the outputs bit for bit; the verdict (None: equal on
    every rank) agreed over the group, naming each rank's difference."""
    try:
        local = _bits_differ(sequential(), pipelined())
    except Exception as exc:  # noqa: BLE001 - agreed below: every rank keeps sequential
        local = f"a forward raised {type(exc).__name__}: {exc}"
    return _agree.agree_reason(group, local, "pipeline check")


def _bits_differ(a, b) -> str | None:
    """Why ``a`` and ``b`` (tensors, or tuples/lists of them) are not the same bits."""
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        if not isinstance(a, (tuple, list)) or not isinstance(b, (tuple, list)) \
                or len(a) != len(b):
            return "the outputs have different structures"
        for i, (x, y) in enumerate(zip(a, b)):
            why = _bits_differ(x, y)
            if why is not None:
                return f"output {i}: {why}"
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{list(a.shape)} {a.dtype} vs {list(b.shape)} {b.dtype}"
    xa = a.detach().reshape(-1).contiguous().view(torch.uint8)
    xb = b.detach().reshape(-1).contiguous().view(torch.uint8)
    n = int((xa != xb).sum().item())
    return None if n == 0 else f"{n} of {xa.numel()} bytes differ"


@_dist.on_release
def _release(key) -> None:
    _DECISIONS.pop(key, None)
    for k in [k for k in _FITS if k[0] == key]:
        del _FITS[k]


# ------------------------------------------------------------------ the count and its checks
def auto_groups(heads_per_rank, batch: int, seq_total: int, sm_count: int,
                max_groups: int = MAX_GROUPS, min_waves: float = MIN_WAVES) -> int:
    """The head-group count ``pipeline_groups=-1`` uses when it pipelines: the largest
    ``G ≤ max_groups`` that splits every rank's query heads evenly (``heads_per_rank``, e.g.
    ``head_split(Hq, W)``) and keeps each group's attention ``≥ min_waves`` waves deep
    (``batch · h_r/G · ⌈S/128⌉ ≥ min_waves · sm_count`` on the rank with the fewest heads);
    1 when none does. 56 heads at W = 2, 4, 8 and S = 32768 on 132 SMs → 7 (SGLang's choice
    for MiniMax-H3)."""
    busy = [h for h in heads_per_rank if h > 0]
    if not busy or sm_count < 1:
        return 1
    blocks = batch * math.ceil(seq_total / _BLOCK_M)
    for g in range(min(max_groups, min(busy)), 1, -1):
        if all(h % g == 0 for h in busy) and blocks * (min(busy) // g) >= min_waves * sm_count:
            return g
    return 1


def choose_groups(group, signature, build, run, device, dims, rows, seq):
    """``pipeline_groups=-1``: ``(plan, PipelineDecision)`` for a new forward shape.
    ``build(n)`` makes the plan of ``n`` head groups, ``run(plan)`` runs one forward with it;
    ``dims`` is ``(B, Hq, Hkv, D, Dv)``, ``rows`` the rows attention runs over, ``seq`` every
    rank's ``S_r``. The decision cached for ``signature`` (this group's, from any module) is
    taken as it is; otherwise, where ``_measurement`` says to measure (CUDA), ``auto_groups``'
    count (from the SM count agreed across ranks) is checked for memory (``fits``) and
    ``decide_pipeline`` runs the sequential and the pipelined plan, compares and times them;
    on CPU it decides sequential without running anything. Collective unless cached."""
    hit = cached_decision(group, signature)
    if hit is not None:
        return build(hit.groups), hit
    measured, timer = _measurement(device)
    rule = None
    if measured and device.type == "cuda":
        # Ranks that share a GPU time-slice it: their timings say nothing (by rule).
        rule = capability.unmeasured_reason(group, device)
        measured = rule is None
    cand = 1
    if measured:
        sms = _agree.agreed_min(group, _sm_count(device))
        cand = auto_groups(head_split(dims[1], dist.get_world_size(group)), dims[0], rows, sms)
        if cand >= 2 and not fits(group, cand, device, dims, seq, rows):
            return build(1), decide_depth(DepthFacts(cand, fits=False))
    seq_plan = build(1)
    pipe_plan = build(cand) if measured and cand >= 2 else None
    decision = decide_pipeline(group, signature, lambda: run(seq_plan), lambda: run(pipe_plan),
                               cand, timer=timer, measured=measured, device=device, rule=rule)
    return (pipe_plan if decision.pipelined else seq_plan), decision


def fits(group, g: int, device, dims, seq, rows) -> bool:
    """Whether every rank has room for two of ``g`` head groups' working sets (one
    all_reduce(MIN) over the gloo twin of ``group`` before any allocation, cached per call
    shape, so a later call does not ask); ``dims``, ``seq``, ``rows`` as ``choose_groups``."""
    b, hq, hkv, d, dv = dims
    rank = dist.get_rank(group)
    h_r = head_split(hq, dist.get_world_size(group))[rank]
    item = 4  # an upper bound for fp16/bf16/fp32
    work = b * (seq[rank] * (hq + 2 * hkv) * d          # fill send buffer
                + rows * (h_r + 2 * hkv) * d            # receive buffer (≤ all KV heads)
                + rows * h_r * dv) * item               # attention output
    need = 2 * -(-work // g)
    ck = (_dist.group_key(group), device.type, (dims, tuple(seq), rows, g))
    if ck not in _FITS:
        free = _free_bytes(device)
        if len(_FITS) > 256:
            _FITS.clear()
        _FITS[ck] = _agree.agreed_min(group, int(free is None or free >= need)) == 1
    return _FITS[ck]


#: ``(group_key(group), device type, call shape) → bool``: ``fits``' agreed verdicts, keyed by
#: the group object (never ``id``, which can be reused) and a shape every rank computes alike.
_FITS: dict = {}


def _free_bytes(device) -> int | None:
    """Memory this rank can still allocate on ``device`` (free + cached by torch's allocator);
    None where there is no bound worth checking (CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _sm_count(device) -> int:
    """The device's SM count (0 on CPU: ``auto_groups`` then finds no split)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def _measurement(device) -> tuple[bool, object]:
    """``(measure, timer)`` for ``pipeline_groups=-1`` on ``device``: measured on CUDA with the
    default timer (None); on CPU not measured. Tests replace it to drive the measured decision
    on CPU ranks with a fake timer."""
    return device.type == "cuda", None
