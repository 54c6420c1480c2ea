"""The GPU fault matrix: the peer-mapped exchanges × eager / graph-replayed × fault, on fresh
worlds of W processes that share one GPU (CUDA IPC peers, a gloo group).

Exchanges: ``symm_a2a`` (``DcpMerger``), ``gather_symm`` (``DcpQueryGather``), ``ce``
(``ulysses.seq_to_head``). Faults, always on the last rank (the victim):

- ``kill_before``: the victim is SIGKILLed before the exchange; the others call a second later;
- ``kill_inside``: the others call at once and wait inside the exchange; the victim is
  SIGKILLed a second later, without calling;
- ``skip``: the victim never calls (it sleeps past the budget, then exits);
- ``shape``: eager, every rank calls with a shape it has not used before and the victim's
  differs (the first-sight argument check); graph-replayed, the victim replays a graph captured
  for another shape while the others replay theirs (no host check between replays).

Every survivor must raise within ``timeout_s + 10`` s: ``PeerTimeoutError`` naming the victim,
or for an eager ``shape`` fault ``ValueError`` (the victim survives that one too). Outcomes:
``PeerTimeoutError``, ``ValueError``, ``no_error`` (returned right rows: the fault went
unnoticed), ``wrong_row`` (returned rows that differ from the reference), ``hang`` (no report
within ``timeout_s + 60`` s). After the error each survivor must still free the exchange
(``close()`` / ``attncomm.release()``) and run a fresh CUDA op.

``python -m attncomm.testing.gpu_faults --json PATH [--timeout 4] [--jobs 4] [--world 2 3]``
runs the matrix (on a CUDA machine) and writes one record per cell.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from attncomm import _dist, config, dcp, ulysses
from attncomm.errors import PeerTimeoutError
from attncomm.launch import init_distributed
from attncomm.testing.faults import run_world
from attncomm.testing.reference import ref_merge
from attncomm.ulysses.policy import get_transport

__all__ = ["EXCHANGES", "MODES", "FAULTS", "Record", "judge", "run_cell", "run_matrix", "main"]

EXCHANGES = ("symm_a2a", "gather_symm", "ce")
MODES = ("eager", "graph")
FAULTS = ("kill_before", "kill_inside", "skip", "shape")
#: Seconds past ``timeout_s`` a survivor may take to raise (time slices of the shared GPU).
SLACK_S = 10.0
H, D = 8, 64          # merge / gather geometry (heads divisible by W = 2 and 4; 8 at W = 3: no)
T, T_OTHER = 8, 5     # tokens of the call and of the victim's other graph


# ------------------------------------------------------------------------------ one exchange
class _Case:
    """One exchange on this rank: ``call(step, shape)`` runs it on fresh inputs of that step
    (the same on every rank: each rank draws every rank's inputs from the step's seed) and
    returns ``(result, want, exact)``; ``check()`` raises a recorded timeout; ``close()``
    frees it."""

    def __init__(self, exchange: str, rank: int, world: int, timeout_s: float):
        self.exchange, self.rank, self.world, self.timeout_s = exchange, rank, world, timeout_s
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.heads = H if H % world == 0 else H * world  # symm_a2a / gather: H % W == 0
        if exchange == "symm_a2a":
            self.obj = dcp.DcpMerger(max_tokens=16, num_heads=self.heads, head_dim=D,
                                     dtype=torch.bfloat16, backend="symm_a2a",
                                     timeout_s=timeout_s)
        elif exchange == "gather_symm":
            self.obj = dcp.DcpQueryGather(max_tokens=16, num_heads=self.heads, head_dim=D,
                                          dtype=torch.bfloat16, backend="symm",
                                          timeout_s=timeout_s)
        else:
            self.obj = None  # ulysses.seq_to_head: the functional call's transport
        self.static: dict = {}

    def _inputs(self, step: int, n: int):
        g = torch.Generator(device=self.dev).manual_seed(1000 + step)
        W, hs = self.world, self.heads // self.world
        if self.exchange == "symm_a2a":
            outs = torch.randn((W, n, self.heads, D), generator=g, device=self.dev)
            lses = torch.randn((W, n, self.heads), generator=g, device=self.dev) * 3
            lses[:, 0, 0] = float("-inf")  # an empty shard of row 0, head 0 on every rank
            outs[:, 0, 0] = float("nan")   # whose payload is never read
            outs = outs.to(torch.bfloat16)
            sl = slice(self.rank * hs, (self.rank + 1) * hs)
            want, _ = ref_merge(outs[:, :, sl].cpu(), lses[:, :, sl].cpu())
            return (outs[self.rank].contiguous(), lses[self.rank].contiguous()), want
        if self.exchange == "gather_symm":
            qs = torch.randn((W, n, hs, D), generator=g, device=self.dev).to(torch.bfloat16)
            return (qs[self.rank].contiguous(),), torch.cat(list(qs), dim=1)
        h = 2 * W + 1  # uneven heads: ranks hold different counts
        full = torch.randn((1, n * W, h, D), generator=g, device=self.dev).to(torch.bfloat16)
        offs = [sum(ulysses.head_split(h, W)[:r]) for r in range(W + 1)]
        x = full[:, self.rank * n:(self.rank + 1) * n].contiguous()
        return (x,), full[:, :, offs[self.rank]:offs[self.rank + 1]]

    def _run(self, args):
        if self.exchange == "symm_a2a":
            return self.obj(*args)
        if self.exchange == "gather_symm":
            return self.obj(*args)
        return ulysses.seq_to_head(args[0], backend="ce", timeout_s=self.timeout_s)

    def call(self, step: int, n: int):
        args, want = self._inputs(step, n)
        return self._run(args), want, self.exchange != "symm_a2a"

    def functional(self, step: int, n: int):
        """The first-sight-checked functional form (the ``shape`` fault, eager)."""
        args, want = self._inputs(step, n)
        if self.exchange == "symm_a2a":
            res = dcp.merge(*args, backend="symm_a2a", timeout_s=self.timeout_s)
        elif self.exchange == "gather_symm":
            res = dcp.gather_heads(*args, backend="symm", timeout_s=self.timeout_s)
        else:
            res = self._run(args)
        return res, want, self.exchange != "symm_a2a"

    def capture(self, n: int) -> None:
        """A graph of one call of ``n`` tokens (rows), captured after an eager call of it."""
        args, _ = self._inputs(0, n)
        static = tuple(a.clone() for a in args)
        self._run(static)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = self._run(static)
        self.static[n] = (graph, static, out)

    def replay(self, step: int, n: int):
        graph, static, out = self.static[n]
        args, want = self._inputs(step, n)
        for s, a in zip(static, args):
            s.copy_(a)
        graph.replay()
        return out, want, self.exchange != "symm_a2a"

    def check(self) -> None:
        if self.obj is not None:
            self.obj.check()
        else:  # the functional call's transport raises a recorded timeout when asked for
            get_transport(None, "ce", self.dev, self.timeout_s)

    def close(self) -> None:
        if self.obj is not None:
            self.obj.close()
        _dist.release()


def _rows_ok(res, want, exact: bool) -> bool:
    res = res.detach()
    if exact:
        return bool(torch.equal(res.contiguous().view(torch.uint8),
                                want.contiguous().view(torch.uint8)))
    got = res.double().cpu()
    if not bool(torch.isfinite(got).all()):
        return False
    return bool(((got - want).abs() <= 2e-2 * (1 + want.abs())).all())


# ------------------------------------------------------------------------------ one rank
def _survivor(case: _Case, mode: str, fault: str, victim: bool, t0: float):
    """The fault's call on a rank that is not dying: the outcome dict."""
    if fault == "kill_before":
        time.sleep(1.0)
    out = {"kind": "no_error", "peers": None, "message": ""}
    try:
        if mode == "eager" and fault == "shape":
            res, want, exact = case.functional(2, T + 3 + (1 if victim else 0))
        elif mode == "eager":
            res, want, exact = case.call(2, T)
        else:
            res, want, exact = case.replay(2, T_OTHER if victim and fault == "shape" else T)
        torch.cuda.synchronize()
        case.check()
        if not _rows_ok(res, want, exact):
            out["kind"] = "wrong_row"
    except PeerTimeoutError as exc:
        out = {"kind": "PeerTimeoutError", "peers": exc.peer_ranks, "message": str(exc)[:600]}
    except ValueError as exc:
        out = {"kind": "ValueError", "peers": None, "message": str(exc)[:600]}
    out["seconds"] = time.monotonic() - t0
    return out


