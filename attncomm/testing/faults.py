"""The fault matrix: every exchange × CPU transport × fault, on fresh two-rank gloo worlds.

Faults, always on the last rank (the "peer"; rank 0 survives):

- ``kill``: the peer process exits (``os._exit``) at the last collective of the call, so rank 0
  is inside the call when its peer goes (the count comes from a warm-up call);
- ``skip``: the peer never makes the call (it sleeps past the budget, then leaves);
- ``shape``: the peer makes the call with another shape (or, for the DP sync, other sizes);
- ``slip``: with the default first-sight validation, both ranks have made the call (its
  signature is seen), then rank 0 repeats it while the peer brings another shape: rank 0 skips
  the check and enters the exchange, the peer enters the check. Both must raise
  (``PeerTimeoutError`` or ``ValueError``) within the budget, never hang or return.

Each cell of the first three runs with validation on and off (``validate=`` /
``ATTNCOMM_VALIDATE``); ``slip`` with the default (``validate=None``, the variable unset). The
call's budget ``timeout_s`` small and the process group's own timeout at the 60 s default, so a wait
that ignores the call's budget shows. The rule checked: every surviving rank raises
within ``timeout_s + 5`` s — ``PeerTimeoutError`` naming the peer, or ``ValueError`` naming the
values — and nothing hangs or returns silently wrong. A rank that a C++ check aborts is not a
survivor (``launch`` reports it).

Worlds come from a fork server that has torch and attncomm imported (``multiprocessing``
"forkserver" with preloads): a fresh world costs ~0.2 s, so no cell inherits a broken group.

``python -m attncomm.testing.faults [--timeout 2] [--jobs 4] [--exchange NAME ...]`` prints the
matrix and exits non-zero on any failure.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing as mp
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from attncomm import config, dcp, ring, ulysses, usp
from attncomm._wait import poll_until
from attncomm.dp_attention import (
    BatchView,
    DpPaddingMode,
    ForwardMode,
    dp_gather,
    dp_reduce_scatter,
    prepare_mlp_sync_batch,
    shm,
)
from attncomm.errors import PeerTimeoutError
from attncomm.launch import init_distributed

__all__ = ["EXCHANGES", "FAULTS", "Cell", "main", "run_cell", "run_matrix", "run_world"]

FAULTS = ("kill", "skip", "shape", "slip")
KILL_EXIT_CODE = 17
# The collectives a call can go through (patched on the peer to count and to kill).
_COLLECTIVES = ("all_gather_into_tensor", "all_gather_single", "all_to_all_single",
                "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single",
                "all_gather_object", "broadcast", "barrier", "all_gather", "send", "recv",
                "isend", "irecv", "broadcast_object_list", "batch_isend_irecv")
_PRELOAD = ["torch", "torch.distributed", "attncomm", "attncomm.dcp", "attncomm.ulysses",
            "attncomm.dp_attention", "attncomm.launch", "attncomm.ring", "attncomm.usp"]


# ------------------------------------------------------------------------------ exchanges
# Each takes (rank, world, bad, validate, timeout_s) and makes one call; ``bad`` → the other
# shape. ``words`` are what a ValueError for the bad call must name.

def _dcp(backend):
    def call(rank, world, bad, validate, timeout_s):
        T = 6 if bad else 5
        dcp.merge(torch.randn(T, 2 * world, 8), torch.randn(T, 2 * world), backend=backend,
                  validate=validate, timeout_s=timeout_s)
    return call


def _seq_to_head(rank, world, bad, validate, timeout_s):
    ulysses.seq_to_head(torch.randn(1, 3, 4, 16 if bad else 8), seq_lens=[3] * world,
                        backend="all_to_all", validate=validate, timeout_s=timeout_s)


def _head_to_seq(rank, world, bad, validate, timeout_s):
    ulysses.head_to_seq(torch.randn(1, 3 * world, 2, 16 if bad else 8), num_heads=2 * world,
                        seq_lens=[3] * world, backend="all_to_all", validate=validate,
                        timeout_s=timeout_s)


def _ulysses_attention(rank, world, bad, validate, timeout_s):
    d = 16 if bad else 8
    q, k, v = torch.randn(1, 3, 4, d), torch.randn(1, 3, 2, d), torch.randn(1, 3, 2, d)
    attn = ulysses.UlyssesAttention(backend="all_to_all", timeout_s=timeout_s,
                                    validate=validate)
    attn(q, k, v, seq_lens=[3] * world)


def _ring(layout):
    def call(rank, world, bad, validate, timeout_s):
        d = 16 if bad else 8
        q, kv = torch.randn(1, 4, 2, d), torch.randn(1, 4, 1, d)
        ring.ring_attention(q, kv, kv, causal=True, layout=layout, validate=validate,
                            timeout_s=timeout_s)
    return call


_USP: dict = {}  # this world's grids and modules, built in the warm-up calls


def _usp(ulysses_degree):
    # U = 1: the Ulysses groups are single ranks and the exchanges are the ring's; U = W: the
    # ring groups are single ranks and the exchanges are Ulysses'.
    def call(rank, world, bad, validate, timeout_s):
        u = min(ulysses_degree, world)
        key = (u, validate, timeout_s)
        if key not in _USP:
            ug, rg = _USP.get(u) or _USP.setdefault(u, usp.make_groups(u, world // u))
            _USP[key] = usp.USPAttention(ulysses_group=ug, ring_group=rg, backend="all_to_all",
                                         timeout_s=timeout_s, validate=validate,
                                         layout="zigzag")
        d = 16 if bad else 8
        q, kv = torch.randn(1, 4, 2, d), torch.randn(1, 4, 2, d)
        _USP[key](q, kv, kv, causal=True)
    return call


def _dp_sync(sync):
    def call(rank, world, bad, validate, timeout_s):
        # bad: the peer believes in another DP × attention-TP layout of the same group.
        dp, tp = (1, world) if bad else (world, 1)
        prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 1), dp_size=dp,
                               attn_tp_size=tp, group=None, sync=sync, timeout_s=timeout_s,
                               get_idle_batch=lambda: BatchView(ForwardMode.IDLE))
    return call


def _dp_gather(rank, world, bad, validate, timeout_s):
    n = [2 + r for r in range(world)]
    dp_gather(torch.randn(n[rank], 8 if bad else 4), n, None, mode=DpPaddingMode.SUM_LEN,
              validate=validate, timeout_s=timeout_s)


def _dp_reduce_scatter(rank, world, bad, validate, timeout_s):
    n = [2 + r for r in range(world)]
    dp_reduce_scatter(torch.randn(max(n) * world, 8 if bad else 4), n, None,
                      mode=DpPaddingMode.MAX_LEN, validate=validate, timeout_s=timeout_s)


@dataclass(frozen=True)
class Exchange:
    call: object
    words: tuple  # what the ValueError of the "shape" fault names


EXCHANGES = {
    "dcp.merge[reference]": Exchange(_dcp("reference"), ("T (tokens)", "5", "6")),
    "dcp.merge[ag_rs]": Exchange(_dcp("ag_rs"), ("T (tokens)", "5", "6")),
    "dcp.merge[a2a]": Exchange(_dcp("a2a"), ("T (tokens)", "5", "6")),
    "seq_to_head[all_to_all]": Exchange(_seq_to_head, ("D", "8", "16")),
    "head_to_seq[all_to_all]": Exchange(_head_to_seq, ("D", "8", "16")),
    "UlyssesAttention[all_to_all]": Exchange(_ulysses_attention, ("D", "8", "16")),
    "ring_attention[contiguous]": Exchange(_ring("contiguous"), ("D", "8", "16")),
    "ring_attention[zigzag]": Exchange(_ring("zigzag"), ("D", "8", "16")),
    "USPAttention[U=1,R=2]": Exchange(_usp(1), ("D", "8", "16")),
    "USPAttention[U=2,R=1]": Exchange(_usp(2), ("D", "8", "16")),
    "dp sync[shm]": Exchange(_dp_sync("shm"), ("dp_size·tp_size·cp_size", "1·2·1")),
    "dp sync[cpu]": Exchange(_dp_sync("cpu"), ("dp_size·tp_size·cp_size", "1·2·1")),
    "dp_gather": Exchange(_dp_gather, ("shape[1]", "4", "8")),
    "dp_reduce_scatter": Exchange(_dp_reduce_scatter, ("shape[1]", "4", "8")),
}


# ------------------------------------------------------------------------------ one rank

def _patch_collectives(kill_at: int | None) -> list:
    """Count (and with ``kill_at``, die at) the peer's collectives; returns the counter."""


    count = [0]

    def wrap(fn):
        def counted(*args, **kwargs):
            count[0] += 1
            if kill_at is not None and count[0] >= kill_at:
                os._exit(KILL_EXIT_CODE)
            return fn(*args, **kwargs)
        counted.__wrapped__ = fn
        return counted

    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is not None:
            setattr(dist, name, wrap(getattr(fn, "__wrapped__", fn)))
    ex = shm.ShmRowExchange.exchange_flat
    shm.ShmRowExchange.exchange_flat = wrap(getattr(ex, "__wrapped__", ex))
    return count


