"""The Ulysses fill kernel under the Triton interpreter, bitwise against the torch path.

Run with TRITON_INTERPRET=1 (tests/test_ulysses_fill.py does this in a subprocess); prints one
line per failing case and exits 1 if any failed. Seed: argv[1]; argv[2] == "fp8": the FP8
payload cases instead (special values in the rows, and the e4m3 conversion alone).
"""
from __future__ import annotations

import contextlib
import random
import sys

import torch
import triton

import _interp_rounding  # noqa: F401  (fp32 → bf16 rounds to nearest even, as on the GPU)
from attncomm.ulysses.fill import fill_triton
from attncomm.ulysses import fill as fill_mod
from attncomm.ulysses import fill_epilogue, fill_kernels
from attncomm.ulysses.fill import FillPart, fill_torch, send_layout
from attncomm.ulysses.fp8 import FP8_DTYPE, row_bytes
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
#: Every block full with one head group (64 rows, the default block for D=16; 2 heads of each
#: part per destination): the unmasked kernel (``FULL``). With two groups, entries of 1 head.
FULL_CASE = (2, 4, 4, 16, 2, 64, torch.bfloat16, True, True, "sliced")
CASES.append(FULL_CASE)


class _FullSpy:
    """Stands in for ``fill_kernel`` and records each launch's ``FULL``."""

    def __init__(self, kernel):
        self.kernel, self.full = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.full.append(kwargs["FULL"])
            return launch(*args, **kwargs)
        return run


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


def _poison(g, xs):
    """Special values in the rows of q, k, v: a zero row, a NaN, ±inf, a huge value and a
    tiny row (what the FP8 rule treats apart)."""
    for x in xs:
        b, s, h, _ = x.shape
        if b * s == 0:
            continue
        pick = [(int(torch.randint(b, (1,), generator=g)), int(torch.randint(s, (1,),
                 generator=g)), int(torch.randint(h, (1,), generator=g))) for _ in range(5)]
        x[pick[0]] = 0.0
        x[pick[1]][1] = float("nan")
        x[pick[2]][0] = float("inf") if pick[2][1] % 2 else -float("inf")
        x[pick[3]][2] = 6e4 if x.dtype == torch.float16 else 1e30
        x[pick[4]] = x[pick[4]] * (2.0 ** -20 if x.dtype == torch.float16 else 2.0 ** -120)


def run_case(seed, w, hq, hkv, d, b, s_r, dtype, norm, rope, layout, groups, weights="mixed",
             payload=None):
    spy = fill_kernels.fill_kernel = _FullSpy(fill_kernels.fill_kernel)
    try:
        bad = _run_case(seed, w, hq, hkv, d, b, s_r, dtype, norm, rope, layout, groups, weights,
                        payload)
    finally:
        fill_kernels.fill_kernel = spy.kernel
    want = (w, hq, hkv, d, b, s_r, dtype, norm, rope, layout) == FULL_CASE and groups == 1
    if s_r and spy.full != [want] * len(spy.full):
        bad.append(f"FULL {spy.full}, want {want}")
    return bad


