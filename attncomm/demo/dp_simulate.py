"""A DP-attention scheduler simulation: W DP ranks, random arrivals, idle stretches, prefills
mixed with decodes, and every step the full path sync → dp_gather → MLP → dp_scatter.

Every step checks, on every rank:
- all ranks made identical decisions (batch or None, token counts, graph / extend / TBO, padding
  mode, graph size) — by gathering each rank's decisions together with its own independently
  computed token count;
- the MLP input holds exactly (bitwise) every DP rank's tokens in its slot;
- the MLP output rows of this DP rank (both ``dp_scatter`` after an all_reduce and
  ``dp_reduce_scatter``) against one process running the MLP over all tokens in fp64.
Every wait has a timeout, so a disagreement fails loudly (``SimulationError``,
``PeerTimeoutError``) instead of hanging.

``simulate_rank`` runs on the ranks (``attncomm.launch`` or a ``RankPool``);
``run_dp_attention_demo`` launches it and summarises the demo row.
"""
from __future__ import annotations

import copy
import math
import os
import random
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .. import config
from .._dist import cpu_group, wait
from ..collectives import all_gather_tensor, all_reduce
from ..launch import launch
from ..dp_attention.gather import (DpPaddingMode, choose_padding_mode, dp_gather,
                                   dp_reduce_scatter, dp_scatter, select_cuda_graph_bs)
from ..dp_attention.sync import BatchView, ForwardMode, prepare_mlp_sync_batch

__all__ = ["SimConfig", "MlpWeights", "SimulationError", "simulate_rank",
           "run_dp_attention_demo", "summarize"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64}


class SimulationError(RuntimeError):
    """The ranks disagreed, or the MLP input was not every rank's tokens (raised on every rank
    that saw it; the message names the step and what differed)."""


@dataclass(frozen=True)
class SimConfig:
    """Simulation settings (identical on every rank).

    ``attn_tp_size`` ranks share each DP rank (``world_size % attn_tp_size == 0``). Token hidden
    size ``hidden``, MLP width ``ffn`` (used with random weights; given weights set their own).
    """

    steps: int = 1000
    hidden: int = 64
    ffn: int = 256
    attn_tp_size: int = 1
    sync: str = "auto"
    dtype: str = "fp32"
    seed: int = 0
    timeout_s: float | None = None
    enable_tbo: bool = True
    capture_bs: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64)
    max_prompt: int = 40
    max_prefill_tokens: int = 96
    max_output: int = 24
    device: str = "cpu"


@dataclass
class MlpWeights:
    """A two-matmul MLP: ``y = gelu(x @ w1 + b1) @ w2 + b2`` with ``w1 [E, F]``, ``b1 [F]``,
    ``w2 [F, E]``, ``b2 [E]``. Tensor-parallel: rank r of W holds a contiguous F slice."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    @classmethod
    def random(cls, hidden: int, ffn: int, seed: int) -> MlpWeights:
        g = torch.Generator().manual_seed(seed)
        return cls(torch.randn(hidden, ffn, generator=g, dtype=torch.float64) / math.sqrt(hidden),
                   torch.randn(ffn, generator=g, dtype=torch.float64) * 0.1,
                   torch.randn(ffn, hidden, generator=g, dtype=torch.float64) / math.sqrt(ffn),
                   torch.randn(hidden, generator=g, dtype=torch.float64) * 0.1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The whole MLP in fp64 (one process), on ``x``'s device."""
        key = str(x.device)
        w = self._fp64.get(key) if hasattr(self, "_fp64") else None
        if w is None:
            w = [t.to(x.device, torch.float64) for t in (self.w1, self.b1, self.w2, self.b2)]
            self._fp64 = {key: w}
        return torch.nn.functional.gelu(x.double() @ w[0] + w[1]) @ w[2] + w[3]

    def shard(self, rank: int, world: int, dtype, device) -> Callable[[torch.Tensor], torch.Tensor]:
        """This rank's partial-sum function ``[T, E] → [T, E]`` (b2 added on rank 0 only)."""
        f = self.w1.shape[1]
        lo, hi = rank * f // world, (rank + 1) * f // world
        w1 = self.w1[:, lo:hi].to(device, dtype)
        b1 = self.b1[lo:hi].to(device, dtype)
        w2 = self.w2[lo:hi].to(device, dtype)
        b2 = self.b2.to(device, dtype) if rank == 0 else None

        def partial(x):
            y = torch.nn.functional.gelu(x @ w1 + b1) @ w2
            return y + b2 if b2 is not None else y

        return partial


