"""DP-attention sync when a rank stops answering: the others raise PeerTimeoutError within the
timeout (shm and cpu paths), and the shared-memory segment never outlives its setup.

Fresh ranks (``attncomm.launch``) per test: a group that saw a timeout may be broken afterwards.
"""
from __future__ import annotations

import glob
import os
import time

import pytest

import attncomm
from attncomm import PeerTimeoutError
from attncomm.dp_attention import BatchView, ForwardMode, prepare_mlp_sync_batch, resolve_sync

TIMEOUT_S = 3.0


def _segments(pid):
    return glob.glob(f"/dev/shm/attncomm-dp-{pid}-*")


def _step(rank, world, sync, timeout_s=None):
    return prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 1),
                                  dp_size=world, attn_tp_size=1, group=None,
                                  get_idle_batch=lambda: BatchView(ForwardMode.IDLE),
                                  sync=sync, timeout_s=timeout_s)[1].global_num_tokens


def _timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        return ("no error", None, time.monotonic() - t0)
    except PeerTimeoutError as exc:
        return ("timeout", exc.peer_ranks, time.monotonic() - t0)


def _rank_goes_silent_mid_run(rank, world, timeout_s):
    out = {"pid": os.getpid()}
    out["warm"] = [_step(rank, world, s) for s in ("shm", "shm", "cpu", "shm")]
    out["left_after_setup"] = _segments(os.getpid())
    silent = world - 1
    for sync in ("shm", "cpu"):
        if rank == silent:                        # this rank "dies": it never takes the step
            time.sleep(timeout_s + 0.5)
            out[sync] = ("silent", None, 0.0)
        else:
            out[sync] = _timed(lambda: _step(rank, world, sync, timeout_s))
    return out


@pytest.mark.slow
def test_silent_rank_mid_run_raises_within_timeout():
    world = 3
    res = attncomm.launch(_rank_goes_silent_mid_run, world, args=(TIMEOUT_S,), timeout_s=120)
    want = [[r + 1 for r in range(world)]] * 4
    for rank, out in enumerate(res):
        assert out["warm"] == want
        assert out["left_after_setup"] == []       # the name is gone once every rank mapped it
        if rank == world - 1:
            continue
        kind, peers, took = out["shm"]
        assert kind == "timeout" and peers == [world - 1], out["shm"]
        assert TIMEOUT_S * 0.9 <= took <= TIMEOUT_S + 2.0, out["shm"]
        kind, peers, took = out["cpu"]
        assert kind == "timeout" and world - 1 in peers, out["cpu"]
        assert took <= TIMEOUT_S + 2.0, out["cpu"]
    assert _segments(res[0]["pid"]) == []


def _rank_misses_setup(rank, world, timeout_s):
    resolve_sync("shm")                            # the host check passes on every rank
    if rank == world - 1:
        time.sleep(timeout_s + 0.5)
        return ("silent", None, 0.0), []
    res = _timed(lambda: _step(rank, world, "shm", timeout_s))
    return res, _segments(os.getpid())


@pytest.mark.slow
def test_silent_rank_during_setup_leaves_no_segment():
    world = 2
    res = attncomm.launch(_rank_misses_setup, world, args=(TIMEOUT_S,), timeout_s=120)
    (kind, peers, took), left = res[0]
    assert kind == "timeout" and peers == [1] and took <= TIMEOUT_S + 2.0, res[0]
    assert left == []                              # the creator removed it on the failure