def _run_case(seed, w, hq, hkv, d, b, s_r, dtype, norm, rope, layout, groups, weights, payload):
    g = torch.Generator()
    g.manual_seed(seed)
    q, k, v = (_make(g, (b, s_r, h, d), dtype, layout) for h in (hq, hkv, hkv))
    if payload is not None:
        _poison(g, (q, k, v))
    qw, kw = _weights(g, d, dtype, norm, weights)
    cos = torch.randn((s_r, d), generator=g) if rope else None
    sin = torch.randn((2 * s_r, d), generator=g)[::2] if rope else None
    bad = []
    for grp in range(groups):
        qr = tuple(group_head_ranges(hq, w, groups)[grp])
        kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
        parts = [FillPart(q, qr, qw, rope), FillPart(k, kr, kw, rope), FillPart(v, kr)]
        want = fill_torch(parts, 1e-5, cos, sin, payload_dtype=payload)
        out = _poisoned(want.numel(), want.dtype)
        got = fill_triton(parts, 1e-5, cos, sin, out=out, payload_dtype=payload)
        if got.data_ptr() != out.data_ptr() or not torch.equal(want, got):
            diff = (want.float() - got.float()).abs().nan_to_num(float("inf")).max().item()
            bad.append(f"group {grp}/{groups}: max diff {diff}")
        # regions in separate allocations (a transport's staging), allocated in reverse order
        row = d if payload is None else row_bytes(d)
        _, starts = send_layout(b, s_r, row, [x.ranges for x in parts])
        sizes = [starts[p + 1] - starts[p] for p in range(w)]
        regions = [_poisoned(n, want.dtype) for n in reversed(sizes)][::-1]
        fill_triton(parts, 1e-5, cos, sin, out=regions, payload_dtype=payload)
        if not torch.equal(torch.cat(regions), want):
            bad.append(f"group {grp}/{groups}: regions differ")
    return bad


def _poisoned(n, dtype):
    if dtype == torch.uint8:
        return torch.full((n,), 0xA5, dtype=dtype)
    return torch.full((n,), float("nan"), dtype=dtype)


def check_e4m3(seed: int) -> list:
    """The kernel's conversion against torch's ``clamp(−448, 448).to(float8_e4m3fn)`` with the
    rule's NaN byte for non-finite inputs: every binade, ties, subnormals, saturation."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.empty(3000).uniform_(-16, 12, generator=g))
    x = x * torch.where(torch.rand(3000, generator=g) < 0.5, -1.0, 1.0)
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()
    ties = (grid[1:] + grid[:-1]) / 2
    x = torch.cat([x, ties, -ties, grid, -grid, torch.tensor(
        [464.0, 480.0, 1e38, float("inf"), -float("inf"), float("nan"), 2.0 ** -149])])
    want = x.clamp(-448.0, 448.0).to(FP8_DTYPE).view(torch.uint8).clone()
    want[~torch.isfinite(x)] = 0x7F
    msgs = []
    for hw in (False, True):  # integer rounding; the hardware's conversion (as patched here)
        out = torch.empty(x.numel(), dtype=torch.uint8)
        fill_epilogue.e4m3_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), BLOCK=256,
                                                                  HW_E4M3=hw)
        bad = (out != want).nonzero().flatten()
        msgs += [f"e4m3 (HW_E4M3={hw}) of {x[i].item()!r}: {int(out[i]):#x} vs torch "
                 f"{int(want[i]):#x}" for i in bad[:5].tolist()]
    return msgs


def check_quotient_rows(seed: int) -> list:
    """fp32 rows whose elements divide by the row's scale near e4m3's and fp32's rounding
    boundaries (targets of e4m3 values and midpoints times the divisor, a few ulps either side),
    amaxes over the whole fp32 range with all-ones and power-of-two significands, zero and tiny
    rows (blocks of 2 rows: a tiny row sends only its own block to ``div_rn``): the kernel's
    epilogue as on sm_89+ (the FMAs rounded once, ``_interp_rounding``) against the torch
    path."""
    g = torch.Generator().manual_seed(seed)
    s_r, h, d = 48, 2, 16
    e = torch.randint(-70, 127, (s_r, h), generator=g).double()
    m = 1 + torch.randint(0, 1 << 23, (s_r, h), generator=g).double() * 2.0 ** -23
    m[::5] = 2 - 2.0 ** -23
    m[1::5] = 1.0
    amax = (m * torch.exp2(e)).float()
    amax[3, 0], amax[7, 1], amax[8, 0] = 0.0, 2.0 ** -100, 3.4028234663852886e38
    scale = amax / torch.tensor(448.0)
    dv = torch.where(scale > 0, scale, 1.0).double()
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).double()
    targets = torch.cat([grid, (grid[1:] + grid[:-1]) / 2])
    t = targets[torch.randint(0, targets.numel(), (s_r, h, d), generator=g)]
    x = (t * dv[:, :, None]).float()
    x = (x.view(torch.int32) + torch.randint(-2, 3, x.shape, generator=g,
                                             dtype=torch.int32)).view(torch.float32)
    x = torch.minimum(x.abs(), amax[:, :, None]) * torch.where(
        torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    x[:, :, 0] = amax
    x[5, 1, 3], x[9, 0, 2] = -0.0, float("nan")
    return _sm89_bytes(x[None], "quotient rows")


def check_nan_beside_amax(seed: int) -> list:
    """fp32 and bf16 rows whose amax element sits at the same place in its half as a NaN in the
    other half (the epilogue takes the row's amax over the halves' element-wise maxima, whose
    ``max.f32`` returns the amax there): the epilogue as on sm_89+ against the torch path."""
    g = torch.Generator().manual_seed(seed)
    s_r, h, d = 8, 2, 16
    x = torch.randn((1, s_r, h, d), generator=g)
    j = torch.randint(0, d // 2, (s_r, h), generator=g)
    for r in range(s_r):
        for k in range(h):
            first = (r + k) % 2 == 0  # the amax in the first half or in the second
            x[0, r, k, j[r, k] + (0 if first else d // 2)] = -8.0 if r % 3 else 8.0
            x[0, r, k, j[r, k] + (d // 2 if first else 0)] = float("nan")
    return [m for dtype in (torch.float32, torch.bfloat16)
            for m in _sm89_bytes(x.to(dtype), f"NaN beside the amax, {dtype}")]


@contextlib.contextmanager
def _sm89():
    """The fill's epilogue as on sm_89+ (the host told the GPU converts to e4m3 itself; the
    conversion is ``_interp_rounding``'s stand-in)."""
    hw, fill_mod._hw_e4m3 = fill_mod._hw_e4m3, lambda device: True
    try:
        yield
    finally:
        fill_mod._hw_e4m3 = hw


