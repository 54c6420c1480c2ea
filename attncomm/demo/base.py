"""What a demo mode is, and what it gets to work with.

A mode is a module (``attncomm/demo/<name>.py``, registered in ``attncomm/demo/__init__.py``) with:

- ``NAME: str`` — the ``--mode`` name.
- ``skip_reason(cfg: DemoConfig, info: MiniLMInfo) -> str | None`` — why the mode does not apply
  (e.g. DCP needs ``num_heads % world_size == 0``); None when it does. Runs in the parent.
- ``backends(cfg: DemoConfig) -> list[str]`` — the backends to run, one table row each. Parent.
- ``run(ctx: RankContext, backend: str) -> DemoRow | None`` — runs on every rank (collective);
  rank 0 returns the row, the other ranks return None. Build the row with ``ctx.row(...)``.

All modes run inside one ``attncomm.launch`` of ``world_size`` ranks; ``RankContext`` carries the
model (already on this rank's device, in the compute dtype), the tokenized corpus, the groups,
the progress bar and helpers (timing, one-process references shared between modes). A minimal
mode::

    NAME = "my_mode"

    def skip_reason(cfg, info):
        return None

    def backends(cfg):
        return ["some_backend"]

    def run(ctx, backend):
        ref = sentence_reference(ctx)                 # [N, E] on rank 0, None elsewhere
        embs = []

        def work():
            for ids, mask in ctx.sentence_chunks():   # [b, s] each
                hidden = ctx.model.forward(ids, my_attend(mask, backend))
                embs.append(mean_pool(hidden, mask))
                ctx.advance(1 / ctx.num_chunks)

        seconds = ctx.timed(work)
        return ctx.row(NAME, backend, torch.cat(embs), ref, seconds)
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol
from collections.abc import Callable

import torch
import torch.distributed as dist

from .. import collectives
from .._dist import cpu_group
from .models import MiniLM, MiniLMInfo, full_attention, mean_pool

__all__ = ["DemoConfig", "DemoRow", "DemoInputs", "RankContext", "DemoMode", "compare",
           "sentence_reference", "DTYPES", "THRESHOLDS", "FP8_THRESHOLD"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: Minimum cosine similarity to the one-process reference for a row to pass, per dtype.
THRESHOLDS = {"fp32": 0.99999, "bf16": 0.999}
#: The bound of a row whose q/k/v exchange carries the lossy FP8 payload (``payload_dtype=
#: torch.float8_e4m3fn``), in any compute dtype. Each q/k/v row moves by at most 1/28 + u of
#: its amax (``ulysses/fp8.py``; u = 2⁻⁸ in bf16): a relative error ε ≤ 0.04 per row, which
#: alone keeps a row's cosine with the exact one ≥ √(1 − ε²) ≈ 0.9992. Attention is a convex
#: combination of v rows under a softmax of logits each off by at most that relative amount,
#: and the residual stream adds the unquantized path back, so the end-to-end cosine is bounded
#: by the same order: 0.995 leaves room for a few layers of such errors compounding (the rows
#: measured are far above it: benchmarks/results/ulysses-dit-*.md).
FP8_THRESHOLD = 0.995


@dataclass(frozen=True)
class DemoConfig:
    """The demo's settings (the CLI options), identical on every rank.

    ``num_sentences`` None → the whole corpus. ``batch_size`` sentences run per forward pass;
    each such chunk is cut to its longest sequence (padding keys stay masked, so this changes no
    result, only the work). ``decode_*``: sequences, prefix tokens and steps of the decode mode.
    """

    world_size: int = 2
    device: str = "cpu"
    dtype: str = "fp32"
    model_dir: str | None = None
    num_sentences: int | None = None
    max_len: int = 256
    modes: tuple[str, ...] = ()
    batch_size: int = 16
    decode_seqs: int = 8
    decode_prefix: int = 32
    decode_steps: int = 64

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def threshold(self) -> float:
        return THRESHOLDS[self.dtype]


@dataclass
class DemoRow:
    """One table row: a (mode, backend) run compared with the one-process reference.

    ``min_cosine``: the smallest cosine similarity over compared vectors (sentence embeddings,
    or per-token hidden states); ``max_abs_err``: the largest elementwise difference; ``seconds``:
    wall time of the parallel run on the slowest rank. ``threshold``: the row's pass bound on
    ``min_cosine`` (None: the dtype's, ``DemoConfig.threshold``; lossy rows such as the FP8
    payload's set their own). ``error``: set (and the numbers None) when the run raised a
    ValueError on every rank, e.g. a backend that cannot run here.
    """

    mode: str
    backend: str
    world_size: int
    min_cosine: float | None
    max_abs_err: float | None
    seconds: float | None
    threshold: float | None = None
    error: str | None = None

    def record(self) -> dict:
        """The JSON record (exactly the documented keys)."""
        d = asdict(self)
        d.pop("error")
        return d


@dataclass
class DemoInputs:
    """What the parent hands every rank (CPU tensors; moved to the device by ``RankContext``).

    ``input_ids, attention_mask [N, S]`` int64: the corpus sentences, right-padded, S ≤ max_len.
    ``decode_ids [B, P + steps]`` int64: the decode mode's token sequences (no padding).
    """

    state: dict[str, torch.Tensor]
    info: MiniLMInfo
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    decode_ids: torch.Tensor


class DemoMode(Protocol):
    """The interface of a demo mode module (see the module docstring)."""

    NAME: str

    def skip_reason(self, cfg: DemoConfig, info: MiniLMInfo) -> str | None: ...

    def backends(self, cfg: DemoConfig) -> list[str]: ...

    def run(self, ctx: RankContext, backend: str) -> DemoRow | None: ...


def compare(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(min cosine similarity over rows, max abs error) of ``out`` vs ``ref`` ``[..., E]``,
    computed in fp64. Raises ValueError on a shape mismatch; a NaN anywhere gives NaN (fails)."""
    if out.shape != ref.shape:
        raise ValueError(f"compare: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    a = out.detach().double().cpu().reshape(-1, out.shape[-1])
    b = ref.detach().double().cpu().reshape(-1, ref.shape[-1])
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-30)
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("nan"), float("nan")
    return float(cos.min()), float((a - b).abs().max())


@dataclass
class RankContext:
    """One rank's view of the demo: model, data, groups, progress, helpers.

    Attributes:
        rank, world_size: this rank in the default group (``group`` None).
        cfg: the DemoConfig. info: the model's shape facts.
        device: this rank's device (``cuda:rank`` or cpu). model: ``MiniLM`` on ``device`` in
            ``cfg.torch_dtype``.
        input_ids, attention_mask: ``[N, S]`` int64 on ``device``. decode_ids: ``[B, L]``.
        group: the device process group of all ranks (None: the default group; NCCL on cuda,
            gloo on cpu). cpu_group: the gloo group over the same ranks (host-side exchanges).
        bar: the tqdm bar (rank 0; None elsewhere) — use ``advance``/``describe``.
    """

    rank: int
    world_size: int
    cfg: DemoConfig
    info: MiniLMInfo
    device: torch.device
    model: MiniLM
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    decode_ids: torch.Tensor
    cpu_group: Any = None
    group: Any = None
    bar: Any = None
    memos: dict = field(default_factory=dict)
    run_end: float = 1.0  # where the bar stands at the end of the current (mode, backend) run

    @classmethod
    def create(cls, rank: int, world_size: int, cfg: DemoConfig, inputs: DemoInputs,
               total_runs: int) -> RankContext:
        device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" \
            else torch.device("cpu")
        bar = None
        if rank == 0:
            from tqdm import tqdm
            bar = tqdm(total=total_runs, desc="demo", unit="run", dynamic_ncols=True,
                       mininterval=0.5,
                       bar_format="{desc:<28} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}")
        return cls(rank=rank, world_size=world_size, cfg=cfg, info=inputs.info, device=device,
                   model=MiniLM(inputs.state, inputs.info, device=device, dtype=cfg.torch_dtype),
                   input_ids=inputs.input_ids.to(device),
                   attention_mask=inputs.attention_mask.to(device),
                   decode_ids=inputs.decode_ids.to(device), cpu_group=cpu_group(), bar=bar)

    # -- data -------------------------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return -(-self.input_ids.shape[0] // self.cfg.batch_size)

    def sentence_chunks(self):
        """Yield ``(ids [b, s], mask [b, s])`` per chunk of ``cfg.batch_size`` sentences, cut to
        the chunk's longest sequence (right padding: the cut drops only padding columns)."""
        for start in range(0, self.input_ids.shape[0], self.cfg.batch_size):
            ids = self.input_ids[start:start + self.cfg.batch_size]
            mask = self.attention_mask[start:start + self.cfg.batch_size]
            s = int(mask.sum(dim=1).max())
            yield ids[:, :s], mask[:, :s]

    # -- helpers ----------------------------------------------------------------------------
    def memo(self, key: str, fn: Callable[[], Any], label: str | None = None) -> Any:
        """``fn()`` once per demo run (e.g. a reference several modes or backends share);
        ``label`` shows on the progress bar meanwhile."""
        if key not in self.memos:
            before = self.bar.desc if self.bar is not None else None
            if label:
                self.describe(label)
            self.memos[key] = fn()
            if label and before is not None:
                self.describe(before)
        return self.memos[key]

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dist.barrier(group=self.cpu_group)

    def timed(self, fn: Callable[[], Any]) -> float:
        """Run ``fn()`` on every rank between barriers; seconds on the slowest rank."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return float(t)

    def row(self, mode: str, backend: str, out: torch.Tensor, ref: torch.Tensor | None,
            seconds: float, threshold: float | None = None) -> DemoRow | None:
        """Rank 0: the row comparing ``out`` with ``ref`` (``[..., E]``), passing at
        ``threshold`` (None: the dtype's); other ranks: None."""
        if self.rank != 0:
            return None
        min_cos, max_err = compare(out, ref)
        return DemoRow(mode, backend, self.world_size, min_cos, max_err, seconds,
                       threshold if threshold is not None else self.cfg.threshold)

    def begin_run(self, index: int, label: str) -> None:
        """Start (mode, backend) run ``index`` (0-based) of the plan: the bar shows ``label``
        and its advances stop at ``index + 1``."""
        self.run_end = index + 1
        self.describe(label)

    def end_run(self) -> None:
        """Land the bar exactly on the end of the current run."""
        if self.bar is not None:
            self.bar.n = self.run_end
            self.bar.refresh()

    def advance(self, fraction: float) -> None:
        """Move the progress bar by ``fraction`` of one (mode, backend) run (rank 0 only),
        never past the run's end: fractions such as ``1 / steps`` add up to a little more
        than 1 in floating point, and a bar past its total is clamped with a warning."""
        if self.bar is not None:
            self.bar.update(max(0.0, min(fraction, self.run_end - self.bar.n)))

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def sentence_reference(ctx: RankContext) -> torch.Tensor | None:
    """The one-process sentence embeddings ``[N, E]`` fp32 of the corpus (full attention with
    the padding mask), on rank 0 (None elsewhere). Each chunk is computed whole by one rank
    (chunk c on rank c % W, no communication inside), then collected; computed once per run."""

    def compute():
        n, e = ctx.input_ids.shape[0], ctx.info.hidden_size
        buf = torch.zeros(n, e, dtype=torch.float32)
        bs = ctx.cfg.batch_size
        for c, (ids, mask) in enumerate(ctx.sentence_chunks()):
            if c % ctx.world_size != ctx.rank:
                continue
            valid = mask.bool()[:, None, :]
            scale = ctx.model.scale

            def attend(i, q, k, v):
                return full_attention(q, k, v, valid, scale)

            hidden = ctx.model.forward(ids, attend)
            buf[c * bs:c * bs + ids.shape[0]] = mean_pool(hidden, mask).cpu()
        # Every row has exactly one non-zero contributor, so the sum is exact.
        collectives.all_reduce(buf, group=ctx.cpu_group)
        return buf if ctx.rank == 0 else None

    return ctx.memo("sentence_reference", compute, label="one-process reference")
