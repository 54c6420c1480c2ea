"""launch / RankPool: return values, failures re-raised with the rank named, timeouts."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm import PeerTimeoutError
from attncomm._dist import guard_timeout


def _sum_ranks(rank, world_size, offset):
    t = torch.tensor([rank + offset], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def _fail_on_rank1(rank, world_size):
    if rank == 1:
        raise KeyError("boom on purpose")
    return rank


def _rank1_skips_collective(rank, world_size, timeout_s):
    from datetime import timedelta
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    if rank == 1:
        time.sleep(timeout_s * 3)
        return "skipped"
    t0 = time.monotonic()
    try:
        with guard_timeout(group, "test all_reduce", timeout_s):
            dist.all_reduce(torch.ones(1), group=group)
    except PeerTimeoutError as exc:
        return ("timeout", exc.peer_ranks, time.monotonic() - t0)
    return "no error"


def test_launch_returns_per_rank_values():
    out = attncomm.launch(_sum_ranks, 3, args=(10,))
    assert out == [33, 33, 33]


def test_launch_reraises_with_rank_named():
    with pytest.raises(KeyError, match="rank 1") as info:
        attncomm.launch(_fail_on_rank1, 2, timeout_s=120)
    assert "boom on purpose" in str(info.value)
    assert info.value.rank == 1


def test_pool_reused_and_failure_does_not_poison_it(pools):
    assert pools.run(2, _sum_ranks, 1) == [3, 3]
    with pytest.raises(KeyError, match="rank 1"):
        pools.run(2, _fail_on_rank1)
    assert pools.run(2, _sum_ranks, 0) == [1, 1]


def test_missing_peer_raises_peer_timeout_within_budget():
    budget = 3.0
    out = attncomm.launch(_rank1_skips_collective, 2, args=(budget,), timeout_s=120)
    kind, peers, waited = out[0]
    assert kind == "timeout"
    assert peers == [1]
    assert waited < budget + 5


def test_launch_bad_arguments():
    with pytest.raises(ValueError, match="world_size"):
        attncomm.launch(_sum_ranks, 0)
    with pytest.raises(ValueError, match="device"):
        attncomm.launch(_sum_ranks, 1, device="tpu")
