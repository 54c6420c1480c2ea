"""The fuzz's cases: each one drawn from a single integer seed, run on W gloo ranks, checked
against a single-process reference (fp64 where arithmetic is involved, bitwise where the
exchange only moves data).

Every rank draws the same case from the seed (``spec``), builds the same global inputs from it,
takes its own part, runs the exchange and compares its own part of the result. ``run_case``
returns None or a failure message; an exception leaves the group possibly out of step, so the
driver (``attncomm.testing.fuzz``) starts fresh ranks after one.
"""
from __future__ import annotations

import math
import random

import torch

from attncomm import config, dcp, dp_attention, ulysses
from attncomm.dp_attention import BatchView, ForwardMode

from .reference import ref_attention, ref_norm_rope
from .special import bitwise_equal, check_merge

__all__ = ["KINDS", "run_case", "spec"]

# kind → relative weight in the draw
KINDS = {"dcp_merge": 4, "seq_to_head": 2, "head_to_seq": 2, "ulysses_attention": 2,
         "dp_gather_scatter": 2, "dp_reduce_scatter": 1, "dp_sync": 1}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
           "fp64": torch.float64, "int64": torch.int64, "int32": torch.int32}


def _gen(seed: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 7919 + salt) & ((1 << 62) - 1))


def _split(rng: random.Random, world: int, hi: int, p_zero: float = 0.3) -> list[int]:
    return [0 if rng.random() < p_zero else rng.randint(1, hi) for _ in range(world)]


def spec(seed: int) -> dict:
    """The case drawn from ``seed``: ``{"seed", "kind", "W", ...parameters}``."""
    rng = random.Random(seed)
    W = rng.choice([1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8])
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    return {"seed": seed, "kind": kind, "W": W, **_DRAW[kind](rng, W)}


def _draw_dcp(rng, W):
    T = 0 if rng.random() < 0.08 else rng.randint(1, 24)
    H = W * rng.randint(1, 3)
    D = rng.choice([1, 2, 3, 5, 8, 16, 17, 64, 128])
    spread = rng.choice([0.5, 4.0, 4.0, 30.0, 1e4])
    # Triton combine under the interpreter: each (token, head) program runs in Python.
    impl = "triton" if T * H // W <= 12 and rng.random() < 0.1 else "torch"
    return {"backend": rng.choice(["reference", "ag_rs", "a2a"]), "T": T, "H": H, "D": D,
            "dtype": rng.choice(["fp32", "bf16", "fp16"]), "spread": spread,
            "base": "2" if spread <= 30 and rng.random() < 0.3 else "e",
            "p_empty": rng.choice([0.0, 0.1, 0.3, 0.7]),
            "p_all_empty": rng.choice([0.0, 0.05, 0.3]),
            # NaN/inf payloads under finite LSEs (the propagate rule), at ordinary spreads only
            "bad_payloads": spread <= 4.0 and rng.random() < 0.15, "impl": impl}


def _draw_a2a(rng, W):
    return {"B": rng.choice([1, 1, 2]), "seq_lens": _split(rng, W, 5),
            "H": rng.randint(1, 13), "D": rng.choice([1, 2, 3, 8, 16]),
            "dtype": rng.choice(["fp32", "fp32", "bf16", "fp16", "int64", "int32"])}


def _draw_attention(rng, W):
    lens = _split(rng, W, 6)
    if sum(lens) == 0:
        lens[rng.randrange(W)] = rng.randint(1, 6)
    hkv = rng.choice([1, 1, 2, 3, 4, 6])
    rope = rng.random() < 0.5
    return {"seq_lens": lens, "Hkv": hkv, "Hq": hkv * rng.choice([1, 2, 3, 4]),
            "D": rng.choice([2, 4, 8, 16]) if rope else rng.choice([1, 3, 4, 8]),
            "rope": rope, "qk_norm": rng.random() < 0.5, "causal": rng.random() < 0.5,
            "dtype": "bf16" if rng.random() < 0.2 else "fp32",
            "pipeline_groups": rng.choice([-1, 0])}


