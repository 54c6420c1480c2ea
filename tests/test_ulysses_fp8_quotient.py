"""The FP8 fill's quotients without a division (``fill_epilogue._quotient``, sm_89+): its steps
emulated in fp32 with a once-rounded FMA (``_interp_rounding.fma_f32``) against torch's IEEE
division, on every significand pair of bf16 and fp16 rows, the pairs the argument leaves to be
checked, and millions of fp32 pairs (random, near e4m3 and fp32 rounding boundaries, all-ones
significands, powers of two, tiny and huge divisors, special values). Where ``|g/d| ≥ 2⁻¹¹``
the fp32 quotient itself must be the division's; everywhere the e4m3 byte must be the rule's.
The kernel itself runs these steps under the interpreter in tests/_fill_interp.py and on the
GPU in scripts/fp8_quotient_gpu.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import _interp_rounding
from attncomm.ulysses import fill_epilogue
from attncomm.ulysses.fp8 import FP8_DTYPE, FP8_MAX

F32 = torch.float32


def _rule_bytes(g: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """fp8.quantize_rows' bytes for elements ``g`` of rows with divisor ``d``."""
    q = (g / d).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).clone()
    q[~torch.isfinite(g)] = 0x7F
    return q


def _kernel_quotient(g: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The epilogue's quotient on sm_89+, step by step: ``_quotient`` where ``d`` ≥ _DV_MIN,
    ``div_rn`` elsewhere (the kernel decides per block; per element is the same bits)."""
    y = torch.ones_like(d) / d
    q0 = g * y                                           # one fp32 rounding
    r = _interp_rounding.fma_f32(q0.numpy(), (-d).numpy(), g.numpy())
    q1 = torch.from_numpy(_interp_rounding.fma_f32(r, y.numpy(), q0.numpy()))
    q = torch.where(torch.signbit(g), -q1.abs(), q1.abs())
    return torch.where(d >= fill_epilogue._DV_MIN, q, g / d)


def _check(g: torch.Tensor, d: torch.Tensor, what: str) -> None:
    """The emulated kernel against the rule for elements ``g`` of rows with divisor ``d``
    (rows the rule makes: ``|g| ≤ amax`` with ``d = amax / 448``, so ``|g/d| < 2¹⁰``)."""
    g, d = g.to(F32).contiguous(), d.to(F32).contiguous()
    want = g / d
    assert not (torch.isfinite(g) & (want.abs() >= 2.0 ** 10)).any(), f"{what}: no row has it"
    got = _kernel_quotient(g, d)
    # where e4m3 has non-zero bytes (and a little below), the fp32 quotient itself
    exact = torch.isfinite(g) & (want.abs() >= 2.0 ** -11)
    bad = (exact & (got.view(torch.int32) != want.view(torch.int32))).nonzero().flatten()
    assert bad.numel() == 0, (what, [(g[i].item().hex(), d[i].item().hex(), got[i].item(),
                                      want[i].item()) for i in bad[:5].tolist()])
    # below, the byte: e4m3's zero with g's sign, as the rule's
    tiny = (torch.isfinite(g) & ~exact).nonzero().flatten()
    qg = got[tiny].clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    bad = (qg != _rule_bytes(g[tiny], d[tiny])).nonzero().flatten()
    assert bad.numel() == 0, (what, [(g[tiny[i]].item(), d[tiny[i]].item())
                                     for i in bad[:5].tolist()])


def _significands(bits: int) -> torch.Tensor:
    """Every significand in [1, 2) with ``bits`` fraction bits."""
    return 1.0 + torch.arange(1 << bits, dtype=torch.float64) / (1 << bits)


@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_every_16_bit_significand_pair(dtype, bits):
    """Rows of bf16 / fp16 values (the fill rounds to the parts' dtype before quantizing): every
    element significand against every amax significand, the divisor ``amax / 448`` as the rule
    makes it, quotients from 448 down past e4m3's zero; powers of two change nothing (the
    argument in ``_quotient``), so this is every pair such rows can meet in the normal range."""
    sig = _significands(bits)
    a = sig.repeat_interleave(sig.numel())               # element significands
    amax = sig.repeat(sig.numel())
    d = amax.float() / torch.tensor(FP8_MAX)
    gen = torch.Generator().manual_seed(bits)
    sign = torch.where(torch.rand(a.numel(), generator=gen) < 0.5, -1.0, 1.0).double()
    for k in (0, 7, 19):                 # g = a·2⁻ᵏ: x from 448 to below e4m3's zero
        g = (sign * a * 2.0 ** -k).to(dtype).float()
        _check(g, d, f"{dtype} 2^-{k}")


def _split_bytes(g: np.ndarray, d: np.ndarray) -> np.ndarray:
    """``fill_epilogue._ptx_split_bytes``' bytes, step by step in fp32 (FMAs rounded once), for
    elements ``g`` of rows with divisor ``d``: ``y_hi = RD(1/d)`` (the RN reciprocal, one step
    down where it exceeds 1/d: ``1 − d·y < 0``), ``y_lo = RN((1 − d·y_hi)·y_hi)``,
    ``q = RN(g·y_hi + RN(g·y_lo))``, then ``cvt.rn.satfinite`` (the rule's clamp and rounding)
    and 0x7F for a NaN."""
    fma = _interp_rounding.fma_f32
    with np.errstate(all="ignore"):
        y = np.float32(1) / d
        y = np.where(fma(-d, y, np.float32(1)) < 0, np.nextafter(y, np.float32(0)), y)
        yl = fma(-d, y, np.float32(1)) * y
        q = fma(g, y, g * yl)
    out = torch.from_numpy(q).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8).clone()
    out[torch.from_numpy(np.isnan(q))] = 0x7F
    return out


def _split_check(a: np.ndarray, amax: np.ndarray, what: str) -> None:
    """``_split_bytes`` against the rule for elements ``a`` of rows with amax ``amax`` (fp32
    arrays, ``|a| ≤ amax``), both signs."""
    d = (amax / np.float32(FP8_MAX)).astype(np.float32)
    for sign in (1, -1):
        g = (sign * a).astype(np.float32)
        want = _rule_bytes(torch.from_numpy(g), torch.from_numpy(d))
        bad = (_split_bytes(g, d) != want).nonzero().flatten()
        assert bad.numel() == 0, (what, [(float(g[i]), float(amax[i])) for i in bad[:5].tolist()])


@pytest.mark.slow
@pytest.mark.parametrize("dtype,bits", [(torch.bfloat16, 7), (torch.float16, 10)])
def test_split_reciprocal_every_16_bit_pair(dtype, bits):
    """``_ptx_split_bytes`` (the PTX epilogue's quotients of 16-bit rows): every element
    significand against every amax significand, at every exponent offset from ``g = amax``
    down to quotients under e4m3's zero (2⁻¹¹), both signs, zeros, NaN, and at the ends of
    the amax range ``_fast_block(SPLIT)`` lets through. There d, y_hi and y_lo are normal, and
    so are the products wherever the byte can be non-zero, so a power of two on a row changes
    no byte: this is every pair such rows can meet. Only the bytes are promised (not the fp32
    quotient): here they are the rule's, with no exception."""
    sig = _significands(bits).numpy()
    a, amax = np.repeat(sig, sig.size), np.tile(sig, sig.size)
    for k in range(24):                       # g = a·2⁻ᵏ ≤ amax: |g/d| from 448 to < 2⁻¹¹
        g = a * 2.0 ** -k
        keep = g <= amax
        _split_check(g[keep].astype(np.float32), amax[keep].astype(np.float32),
                     f"{dtype} 2^-{k}")
    # the ends of the range, from its least amax (448·2⁻⁸⁰) to its largest (2⁶⁴) (every pair
    # at 2⁻¹ and 2⁻⁹ below the amax), zeros, NaN and subnormal elements
    lo, hi = fill_epilogue._AMAX_MIN, fill_epilogue._AMAX_MAX_SPLIT
    special = np.float32([0.0, np.nan, 2.0 ** -133, 2.0 ** -149])
    for e in (np.floor(np.log2(lo)), np.ceil(np.log2(lo)), -40.0, 40.0, np.log2(hi) - 1,
              np.log2(hi)):
        top = amax * 2.0 ** e
        keep = (top >= lo) & (top <= hi)
        assert keep.any(), e
        for k in (1, 9):
            _split_check((a[keep] * 2.0 ** (e - k)).astype(np.float32),
                         top[keep].astype(np.float32), f"{dtype} amax 2^{e:g}, 2^-{k}")
        m = sig * 2.0 ** e
        m = np.float32(m[(m >= lo) & (m <= hi)])
        _split_check(np.repeat(special, m.size), np.tile(m, special.size), f"specials 2^{e:g}")


def test_the_pairs_the_argument_leaves():
    """``_quotient``'s argument covers every significand pair but ``a ≥ 2 − 3·2⁻²³ < b``: those
    three, with all of their neighbours near 2 (64 × 64 pairs), at several exponents."""
    s = torch.tensor([2.0 - k * 2.0 ** -23 for k in range(1, 65)], dtype=torch.float64)
    a, b = s.repeat_interleave(s.numel()), s.repeat(s.numel())
    for ea, eb in ((0, 0), (3, -5), (-20, 10), (8, 0)):
        for sign in (1.0, -1.0):
            _check((sign * a * 2.0 ** ea).float(), (b * 2.0 ** eb).float(), f"near 2 {ea} {eb}")
    left = [(2.0 - 2 * 2.0 ** -23, 2.0 - 2.0 ** -23), (2.0 - 3 * 2.0 ** -23, 2.0 - 2.0 ** -23),
            (2.0 - 3 * 2.0 ** -23, 2.0 - 2 * 2.0 ** -23)]
    g, d = torch.tensor(left).T.float()
    assert (g.double() / d.double() < 1).all() and (g < d).all()
    _check(g, d, "the three pairs")


def _random_divisors(gen, n: int, lo: float, hi: float) -> torch.Tensor:
    """Log-uniform fp32 divisors in [2^lo, 2^hi] with random significands; a quarter of them
    powers of two or all-ones significands."""
    e = torch.randint(int(lo), int(hi), (n,), generator=gen).double()
    m = 1.0 + torch.randint(0, 1 << 23, (n,), generator=gen).double() * 2.0 ** -23
    kind = torch.randint(0, 8, (n,), generator=gen)
    m = torch.where(kind == 0, 1.0, torch.where(kind == 1, 2.0 - 2.0 ** -23, m))
    return (m * torch.exp2(e)).float()


def test_millions_of_fp32_pairs(seed):
    """fp32 rows (any element, any divisor the rule makes, and more): random quotients over
    e4m3's range and below it, quotients at and next to e4m3's and fp32's rounding boundaries
    (a few ulps of g either side), saturation near 448, and divisors under _DV_MIN (the
    ``div_rn`` path): about 4 M pairs."""
    gen = torch.Generator().manual_seed(seed)
    n = 1 << 19
    d = _random_divisors(gen, n, -80, 119)  # up to the largest scale, FLT_MAX / 448
    # quotients log-uniform in [2⁻³⁰, 460], random sign
    t = torch.exp2(torch.empty(n, dtype=torch.float64).uniform_(-30, 8.85, generator=gen))
    t = t * torch.where(torch.rand(n, generator=gen) < 0.5, -1, 1)
    g = (t * d.double()).float()
    _check(g, d, f"seed {seed} random")
    # e4m3 values and midpoints (ties), 448 and past it, times d, then ±1..3 fp32 ulps of g
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8_DTYPE).double()
    targets = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([464.0, 480.0, 2.0 ** -10,
                                                                         2.0 ** -11])])
    pick = targets[torch.randint(0, targets.numel(), (n,), generator=gen)]
    g0 = (pick * d.double()).float()
    for step in (-3, -1, 0, 1, 2):
        gi = g0.view(torch.int32) + step
        g = gi.view(F32) * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        _check(g, d, f"seed {seed} boundaries {step}")
    # fp32 midpoints of the quotient's grid: g = (q + ulp/2)·d rounded, for random q
    q = (t.abs().clamp(2.0 ** -11, 448.0)).float().double()
    mid = q + torch.exp2(torch.floor(torch.log2(q)) - 24)
    _check((mid * d.double()).float(), d, f"seed {seed} fp32 midpoints")
    # tiny rows (the div_rn path), subnormal elements and divisors, specials
    dt = _random_divisors(gen, n // 4, -149, -79).clamp(min=2.0 ** -149)
    gt = (torch.exp2(torch.empty(n // 4, dtype=torch.float64).uniform_(-12, 9.8, generator=gen))
          * dt.double()).float()
    _check(gt, dt, f"seed {seed} tiny divisors")
    sub = torch.randint(1, 1 << 23, (n // 4,), generator=gen, dtype=torch.int32).view(F32)
    _check(sub, _random_divisors(gen, n // 4, -80, -60), f"seed {seed} subnormal g")
    big = 3.4028234663852886e38
    spec = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 2.0 ** -149,
                         -(2.0 ** -149)])
    dd = torch.tensor([1.0, 2.0 ** -80, 2.0 ** 119, big / 448, 1.5 * 2.0 ** -81])
    _check(spec.repeat(dd.numel()), dd.repeat_interleave(spec.numel()), "specials")
    amax = torch.tensor([big, -big, 2.0 ** -80 * 448, 2.0 ** -149, 448.0])
    scale = amax.abs() / torch.tensor(FP8_MAX)
    _check(amax, torch.where(scale > 0, scale, 1.0), "amax elements")  # the rule's divisor


def test_fma_emulation_rounds_once():
    """``fma_f32`` against exact rational arithmetic: products that need all 48 bits, sums at
    fp32 ties and one unit in the 2⁻⁷⁰ place away from them, subnormal results; and a sum that
    rounding twice (to fp64, then to fp32) gets wrong."""
    from fractions import Fraction
    # a·b + c = 1 + 2⁻²³ + 2⁻²⁴ − 2⁻⁷⁰: to fp64 it rounds up to the fp32 tie 1 + 2⁻²³ + 2⁻²⁴,
    # which then rounds to even, 1 + 2⁻²²; rounded once it is 1 + 2⁻²³.
    one = _interp_rounding.fma_f32(np.float32([2.0 ** -24 * (1 + 2.0 ** -23)]),
                                   np.float32([1 - 2.0 ** -23]), np.float32([1 + 2.0 ** -23]))
    assert float(np.float32(one[0])) == 1 + 2.0 ** -23, float(one[0])
    rng = np.random.default_rng(7)
    a = np.float32(1 + rng.integers(0, 1 << 23, 300) / 2 ** 23)
    b = np.float32(1 + rng.integers(0, 1 << 23, 300) / 2 ** 23)
    p = a.astype(np.float64) * b.astype(np.float64)
    c = np.concatenate([-np.float32(p), -np.float32(p) * np.float32(0.999),
                        np.float32(rng.standard_normal(300))]).astype(np.float32)
    a, b = np.tile(a, 3), np.tile(b, 3)
    a[:50] *= np.float32(2.0 ** -75)
    b[:50] *= np.float32(2.0 ** -75)
    c[:50] = 0.0
    got = _interp_rounding.fma_f32(a, b, c)
    for i in range(a.size):
        exact = Fraction(float(a[i])) * Fraction(float(b[i])) + Fraction(float(c[i]))
        f = np.float32(got[i])
        near = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        errs = [abs(Fraction(float(v)) - exact) for v in near]
        assert errs[1] <= min(errs), (a[i], b[i], c[i])
        if errs[1] == min(errs[0], errs[2]):  # a tie: the even one
            assert int(np.float32(f).view(np.int32)) % 2 == 0, (a[i], b[i], c[i])
