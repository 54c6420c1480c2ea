"""Seeded fuzz of every exchange on gloo CPU ranks against single-process references.

``python -m attncomm.testing.fuzz --cases N --seed S`` draws N cases (``attncomm.testing.cases``:
W 1..8, dtypes, T and sequence splits with zeros, uneven heads, GQA/MQA with Hkv < W, head_dim 1
and odd, idle DP ranks, special LSE values and payloads) for ``dcp.merge`` on every CPU backend
(torch and Triton-interpreted combines), ``seq_to_head`` / ``head_to_seq``, ``UlyssesAttention``
with qk-norm and RoPE, ``dp_gather`` / ``dp_scatter`` / ``dp_reduce_scatter`` and the DP sync.
Case i's seed is ``case_seed(S, i)``; every case is rebuilt from its seed alone, and a failure
prints ``python -m attncomm.testing.fuzz --replay SEED``.

Ranks are reused: one pool per world size, many cases per call. A case that raises may leave the
group out of step, so its batch stops there and the driver starts fresh ranks for the rest.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import random
import sys
import time
from collections.abc import Sequence

import torch

from .. import config
from ..launch import RankPool
from .cases import run_case, spec

__all__ = ["case_seed", "main", "run"]

_BATCH = 24


def case_seed(seed: int, index: int) -> int:
    """The seed of case ``index`` of the run seeded ``seed`` (48 bits)."""
    return random.Random(seed * 1_000_003 + index).getrandbits(48)


def replay_command(seed: int) -> str:
    return f"python -m attncomm.testing.fuzz --replay {seed}"


def _run_batch(rank, world, seeds, timeout_s):
    """On every rank: run the cases; ``[(seed, message or None, raised)]``, cut after the first
    case that raised (the group may be out of step after it)."""
    out = []
    with config.setting(ATTNCOMM_TIMEOUT_S=timeout_s):
        for s in seeds:
            try:
                msg = run_case(rank, world, spec(s))
            except Exception as exc:  # noqa: BLE001 - a failure of the case, reported
                out.append((s, f"rank {rank}: {type(exc).__name__}: {str(exc)[:400]}", True))
                break
            out.append((s, msg and f"rank {rank}: {msg}", False))
    return out


def _merge(per_rank: list, seeds: list) -> tuple[dict, list, bool]:
    """``({seed: [messages]}, seeds to rerun, whether a case raised)``: the cases up to the
    first one that raised on any rank count as run (later ones may have run out of step)."""
    stops = [len(res) - 1 for res in per_rank if res and res[-1][2]]
    n = min(stops) + 1 if stops else len(seeds)
    done: dict = {s: [] for s in seeds[:n]}
    for res in per_rank:
        for s, msg, _ in res[:n]:
            if msg:
                done[s].append(msg)
    return done, seeds[n:], bool(stops)


def run(cases: int, seed: int, *, worlds=range(1, 9), time_budget_s: float | None = None,
        pool_for=None, timeout_s: float = 60.0, log=print,
        case_seeds: Sequence[int] | None = None) -> dict:
    """Run ``cases`` cases of seed ``seed`` whose world size is in ``worlds`` (others skipped),
    or, with ``case_seeds``, exactly those cases (``cases`` and ``worlds`` unused).

    ``pool_for(W)`` gives a ``RankPool`` (e.g. the test session's pools): batches then go round
    the world sizes, so a time budget covers all of them. Default: one new pool per world size
    at a time, world by world, each closed when its cases are done. No batch starts after
    ``time_budget_s``. Returns the summary (see ``main``)."""
    t0 = time.monotonic()
    queues: dict = collections.defaultdict(list)
    if case_seeds is None:
        case_seeds = [s for s in (case_seed(seed, i) for i in range(cases))
                      if spec(s)["W"] in worlds]
    else:
        cases = len(case_seeds)
    for s in case_seeds:
        queues[spec(s)["W"]].append(s)
    interleave = pool_for is not None
    pool_for = pool_for or (lambda w: RankPool(w, device="cpu"))
    pools: dict = {}
    results: dict = {}
    isolate: set = set()
    turn = 0
    while any(queues.values()) and not (time_budget_s and time.monotonic() - t0 > time_budget_s):
        ready = [w for w in sorted(queues) if queues[w]]
        w = ready[turn % len(ready)] if interleave else ready[0]
        turn += 1
        if not interleave:
            for other in [x for x in pools if x != w]:
                pools.pop(other).close(force=True)
        pool = pools.get(w)
        if pool is None or not pool.alive:
            pool = pools[w] = pool_for(w)
        todo = queues[w]
        n = 1 if todo[0] in isolate else _BATCH
        batch, queues[w] = todo[:n], todo[n:]
        try:
            per_rank = pool.run(_run_batch, batch, timeout_s, timeout_s=timeout_s * 6 + 120)
        except Exception as exc:  # noqa: BLE001 - the ranks themselves failed
            pool.close(force=True)
            if len(batch) > 1:  # find the case: one per batch from here
                isolate.update(batch)
                queues[w] = batch + queues[w]
                continue
            per_rank = [[(batch[0], f"the ranks failed: {type(exc).__name__}: {exc}", True)]]
        done, rerun, raised = _merge(per_rank, batch)
        results.update(done)
        queues[w] = rerun + queues[w]
        if raised:
            pool.close(force=True)  # fresh ranks after a case that raised
    if not interleave:
        for pool in pools.values():
            pool.close(force=True)
    return _summary(results, seed, cases, time.monotonic() - t0, log)


def _summary(results: dict, seed: int, cases: int, elapsed: float, log) -> dict:
    by_kind, by_world, failures = collections.Counter(), collections.Counter(), []
    for s, msgs in results.items():
        sp = spec(s)
        by_kind[sp["kind"]] += 1
        by_world[sp["W"]] += 1
        if msgs:
            failures.append({"seed": s, "kind": sp["kind"], "W": sp["W"],
                             "messages": msgs[:4], "replay": replay_command(s)})
            log(f"FAIL case {s} ({sp['kind']}, W={sp['W']}): {msgs[0]}\n"
                f"  replay: {replay_command(s)}")
    return {"seed": seed, "cases_drawn": cases, "cases_run": len(results),
            "failures": failures, "by_kind": dict(sorted(by_kind.items())),
            "by_world": dict(sorted(by_world.items())), "elapsed_s": round(elapsed, 1),
            "date": datetime.date.today().isoformat(), "machine": _machine()}


def _machine() -> dict:
    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__}


def replay(seed: int, log=print) -> int:
    """Run one case on fresh ranks and print its parameters and verdict."""
    sp = spec(seed)
    log(f"case {seed}: {sp}")
    with RankPool(sp["W"], device="cpu") as pool:
        done, _, _ = _merge(pool.run(_run_batch, [seed], 60.0), [seed])
    msgs = done.get(seed, ["not run"])
    log("pass" if not msgs else "FAIL: " + " | ".join(msgs))
    return 1 if msgs else 0


def markdown(summary: dict) -> str:
    m = summary["machine"]
    command = (f"`python -m attncomm.testing.fuzz --cases {summary['cases_drawn']} --seed "
               f"{summary['seed']}` on {m['platform']}, {m['cpus']} CPUs (shared), Python "
               f"{m['python']}, torch {m['torch']}, gloo ranks.")
    verdict = (f"**{summary['cases_run']} cases run, {len(summary['failures'])} failed**, "
               f"{summary['elapsed_s']:.0f} s.")
    lines = [f"# Fuzz run, {summary['date']}", "", command, "", verdict, "",
             "| kind | cases |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["by_kind"].items()]
    lines += ["", "| W | cases |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["by_world"].items()]
    if summary["failures"]:
        lines += ["", "Failures:", ""]
        lines += [f"- case {f['seed']} ({f['kind']}, W={f['W']}): {f['messages'][0]} — "
                  f"`{f['replay']}`" for f in summary["failures"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncomm.testing.fuzz",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, metavar="CASE_SEED", help="run one case again")
    ap.add_argument("--max-world", type=int, default=8, help="skip cases with W above this")
    ap.add_argument("--time-budget", type=float, help="stop starting batches after this (s)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--md", help="write the summary as Markdown here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        # The Triton combine cases run under the interpreter on CPU (the ranks inherit this).
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if a.replay is not None:
        return replay(a.replay)
    summary = run(a.cases, a.seed, worlds=range(1, a.max_world + 1),
                  time_budget_s=a.time_budget)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(summary, f, indent=1)
    if a.md:
        with open(a.md, "w") as f:
            f.write(markdown(summary))
    print(f"{summary['cases_run']} cases run, {len(summary['failures'])} failed, "
          f"{summary['elapsed_s']:.0f} s; by kind {summary['by_kind']}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
