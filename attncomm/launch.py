"""Spawn local ranks, run a function on all of them, and bring failures back to the caller.

``launch`` is the one-shot form; ``RankPool`` keeps the ranks (and their process group) alive so
that many functions can run on the same world (tests spawn each world size once per session).
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import config
from ._dist import clear_cpu_groups, cpu_group
from .errors import PeerTimeoutError

__all__ = ["launch", "RankPool", "init_distributed"]

# How long the other ranks get to finish after one rank failed, before the pool is torn down.
FAILURE_GRACE_S = 30.0

def _timedelta(timeout: float | None = None) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.timeout_s(timeout))


def init_distributed(rank: int, world_size: int, device: str, init_method: str,
                     timeout_s: float | None = None) -> None:
    """Initialise torch.distributed for one local rank (gloo on CPU, NCCL on CUDA).

    NCCL groups take their timeout from ``ATTNCOMM_TIMEOUT_S`` and abort the communicator on
    error (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) so the failure surfaces as an exception in the
    caller instead of a watchdog killing the process.
    """
    config.force_safe_env()
    if device == "cuda":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_timedelta(timeout_s),
                                device_id=torch.device("cuda", rank))
        cpu_group(None)  # collective: create the gloo twin on every rank now
    elif device == "cpu":
        # W ranks share the host's cores: without a cap each rank's intra-op pool oversubscribes
        # them (measured: a DP-attention simulation ran ~26x slower on 2 cores at W=4).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_timedelta(timeout_s))
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _worker(rank, world_size, device, init_method, timeout_s, tasks, results):
    try:
        init_distributed(rank, world_size, device, init_method, timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        results.put((-1, rank, False, _pack_exc(exc)))
        return
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, fn, args, kwargs = item
            try:
                value = fn(rank, world_size, *args, **kwargs)
                results.put((task_id, rank, True, value))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                results.put((task_id, rank, False, _pack_exc(exc)))
    finally:
        clear_cpu_groups()
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after a failure may find a broken group
            pass


def _pack_exc(exc: BaseException):
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickle.loads(pickle.dumps(exc))
        return (exc, tb)
    except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text
        return (None, f"{type(exc).__name__}: {exc}\n{tb}")


def _rebuild(rank: int, packed) -> BaseException:
    exc, tb = packed
    if exc is not None:
        msg = f"rank {rank}: {exc}"
        if isinstance(exc, PeerTimeoutError):
            new = PeerTimeoutError(msg, peer_ranks=exc.peer_ranks, timeout_s=exc.timeout_s,
                                   op=exc.op)
        else:
            try:
                new = type(exc)(msg)
            except Exception:  # noqa: BLE001 - constructors with other signatures
                new = RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")
    else:
        new = RuntimeError(f"rank {rank}: {tb.splitlines()[0]}")
    new.rank = rank
    if hasattr(new, "add_note"):
        new.add_note(f"--- traceback on rank {rank} ---\n{tb}")
    return new


class RankPool:
    """``world_size`` local ranks with an initialised process group, ready to run functions.

    Arguments:
        world_size: number of ranks (processes), ≥ 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on GPU r).
        timeout_s: the process group's collective timeout (None → ``ATTNCOMM_TIMEOUT_S``, 60 s).

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the list of
    return values in rank order. If a rank raises, the first failure is re-raised here with the
    rank named; ranks that do not return within 30 s after that are stopped and the pool is
    closed (``alive`` turns False).
    """

    def __init__(self, world_size: int, device: str = "cpu", timeout_s: float | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int ≥ 1, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        if device == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if n < world_size:
                raise ValueError(f"device='cuda' with world_size={world_size} needs "
                                 f"{world_size} GPUs, this machine has {n}")
        self.world_size = world_size
        self.device = device
        self._ctx = mp.get_context("spawn")
        fd, path = tempfile.mkstemp(prefix="attncomm-rdzv-")
        os.close(fd)
        os.unlink(path)  # the FileStore creates it
        self._store_path = path
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = []
        for rank in range(world_size):
            p = self._ctx.Process(
                target=_worker,
                args=(rank, world_size, device, f"file://{path}", timeout_s,
                      self._tasks[rank], self._results),
                daemon=True, name=f"attncomm-rank{rank}")
            p.start()
            self._procs.append(p)
        self._next_id = 0
        self.alive = True

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the values."""
        if not self.alive:
            raise RuntimeError("this RankPool was closed after a failure; create a new one")
        task_id = self._next_id
        self._next_id += 1
        for q in self._tasks:
            q.put((task_id, fn, args, kwargs))
        values: dict[int, Any] = {}
        failure: BaseException | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        grace_deadline = None
        while len(values) < self.world_size:
            now = time.monotonic()
            limits = [d for d in (deadline, grace_deadline) if d is not None]
            if limits and now >= min(limits):
                missing = [r for r in range(self.world_size) if r not in values]
                self.close(force=True)
                if failure is not None:
                    raise failure
                raise PeerTimeoutError(
                    f"launch: rank(s) {missing} did not return within {timeout_s} s",
                    peer_ranks=missing, timeout_s=timeout_s, op="launch")
            try:
                task, rank, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs)
                        if r not in values and p.exitcode is not None]
                if dead:
                    r = dead[0]
                    if failure is None:
                        failure = RuntimeError(
                            f"rank {r}: process exited with code {self._procs[r].exitcode}")
                        failure.rank = r
                    for d in dead:
                        values[d] = None
                    grace_deadline = grace_deadline or time.monotonic() + FAILURE_GRACE_S
                continue
            if task not in (task_id, -1):
                continue  # a straggler from an earlier, abandoned task
            values[rank] = value if ok else None
            if not ok and failure is None:
                failure = _rebuild(rank, value)
                grace_deadline = time.monotonic() + FAILURE_GRACE_S
        if failure is not None:
            if any(p.exitcode is not None for p in self._procs):
                self.close(force=True)
            raise failure
        return [values[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``) and remove the rendezvous file."""
        if not self._procs:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self._procs = []
        try:
            os.unlink(self._store_path)
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:  # noqa: BLE001
            pass


def launch(fn: Callable, world_size: int, *, device: str = "cpu", args: tuple = (),
           timeout_s: float | None = None) -> list:
    """Spawn ``world_size`` local ranks, run ``fn(rank, world_size, *args)`` on each, tear down.

    Arguments:
        fn: a picklable (module-level) function.
        world_size: number of ranks ≥ 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank).
        args: extra positional arguments for ``fn``.
        timeout_s: bound on the whole run in seconds (None: no bound).

    Returns:
        The per-rank return values, in rank order.

    Raises:
        The first rank's exception (same type where it can be rebuilt, else ``RuntimeError``) with
        ``"rank r: "`` in front of its message; the other ranks are stopped within 30 s.
        ``PeerTimeoutError`` when ``timeout_s`` passes first.
    """
    pool = RankPool(world_size, device=device)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s)
    finally:
        pool.close(force=not pool.alive)