@dataclass
class _Request:
    prompt: int
    remaining: int


@dataclass
class _Scheduler:
    """One DP rank's scheduler: arrivals in busy stretches, none in idle stretches, and none
    on any rank in steps 140..199 of every 200 (so that every rank goes idle together). Steps
    ``0..len(opening)-1`` run ``opening[step][dp_rank]`` instead (a copy; no requests)."""

    rng: random.Random
    cfg: SimConfig
    dp_rank: int = 0
    opening: Sequence = ()
    waiting: list = field(default_factory=list)
    running: list = field(default_factory=list)
    prebuilt: list = field(default_factory=list)
    busy: bool = True
    stretch: int = 0

    def _arrivals(self, step: int) -> None:
        if step % 200 >= 140:  # a lull on every rank at once: they drain and all go idle
            return
        if self.stretch <= 0:
            self.busy = not self.busy
            self.stretch = self.rng.randint(10, 80) if self.busy else self.rng.randint(5, 60)
        self.stretch -= 1
        if self.busy and self.rng.random() < 0.05:  # prefilled elsewhere (disaggregation)
            self.prebuilt += [_Request(0, self.rng.randint(1, self.cfg.max_output))
                              for _ in range(self.rng.randint(1, 3))]
        if self.busy and self.rng.random() < 0.25:
            for _ in range(self.rng.randint(1, 3)):
                self.waiting.append(_Request(self.rng.randint(1, self.cfg.max_prompt),
                                             self.rng.randint(1, self.cfg.max_output)))

    def next_batch(self, step: int) -> tuple[BatchView | None, list]:
        """This step's batch and the requests it carries (for ``commit``)."""
        if step < len(self.opening):
            batch = self.opening[step][self.dp_rank]
            return (None if batch is None else copy.copy(batch)), []
        self._arrivals(step)
        rng = self.rng
        if self.prebuilt and rng.random() < 0.5:
            take, self.prebuilt = self.prebuilt, []
            return BatchView(ForwardMode.PREBUILT, batch_size=len(take)), take
        if self.waiting and (not self.running or rng.random() < 0.4):
            take, total = [], 0
            while self.waiting and (not take or total + self.waiting[0].prompt
                                    <= self.cfg.max_prefill_tokens):
                req = self.waiting.pop(0)
                take.append(req)
                total += req.prompt
            lens = [r.prompt for r in take]
            mixed = bool(self.running) and rng.random() < 0.3
            if mixed:
                lens += [1] * len(self.running)
            logprob = rng.random() < 0.3
            starts = [rng.randint(0, e) for e in lens] if logprob else None
            mode = ForwardMode.MIXED if mixed else ForwardMode.EXTEND
            return (BatchView(mode, batch_size=len(lens), extend_num_tokens=sum(lens),
                              extend_lens=lens, extend_logprob_start_lens=starts,
                              return_logprob=logprob), take)
        if self.running:
            return BatchView(ForwardMode.DECODE, batch_size=len(self.running)), []
        return (BatchView(ForwardMode.IDLE) if rng.random() < 0.3 else None), []

    @staticmethod
    def true_tokens(batch: BatchView | None) -> int:
        """The token count, computed here independently of the library."""
        if batch is None or batch.forward_mode in (ForwardMode.IDLE, ForwardMode.PREBUILT):
            return 0
        if batch.forward_mode == ForwardMode.DECODE:
            return batch.batch_size
        return sum(batch.extend_lens)

    def commit(self, batch: BatchView | None, new: list) -> None:
        if batch is None or batch.forward_mode == ForwardMode.IDLE:
            return
        if batch.forward_mode in (ForwardMode.DECODE, ForwardMode.MIXED):
            for r in self.running:
                r.remaining -= 1
        self.running = [r for r in self.running if r.remaining > 0] + new