def _outcome(exc: BaseException | None, t0: float) -> dict:
    out = {"elapsed_s": time.monotonic() - t0, "kind": "returned", "message": "", "peers": None}
    if exc is not None:
        out["kind"] = ("PeerTimeoutError" if isinstance(exc, PeerTimeoutError) else
                       type(exc).__name__)
        out["message"] = str(exc)[:2000]
        out["peers"] = getattr(exc, "peer_ranks", None)
    return out


def _rank_main(rank, world, path, exchange, fault, validate, timeout_s, results):
    config.set_var("ATTNCOMM_VALIDATE", None if validate is None else 1 if validate else 0)
    config.set_var("ATTNCOMM_TIMEOUT_S", None)  # the group keeps the 60 s default
    try:
        init_distributed(rank, world, "cpu", f"file://{path}")
        call = EXCHANGES[exchange].call
        peer = rank == world - 1
        count = _patch_collectives(None) if peer else [0]
        for _ in range(2):  # warm-up: lazy set-up (gloo twin, shm channel, caches) done
            before = count[0]
            call(rank, world, False, validate, timeout_s)
        steps = count[0] - before
        if peer and fault == "skip":
            time.sleep(timeout_s + 4)
            results.put((rank, {"kind": "skipped"}))
            os._exit(0)
        if peer and fault == "kill":
            _patch_collectives(max(1, steps))
        t0, exc = time.monotonic(), None
        try:
            call(rank, world, peer and fault in ("shape", "slip"), validate, timeout_s)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            exc = e
        results.put((rank, _outcome(exc, t0)))
    except BaseException as e:  # noqa: BLE001 - set-up failed: reported as such
        results.put((rank, {"kind": "setup failed", "message": f"{type(e).__name__}: {e}"}))
    os._exit(0)  # a group a fault broke can hang in its teardown


