"""Timers: GPU work eager (CUDA events) and inside a CUDA graph; host µs of calls, interleaved.

The library itself times with them (``DcpMerger(backend="auto")`` measures its candidates); the
benchmarks reach them through ``attncomm.bench.common``. This module imports nothing of attncomm,
so a script can load it by path and time an older tree's calls with it.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["time_eager", "time_graph", "time_host", "paired"]


def time_eager(fn: Callable[[], object], *, warmup: int = 10, iters: int = 100,
               device: str = "cuda", barrier: Callable[[], None] | None = None) -> list[float]:
    """Per-iteration times of ``fn()`` in µs. On CUDA each iteration is timed with events and
    preceded by ``barrier`` (e.g. a group barrier) so ranks start together."""
    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            if barrier is not None:
                barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return times


def time_graph(fn: Callable[[], object], *, per_graph: int = 10, warmup: int = 10,
               iters: int = 100, barrier: Callable[[], None] | None = None,
               back_to_back: bool = False, stats: dict | None = None) -> list[float]:
    """Capture ``per_graph`` consecutive calls of ``fn`` in one CUDA graph (as an engine's graph
    holds every layer) and return replay time / ``per_graph`` per iteration, in µs.

    ``back_to_back=False``: ``barrier`` before every timed replay (ranks start each replay
    together; for transfers long next to a barrier). ``True``: one ``barrier``, then the replays
    run back to back, each between its own events (for µs-scale work, where a per-replay barrier
    would dominate; ranks stay in step through the exchange itself). There, ``stats`` (a dict,
    if given) receives ``gpu_idle_us``: the median time the GPU sat between one replay's end
    event and the next one's start event, per call. Enqueued ahead, the next replay follows at
    once; a gap means the GPU waited for the host, and the times then measure the host (across
    ranks, the slowest rank's host), not the work."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    torch.cuda.synchronize()
    if not back_to_back:
        times = time_eager(graph.replay, warmup=warmup, iters=iters, device="cuda",
                           barrier=barrier)
        return [t / per_graph for t in times]
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    if barrier is not None:
        barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    if stats is not None and len(events) > 1:
        gaps = [e.elapsed_time(s) * 1e3 for (_, e), (s, _) in zip(events, events[1:])]
        stats["gpu_idle_us"] = statistics.median(gaps) / per_graph
    return [s.elapsed_time(e) * 1e3 / per_graph for s, e in events]


def time_host(fns: Sequence[Callable[[], object]], *, repeats: int = 200, rounds: int = 10,
              warmup: int = 10, before: Callable[[], None] | None = None
              ) -> list[list[list[float]]]:
    """Host µs of single calls of each of ``fns``, interleaved: ``times[i][r]`` holds the times
    of ``fns[i]`` in round ``r``, ``ceil(repeats / rounds)`` calls each, in ``min(rounds,
    repeats)`` rounds.

    Each round times every function in turn (the order rotated by one per round), each call
    preceded by ``before()`` (e.g. a synchronize, so the call starts on an idle device) and
    timed alone with ``time.perf_counter_ns``. A machine whose speed drifts (a shared host,
    clocks) drifts within a round by far less than over a whole block of one function's calls,
    so figures compared round by round (``paired``) cancel most of it. ``warmup`` untimed calls
    of each function come first. ``ValueError`` if ``repeats`` or ``rounds`` is below 1."""
    if repeats < 1 or rounds < 1:
        raise ValueError(f"time_host: repeats and rounds must be ≥ 1, got {repeats}, {rounds}")
    rounds = min(rounds, repeats)
    calls = -(-repeats // rounds)
    for fn in fns:
        for _ in range(warmup):
            fn()
    n = len(fns)
    times: list[list[list[float]]] = [[[] for _ in range(rounds)] for _ in fns]
    for r in range(rounds):
        for k in range(n):
            i = (k + r) % n
            fn, out = fns[i], times[i][r]
            for _ in range(calls):
                if before is not None:
                    before()
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1e3)
    return times


def paired(call: Sequence[float], unit: Sequence[float],
           baseline: Sequence[float] | None = None) -> float:
    """The median over rounds of ``(call[r] − baseline[r]) / unit[r]`` (no baseline: of
    ``call[r] / unit[r]``): a host cost in units, each round against the unit and baseline
    timed beside it (per-round figures, e.g. medians of ``time_host``'s rounds)."""
    base = baseline if baseline is not None else [0.0] * len(call)
    if not len(call) == len(unit) == len(base):
        raise ValueError(f"paired: rounds differ: call {len(call)}, unit {len(unit)}, "
                         f"baseline {len(base)}")
    return statistics.median((c - b) / u for c, b, u in zip(call, base, unit))