def _rank_main(rank, world, path, exchange, mode, fault, timeout_s, results):
    try:
        init_distributed(rank, world, "cuda", f"file://{path}", gpu=0, shared_gpu=True)
        case = _Case(exchange, rank, world, timeout_s)
        victim = rank == world - 1
        for step in range(2):  # warm-up: right rows on every rank first
            res, want, exact = case.call(step, T)
            torch.cuda.synchronize()
            if not _rows_ok(res, want, exact):
                raise RuntimeError(f"warm-up call {step} gave wrong rows")
        if mode == "graph":
            case.capture(T)
            case.capture(T_OTHER)
            res, want, exact = case.replay(1, T)
            torch.cuda.synchronize()
            if not _rows_ok(res, want, exact):
                raise RuntimeError("the first replay gave wrong rows")
        g = _dist.cpu_group()
        _dist.wait(dist.barrier(group=g, async_op=True), g, "fault start", 60.0)
        t0 = time.monotonic()
        if victim and fault == "kill_before":
            os.kill(os.getpid(), signal.SIGKILL)
        if victim and fault == "kill_inside":
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        if victim and fault == "skip":
            time.sleep(timeout_s + 5)
            results.put((rank, {"kind": "skipped"}))
            os._exit(0)
        out = _survivor(case, mode, fault, victim, t0)
        t1 = time.monotonic()
        try:
            case.close()
            out["closed"] = True
        except Exception as exc:  # noqa: BLE001 - reported
            out["closed"] = f"{type(exc).__name__}: {exc}"[:300]
        out["close_seconds"] = time.monotonic() - t1
        try:
            out["context_ok"] = float(torch.ones(64, device=case.dev).sum().item()) == 64.0
        except Exception as exc:  # noqa: BLE001 - reported
            out["context_ok"] = f"{type(exc).__name__}: {exc}"[:300]
        results.put((rank, out))
    except BaseException as e:  # noqa: BLE001 - set-up failed: reported as such
        results.put((rank, {"kind": "setup failed", "message": f"{type(e).__name__}: {e}"[:600]}))
    os._exit(0)  # a world a fault broke can hang in its teardown