def default_tokens(seed: int, hidden: int, dtype, device):
    """``(step, dp_rank, n) → [n, hidden]``: fresh random tokens, the same on every rank."""

    def tokens(step: int, dp_rank: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 4099 + dp_rank)
        return torch.randn(n, hidden, generator=g).to(device, dtype)

    return tokens


#: The step counts each rank keeps (``summarize``'s ``counts``: rank 0's).
COUNTS = ("steps_run", "all_idle", "extend", "sum_len", "max_len", "graph", "tbo",
          "idle_batches", "prebuilt")


@dataclass
class _Stats:
    counts: dict = field(default_factory=lambda: dict.fromkeys(COUNTS, 0))
    min_cosine: float = 1.0
    max_abs_err: float = 0.0
    max_rs_vs_scatter: float = 0.0

    def compare(self, out: torch.Tensor, ref: torch.Tensor) -> None:
        if out.shape != ref.shape:
            raise SimulationError(f"MLP output shape {tuple(out.shape)} != {tuple(ref.shape)}")
        if out.numel() == 0:
            return
        a, b = out.double().cpu(), ref.double().cpu()
        if not bool(torch.isfinite(a).all()):
            self.min_cosine, self.max_abs_err = float("nan"), float("nan")
            return
        cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)
        self.min_cosine = min(self.min_cosine, float(cos.min()))
        self.max_abs_err = max(self.max_abs_err, float((a - b).abs().max()))


def _decision_row(got, info, mode, graph_bs, batch) -> list[int]:
    true_n = _Scheduler.true_tokens(batch)
    true_ext = int(batch is not None and batch.forward_mode.is_extend())
    return [int(got is None), int(info.can_cuda_graph), int(info.is_extend_in_batch),
            int(info.can_run_tbo), int(mode or 0), -1 if graph_bs is None else graph_bs,
            true_n, true_ext, *info.global_num_tokens]


def _verify_decisions(rows: list[list[int]], step: int, atp: int) -> None:
    """Every rank's decisions equal, and equal to what the ranks' own counts imply."""
    shared = [r[:6] + r[8:] for r in rows]
    if any(s != shared[0] for s in shared):
        raise SimulationError(f"step {step}: ranks decided differently: "
                              + "; ".join(f"rank {i}: {s}" for i, s in enumerate(shared)))
    tp0 = rows[::atp]
    gnt = rows[0][8:]
    truth = [r[6] for r in tp0]
    if gnt != truth:
        raise SimulationError(f"step {step}: synced token counts {gnt} != the DP ranks' own "
                              f"counts {truth}")
    if rows[0][2] != int(any(r[7] for r in tp0)):
        raise SimulationError(f"step {step}: is_extend_in_batch={rows[0][2]} but the DP ranks' "
                              f"extend flags are {[r[7] for r in tp0]}")
    if rows[0][0] != int(max(truth) == 0):
        raise SimulationError(f"step {step}: batch-is-None={rows[0][0]} with counts {truth}")


def _gather_decisions(row: list[int], cg, timeout_s) -> list[list[int]]:
    world = dist.get_world_size(cg)
    local = torch.tensor(row, dtype=torch.int64)
    out = torch.empty(world * len(row), dtype=torch.int64)
    wait(all_gather_tensor(out, local, cg, async_op=True), cg, "simulation decision check",
         config.timeout_s(timeout_s))
    return out.view(world, len(row)).tolist()


def _verify_slots(buf, gnt, mode, tokens, step) -> list[torch.Tensor]:
    """The MLP input holds every DP rank's tokens, bitwise, in its slot; returns them."""
    xs = [tokens(step, q, n) for q, n in enumerate(gnt)]
    m = max(gnt)
    off = 0
    for q, x in enumerate(xs):
        start = off if mode is DpPaddingMode.SUM_LEN else q * m
        if not torch.equal(buf[start:start + x.shape[0]], x):
            raise SimulationError(f"step {step}: MLP input slot of DP rank {q} ({mode.name}, "
                                  f"counts {gnt}) is not that rank's tokens")
        off += x.shape[0]
    if mode is DpPaddingMode.SUM_LEN and not torch.equal(buf, torch.cat(xs)):
        raise SimulationError(f"step {step}: SUM_LEN buffer is not the concatenation")
    return xs


