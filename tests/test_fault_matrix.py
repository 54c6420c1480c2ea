"""The fault matrix (attncomm.testing.faults): every exchange × CPU transport × fault (a peer
killed mid-call, a peer that skips the call, a peer that calls with another shape) × validation
on/off, and the slipped mismatch under the default first-sight validation (rank 0 repeats a seen
call while the peer brings a new shape), each on a fresh two-rank gloo world; every surviving
rank raises within timeout + 5 s, PeerTimeoutError naming the peer or ValueError naming the
values, and nothing hangs.

``dp_scatter`` is local (no communication), so it has no peer to lose. The GPU transports
(symm_a2a, ce, DP ``device``) get the same matrix on a multi-GPU device."""
from __future__ import annotations

import pytest

from attncomm.testing import faults

TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def matrix():
    # One run of every cell, 8 worlds at a time (the cells mostly wait on their budgets).
    return {(c.exchange, c.fault, c.validate): c
            for c in faults.run_matrix(timeout_s=TIMEOUT_S, jobs=8)}


@pytest.mark.slow
@pytest.mark.parametrize("exchange", list(faults.EXCHANGES))
def test_fault_matrix(matrix, exchange):
    bad = []
    for fault in faults.FAULTS:
        for validate in ((None,) if fault == "slip" else (True, False)):
            cell = matrix[(exchange, fault, validate)]
            bad += [f"{cell.label}: {m}" for m in cell.failures]
    assert not bad, "\n".join(bad)


def test_matrix_judge_catches_a_silent_fault():
    # The judge itself: a cell where the survivor returned normally from a skipped call, or
    # raised too late, or named the wrong peer, fails.
    cell = faults.Cell("dcp.merge[ag_rs]", "skip", True,
                       ranks={0: {"kind": "returned", "elapsed_s": 0.1, "message": "",
                                  "peers": None}, 1: {"kind": "skipped"}},
                       exit_codes={0: 0, 1: 0})
    faults._judge(cell, TIMEOUT_S, 2)
    assert any("unnoticed" in m for m in cell.failures)
    cell = faults.Cell("dcp.merge[ag_rs]", "kill", False,
                       ranks={0: {"kind": "PeerTimeoutError", "elapsed_s": 9.0, "message": "",
                                  "peers": [0]}}, exit_codes={0: 0, 1: 17})
    faults._judge(cell, TIMEOUT_S, 2)
    assert any("timeout + 5" in m for m in cell.failures)
    assert any("names [0]" in m for m in cell.failures)
    # a slipped mismatch that returned on one rank is a failure
    cell = faults.Cell("dcp.merge[a2a]", "slip", None,
                       ranks={0: {"kind": "returned", "elapsed_s": 0.1, "message": "",
                                  "peers": None},
                              1: {"kind": "PeerTimeoutError", "elapsed_s": 2.1, "message": "",
                                  "peers": [0]}}, exit_codes={0: 0, 1: 0})
    faults._judge(cell, TIMEOUT_S, 2)
    assert any("slipped mismatch" in m and "rank 0" in m for m in cell.failures)
