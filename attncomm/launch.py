"""Spawn local ranks, run a function on all of them, and bring failures back to the caller.

``launch`` is the one-shot form; ``RankPool`` keeps the ranks (and their process group) alive so
that many functions can run on the same world (tests spawn each world size once per session).

On CUDA each rank gets a GPU of its own (NCCL), or, with more ranks than GPUs (or
``ranks_per_gpu`` > 1), several ranks share a GPU (``gpu_placement``): NCCL refuses two ranks on
one device, so their group is gloo, its collectives stage CUDA tensors through the host
(``attncomm.collectives``) and peer-mapped memory is shared by CUDA IPC. The GPU then runs the
ranks' contexts in time slices: a shared GPU is for development, CI, correctness and fault
tests, never for speed figures.
"""
from __future__ import annotations

import datetime
import logging
import os
import pickle
import queue
import shutil
import tempfile
import threading
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import config
from ._dist import validation_group, clear_cpu_groups, cpu_group, set_group_device
from ._wait import poll_until
from .errors import PeerTimeoutError, ranks_text
from .rank_report import (MAIN_REIMPORT_EXIT, WHERE, death_error, dumps, pack_exception,
                          rebuild_exception, answer_where, note_where, same_error, stuck_error)

__all__ = ["launch", "RankPool", "init_distributed", "gpu_placement"]

log = logging.getLogger("attncomm.launch")

# How long the other ranks get to report after one rank failed (their errors become notes on
# the failure) before they are stopped and the pool is torn down. Ranks that fail alike (an
# argument check) report together; a rank that is still running after that is waiting for the
# failed one, which will not come. Ranks a PeerTimeoutError names as silent are not waited for.
FAILURE_GRACE_S = 3.0
# After a rank process died: how long the others get to report (their errors are notes on the
# failure) before the pool is torn down.
DEATH_GRACE_S = 3.0
EXIT_REPORT_S = 1.0  # how long a cleanly exited rank's last report may take to arrive
# Once a rank's function has returned (or its process died) while others still run: how often
# the launcher asks the running ranks where they are, and how long one of them may sit in the
# same collective on a group with a finished rank (a collective that cannot complete) before
# every rank is stopped. The confirmation covers a collective whose last data had already
# arrived when the finished rank returned (it ends within milliseconds) and a rank whose own
# timeout is about to fire, on a loaded host where a process may not run for a second or more.
PROBE_INTERVAL_S = 0.25
STUCK_CONFIRM_S = 3.0

def _timedelta(timeout: float | None = None) -> datetime.timedelta:
    return datetime.timedelta(seconds=config.timeout_s(timeout))


