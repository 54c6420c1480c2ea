"""``attncomm bench ulysses --payload fp8``: the FP8 payload's error on random data from fixed
seeds, beside the layer timings.

Per case (B = 1, S tokens, Hq query and Hkv KV heads, head_dim D, bf16 inputs, non-causal
SDPA): the full q, k, v are drawn from a fixed seed (the same tensors on every rank; each rank
takes its sequence shard ``head_split(S, W)``), sent through ``UlyssesAttention`` with the
plain payload (the bf16 exchange) and with ``payload_dtype=torch.float8_e4m3fn``, and compared
with an fp64 attention over the full sequence on this rank's rows. Two input kinds: ``normal``
(i.i.d. N(0, 1)) and ``outliers`` (two channels of every row 20× larger, as activation outliers
make real q/k rows, then each row scaled to RMS 1 as a QK RMSNorm leaves it: the row's amax,
and so its scale, is set by the outliers, and the other channels sit ~20× below it; with the
rows not rescaled the logits reach ~100 and the softmax is so sharp that any rounding moves
its argmax, which says nothing about the payload).

Figures, over every rank's rows (max, min, or the root of the summed squares):

- ``payload_rel_max``: max over q, k, v rows of ``|x̂ − x| / amax(row)``, the wire rows' own
  error (``fp8.py`` bounds it by 1/28 + u: 0.0396 for bf16);
- for the plain exchange against fp64, FP8 against fp64 and FP8 against the plain exchange:
  ``max_abs`` (max |Δ|), ``rel_rms`` (‖Δ‖ / ‖reference‖ over all elements) and ``min_cos``
  (the smallest cosine similarity of one (token, head) output vector with its reference).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .. import collectives
from ..ulysses import UlyssesAttention, fp8
from ..ulysses.layout import head_offsets, head_split

__all__ = ["CASES", "fp8_error_records", "markdown_rows"]

#: (S, Hq, Hkv, D) on CPU and on CUDA (the fp64 reference bounds S).
CASES = {"cpu": [(512, 8, 8, 64), (512, 8, 2, 128)],
         "cuda": [(2048, 24, 24, 128), (2048, 24, 8, 128)]}
SEEDS = (0, 1, 2)
KINDS = ("normal", "outliers")


def _full(case, seed, kind, device):
    s, hq, hkv, d = case
    g = torch.Generator(device="cpu").manual_seed(1000 * seed + s + hq + hkv + d)
    out = []
    for h in (hq, hkv, hkv):
        x = torch.randn((1, s, h, d), generator=g)
        if kind == "outliers":
            x[..., :2] *= 20.0
            x = x * torch.rsqrt((x * x).mean(-1, keepdim=True))
        out.append(x.to(torch.bfloat16).to(device))
    return out


def _ref_rows(q_rows, k, v):
    """fp64 attention of ``q_rows [1, s, Hq, D]`` over ``k, v [1, S, Hkv, D]`` → ``[1, s, Hq,
    D]``, one head at a time (bounded memory)."""
    m = q_rows.shape[2] // k.shape[2]
    out = []
    for h in range(q_rows.shape[2]):
        qh = q_rows[0, :, h].double()
        kh, vh = k[0, :, h // m].double(), v[0, :, h // m].double()
        w = torch.softmax(qh @ kh.T / math.sqrt(qh.shape[-1]), dim=-1)
        out.append(w @ vh)
    return torch.stack(out, dim=1).unsqueeze(0)


def _stats(a, b) -> list[float]:
    """``[max |a − b|, Σ (a − b)², Σ b², min cosine]`` over (token, head) vectors."""
    a, b = a.double(), b.double()
    diff = a - b
    if a.numel() == 0:
        return [0.0, 0.0, 0.0, 1.0]
    cos = torch.nn.functional.cosine_similarity(a.reshape(-1, a.shape[-1]),
                                                b.reshape(-1, b.shape[-1]), dim=-1, eps=1e-30)
    return [float(diff.abs().max()), float((diff * diff).sum()), float((b * b).sum()),
            float(cos.min())]


def _reduce(values: list[float], op, cpu_g) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size(cpu_g) > 1:
        collectives.all_reduce(t, op=op, group=cpu_g)
    return t.tolist()


def _payload_rel(xs) -> float:
    worst = 0.0
    for x in xs:
        q, scale = fp8.quantize_rows(x)
        xh = fp8.dequantize_rows(q, scale, x.dtype).double()
        amax = x.double().abs().amax(-1, keepdim=True).clamp_min(1e-300)
        worst = max(worst, float(((xh - x.double()).abs() / amax).max()))
    return worst


def fp8_error_records(rank: int, world: int, device: torch.device, cpu_g, cases=None,
                      seeds=SEEDS) -> list[dict]:
    """One record per (case, kind, seed): the figures of the module docstring (every rank
    returns the same records). ``cases``: ``[(S, Hq, Hkv, D)]`` (default ``CASES`` of the
    device type)."""
    records = []
    for case in cases or CASES[device.type]:
        s = case[0]
        lens = head_split(s, world)
        lo = head_offsets(lens)[rank]
        hi = lo + lens[rank]
        plain = UlyssesAttention(pipeline_groups=0, validate=False)
        quant = UlyssesAttention(pipeline_groups=0, validate=False,
                                 payload_dtype=fp8.FP8_DTYPE)
        for kind in KINDS:
            for seed in seeds:
                q, k, v = _full(case, seed, kind, device)
                local = [t[:, lo:hi] for t in (q, k, v)]
                out_p = plain(*local, seq_lens=lens)
                out_f = quant(*local, seq_lens=lens)
                ref = _ref_rows(q[:, lo:hi], k, v)
                parts = [_stats(out_p, ref), _stats(out_f, ref), _stats(out_f, out_p)]
                mx = _reduce([p[0] for p in parts] + [_payload_rel([t[:, lo:hi] for t in
                                                                    (q, k, v)])],
                             dist.ReduceOp.MAX, cpu_g)
                sums = _reduce([x for p in parts for x in p[1:3]], dist.ReduceOp.SUM, cpu_g)
                mins = _reduce([p[3] for p in parts], dist.ReduceOp.MIN, cpu_g)
                rec = dict(geometry="fp8_error", seq=s, heads=case[1], kv_heads=case[2],
                           head_dim=case[3], kind=kind, seed=seed, dtype="bf16",
                           world_size=world, payload_rel_max=mx[3])
                for i, name in enumerate(("plain_vs_fp64", "fp8_vs_fp64", "fp8_vs_plain")):
                    rec[name] = {"max_abs": mx[i],
                                 "rel_rms": math.sqrt(sums[2 * i] / max(sums[2 * i + 1],
                                                                        1e-300)),
                                 "min_cos": mins[i]}
                records.append(rec)
    return records


def markdown_rows(records: list[dict]) -> list[str]:
    """The FP8 error section of the Markdown report."""
    rows = [r for r in records if r.get("geometry") == "fp8_error"]
    if not rows:
        return []
    lines = ["", "## FP8 payload error (random bf16 inputs, fixed seeds)", "",
             "payload: max |x̂ − x| / row amax over q, k, v; then max |Δ|, ‖Δ‖/‖ref‖ and the "
             "min cosine per (token, head) of the attention output.", "",
             "| S | Hq | Hkv | D | inputs | seed | payload | bf16 exch. vs fp64 (max, rel, "
             "min cos) | FP8 vs fp64 | FP8 vs bf16 exch. |", "|---|---|---|---|---|---|---|---|"
             "---|---|"]

    def cell(x):
        return f"{x['max_abs']:.2e}, {x['rel_rms']:.2e}, {x['min_cos']:.6f}"

    for r in rows:
        lines.append(f"| {r['seq']} | {r['heads']} | {r['kv_heads']} | {r['head_dim']} | "
                     f"{r['kind']} | {r['seed']} | {r['payload_rel_max']:.4f} | "
                     f"{cell(r['plain_vs_fp64'])} | {cell(r['fp8_vs_fp64'])} | "
                     f"{cell(r['fp8_vs_plain'])} |")
    return lines
