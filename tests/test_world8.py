"""All three exchanges at W=8 on gloo CPU ranks (the largest world the GPU machines lend is 2;
this is where W=8 logic is exercised). One pool of 8 ranks, one call, many cases."""
from __future__ import annotations

import math

import pytest
import torch

from attncomm import dcp, ulysses
from attncomm.demo import dp_simulate as simulate
from _reference import ref_merge


def _world8(rank, world_size, seed):
    failures = []
    # DCP: every CPU backend, H = W and 2W, with empty shards (−inf LSE, NaN payload)
    for H in (world_size, 2 * world_size):
        g = torch.Generator().manual_seed(seed + H)
        outs = torch.randn(world_size, 9, H, 16, generator=g)
        lses = torch.randn(world_size, 9, H, generator=g) * 3
        empty = torch.rand(world_size, 9, H, generator=g) < 0.3
        lses[empty], outs[empty] = -math.inf, float("nan")
        ref, _ = ref_merge(outs, lses)
        hs = H // world_size
        ref = ref[:, rank * hs:(rank + 1) * hs]
        for backend in ("reference", "ag_rs", "a2a", "auto"):
            got = dcp.merge(outs[rank], lses[rank], backend=backend)
            err = float((got.double() - ref).abs().max())
            if not err < 1e-5:
                failures.append(f"dcp {backend} H={H}: err {err}")
    # Ulysses: 13 heads over 8 ranks (2,2,2,2,2,1,1,1), uneven sequence with empty shards
    lens = [3, 0, 5, 1, 0, 2, 4, 1]
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(2, sum(lens), 13, 8, generator=g)
    start = sum(lens[:rank])
    x = full[:, start:start + lens[rank]].contiguous()
    y = ulysses.seq_to_head(x, seq_lens=lens)
    counts = ulysses.head_split(13, world_size)
    h0 = sum(counts[:rank])
    if not torch.equal(y, full[:, :, h0:h0 + counts[rank]]):
        failures.append("ulysses seq_to_head differs from the head slice of the full tensor")
    back = ulysses.head_to_seq(y, num_heads=13, seq_lens=lens)
    if not torch.equal(back, x):
        failures.append("ulysses round trip is not bitwise")
    # DP attention: the scheduler simulation over the shm and cpu sync paths
    for path in ("shm", "cpu"):
        cfg = simulate.SimConfig(steps=40, sync=path, seed=seed, timeout_s=60)
        res = simulate.simulate_rank(rank, world_size, cfg)
        st = res["stats"]  # a step where every rank is idle does not run the MLP
        if not st["min_cosine"] > 0.99999 or st["steps_run"] + st["all_idle"] != 40:
            failures.append(f"dp_attention {path}: {res}")
    return failures


@pytest.mark.slow
def test_all_exchanges_at_world_size_8(pools, seed):
    failures = sum(pools.run(8, _world8, seed, timeout_s=600), [])
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)