def _draw_dp(rng, W):
    tp = rng.choice([d for d in range(1, W + 1) if W % d == 0])
    dims = [rng.randint(1, 5) for _ in range(rng.choice([1, 1, 2]))]
    return {"tp": tp, "n": _split(rng, W // tp, 6), "mode": rng.choice(["sum_len", "max_len"]),
            "rest": dims, "dtype": rng.choice(["fp32", "fp64", "int64"])}


def _draw_sync(rng, W):
    tp = rng.choice([d for d in range(1, W + 1) if W % d == 0])
    batches = []
    for _ in range(W // tp):
        r = rng.random()
        if r < 0.35:
            batches.append(None)  # an idle DP rank
        elif r < 0.7:
            batches.append(("decode", rng.randint(1, 8)))
        else:
            bs = rng.randint(1, 4)
            batches.append(("extend", bs, [rng.randint(1, 9) for _ in range(bs)]))
    return {"tp": tp, "batches": batches, "sync": rng.choice(["shm", "cpu"])}


_DRAW = {"dcp_merge": _draw_dcp, "seq_to_head": _draw_a2a, "head_to_seq": _draw_a2a,
         "ulysses_attention": _draw_attention, "dp_gather_scatter": _draw_dp,
         "dp_reduce_scatter": _draw_dp, "dp_sync": _draw_sync}


# ------------------------------------------------------------------------------------- runners

def run_case(rank: int, world: int, sp: dict) -> str | None:
    """Run case ``sp`` (from ``spec``) on this rank of the default group; a failure message or
    None. Exceptions propagate (the driver reports them and starts fresh ranks)."""
    if sp["W"] != world:
        raise ValueError(f"case {sp['seed']} is for W={sp['W']}, this world has {world}")
    return _RUN[sp["kind"]](rank, world, sp)


def _dcp_inputs(sp):
    W, T, H, D, seed = sp["W"], sp["T"], sp["H"], sp["D"], sp["seed"]
    g = _gen(seed)
    outs = torch.randn(W, T, H, D, generator=g)
    lses = torch.randn(W, T, H, generator=g) * sp["spread"]
    if T:
        empty = torch.rand(W, T, H, generator=g) < sp["p_empty"]
        kinds = torch.randint(0, 3, (W, T, H), generator=g)  # −inf, +inf, NaN
        marks = torch.tensor([-math.inf, math.inf, math.nan])[kinds]
        lses = torch.where(empty, marks, lses)
        outs[empty] = math.nan  # never read
        all_empty = torch.rand(T, H, generator=g) < sp["p_all_empty"]
        lses[:, all_empty] = marks[0][all_empty]
        outs[:, all_empty] = math.nan
        if sp["bad_payloads"]:
            bad = torch.rand(W, T, H, D, generator=g) < 0.05
            vals = torch.tensor([math.nan, math.inf, -math.inf])[
                torch.randint(0, 3, (W, T, H, D), generator=g)]
            outs = torch.where(bad, vals, outs)
    return outs.to(_DTYPES[sp["dtype"]]), lses


def _run_dcp(rank, W, sp):
    outs, lses = _dcp_inputs(sp)
    hs = sp["H"] // W
    base2 = sp["base"] == "2"
    lse_in = (lses[rank] / math.log(2)).float() if base2 else lses[rank]
    lses_ref = (lses / math.log(2)).float().double() * math.log(2) if base2 else lses
    mine_out, mine_lse = outs[rank].clone(), lse_in.clone()
    with config.setting(ATTNCOMM_COMBINE_IMPL=sp["impl"]):
        o, l = dcp.merge(mine_out, mine_lse, backend=sp["backend"], lse_base=sp["base"],
                         return_lse=True)
    if not (bitwise_equal(mine_out, outs[rank]) and bitwise_equal(mine_lse, lse_in)):
        return "dcp.merge modified its inputs"
    bad = check_merge(o, l * math.log(2) if base2 else l, outs, lses_ref,
                      slice(rank * hs, (rank + 1) * hs), "dcp.merge")
    return "; ".join(bad[:3]) or None


def _global_x(sp, shape):
    dt = _DTYPES[sp["dtype"]]
    g = _gen(sp["seed"], 1)
    if dt.is_floating_point:
        return torch.randn(shape, generator=g).to(dt)
    return torch.randint(-1000, 1000, shape, generator=g).to(dt)


def _run_a2a(rank, W, sp):
    lens, B, H, D = sp["seq_lens"], sp["B"], sp["H"], sp["D"]
    X = _global_x(sp, (B, sum(lens), H, D))
    off = sum(lens[:rank])
    heads = ulysses.head_split(H, W)
    h0 = sum(heads[:rank])
    mine_seq = X[:, off:off + lens[rank]]
    mine_heads = X[:, :, h0:h0 + heads[rank]]
    if sp["kind"] == "seq_to_head":
        got = ulysses.seq_to_head(mine_seq.clone(), seq_lens=lens, backend="all_to_all")
        want = mine_heads
    else:
        got = ulysses.head_to_seq(mine_heads.clone(), num_heads=H, seq_lens=lens,
                                  backend="all_to_all")
        want = mine_seq
    if not bitwise_equal(got, want.contiguous()):
        return f"{sp['kind']}: result differs from the slice of the global tensor " \
               f"(shape {tuple(got.shape)} vs {tuple(want.shape)})"
    return None


def _run_attention(rank, W, sp):
    lens, hq, hkv, D = sp["seq_lens"], sp["Hq"], sp["Hkv"], sp["D"]
    S, dt = sum(lens), _DTYPES[sp["dtype"]]
    g = _gen(sp["seed"], 2)
    q, k, v = (torch.randn(1, S, h, D, generator=g).to(dt) for h in (hq, hkv, hkv))
    norm = rope = None
    if sp["qk_norm"]:
        norm = (1 + 0.1 * torch.randn(D, generator=g), 1 + 0.1 * torch.randn(D, generator=g),
                1e-6)
    if sp["rope"]:
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).double() / D))
        ang = torch.arange(S).double()[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        rope = (ang.cos().float(), ang.sin().float())
    off = sum(lens[:rank])
    sl = slice(off, off + lens[rank])
    attn = ulysses.UlyssesAttention(backend="all_to_all", qk_norm=norm,
                                    pipeline_groups=sp["pipeline_groups"])
    got = attn(q[:, sl], k[:, sl], v[:, sl], seq_lens=lens, causal=sp["causal"], rope=rope)
    qr, kr = q.double(), k.double()
    if norm is not None or rope is not None:
        cos, sin = rope if rope is not None else (None, None)
        qr = ref_norm_rope(qr, None if norm is None else norm[0], 1e-6, cos, sin)
        kr = ref_norm_rope(kr, None if norm is None else norm[1], 1e-6, cos, sin)
    want = ref_attention(qr, kr, v.double(), sp["causal"])[:, sl]
    tol = 2e-5 if dt == torch.float32 else 6e-2
    if got.shape != want.shape or got.dtype != dt:
        return f"UlyssesAttention: got {tuple(got.shape)} {got.dtype}, want " \
               f"{tuple(want.shape)} {dt}"
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    if not err <= tol * max(1.0, want.abs().max().item() if want.numel() else 1.0):
        return f"UlyssesAttention: max abs error {err:.3g} against the fp64 reference"
    return None


def _dp_rows(sp, d):
    shape = (sp["n"][d], *sp["rest"])
    g = _gen(sp["seed"], 100 + d)
    dt = _DTYPES[sp["dtype"]]
    return torch.randint(-50, 50, shape, generator=g).to(dt)


def _layout(n, mode):
    m = max(n)
    if mode == "sum_len":
        return sum(n), [sum(n[:d]) for d in range(len(n))]
    return m * len(n), [d * m for d in range(len(n))]


def _run_dp_gather(rank, W, sp):
    n, tp, mode = sp["n"], sp["tp"], sp["mode"]
    d = rank // tp
    rows = [_dp_rows(sp, q) for q in range(len(n))]
    total, offs = _layout(n, mode)
    got = dp_attention.dp_gather(rows[d].clone(), n, None, mode=mode, attn_tp_size=tp)
    if tuple(got.shape) != (total, *sp["rest"]) and not (total == 0 and got.shape[0] == 0):
        return f"dp_gather: shape {tuple(got.shape)}, want {(total, *sp['rest'])}"
    for q in range(len(n)):
        if not bitwise_equal(got[offs[q]:offs[q] + n[q]], rows[q]):
            return f"dp_gather: DP rank {q}'s rows differ"
    if total and not bitwise_equal(dp_attention.dp_scatter(got, n, d, mode=mode), rows[d]):
        return "dp_scatter: this DP rank's rows differ from what it sent"
    return None


def _run_dp_reduce_scatter(rank, W, sp):
    n, tp, mode = sp["n"], sp["tp"], sp["mode"]
    total, offs = _layout(n, mode)
    dt = _DTYPES[sp["dtype"]]
    parts = [torch.randint(-50, 50, (total, *sp["rest"]), generator=_gen(sp["seed"], 200 + r))
             .to(dt) for r in range(W)]
    got = dp_attention.dp_reduce_scatter(parts[rank].clone(), n, None, mode=mode, attn_tp_size=tp)
    d = rank // tp
    want = torch.stack(parts).sum(0)[offs[d]:offs[d] + n[d]]  # small integers: exact
    if not bitwise_equal(got, want.to(dt)):
        return f"dp_reduce_scatter: DP rank {d}'s sum differs"
    return None


def _run_dp_sync(rank, W, sp):
    tp, batches = sp["tp"], sp["batches"]

    def view(b):
        if b is None:
            return None
        if b[0] == "decode":
            return BatchView(ForwardMode.DECODE, batch_size=b[1])
        return BatchView(ForwardMode.EXTEND, batch_size=b[1], extend_num_tokens=sum(b[2]),
                         extend_lens=list(b[2]))

    want = [0 if b is None else (b[1] if b[0] == "decode" else sum(b[2])) for b in batches]
    batch, info = dp_attention.prepare_mlp_sync_batch(
        view(batches[rank // tp]), dp_size=W // tp, attn_tp_size=tp, group=None,
        sync=sp["sync"], get_idle_batch=lambda: BatchView(ForwardMode.IDLE))
    if info.global_num_tokens != want:
        return f"dp sync: global_num_tokens {info.global_num_tokens}, want {want}"
    if info.is_extend_in_batch != any(b is not None and b[0] == "extend" for b in batches):
        return "dp sync: is_extend_in_batch differs"
    idle_everywhere = all(b is None for b in batches)
    if (batch is None) != idle_everywhere:
        return f"dp sync: returned batch {batch!r} with every rank idle = {idle_everywhere}"
    if batch is not None and batches[rank // tp] is None and \
            ForwardMode(int(batch.forward_mode)) != ForwardMode.IDLE:
        return "dp sync: an idle rank did not get the idle batch"
    return None


_RUN = {"dcp_merge": _run_dcp, "seq_to_head": _run_a2a, "head_to_seq": _run_a2a,
        "ulysses_attention": _run_attention, "dp_gather_scatter": _run_dp_gather,
        "dp_reduce_scatter": _run_dp_reduce_scatter, "dp_sync": _run_dp_sync}