# ------------------------------------------------------------------------------ the parent

@dataclass
class Cell:
    exchange: str
    fault: str
    validate: bool | None  # None: the default (first sight of a signature)
    ranks: dict = field(default_factory=dict)   # rank → outcome dict
    exit_codes: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.exchange} × {self.fault} × validate={_mode(self.validate)}"


_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(_PRELOAD)
    return _CTX


def _mode(validate: bool | None) -> str:
    return "first" if validate is None else "on" if validate else "off"


def run_world(target, world: int, args: tuple, wait_s: float, *,
              prefix: str = "attncomm-faults-") -> tuple[dict, dict]:
    """One fresh world: ``world`` processes from the fork server, each running ``target(rank,
    world, path, *args, results)`` (``path``: a FileStore path of its own; ``results``: the
    queue a rank puts ``(rank, report)`` on). Waits until every rank reported or every process
    is gone, at most ``wait_s``; a rank that has not reported by then is stopped. Returns
    ``(reports by rank, exit codes by rank)``."""
    ctx = _context()
    fd, path = tempfile.mkstemp(prefix=prefix)
    os.close(fd)
    os.unlink(path)
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, world, path, *args, results), daemon=True)
             for r in range(world)]
    reports: dict = {}
    for p in procs:
        p.start()
    deadline = time.monotonic() + wait_s

    def collected() -> bool:  # every rank reported, or every process is gone
        while not results.empty():
            rank, outcome = results.get()
            reports[rank] = outcome
        return len(reports) >= world or all(p.exitcode is not None for p in procs)

    poll_until(collected, wait_s, interval_s=0.02)
    codes = {}
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if r not in reports else 10)
        if p.is_alive():
            p.kill()
            p.join(5)
        codes[r] = p.exitcode
    collected()
    try:
        os.unlink(path)
    except OSError:
        pass
    return reports, codes


def run_cell(exchange: str, fault: str, validate: bool | None, timeout_s: float = 2.0,
             world: int = 2) -> Cell:
    """Run one cell on a fresh ``world``-rank gloo world and judge it (``Cell.failures``)."""
    cell = Cell(exchange, fault, validate)
    # far past every bound checked by the judge
    cell.ranks, cell.exit_codes = run_world(_rank_main, world, (exchange, fault, validate,
                                                                timeout_s), timeout_s + 60)
    _judge(cell, timeout_s, world)
    return cell