def gpu_placement(world_size: int, gpu_count: int,
                  ranks_per_gpu: int | None = None) -> list[int]:
    """The GPU of each rank: rank r on GPU ``r % n`` of the ``n = ceil(W / ranks_per_gpu)``
    GPUs used (round-robin). ``ranks_per_gpu`` None: 1 when the GPUs suffice, else as few per
    GPU as fit (``ceil(W / gpu_count)``).

    Raises ValueError when there is no GPU, ``ranks_per_gpu`` is not an int ≥ 1, or the
    placement needs more GPUs than ``gpu_count``."""
    if gpu_count < 1:
        raise ValueError(f"device='cuda' with world_size={world_size} needs a CUDA GPU, this "
                         f"machine has none")
    if ranks_per_gpu is None:
        ranks_per_gpu = -(-world_size // gpu_count)
    if isinstance(ranks_per_gpu, bool) or not isinstance(ranks_per_gpu, int) \
            or ranks_per_gpu < 1:
        raise ValueError(f"ranks_per_gpu must be an int ≥ 1, got {ranks_per_gpu!r}")
    used = -(-world_size // ranks_per_gpu)
    if used > gpu_count:
        raise ValueError(f"device='cuda' with world_size={world_size} and ranks_per_gpu="
                         f"{ranks_per_gpu} needs {used} GPUs, this machine has {gpu_count}")
    return [r % used for r in range(world_size)]


def init_distributed(rank: int, world_size: int, device: str, init_method: str,
                     timeout_s: float | None = None, *, gpu: int | None = None,
                     shared_gpu: bool = False) -> None:
    """Initialise torch.distributed for one local rank (gloo on CPU, NCCL on CUDA, gloo with
    CUDA tensors for ranks that share a GPU).

    Arguments:
        gpu: this rank's CUDA device (default ``rank``). shared_gpu: some ranks share a GPU:
            the group is gloo (NCCL refuses two ranks on one device) and the exchange objects
            allocate on ``gpu`` (``attncomm.set_group_device``).

    NCCL groups take their timeout from ``ATTNCOMM_TIMEOUT_S`` and abort the communicator on
    error (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) so the failure surfaces as an exception in the
    caller instead of a watchdog killing the process.
    """
    config.force_safe_env()
    gpu = rank if gpu is None else gpu
    if device == "cuda" and shared_gpu:
        torch.cuda.set_device(gpu)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_timedelta(timeout_s))
        set_group_device(torch.device("cuda", gpu))
        validation_group(None)  # collective: the argument checks' own gloo group, on every rank now
    elif device == "cuda":
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_timedelta(timeout_s),
                                device_id=torch.device("cuda", gpu))
        cpu_group(None)  # collective: create the gloo twin on every rank now
    elif device == "cpu":
        # W ranks share the host's cores: without a cap each rank's intra-op pool oversubscribes
        # them (measured: a DP-attention simulation ran ~26x slower on 2 cores at W=4).
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=init_method, rank=rank,
                                world_size=world_size, timeout=_timedelta(timeout_s))
        validation_group(None)  # collective: the argument checks' own gloo group, on every rank now
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _unpicklable_part(fn, args: tuple, kwargs: dict) -> str | None:
    """Which of ``fn``, ``args[i]``, ``kwargs[k]`` cannot be pickled, with the pickler's reason."""
    parts = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
        [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for label, obj in parts:
        try:
            ForkingPickler.dumps(obj)
        except Exception as exc:
            return f"{label} ({type(obj).__name__}): {type(exc).__name__}: {exc}"
    return None


# Held by a rank's main thread while it creates the rendezvous directory and by its parent
# watch while it removes it: a rank creates the directory only while its launcher lives, and a
# removal always comes after this process's creation.
_RENDEZVOUS_LOCK = threading.Lock()


def _remove_rendezvous(store_dir: str) -> None:
    """Remove the launch's rendezvous directory (and the FileStore file in it). Retried: a
    FileStore may create its file between rmtree's listing and its rmdir; once the directory
    is gone no FileStore can create the file again (only ranks whose launcher lives create the
    directory)."""
    def gone() -> bool:
        shutil.rmtree(store_dir, ignore_errors=True)
        return not os.path.lexists(store_dir)

    poll_until(gone, 2.0, interval_s=0.01)


def _watch_parent(launcher: int, store_dir: str) -> None:
    """Exit this rank when the process that launched it (pid ``launcher``) is gone (killed, even
    by SIGKILL): a daemon thread compares the parent pid with it every 0.5 s (a launcher that
    died before this rank got here is seen at once); the rank removes the rendezvous directory
    (FileStore leaves its file behind when no rank tears down) and exits with code 3."""
    def watch():
        poll_until(lambda: os.getppid() != launcher, None, interval_s=0.5)
        with _RENDEZVOUS_LOCK:
            _remove_rendezvous(store_dir)
            os._exit(3)

    threading.Thread(target=watch, name="attncomm-parent-watch", daemon=True).start()


def _orphaned_cleanup(launcher: int, store_dir: str) -> None:
    """On a rank's way out: if its launcher is gone, remove the rendezvous directory now (the
    process may end before its watch looks again)."""
    if os.getppid() != launcher:
        with _RENDEZVOUS_LOCK:
            _remove_rendezvous(store_dir)


def _worker(rank, world_size, device, store_path, timeout_s, tasks, results, launcher,
            gpu=None, shared_gpu=False, where_requests=None):
    store_dir = os.path.dirname(store_path)
    _watch_parent(launcher, store_dir)
    if where_requests is not None:
        threading.Thread(target=answer_where, name="attncomm-where", daemon=True,
                         args=(rank, where_requests, results, threading.main_thread().ident,
                               _run_task.__code__)).start()
    with _RENDEZVOUS_LOCK:
        if os.getppid() != launcher:
            os._exit(3)  # the launcher is already gone: create nothing
        os.makedirs(store_dir, mode=0o700, exist_ok=True)
    try:
        init_distributed(rank, world_size, device, f"file://{store_path}", timeout_s, gpu=gpu,
                         shared_gpu=shared_gpu)
    except BaseException as exc:
        _orphaned_cleanup(launcher, store_dir)
        results.put((-1, rank, False, pack_exception(exc)))
        return
    try:
        while True:
            item = tasks.get()
            if item is None:
                break
            task_id, payload = item
            results.put((task_id, rank, *_run_task(rank, world_size, payload)))
    finally:
        clear_cpu_groups()
        try:
            dist.destroy_process_group()
        except Exception:
            pass
        _orphaned_cleanup(launcher, store_dir)


def _run_task(rank: int, world_size: int, payload: bytes) -> tuple[bool, bytes]:
    """``(ok, pickled value)`` or ``(False, packed exception)``; never raises."""
    try:
        fn, args, kwargs = pickle.loads(payload)
    except BaseException as exc:
        return False, pack_exception(RuntimeError(
            f"the task could not be unpickled in the rank process ({type(exc).__name__}: "
            f"{exc}); is fn importable there (a module-level function of an importable "
            f"module)?"))
    try:
        value = fn(rank, world_size, *args, **kwargs)
    except BaseException as exc:
        return False, pack_exception(exc, skip_frames=1)  # from fn's own frame on
    try:
        return True, dumps(value)
    except Exception as exc:
        return False, pack_exception(TypeError(
            f"the return value of {getattr(fn, '__qualname__', fn)!r} "
            f"({type(value).__name__}) could not be pickled: {type(exc).__name__}: {exc}"))


def _still_stuck(rank: int, info: dict, where: dict[int, dict], since: dict) -> bool:
    """Record ``rank``'s answer to a probe; True once it has sat in one blocking call that
    needs a finished rank for ``STUCK_CONFIRM_S``."""
    where[rank] = info
    key = info["key"] if info["stuck_on"] else None
    if key is None:
        since.pop(rank, None)
    elif since.get(rank, (None,))[0] != key:
        since[rank] = (key, time.monotonic())
    else:
        return time.monotonic() - since[rank][1] >= STUCK_CONFIRM_S
    return False


def _refuse_in_rank_bootstrap() -> None:
    """In a spawned process that is importing the main module (its parent's script, re-run at
    top level), exit with ``MAIN_REIMPORT_EXIT`` instead of starting ranks of its own: the
    script calls launch outside ``if __name__ == "__main__":`` and every rank would end in
    multiprocessing's bootstrapping error; the launcher reports the exit code in one line."""
    if getattr(mp.current_process(), "_inheriting", False):  # set by spawn while it imports
        raise SystemExit(MAIN_REIMPORT_EXIT)


class RankPool:
    """``world_size`` local ranks with an initialised process group, ready to run functions.

    Arguments:
        world_size: number of ranks (processes), ≥ 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank r on GPU r; more ranks than GPUs
            share them, see ``ranks_per_gpu``).
        timeout_s: the process group's collective timeout (None → ``ATTNCOMM_TIMEOUT_S``, 60 s).
        ranks_per_gpu: ranks per GPU on CUDA (None: 1 when there are enough GPUs, else as few
            as fit); above 1 the ranks share GPUs round-robin (``gpu_placement``) on a gloo
            group, their peers mapped by CUDA IPC: for correctness and fault tests, not speed.

    Attributes:
        gpus: each rank's CUDA device (None on CPU). shared_gpu: whether ranks share GPUs.

    ``run(fn, *args)`` calls ``fn(rank, world_size, *args)`` on every rank and returns the list of
    return values in rank order. If a rank raises, the first failure is re-raised here with the
    rank named (an error every rank raised alike is said once, with the other ranks named);
    ranks that do not return within ``FAILURE_GRACE_S`` (3 s) after that, or that a
    ``PeerTimeoutError`` names as silent, are stopped and the pool is closed (``alive`` turns
    False).

    A rank whose function returns (or whose process dies) while others still run: from then on
    the launcher asks the running ranks every ``PROBE_INTERVAL_S`` where they are (a thread in
    each rank reads its main thread's stack). A rank that sits for ``STUCK_CONFIRM_S`` (3 s) in
    one blocking torch.distributed call (collective, barrier, group creation, send/recv) or
    attncomm collective wait whose group includes a finished rank (for send/recv: whose peer is
    one) waits for a call that will never come: every rank is stopped and ``PeerTimeoutError``
    names the finished rank, the call and attncomm operation it waited in, with each stopped
    rank's stack as a note. Ranks that compute, or run collectives among unfinished ranks only,
    are left alone however long they take. A wait the launcher cannot attribute to a group
    (an NCCL collective waited for on a CUDA stream, a shared-memory flag) still ends at its
    own timeout.
    """

    def __init__(self, world_size: int, device: str = "cpu", timeout_s: float | None = None,
                 *, ranks_per_gpu: int | None = None):
        _refuse_in_rank_bootstrap()
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int ≥ 1, got {world_size!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.gpus: list[int] | None = None
        self.shared_gpu = False
        if device == "cuda":
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            self.gpus = gpu_placement(world_size, n, ranks_per_gpu)
            self.shared_gpu = len(set(self.gpus)) < world_size
            if self.shared_gpu:
                log.warning("%d ranks on %d GPU(s): ranks share GPUs (a gloo group, CUDA IPC "
                            "peers): for correctness and fault tests, not speed", world_size,
                            len(set(self.gpus)))
        elif ranks_per_gpu is not None:
            raise ValueError("ranks_per_gpu applies to device='cuda' only")
        self.world_size = world_size
        self.device = device
        self._ctx = mp.get_context("spawn")
        # A per-launch directory that the ranks create and that the launcher (or, when it was
        # killed, its orphaned ranks) removes as a whole: a removed directory cannot get its
        # FileStore file back, however the ranks' last steps interleave.
        self._store_dir = tempfile.mkdtemp(prefix="attncomm-rdzv-")
        os.rmdir(self._store_dir)  # the ranks create it
        path = os.path.join(self._store_dir, "store")
        self._results = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._where_requests = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = []
        for rank in range(world_size):
            p = self._ctx.Process(
                target=_worker,
                args=(rank, world_size, device, path, timeout_s, self._tasks[rank],
                      self._results, os.getpid(), None if self.gpus is None else self.gpus[rank],
                      self.shared_gpu, self._where_requests[rank]),
                daemon=True, name=f"attncomm-rank{rank}")
            p.start()
            self._procs.append(p)
        self._next_id = 0
        self.alive = True

    def run(self, fn: Callable, *args, timeout_s: float | None = None, **kwargs) -> list:
        """Run ``fn(rank, world_size, *args, **kwargs)`` on every rank; return the values.

        Raises ``ValueError`` naming the part (``fn``, ``args[i]``, ``kwargs[k]``) that cannot
        be pickled, before anything is sent (the pool stays usable). A rank process that dies
        during the call is reported within seconds, with its rank and exit code, whatever
        ``timeout_s`` is."""
        if not self.alive:
            raise RuntimeError("this RankPool was closed after a failure; create a new one")
        try:
            payloads = [dumps((fn, args, kwargs)) for _ in self._tasks]
        except Exception as exc:
            bad = _unpicklable_part(fn, args, kwargs) or f"{type(exc).__name__}: {exc}"
            raise ValueError(
                f"launch: cannot send the task to the rank processes, {bad}; fn must be a "
                f"module-level function (not a lambda or a local function) and args/kwargs "
                f"picklable") from exc
        task_id = self._next_id
        self._next_id += 1
        for q, payload in zip(self._tasks, payloads):
            q.put((task_id, payload))
        out = self._collect(task_id, timeout_s)
        if isinstance(out, BaseException):
            raise out
        return out

    def _collect(self, task_id: int, timeout_s: float | None) -> list | BaseException:
        values: dict[int, Any] = {}
        returned: set[int] = set()  # ranks whose function returned a value
        failure: BaseException | None = None
        failed_alike: list[int] = []  # other ranks that raised the failure's own message
        deaths: dict[int, int] = {}
        exited_at: dict[int, float] = {}
        silent: set[int] = set()  # ranks a PeerTimeoutError named: not waited for
        where: dict[int, dict] = {}  # each running rank's latest answer to a probe
        stuck_since: dict[int, tuple] = {}  # rank -> (its blocked call's key, first seen)
        stuck: int | None = None  # a rank confirmed blocked on a finished rank
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        grace_deadline = None
        next_probe = 0.0
        while len(set(values) | set(deaths) | silent) < self.world_size:
            now = time.monotonic()
            for r, p in enumerate(self._procs):
                if r not in values and r not in deaths and p.exitcode is not None:
                    # Gone: checked on every pass, so never waited on. A clean exit (a rank
                    # whose start failed reports its error, then returns) counts as a death
                    # only once its report had time to arrive.
                    if p.exitcode == 0 and now - exited_at.setdefault(r, now) < EXIT_REPORT_S:
                        continue
                    deaths[r] = p.exitcode
                    grace_deadline = min(grace_deadline or now + DEATH_GRACE_S,
                                         now + DEATH_GRACE_S)
            limits = [d for d in (deadline, grace_deadline) if d is not None]
            if stuck is not None or (limits and now >= min(limits)):
                break
            finished = returned | set(deaths)
            if finished and failure is None and now >= next_probe:
                next_probe = now + PROBE_INTERVAL_S
                self._probe(task_id, finished, set(values) | set(deaths))
            try:
                task, rank, ok, payload = self._results.get(timeout=0.1)
            except queue.Empty:
                continue
            if task == WHERE:
                # A rank's own error, once there, is the one raised: answers that arrive after
                # it never turn it into a stuck-rank error.
                if failure is None and ok == task_id and payload is not None \
                        and rank not in values and rank not in deaths \
                        and _still_stuck(rank, payload, where, stuck_since):
                    stuck = rank
                continue
            if task not in (task_id, -1):
                continue  # a straggler from an earlier, abandoned task
            if ok:
                try:
                    values[rank] = pickle.loads(payload)
                    returned.add(rank)
                    continue
                except Exception as exc:
                    err = RuntimeError(f"rank {rank}: its return value could not be unpickled "
                                       f"in the launching process: {type(exc).__name__}: {exc}")
                    err.rank = rank
            else:
                err = rebuild_exception(rank, payload)
            values[rank] = None
            if isinstance(err, PeerTimeoutError):
                silent.update(r for r in (err.peer_ranks or ()) if r not in values)
            if failure is None:
                failure = err
                grace_deadline = grace_deadline or time.monotonic() + FAILURE_GRACE_S
            elif same_error(failure, err):
                failed_alike.append(rank)  # every rank raised the same check: said once
            elif hasattr(failure, "add_note"):
                failure.add_note(f"also {err}")
        if failed_alike and hasattr(failure, "add_note"):
            failure.add_note(f"{ranks_text(sorted(failed_alike))} raised the same error")
        return self._finish(task_id, values, returned, deaths, failure, where, stuck,
                            timeout_s)

    def _finish(self, task_id: int, values: dict, returned: set[int], deaths: dict,
                failure: BaseException | None, where: dict, stuck: int | None,
                timeout_s: float | None) -> list | BaseException:
        """The values in rank order, or the error to raise for the task (returned: the caller
        raises it, one frame of this module in the traceback); ranks still running (and the
        pool) are stopped first, their places noted on the error."""
        missing = [r for r in range(self.world_size) if r not in values and r not in deaths]
        if missing:
            fresh = self._locate(task_id, returned | set(deaths), missing, where)
            fresh.pop(stuck, None)  # the stuck rank keeps the place it was confirmed in
            where.update(fresh)
        if deaths:
            self.close(force=True)
            err = death_error(deaths, failure)
            note_where(err, missing, where)
            return err
        if stuck is not None and failure is None:
            self.close(force=True)
            return stuck_error(stuck, where, missing, returned)
        if missing:
            self.close(force=True)
            if failure is not None:
                if hasattr(failure, "add_note"):
                    failure.add_note(f"rank(s) {missing} had not returned when the failure was "
                                     f"raised; they were stopped")
                note_where(failure, missing, where)
                return failure
            err = PeerTimeoutError(
                f"launch: rank(s) {missing} did not return within {timeout_s} s",
                peer_ranks=missing, timeout_s=timeout_s, op="launch")
            note_where(err, missing, where)
            return err
        if failure is not None:
            if any(p.exitcode is not None for p in self._procs):
                self.close(force=True)
            return failure
        return [values[r] for r in range(self.world_size)]

    def _probe(self, task_id: int, finished: set[int], done: set[int]) -> None:
        """Ask every rank still running where it is (answers arrive on the results queue)."""
        for r, q in enumerate(self._where_requests):
            if r not in done:
                try:
                    q.put((task_id, sorted(finished)))
                except Exception:
                    pass

    def _locate(self, task_id: int, finished: set[int], ranks: list[int],
                known: dict[int, dict], wait_s: float = 0.5) -> dict[int, dict]:
        """Where ``ranks`` are now, for the error that stops them (a rank that does not answer
        within ``wait_s`` keeps its last known place, if any)."""
        self._probe(task_id, finished, set(range(self.world_size)) - set(ranks))
        found: dict[int, dict] = {}
        end = time.monotonic() + wait_s
        while len(found) < len(ranks) and time.monotonic() < end:
            try:
                task, rank, ok, payload = self._results.get(timeout=0.05)
            except queue.Empty:
                continue
            if task == WHERE and ok == task_id and rank in ranks and payload is not None:
                found[rank] = payload
        return {r: found.get(r) or known.get(r) for r in ranks if found.get(r) or known.get(r)}

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``) and remove the rendezvous directory."""
        if not self._procs:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                try:
                    q.put(None)
                except Exception:
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
        for q in self._where_requests:  # requests a stopped rank never read: not flushed at exit
            q.cancel_join_thread()
        _remove_rendezvous(self._store_dir)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(force=exc[0] is not None)

    def __del__(self):
        try:
            self.close(force=True)
        except Exception:
            pass


def launch(fn: Callable, world_size: int, *, device: str = "cpu", args: tuple = (),
           timeout_s: float | None = None, ranks_per_gpu: int | None = None) -> list:
    """Spawn ``world_size`` local ranks, run ``fn(rank, world_size, *args)`` on each, tear down.

    Arguments:
        fn: a picklable (module-level) function.
        world_size: number of ranks ≥ 1.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, one GPU per rank; with more ranks than
            GPUs, or ``ranks_per_gpu`` > 1, ranks share GPUs on a gloo group: ``RankPool``).
        args: extra positional arguments for ``fn``.
        timeout_s: bound on the whole run in seconds (None: no bound on a rank that runs; a
            rank process that is gone is reported within seconds either way).
        ranks_per_gpu: as ``RankPool``'s.

    Returns:
        The per-rank return values, in rank order.

    Raises:
        ValueError naming what cannot be pickled (``fn``, ``args[i]``), before any rank starts;
        a rank's return value that cannot be pickled fails that rank (``TypeError``).
        The first rank's exception (same type where it can be rebuilt, else ``RuntimeError``) with
        ``"rank r: "`` in front of its message; the other ranks are stopped within
        ``FAILURE_GRACE_S`` (3 s), at once when a ``PeerTimeoutError`` names them as silent.
        ``RuntimeError`` saying so when the ranks re-ran the script's top level and reached
        ``launch`` again (the call is not under ``if __name__ == "__main__":``).
        ``RuntimeError`` naming each rank process that died (exit code, signal; e.g. a C++ abort
        in gloo on mismatched sizes) and saying that the ranks' arguments may disagree when
        validation is off; the others are stopped within seconds.
        ``PeerTimeoutError`` when ``timeout_s`` passes first, or, within a few seconds, when
        a rank waits in a collective that a rank whose function already returned will never
        join (the rule is ``RankPool``'s; the error names both ranks, the call and where each
        stopped rank was).

    The ranks watch this process: when it is killed they exit too and remove the rendezvous
    directory.
    """
    _refuse_in_rank_bootstrap()
    _require_picklable(fn, tuple(args))  # before spawning anything: fails in milliseconds
    pool = RankPool(world_size, device=device, ranks_per_gpu=ranks_per_gpu)
    try:
        return pool.run(fn, *args, timeout_s=timeout_s)
    finally:
        pool.close(force=not pool.alive)


def _require_picklable(fn, args: tuple) -> None:
    try:
        pickle.dumps((fn, args))  # plain pickle: no shared-memory handles left registered
        return
    except Exception:
        pass
    bad = _unpicklable_part(fn, args, {})
    if bad is not None:
        raise ValueError(f"launch: cannot send the task to the rank processes, {bad}; fn must "
                         f"be a module-level function (not a lambda or a local function) and "
                         f"args picklable")