# ------------------------------------------------------------------------------ the parent
@dataclass
class Record:
    """One cell: the documented keys (``exchange``, ``mode``, ``fault``, ``world_size``,
    ``timeout_s``, ``outcome``, ``seconds``), then each rank's details and the verdict."""

    exchange: str
    mode: str
    fault: str
    world_size: int
    timeout_s: float
    outcome: str = "hang"
    seconds: float | None = None
    ranks: dict = field(default_factory=dict)
    exit_codes: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)


def judge(rec: Record) -> Record:
    """Fill ``outcome`` (the survivors' worst), ``seconds`` (the slowest survivor's) and
    ``failures`` (empty: the cell passes) from ``ranks`` and ``exit_codes``."""
    victim = rec.world_size - 1
    survivors = [r for r in range(rec.world_size)
                 if r != victim or (rec.fault == "shape" and rec.mode == "eager")]
    want = "ValueError" if rec.fault == "shape" and rec.mode == "eager" else "PeerTimeoutError"
    kinds, seconds, f = [], [], rec.failures
    for r in survivors:
        o = rec.ranks.get(r)
        if o is None:
            kinds.append("hang")
            f.append(f"rank {r} never reported (exit code {rec.exit_codes.get(r)})")
            continue
        if o["kind"] == "setup failed":
            kinds.append("setup failed")
            f.append(f"rank {r}: {o['message']}")
            continue
        kinds.append(o["kind"])
        seconds.append(o["seconds"])
        if o["kind"] != want:
            f.append(f"rank {r}: {o['kind']}, expected {want}: {o['message'][:200]}")
        if o["kind"] == "PeerTimeoutError" and o["peers"] != [victim]:
            f.append(f"rank {r}: PeerTimeoutError names {o['peers']}, not [{victim}]")
        if o["seconds"] > rec.timeout_s + SLACK_S:
            f.append(f"rank {r}: took {o['seconds']:.1f} s > timeout + {SLACK_S:g} s")
        if o.get("closed") is not True:
            f.append(f"rank {r}: could not free the exchange: {o.get('closed')}")
        if o.get("context_ok") is not True:
            f.append(f"rank {r}: CUDA context unusable after the fault: {o.get('context_ok')}")
    if rec.fault.startswith("kill") and rec.exit_codes.get(victim) != -signal.SIGKILL:
        f.append(f"the victim was meant to be SIGKILLed; exit code {rec.exit_codes.get(victim)}")
    order = ("hang", "setup failed", "wrong_row", "no_error", "PeerTimeoutError", "ValueError")
    rec.outcome = min(kinds, key=lambda k: order.index(k) if k in order else 0) if kinds \
        else "hang"
    rec.seconds = max(seconds) if seconds else None
    return rec