def _sm89_bytes(x, what: str) -> list:
    """The FP8 fill of ``x [1, S_r, 2, D]`` (one head per destination, blocks of 2 rows and 1
    head) through the sm_89+ epilogue against the torch path: a line per differing byte (5 at
    most)."""
    parts = [FillPart(x, ((0, 1), (1, 2)))]
    want = fill_torch(parts, payload_dtype=FP8_DTYPE)
    with _sm89():
        got = fill_triton(parts, out=_poisoned(want.numel(), want.dtype),
                          payload_dtype=FP8_DTYPE, block_s=2, heads_per_program=1)
    bad = (got != want).nonzero().flatten()
    return [f"{what}: byte {i} {int(got[i]):#x} vs torch {int(want[i]):#x}"
            for i in bad[:5].tolist()]


def main_fp8(seed: int) -> int:
    """FP8 payload: every case whose head_dim is a multiple of 4, one and two head groups on
    the first, with special values in the rows; then the conversion alone."""
    rng = random.Random(seed)
    failed = 0
    cases = [c for c in CASES if c[3] % 4 == 0]
    for i, case in enumerate(cases):
        for groups in ((1, 2) if i == 0 else (1,)):
            bad = run_case(rng.randrange(1 << 30), *case, groups, payload=FP8_DTYPE)
            if bad:
                failed += 1
                print(f"FAIL seed {seed} fp8 case {case} groups {groups}: {bad}")
    # the epilogue as on sm_89+ (the conversion patched to the hardware's): the first case
    with _sm89():
        bad = run_case(rng.randrange(1 << 30), *cases[0], 1, payload=FP8_DTYPE)
    if bad:
        failed += 1
        print(f"FAIL seed {seed} fp8 case {cases[0]} with HW_E4M3: {bad}")
    checks = (check_e4m3, check_quotient_rows, check_nan_beside_amax)
    for check in checks:
        bad = check(rng.randrange(1 << 30))
        if bad:
            failed += 1
            print(f"FAIL seed {seed}: {bad}")
    print(f"{len(cases) + 2 + len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


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
    _seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    sys.exit(main_fp8(_seed) if sys.argv[2:] == ["fp8"] else main(_seed))
