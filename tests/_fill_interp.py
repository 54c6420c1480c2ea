"""The Ulysses fill kernel under the Triton interpreter, bitwise against the torch path.

Run with TRITON_INTERPRET=1 (tests/test_ulysses_fill.py does this in a subprocess); prints one
line per failing case and exits 1 if any failed. Seed: argv[1].
"""
from __future__ import annotations

import random
import sys

import torch

import _interp_rounding  # noqa: F401  (fp32 → bf16 rounds to nearest even, as on the GPU)
from attncomm.ulysses.fill import FillPart, fill_torch, fill_triton, send_layout
from attncomm.ulysses.layout import group_head_ranges, kv_head_range

# (W, Hq, Hkv, D, B, S_r, dtype, norm, rope, layout of the inputs)
CASES = [
    (3, 7, 7, 16, 1, 5, torch.bfloat16, True, True, "dense"),        # uneven heads
    (3, 8, 2, 16, 2, 4, torch.bfloat16, True, True, "dense"),        # GQA, Hkv < W
    (4, 6, 1, 8, 1, 3, torch.float16, True, False, "transposed"),    # MQA, non-contiguous
    (2, 4, 2, 32, 1, 6, torch.float32, False, True, "sliced"),       # RoPE only
    (2, 4, 4, 16, 2, 3, torch.bfloat16, False, False, "transposed"),  # plain pack
    (5, 12, 3, 8, 1, 7, torch.bfloat16, True, True, "sliced"),
    (2, 3, 3, 2, 1, 0, torch.bfloat16, True, True, "dense"),          # empty shard
    (3, 8, 2, 8, 1, 9, torch.float32, True, True, "dense"),           # fp32 norm + RoPE
]


def _make(g, shape, dtype, layout):
    b, s, h, d = shape
    if layout == "transposed":  # [B, H, S, D] storage seen as [B, S, H, D]
        return torch.randn((b, h, s, d), generator=g).to(dtype).transpose(1, 2)
    if layout == "sliced":      # every other head of a wider tensor, last dim strided too
        return torch.randn((b, s, 2 * h, 2 * d), generator=g).to(dtype)[:, :, ::2, ::2]
    return torch.randn(shape, generator=g).to(dtype)


def _weights(g, d, dtype, norm, weights):
    """q and k RMSNorm weights: "mixed" fp32 and ``dtype`` (the kernel gets fp32 copies),
    "same" both ``dtype`` (passed as they are), "strided" both ``dtype``, k's a strided view
    (copied)."""
    if not norm:
        return None, None
    qw = torch.randn(d, generator=g)
    if weights != "mixed":
        qw = qw.to(dtype)
    kw = torch.randn(2 * d if weights == "strided" else d, generator=g).to(dtype)
    return qw, kw[::2] if weights == "strided" else kw


def run_case(seed, w, hq, hkv, d, b, s_r, dtype, norm, rope, layout, groups, weights="mixed"):
    g = torch.Generator()
    g.manual_seed(seed)
    q, k, v = (_make(g, (b, s_r, h, d), dtype, layout) for h in (hq, hkv, hkv))
    qw, kw = _weights(g, d, dtype, norm, weights)
    cos = torch.randn((s_r, d), generator=g) if rope else None
    sin = torch.randn((2 * s_r, d), generator=g)[::2] if rope else None
    bad = []
    for grp in range(groups):
        qr = tuple(group_head_ranges(hq, w, groups)[grp])
        kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
        parts = [FillPart(q, qr, qw, rope), FillPart(k, kr, kw, rope), FillPart(v, kr)]
        want = fill_torch(parts, 1e-5, cos, sin)
        out = torch.full_like(want, float("nan"))
        got = fill_triton(parts, 1e-5, cos, sin, out=out)
        if got.data_ptr() != out.data_ptr() or not torch.equal(want, got):
            diff = (want.float() - got.float()).abs().nan_to_num(float("inf")).max().item()
            bad.append(f"group {grp}/{groups}: max diff {diff}")
        # regions in separate allocations (a transport's staging), allocated in reverse order
        _, starts = send_layout(b, s_r, d, [x.ranges for x in parts])
        sizes = [starts[p + 1] - starts[p] for p in range(w)]
        regions = [torch.full((n,), float("nan"), dtype=dtype) for n in reversed(sizes)][::-1]
        fill_triton(parts, 1e-5, cos, sin, out=regions)
        if not torch.equal(torch.cat(regions), want):
            bad.append(f"group {grp}/{groups}: regions differ")
    return bad


def main(seed: int) -> int:
    rng = random.Random(seed)
    failed = 0
    for case in CASES:
        for groups in (1, 2):
            bad = run_case(rng.randrange(1 << 30), *case, groups)
            if bad:
                failed += 1
                print(f"FAIL seed {seed} case {case} groups {groups}: {bad}")
    extra = [(case, weights) for case in CASES if case[6] is not torch.float32 and case[7]
             for weights in ("same", "strided")][:4]
    for case, weights in extra:
        bad = run_case(rng.randrange(1 << 30), *case, 1, weights=weights)
        if bad:
            failed += 1
            print(f"FAIL seed {seed} case {case} weights {weights}: {bad}")
    print(f"{len(CASES) * 2 + len(extra) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