def _mlp_step(step, rank, world, cfg, gnt, mode, tokens, mlp, weights, stats, timeout_s):
    atp = cfg.attn_tp_size
    d = rank // atp
    x = tokens(step, d, gnt[d])
    buf = dp_gather(x, gnt, None, mode=mode, attn_tp_size=atp, validate=False,
                    timeout_s=timeout_s)
    xs = _verify_slots(buf, gnt, mode, tokens, step)
    partial = mlp(buf)
    full = partial.clone()
    wait(all_reduce(full, async_op=True), None, "simulation all_reduce",
         config.timeout_s(timeout_s))
    out_a = dp_scatter(full, gnt, d, mode=mode)
    out_b = dp_reduce_scatter(partial, gnt, None, mode=mode, attn_tp_size=atp, validate=False,
                              timeout_s=timeout_s)
    # The MLP is row-wise, so the one-process MLP over all tokens, restricted to this DP rank's
    # rows, is the MLP of those rows (regenerated from the source, not read from the buffer).
    ref = weights.reference(xs[d])
    stats.compare(out_a, ref)
    stats.compare(out_b, ref)
    if out_a.numel():
        stats.max_rs_vs_scatter = max(stats.max_rs_vs_scatter,
                                      float((out_a.double() - out_b.double()).abs().max()))


def simulate_rank(rank: int, world_size: int, cfg: SimConfig, weights: MlpWeights | None = None,
                  tokens: Callable | None = None,
                  progress: Callable[[float], None] | None = None,
                  opening: Sequence[Sequence[BatchView | None]] = ()) -> dict:
    """Run the simulation on this rank (collective over the default group).

    Arguments:
        cfg: the settings. weights: the MLP (default: random with ``cfg.seed``).
        tokens: ``(step, dp_rank, n) → [n, E]`` tensor on this rank's device, the same on every
            rank (default: seeded random). progress: called with a fraction after each step.
        opening: the batches of the first steps, ``opening[step][dp_rank]`` (a ``BatchView``
            or None), the same on every rank; the seeded scheduler runs the steps after them
            (a test builds an opening that exercises every rule).

    Returns:
        ``{"rank", "dp_rank", "sync", "seconds", "stats": {...}}`` where stats counts the steps
        run / all idle / extending / per padding mode / graph / TBO / idle batches / prebuilt,
        and holds ``min_cosine`` / ``max_abs_err`` against the fp64 one-process MLP.

    Raises:
        SimulationError when ranks disagree or the MLP input is wrong; PeerTimeoutError.
    """
    if cfg.device == "cpu":  # W ranks sharing the host's cores: one thread each is far faster
        threads = torch.get_num_threads()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        try:
            return _simulate(rank, world_size, cfg, weights, tokens, progress, opening)
        finally:
            torch.set_num_threads(threads)
    return _simulate(rank, world_size, cfg, weights, tokens, progress, opening)