def run_cell(exchange: str, mode: str, fault: str, world: int = 2,
             timeout_s: float = 4.0) -> Record:
    """One cell on a fresh world of ``world`` processes on GPU 0, judged (start-up and JIT,
    then the fault: a rank that has not reported ``timeout_s + 120`` s after the start hangs)."""
    rec = Record(exchange, mode, fault, world, timeout_s)
    rec.ranks, rec.exit_codes = run_world(_rank_main, world, (exchange, mode, fault, timeout_s),
                                          timeout_s + 120, prefix="attncomm-gpu-faults-")
    return judge(rec)


def run_matrix(exchanges=EXCHANGES, modes=MODES, faults=FAULTS, worlds=(2, 3), *,
               timeout_s: float = 4.0, jobs: int = 4, progress=None) -> list[Record]:
    """Every cell, ``jobs`` worlds at a time (they share the GPU; the cells mostly wait)."""
    todo = [(e, m, f, w) for w in worlds for e in exchanges for m in modes for f in faults]
    out = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_cell, e, m, f, w, timeout_s) for e, m, f, w in todo]
        for fut in futures:
            out.append(fut.result())
            if progress is not None:
                progress(out[-1])
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncomm.testing.gpu_faults",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=4.0, help="each exchange's timeout_s")
    ap.add_argument("--jobs", type=int, default=4, help="worlds run at once")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--exchange", nargs="+", choices=EXCHANGES, default=list(EXCHANGES))
    ap.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--fault", nargs="+", choices=FAULTS, default=list(FAULTS))
    ap.add_argument("--json", metavar="PATH", help="write the records here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU fault matrix needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()

    def show(rec: Record) -> None:
        verdict = "pass" if not rec.failures else "FAIL: " + "; ".join(rec.failures)
        secs = "-" if rec.seconds is None else f"{rec.seconds:.1f}"
        print(f"| {rec.exchange} | {rec.mode} | {rec.fault} | {rec.world_size} | "
              f"{rec.outcome} | {secs} | {verdict} |", flush=True)

    print("| exchange | mode | fault | W | outcome | seconds | verdict |")
    print("|---|---|---|---|---|---|---|")
    recs = run_matrix(a.exchange, a.mode, a.fault, a.world, timeout_s=a.timeout, jobs=a.jobs,
                      progress=show)
    bad = sum(1 for r in recs if r.failures)
    print(f"\n{len(recs)} cells, {bad} failed, {time.monotonic() - t0:.0f} s "
          f"(timeout_s={a.timeout:g}, {datetime.date.today()})")
    if a.json:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "machine": config.raw("ATTNCOMM_MACHINE") or None,
                "shared_gpu": "every world's ranks on GPU 0 (CUDA IPC, gloo group)",
                "timeout_s": a.timeout, "slack_s": SLACK_S, "cells": len(recs), "failed": bad}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"meta": meta, "records": [asdict(r) for r in recs]}, fh, indent=1)
            fh.write("\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
