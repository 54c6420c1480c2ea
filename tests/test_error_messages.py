"""What errors say (issue 14, item 6): a seq_lens disagreement prints the lists when they are
short; a timeout inside dcp.merge names dcp.merge, not the DcpMerger it builds."""
from __future__ import annotations

import time

import pytest
import torch

import attncomm
from attncomm import PeerTimeoutError, dcp, ulysses


def _seq_lens_disagree(rank, world):
    x = torch.randn(1, 3, 4, 8)
    # The last rank splits the same 9 tokens otherwise: only the hash of the lists differs.
    lens_bad = [3, 3, 3] if rank != world - 1 else [4, 3, 2]
    out = {}
    for name, call in (
            ("seq_to_head", lambda: ulysses.seq_to_head(
                x if rank != world - 1 else torch.randn(1, 2, 4, 8), seq_lens=lens_bad)),
            ("head_to_seq", lambda: ulysses.head_to_seq(
                torch.randn(1, 3 * world, 2, 8), num_heads=2 * world, seq_lens=lens_bad)),
            ("UlyssesAttention", lambda: ulysses.UlyssesAttention()(
                *(torch.randn(1, lens_bad[rank], 4, 8) for _ in range(3)),
                seq_lens=lens_bad))):
        try:
            call()
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    return out


def test_seq_lens_disagreement_prints_the_lists(pools):
    for rank, out in enumerate(pools.run(3, _seq_lens_disagree)):
        for name, msg in out.items():
            assert "seq_lens = [3, 3, 3] (rank 0), [3, 3, 3] (rank 1), [4, 3, 2] (rank 2)" \
                in msg, (rank, name, msg)
            assert "hash" not in msg, msg


def _merge_peer_absent(rank, world, budget):
    if rank == 1:
        time.sleep(budget + 4)
        return None
    t0 = time.monotonic()
    try:
        # validation off: the first wait is the merger's own set-up inside dcp.merge
        dcp.merge(torch.randn(3, 2 * world, 8), torch.randn(3, 2 * world), validate=False,
                  backend="a2a", timeout_s=budget)
    except PeerTimeoutError as exc:
        return str(exc), exc.op, exc.peer_ranks, time.monotonic() - t0
    return "no error"


@pytest.mark.slow
def test_timeout_inside_merge_names_merge():
    budget = 2.0
    msg, op, peers, waited = attncomm.launch(_merge_peer_absent, 2, args=(budget,),
                                             timeout_s=120)[0]
    assert msg.startswith("dcp.merge") and "DcpMerger" not in msg, msg
    assert op == "dcp.merge" and peers == [1] and waited < budget + 5


def test_gpu_tests_skip_by_gpu_count():
    # tests/conftest.py: a gpu test with gpus(n) is skipped on a machine with fewer GPUs (the
    # Ulysses GPU tests raised ValueError on one GPU, building a 2-rank pool).
    from conftest import gpu_skip_reason
    assert gpu_skip_reason(2, 1, True) == "needs 2 CUDA GPUs, this machine has 1"
    assert gpu_skip_reason(1, 1, True) is None and gpu_skip_reason(2, 8, True) is None
    assert "needs CUDA" in gpu_skip_reason(1, 0, False)