def _simulate(rank, world_size, cfg, weights, tokens, progress, opening) -> dict:
    atp = cfg.attn_tp_size
    if world_size % atp:
        raise ValueError(f"world_size={world_size} is not divisible by attn_tp_size={atp}")
    dp, d = world_size // atp, rank // atp
    dtype = _DTYPES[cfg.dtype] if isinstance(cfg.dtype, str) else cfg.dtype
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" \
        else torch.device("cpu")
    weights = weights or MlpWeights.random(cfg.hidden, cfg.ffn, cfg.seed)
    tokens = tokens or default_tokens(cfg.seed, weights.w1.shape[0], dtype, device)
    mlp = weights.shard(rank, world_size, dtype, device)
    timeout_s = config.timeout_s(cfg.timeout_s)
    if any(len(batches) != dp for batches in opening):
        raise ValueError(f"opening: each step needs one batch per DP rank ({dp}), got "
                         f"{[len(batches) for batches in opening]}")
    sched = _Scheduler(random.Random(cfg.seed * 7919 + d), cfg, dp_rank=d, opening=opening,
                       stretch=d * 7)
    stats, cg, path = _Stats(), cpu_group(None), None
    idle = BatchView(ForwardMode.IDLE)
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch, new = sched.next_batch(step)
        got, info = prepare_mlp_sync_batch(
            batch, dp_size=dp, attn_tp_size=atp, group=None, get_idle_batch=lambda: idle,
            enable_tbo=cfg.enable_tbo, sync=cfg.sync, device=device, timeout_s=timeout_s)
        path = info.sync
        sched.commit(batch, new)
        gnt = info.global_num_tokens
        mode = None if got is None else choose_padding_mode(gnt, info.is_extend_in_batch)
        graph_bs = (select_cuda_graph_bs(gnt, cfg.capture_bs)
                    if got is not None and info.can_cuda_graph else None)
        rows = _gather_decisions(_decision_row(got, info, mode, graph_bs, batch), cg, timeout_s)
        _verify_decisions(rows, step, atp)
        _count(stats, got, info, mode, graph_bs, batch, idle)
        if got is not None:
            _mlp_step(step, rank, world_size, cfg, gnt, mode, tokens, mlp, weights, stats,
                      timeout_s)
        if progress is not None:
            progress(1.0 / cfg.steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"rank": rank, "dp_rank": d, "sync": path, "seconds": time.perf_counter() - t0,
            "stats": {**stats.counts, "min_cosine": stats.min_cosine,
                      "max_abs_err": stats.max_abs_err,
                      "max_rs_vs_scatter": stats.max_rs_vs_scatter}}


def _count(stats: _Stats, got, info, mode, graph_bs, batch, idle) -> None:
    counts = stats.counts
    if got is None:
        counts["all_idle"] += 1
        return
    seen = {"steps_run": True, "extend": info.is_extend_in_batch,
            "sum_len": mode is DpPaddingMode.SUM_LEN, "max_len": mode is DpPaddingMode.MAX_LEN,
            "graph": graph_bs is not None, "tbo": info.can_run_tbo,
            "idle_batches": got is idle or getattr(got, "inner_idle_batch", None) is idle,
            "prebuilt": batch is not None and batch.forward_mode == ForwardMode.PREBUILT}
    for name, hit in seen.items():
        counts[name] += int(bool(hit))


def summarize(results: list[dict]) -> dict:
    """Across ranks: min cosine, max abs error, slowest seconds, and rank 0's step counts."""
    s = [r["stats"] for r in results]
    return {"min_cosine": min(x["min_cosine"] for x in s),
            "max_abs_err": max(x["max_abs_err"] for x in s),
            "max_rs_vs_scatter": max(x["max_rs_vs_scatter"] for x in s),
            "seconds": max(r["seconds"] for r in results),
            "sync": results[0]["sync"], "counts": {k: v for k, v in s[0].items()
                                                    if isinstance(v, int)}}


def run_dp_attention_demo(world_size: int = 2, *, device: str = "cpu", dtype: str = "fp32",
                          steps: int = 1000, attn_tp_size: int = 1, sync: str = "auto",
                          seed: int = 0, timeout_s: float | None = None) -> dict:
    """Launch ``world_size`` ranks, run the simulation, and return the demo row:
    ``{"mode": "dp_attention", "backend": "auto", "world_size", "min_cosine", "max_abs_err",
    "seconds", ...}`` plus the per-rank results under ``"ranks"``."""
    cfg = SimConfig(steps=steps, attn_tp_size=attn_tp_size, sync=sync, dtype=dtype, seed=seed,
                    timeout_s=timeout_s, device=device)
    results = launch(simulate_rank, world_size, device=device, args=(cfg,))
    row = {"mode": "dp_attention", "backend": "auto", "world_size": world_size}
    row.update(summarize(results))
    row["ranks"] = results
    return row

