"""What ranks report to their launcher (``attncomm.launch``): a rank's exception, packed in the
rank and rebuilt in the launcher with the rank named; the error for rank processes that died;
and where a rank is while its peers wait for it.

Once a rank's function has returned (or its process died) while others still run, the launcher
(``attncomm.launch.RankPool``) asks each running rank where it is. A daemon thread in each rank
(``answer_where``) reads the main thread's stack: the blocking torch.distributed call it sits in
(a collective, barrier, group creation or send/recv) or attncomm's own collective wait, the
global ranks that call needs, and the attncomm operation around it. A call that needs a finished
rank can never complete; the launcher then stops the ranks with ``stuck_error``.
"""
from __future__ import annotations

import os
import pickle
import re
import signal
import sys
import traceback
from multiprocessing.reduction import ForkingPickler

import torch.distributed as dist

from . import _dist, collectives, config
from .errors import PeerTimeoutError, ranks_text

__all__ = ["WHERE", "MAIN_REIMPORT_EXIT", "dumps", "pack_exception", "rebuild_exception",
           "death_error", "reimport_error", "exit_text", "answer_where", "same_error",
           "note_where", "stuck_error"]

# Exit code of a rank process that, while it imported the main module (what the spawn start
# method does in every rank), reached launch / RankPool: the script calls them outside
# ``if __name__ == "__main__":``. The launcher turns it into a one-line error.
MAIN_REIMPORT_EXIT = 86

_CARETS = re.compile(r"\s*[\^~]+\s*")  # the lines that point at a part of a frame's code
WHERE = -2  # task id of a rank's answer to "where are you" on the launcher's results queue


_C10D = os.path.join(os.path.dirname(dist.__file__), "distributed_c10d.py")
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_P2P = {"send": "dst", "isend": "dst", "recv": "src", "irecv": "src"}
# A collective staged through the host (CUDA tensors on a gloo group) waits in here, below
# ``_dist.wait``: part of that wait, not code of the rank's own.
_STAGED_WAIT = collectives.StagedWork.wait.__code__


def _call_peers(frame) -> tuple[str, list[int]] | None:
    """``(call, global ranks it needs)`` when ``frame`` is a blocking torch.distributed call
    (a collective, barrier, group creation or send/recv, whose ``group`` it reads) or
    attncomm's own bounded wait on a collective's work; None for any other frame."""
    code = frame.f_code
    if code.co_filename == _C10D:
        kind = "torch.distributed"
    elif code is _dist.wait.__code__:
        kind = "attncomm._dist"
    else:
        return None
    f_locals = frame.f_locals
    group = f_locals.get("group")
    if code.co_name == "new_group" and not f_locals.get("use_local_synchronization"):
        group = None  # a collective on the whole world
    try:
        members = dist.get_process_group_ranks(group or dist.group.WORLD)
        if code.co_name in _P2P:
            peer = f_locals.get(_P2P[code.co_name])
            group_peer = f_locals.get("group_" + _P2P[code.co_name])
            if peer is None and group_peer is not None:
                peer = dist.get_global_rank(group or dist.group.WORLD, group_peer)
            if peer is not None:
                members = [peer]
    except Exception:  # a group being torn down, an unknown rank: not attributable
        return None
    return f"{kind}.{code.co_name}", list(members)


