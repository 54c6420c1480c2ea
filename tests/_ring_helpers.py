"""Shared by the ring and USP tests: seeded data, the fp64 reference with LSE and a key mask, and
bit comparisons."""
from __future__ import annotations

import math
import random

import torch

__all__ = ["gen", "rand", "ref_attention_lse", "bits_equal", "max_err", "SPECIALS",
           "special_blocks", "expect_value_error"]

SPECIALS = (float("-inf"), float("inf"), float("nan"))


def compile_counted(fn):
    """``(torch.compile(fn, fullgraph=True), graphs)``: ``graphs[0]`` counts the graphs it
    compiles (a backend that runs each graph as traced)."""
    graphs = [0]

    def backend(gm, inputs):
        graphs[0] += 1
        return gm.forward

    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def rand(g: torch.Generator, shape, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def ref_attention_lse(q, k, v, causal: bool, key_valid=None, scale=None, cu_seqlens=None):
    """Attention in fp64 over the whole sequence: ``q [B, S, Hq, D]``, ``k [B, S, Hkv, D]``,
    ``v [B, S, Hkv, Dv]`` (query head h uses KV head ``h // (Hq/Hkv)``), ``key_valid [B, S]``
    bool or None, ``cu_seqlens`` (boundaries of packed sequences: no attention across them) →
    ``(out [B, S, Hq, Dv], lse [B, S, Hq])`` fp64; a row with no valid key is 0 with LSE −inf."""
    q, k, v = q.double(), k.double(), v.double()
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s = torch.einsum("bshd,bthd->bhst", q, k) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    n = q.shape[1]
    mask = torch.zeros(q.shape[0], 1, n, k.shape[1], dtype=torch.bool)
    if causal:
        mask |= torch.ones(n, n, dtype=torch.bool).triu(1)
    if key_valid is not None:
        mask |= ~key_valid[:, None, None, :]
    if cu_seqlens is not None:
        ids = torch.zeros(n, dtype=torch.int64)
        for i, a in enumerate(list(cu_seqlens)[1:-1]):
            ids[int(a):] = i + 1
        mask |= ids[:, None] != ids[None, :]
    s = s.masked_fill(mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("bhst,bthd->bshd", p, v)
    return out, lse.transpose(1, 2)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN payloads and the sign of zero included)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def special_blocks(seed: int, shape, dtype=torch.float32, n_blocks: int = 4):
    """Random blocks ``(lo, hi, out [B, hi−lo, H, Dv], lse [B, hi−lo, H] fp32)`` covering row
    ranges of a ``[B, S, H, Dv]`` state (the first covers every row), with special LSEs (−inf,
    +inf, NaN) over NaN payloads (an empty block's payload must never leak), and row
    ``(0, 0, 0)`` empty in every block."""
    b, s, h, dv = shape
    g = gen(seed)
    rng = random.Random(seed)
    blocks = []
    for i in range(n_blocks):
        lo = 0 if i == 0 else rng.randrange(s)
        hi = s if i == 0 else rng.randrange(lo + 1, s + 1)
        out = (rand(g, (b, hi - lo, h, dv)) * 3).to(dtype)
        lse = rand(g, (b, hi - lo, h), torch.float32) * 4
        special = torch.rand((b, hi - lo, h), generator=g) < 0.3
        lse[special] = torch.tensor([SPECIALS[rng.randrange(3)]
                                     for _ in range(int(special.sum()))])
        out[special] = float("nan")
        if lo == 0:
            lse[0, 0, 0] = SPECIALS[i % 3]
            out[0, 0, 0] = float("nan")
        blocks.append((lo, hi, out, lse))
    return blocks


def expect_value_error(fn) -> str:
    """The message of the ValueError ``fn()`` raises, or "WRONG …" / "NO ERROR"."""
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001
        return f"WRONG {type(exc).__name__}: {exc}"
    return "NO ERROR"


def assert_same_error_everywhere(results) -> None:
    """``results[rank][case] = (message, fragment)``: every rank's message of a case is the same
    and holds the fragment."""
    for key in results[0]:
        msgs = [r[key][0] for r in results]
        assert len(set(msgs)) == 1, (key, msgs)
        assert results[0][key][1] in msgs[0], (key, msgs[0])