def _judge(cell: Cell, timeout_s: float, world: int) -> None:
    bound = timeout_s + 5
    peer = world - 1
    f = cell.failures
    for r in range(world):
        o = cell.ranks.get(r)
        if o is None:
            if not (r == peer and cell.fault == "kill") and cell.exit_codes.get(r) in (None, 0):
                f.append(f"rank {r} never reported (hang? exit code {cell.exit_codes.get(r)})")
            continue
        if o["kind"] == "setup failed":
            f.append(f"rank {r}: {o['message']}")
            continue
        if o["kind"] == "skipped":
            continue
        if cell.fault == "slip":
            if o["kind"] not in ("PeerTimeoutError", "ValueError") or o["elapsed_s"] > bound:
                f.append(f"rank {r}: a slipped mismatch must raise PeerTimeoutError or "
                         f"ValueError within {bound:g} s; got {o['kind']} after "
                         f"{o.get('elapsed_s', 0):.1f} s: {o['message'][:200]}")
            continue
        if o["kind"] == "returned":
            # Without validation a shape mismatch is the caller's bug: gloo aborts the rank that
            # receives more than it expects, and the one that receives less may return. Loud
            # (a rank dies, ``launch`` reports it), so accepted; anything else is a fault that
            # went unnoticed.
            aborted = [q for q, c in cell.exit_codes.items() if c not in (0, None)]
            if not (cell.fault == "shape" and not cell.validate and aborted):
                f.append(f"rank {r} returned normally ({o['elapsed_s']:.1f} s): a fault went "
                         f"unnoticed")
            continue
        if o["elapsed_s"] > bound:
            f.append(f"rank {r} raised after {o['elapsed_s']:.1f} s > timeout + 5 = {bound:g} s")
        if o["kind"] == "PeerTimeoutError":
            # At W = 2 the one other rank: the faulty peer, or (a C++ abort under a shape
            # mismatch) whichever rank died.
            want = [q for q in range(world) if q != r] if cell.fault == "shape" else [peer]
            if o["peers"] != want:
                f.append(f"rank {r}: PeerTimeoutError names {o['peers']}, not {want}: "
                         f"{o['message'][:200]}")
        elif o["kind"] == "ValueError":
            if cell.fault != "shape":
                f.append(f"rank {r}: ValueError for a {cell.fault} fault: {o['message'][:200]}")
            elif cell.validate and not all(w in o["message"] for w in EXCHANGES[
                    cell.exchange].words):
                f.append(f"rank {r}: the ValueError does not name "
                         f"{list(EXCHANGES[cell.exchange].words)}: {o['message'][:300]}")
        else:
            f.append(f"rank {r} raised {o['kind']}: {o['message'][:300]}")
    if cell.fault == "kill" and cell.exit_codes.get(peer) != KILL_EXIT_CODE:
        f.append(f"the peer was meant to die mid-call; exit code {cell.exit_codes.get(peer)}")
    # Rank 0 must survive every fault, except a shape mismatch without validation, where
    # gloo's own size check may abort any rank (C++ ``terminate``; ``launch`` reports it).
    if 0 not in cell.ranks and not (cell.fault == "shape" and not cell.validate) \
            and not any("never reported" in m for m in f):
        f.append(f"rank 0 did not survive (exit code {cell.exit_codes.get(0)})")
    if cell.fault == "shape" and cell.validate:
        for r in range(world):
            if cell.ranks.get(r, {}).get("kind") != "ValueError":
                f.append(f"validation on: rank {r} must raise ValueError, got "
                         f"{cell.ranks.get(r, {}).get('kind')}")


def run_matrix(exchanges=None, *, timeout_s: float = 2.0, jobs: int = 4) -> list[Cell]:
    """Every cell of ``exchanges`` (default: all) × ``FAULTS`` × validation on/off, ``jobs``
    worlds at a time (the cells mostly wait)."""
    names = list(exchanges or EXCHANGES)
    todo = [(e, f, v) for e in names for f in FAULTS
            for v in ((None,) if f == "slip" else (True, False))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda c: run_cell(*c, timeout_s=timeout_s), todo))


def _describe(cell: Cell) -> str:
    parts = []
    for r in sorted(set(cell.ranks) | set(cell.exit_codes)):
        o = cell.ranks.get(r)
        if o is None:
            parts.append(f"r{r}: exit {cell.exit_codes.get(r)}")
        elif "elapsed_s" in o:
            parts.append(f"r{r}: {o['kind']} {o['elapsed_s']:.1f}s")
        else:
            parts.append(f"r{r}: {o['kind']}")
    return "; ".join(parts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncomm.testing.faults",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=2.0, help="each call's timeout_s")
    ap.add_argument("--jobs", type=int, default=4, help="worlds run at once")
    ap.add_argument("--exchange", action="append", choices=list(EXCHANGES))
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    cells = run_matrix(a.exchange, timeout_s=a.timeout, jobs=a.jobs)
    print("| exchange | fault | validate | outcome | verdict |")
    print("|---|---|---|---|---|")
    for c in cells:
        verdict = "pass" if not c.failures else "FAIL: " + "; ".join(c.failures)
        print(f"| {c.exchange} | {c.fault} | {_mode(c.validate)} | "
              f"{_describe(c)} | {verdict} |")
    bad = sum(1 for c in cells if c.failures)
    print(f"\n{len(cells)} cells, {bad} failed, {time.monotonic() - t0:.0f} s "
          f"(timeout_s={a.timeout:g}, {datetime.date.today()})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