def _where(frame, finished: set[int], stop) -> dict:
    """Where the rank's main thread is (``frame``, its innermost frame): the stack inside the
    task's function (the frames below the one running code object ``stop``), the blocking
    distributed call it is in (if any) and the finished ranks that call needs (``stuck_on``),
    and the attncomm operation around it (``op``)."""
    frames = []
    f = frame
    while f is not None and f.f_code is not stop:
        frames.append(f)
        f = f.f_back
    info = {"call": None, "stuck_on": [], "op": None, "key": None,
            "stack": "".join(traceback.format_list(
                traceback.extract_stack(frame, limit=len(frames) or None)))}
    if not frames:
        return info
    # The outermost blocking call of the innermost distributed frames: the entry point the
    # rank's code called (its group argument), not the helpers below it.
    entry = None
    for f in frames:  # innermost first
        found = _call_peers(f)
        if found is not None:
            entry = (f, found)
        elif entry is not None:
            break
    if entry is not None and _call_peers(frames[0]) is None \
            and frames[0].f_code.co_filename != _C10D \
            and frames[0].f_code is not _STAGED_WAIT:
        entry = None  # the rank runs code of its own below the call (a callback): not blocked
    for f in frames:
        op = f.f_locals.get("op") if f.f_code.co_filename.startswith(_PACKAGE) \
            and "op" in f.f_code.co_varnames else None
        if isinstance(op, str):
            info["op"] = op
            break
    if entry is not None:
        f, (call, members) = entry
        info["call"] = call
        info["stuck_on"] = sorted(set(members) & finished)
        info["key"] = (id(f), f.f_lineno)
    return info


def answer_where(rank: int, requests, results, main_ident: int, stop) -> None:
    """A rank's daemon thread: answer each ``(task_id, finished ranks)`` request with where the
    main thread is (``_where``; its frames below the one running code object ``stop``). A
    blocked collective releases the GIL, so this runs while the main thread waits on its
    peers."""
    while True:
        req = requests.get()
        if req is None:
            return
        task_id, finished = req
        frame = sys._current_frames().get(main_ident)
        try:
            info = _where(frame, set(finished), stop) if frame is not None else None
        except Exception as exc:  # never let a probe hurt the rank
            info = {"call": None, "stuck_on": [], "op": None, "key": None,
                    "stack": f"(not readable: {type(exc).__name__}: {exc})\n"}
        results.put((WHERE, rank, task_id, info))


def same_error(first: BaseException, other: BaseException) -> bool:
    """Two ranks' failures say the same thing (every rank raises a failed argument check)."""
    def text(e):
        return str(e).split(": ", 1)[-1] if str(e).startswith("rank ") else str(e)
    return type(first) is type(other) and text(first) == text(other)


def _where_text(rank: int, info: dict) -> str:
    call = info.get("call")
    head = f"rank {rank} was " + (f"waiting in {call}" if call else "running")
    if info.get("op"):
        head += f" (in {info['op']})"
    return f"--- {head} ---\n{info.get('stack', '')}"


def note_where(err: BaseException, ranks: list[int], where: dict[int, dict]) -> None:
    """Add to ``err`` where each of ``ranks`` was when it was stopped."""
    if hasattr(err, "add_note"):
        for r in ranks:
            if where.get(r):
                err.add_note(_where_text(r, where[r]))


def stuck_error(rank: int, where: dict[int, dict], missing: list[int],
                returned: set[int]) -> PeerTimeoutError:
    """The error for ranks blocked in a collective that a finished rank will never join."""
    info = where[rank]
    peers = info["stuck_on"]
    parts = [f"{ranks_text(rs)} {verb}" for rs, verb in (
        ([r for r in peers if r in returned], "returned from the function"),
        ([r for r in peers if r not in returned], "died")) if rs]
    at = f"{info['op']}, at {info['call']}" if info.get("op") else info["call"]
    err = PeerTimeoutError(
        f"rank {rank}: {' and '.join(parts)} without joining the collective that rank {rank} "
        f"waits in ({at}); {ranks_text(missing)} {'was' if len(missing) == 1 else 'were'} "
        f"stopped", peer_ranks=peers, timeout_s=None, op=info.get("op") or info["call"])
    err.rank = rank
    note_where(err, missing, where)
    return err


def dumps(obj) -> bytes:
    # The pickler multiprocessing queues use (torch registers its tensor reductions with it);
    # pickled here, where a failure can be reported, not in a queue's feeder thread.
    return bytes(ForkingPickler.dumps(obj))


def pack_exception(exc: BaseException, skip_frames: int = 0) -> bytes:
    """``exc`` and its traceback text, pickled for the launcher. The text leaves out the
    exception's own type and message (the launcher's error carries that message once, in its
    first line), the first ``skip_frames`` frames (the launcher's own code in the rank) and the
    lines of carets under a frame's code."""
    tb_ = exc.__traceback__
    for _ in range(skip_frames):
        tb_ = tb_.tb_next if tb_ is not None and tb_.tb_next is not None else tb_
    lines = traceback.format_exception(type(exc), exc, tb_)
    own = traceback.format_exception_only(type(exc), exc)
    if lines[-len(own):] == own:
        lines = lines[:-len(own)]  # empty for an exception that was never raised
    tb = "".join("\n".join(ln for ln in entry.split("\n") if not _CARETS.fullmatch(ln))
                 for entry in lines)
    try:
        data = dumps((exc, tb))
        pickle.loads(data)
        return data
    except Exception:
        return dumps((None, f"{type(exc).__name__}: {exc}\n{tb}"))


def rebuild_exception(rank: int, packed: bytes) -> BaseException:
    try:
        exc, tb = pickle.loads(packed)
    except Exception as err:
        exc, tb = None, f"an exception that could not be unpickled here ({err})"
    if exc is not None:
        msg = f"rank {rank}: {exc}"
        if isinstance(exc, PeerTimeoutError):
            new = PeerTimeoutError(msg, peer_ranks=exc.peer_ranks, timeout_s=exc.timeout_s,
                                   op=exc.op)
        else:
            try:
                new = type(exc)(msg)
            except Exception:
                new = RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}")
    else:
        head, _, tb = tb.partition("\n")  # the message, then the traceback
        new = RuntimeError(f"rank {rank}: {head}")
    new.rank = rank
    if hasattr(new, "add_note"):
        if tb.strip():
            new.add_note(f"--- traceback on rank {rank} ---\n{tb.rstrip()}")
        for note in getattr(exc, "__notes__", ()):  # the rank's own notes, after its traceback
            new.add_note(note)
    return new


def exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def reimport_error() -> RuntimeError:
    return RuntimeError(
        "the rank processes re-ran this script's top level and reached attncomm.launch again "
        "(each rank is a spawned process that imports the main module): call launch under "
        "`if __name__ == \"__main__\":`")


def death_error(deaths: dict, failure: BaseException | None) -> RuntimeError:
    """The failure for rank processes that died during a task: each rank and exit code, the
    hint about disagreeing arguments, and the other ranks' errors as a note (or, when a
    rank exited with ``MAIN_REIMPORT_EXIT``, the missing ``__main__`` guard: the one cause)."""
    reimported = sorted(r for r, c in deaths.items() if c == MAIN_REIMPORT_EXIT)
    if reimported:
        err = reimport_error()
        err.rank, err.exitcode = reimported[0], MAIN_REIMPORT_EXIT
        return err
    try:
        validation_off = not config.validate_enabled(None)
    except ValueError:  # a malformed ATTNCOMM_VALIDATE: say both
        validation_off = False
    hint = ("validation is off (ATTNCOMM_VALIDATE=0), so the ranks' arguments may disagree: a "
            "collective with mismatched sizes aborts the process inside gloo/NCCL"
            if validation_off else
            "if a call ran with validation off (validate=False), the ranks' arguments may "
            "disagree: a collective with mismatched sizes aborts the process inside gloo/NCCL")
    dead = "; ".join(f"rank {r}: process exited with code {exit_text(c)}"
                     for r, c in sorted(deaths.items()))
    err = RuntimeError(f"{dead} while running the task; {hint}")
    err.rank = min(deaths)
    err.exitcode = deaths[err.rank]
    if failure is not None:
        err.__cause__ = failure
        if hasattr(err, "add_note"):
            err.add_note(f"other ranks: {failure}")
    return err
