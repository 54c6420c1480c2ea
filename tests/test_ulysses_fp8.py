"""The FP8 payload rule (ulysses/fp8.py): the e4m3 rounding against a grid built from the format's
definition, the round trip within the derived bound in fp64 (random rows from fixed seeds, wide
dynamic range, tiny and huge rows), special values, the wire layout bit-exact, and the FP8 fill's
torch path as the bf16 fill quantized."""
from __future__ import annotations

import struct

import pytest
import torch

from attncomm.ulysses import fp8
from attncomm.ulysses.fill import FillPart, fill_torch, send_layout
from attncomm.ulysses.layout import group_head_ranges, kv_head_range, seq_to_head_plan
from attncomm.ulysses.fill import fill

FP8 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _grid() -> tuple[torch.Tensor, torch.Tensor]:
    """Every non-negative finite e4m3fn value (fp64) and its byte, from the format's
    definition: exponent field e (bias 7), mantissa m: e = 0 → m·2⁻⁹, else (1 + m/8)·2^(e−7);
    the byte 0x7F (e = 15, m = 7) is NaN."""
    codes = list(range(0x7F))
    vals = [(c & 7) * 2.0 ** -9 if c >> 3 == 0 else (1 + (c & 7) / 8) * 2.0 ** ((c >> 3) - 7)
            for c in codes]
    return torch.tensor(vals, dtype=torch.float64), torch.tensor(codes, dtype=torch.int64)


def _rne_bytes(v: torch.Tensor) -> torch.Tensor:
    """The e4m3fn byte nearest to each fp64 value, ties to the even code, saturating at 448."""
    vals, codes = _grid()
    a = v.abs().clamp(max=448.0)
    i = torch.searchsorted(vals, a).clamp(1, len(vals) - 1)
    lo, hi = vals[i - 1], vals[i]
    pick_hi = (a - lo > hi - a) | ((a - lo == hi - a) & (codes[i] % 2 == 0))
    code = torch.where(a <= vals[0], codes[0], torch.where(pick_hi, codes[i], codes[i - 1]))
    return code | torch.where(torch.signbit(v), 0x80, 0)


def test_e4m3_rounding_matches_the_format(seed):
    """A row whose amax is 448 has scale 1 and divisor 1: its bytes are the values' own e4m3
    rounding. Random values over every binade up to 448, the exact midpoints between
    neighbours (ties) and subnormals (saturation: tests/_fill_interp.py's conversion check)."""
    g = torch.Generator().manual_seed(seed)
    vals, _ = _grid()
    mids = (vals[1:] + vals[:-1]) / 2  # exact in fp32: 5 significant bits at most
    rnd = torch.exp2(torch.empty(4000).uniform_(-12, 8.807, generator=g)).double()
    x = torch.cat([mids, -mids, rnd * torch.where(torch.rand(4000, generator=g) < 0.5, -1, 1),
                   torch.tensor([2.0 ** -11, -(2.0 ** -10), 2.0 ** -12, 440.0])])
    x = x.float().clamp(-448.0, 448.0)
    x = torch.cat([x, torch.zeros((-x.numel()) % 63)]).view(-1, 63)
    x = torch.cat([x, torch.full((x.shape[0], 1), 448.0)], dim=1)
    q, scale = fp8.quantize_rows(x)
    assert torch.equal(scale, torch.ones_like(scale)), f"seed {seed}"
    want = _rne_bytes(x.double())
    got = q.view(torch.uint8).to(torch.int64)
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"seed {seed}: {x[tuple(bad[0])].item()} → {got[tuple(bad[0])]}"


def _rows(g, dtype, n=512, d=64):
    """Rows over a wide dynamic range: each row randn × 2^k, k per row in the dtype's range."""
    lo, hi = {torch.bfloat16: (-120, 120), torch.float16: (-14, 11),
              torch.float32: (-120, 120)}[dtype]
    k = torch.randint(lo, hi, (n, 1), generator=g).double()
    x = torch.randn((n, d), generator=g, dtype=torch.float64) * torch.exp2(k)
    heavy = torch.randn((n, d), generator=g, dtype=torch.float64) ** 5  # outliers within rows
    return torch.cat([x, heavy]).to(dtype)


def _check_bound(x, seed, what):
    q, scale = fp8.quantize_rows(x)
    xh = fp8.dequantize_rows(q, scale, x.dtype)
    assert xh.dtype == x.dtype and xh.shape == x.shape
    err = (xh.double() - x.double()).abs()
    bound = fp8.roundtrip_bound(x, scale, xh)
    fin = torch.isfinite(x)
    ratio = (err / bound)[fin]
    assert ratio.max() <= 1.0, f"seed {seed} {what}: error {ratio.max().item():.3f}× the bound"
    return ratio, err, scale


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_within_bound(dtype, seed):
    """Element-wise bound, the amax form (a/28 + the output rounding) and that the bound is
    tight (the largest ratio near 1) and the path lossy."""
    g = torch.Generator().manual_seed(seed)
    x = _rows(g, dtype)
    ratio, err, _ = _check_bound(x, seed, "random rows")
    assert ratio.max() > 0.5, f"seed {seed}: the bound is loose ({ratio.max().item():.3f})"
    amax = x.double().abs().amax(-1, keepdim=True)
    u = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -24}[dtype]
    rel = (err / amax).max().item()
    assert 0 < rel <= (1 / 28 + u) * (1 + 2 ** -20) + 2 ** -20, f"seed {seed}: {rel}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_roundtrip_tiny_and_huge_rows(dtype, seed):
    """Rows whose scale is subnormal or 0 in fp32 (amax < 448·2⁻¹²⁶), and rows at the top of
    the dtype's range, the largest finite value in each (the one amax whose dequantized value
    could round past it): the bound holds, nothing becomes inf or NaN."""
    g = torch.Generator().manual_seed(seed)
    tiny_exp = -133 if dtype == torch.bfloat16 else -149
    k = torch.randint(tiny_exp, -110, (256, 1), generator=g).double()
    x = (torch.rand((256, 16), generator=g, dtype=torch.float64) * 2 - 1) * torch.exp2(k)
    x = x.to(dtype)
    _, _, scale = _check_bound(x, seed, "tiny rows")
    assert (scale < 2.0 ** -126).any()
    top = torch.finfo(dtype).max
    big = torch.randn((64, 16), generator=g, dtype=torch.float64).clamp(-1, 1) * top
    big[:, 0] = top
    big = big.to(dtype)
    ratio, _, _ = _check_bound(big, seed, "huge rows")
    xh = fp8.dequantize_rows(*fp8.quantize_rows(big), dtype)
    assert torch.isfinite(xh).all(), f"seed {seed}"


def test_special_values():
    """Zero rows round-trip exactly with signed zeros; NaN and ±inf become NaN in place; the
    finite elements of the same row keep their values (scale from them); an all-NaN row has
    scale 0 and stays NaN."""
    inf, nan = float("inf"), float("nan")
    for dtype in DTYPES:
        x = torch.tensor([[0.0, -0.0, 0.0, -0.0],
                          [nan, 1.0, -inf, -2.0],
                          [nan, nan, nan, nan],
                          [inf, 0.0, -0.0, 3.0]]).to(dtype)
        q, scale = fp8.quantize_rows(x)
        b = q.view(torch.uint8)
        assert b[0].tolist() == [0x00, 0x80, 0x00, 0x80] and scale[0] == 0
        assert b[1, 0] == b[1, 2] == b[3, 0] == 0x7F and b[2].tolist() == [0x7F] * 4
        want = torch.tensor([0.0, 2.0, 0.0, 3.0]) / torch.tensor(448.0)  # fp32 division
        assert torch.equal(scale, want), f"{dtype}: {scale.tolist()}"
        xh = fp8.dequantize_rows(q, scale, dtype)
        assert torch.equal(xh[0].view(torch.uint8), x[0].view(torch.uint8)), dtype  # ±0 bits
        assert torch.isnan(xh).tolist() == [[False] * 4, [True, False, True, False],
                                             [True] * 4, [True, False, False, False]]
        assert xh[1, 1] == 1.0 and xh[1, 3] == -2.0 and xh[3, 3] == 3.0
        assert torch.signbit(xh[3, 2]) and not torch.signbit(xh[3, 1])


@pytest.mark.parametrize("d", [8, 6, 128])
def test_wire_layout_bit_exact(d, seed):
    """``[..., D + 4]`` bytes: the e4m3 bytes then the scale's little-endian fp32 bytes; unpack
    gives the same bits, as views of the buffer when D % 4 == 0 (a copy otherwise)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((3, 2, 5, d), generator=g).bfloat16()
    q, scale = fp8.quantize_rows(x)
    buf = fp8.pack_rows(q, scale)
    assert buf.shape == (3, 2, 5, d + 4) and buf.dtype == torch.uint8
    assert torch.equal(buf[..., :d], q.view(torch.uint8))
    assert bytes(buf[1, 0, 3, d:].tolist()) == struct.pack("<f", scale[1, 0, 3].item())
    q2, s2 = fp8.unpack_rows(buf)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, scale)
    shares = s2.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert shares == (d % 4 == 0), f"d {d}: the scale view {'is' if shares else 'is not'} a view"
    # into a strided region (a send buffer's heads [2, 4) of a wider row block)
    wide = torch.full((3, 2, 8, d + 4), 0xA5, dtype=torch.uint8)
    fp8.quantize_pack(x[:, :, 1:3], out=wide[:, :, 2:4])
    assert torch.equal(wide[:, :, 2:4], buf[:, :, 1:3]) and (wide[:, :, :2] == 0xA5).all()
    got = fp8.dequantize_packed(buf, torch.bfloat16)
    assert torch.equal(got, fp8.dequantize_rows(q, scale, torch.bfloat16))


def test_bad_input():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="payload_dtype must be"):
        fp8.is_fp8_payload(torch.int8, torch.bfloat16)
    with pytest.raises(ValueError, match="needs fp16/bf16/fp32"):
        fp8.is_fp8_payload(FP8, torch.float64)
    assert not fp8.is_fp8_payload(None, torch.float16)
    assert not fp8.is_fp8_payload(torch.float16, torch.float16)
    with pytest.raises(ValueError, match="fp16/bf16/fp32 with a last dim"):
        fp8.quantize_rows(x.double())
    with pytest.raises(ValueError, match=r"unpack_rows: buf must be uint8"):
        fp8.unpack_rows(torch.zeros(3, 4, dtype=torch.uint8))
    q, s = fp8.quantize_rows(x)
    with pytest.raises(ValueError, match="pack_rows: out must be uint8"):
        fp8.pack_rows(q, s, out=torch.empty(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="dequantize_rows"):
        fp8.dequantize_rows(q, s[:1], torch.float32)
    with pytest.raises(ValueError, match="payload_dtype must be"):
        fill_torch([FillPart(x.view(1, 2, 1, 8), ((0, 1),))], payload_dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be a contiguous flat torch.uint8"):
        fill_torch([FillPart(x.view(1, 2, 1, 8), ((0, 1),))], payload_dtype=FP8,
                   out=torch.empty(24))


def test_fp8_fill_is_the_bf16_fill_quantized(seed):
    """The FP8 fill's region p, viewed ``[S_r, B, htot_p, D + 4]``, is ``quantize_pack`` of the
    bf16 fill's region ``[S_r, B, htot_p, D]`` (norm + RoPE bits of the bf16 path, then
    quantized); its size is ``send_layout`` with ``D + 4``; ``fill`` with impl torch agrees;
    the plan over bytes moves exactly that buffer."""
    g = torch.Generator().manual_seed(seed)
    w, hq, hkv, d, b, s_r = 3, 8, 2, 16, 2, 5
    q, k, v = (torch.randn((b, s_r, h, d), generator=g).bfloat16() for h in (hq, hkv, hkv))
    q[0, 1, 3] = 0.0
    k[1, 2, 0, 4] = float("nan")
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g).bfloat16()
    cos, sin = torch.randn((s_r, d), generator=g), torch.randn((s_r, d), generator=g)
    qr = tuple(group_head_ranges(hq, w, 1)[0])
    kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
    parts = [FillPart(q, qr, wq, True), FillPart(k, kr, wk, True), FillPart(v, kr)]
    ref = fill_torch(parts, 1e-6, cos, sin)
    got = fill_torch(parts, 1e-6, cos, sin, payload_dtype=FP8)
    htot, starts = send_layout(b, s_r, d, [qr, kr, kr])
    _, starts8 = send_layout(b, s_r, fp8.row_bytes(d), [qr, kr, kr])
    assert got.dtype == torch.uint8 and got.numel() == starts8[-1]
    for p in range(w):
        want = fp8.quantize_pack(ref[starts[p]:starts[p + 1]].view(s_r, b, htot[p], d))
        assert torch.equal(got[starts8[p]:starts8[p + 1]].view(s_r, b, htot[p], d + 4),
                           want), f"seed {seed}: region {p}"
    regions = [torch.full((starts8[p + 1] - starts8[p],), 7, dtype=torch.uint8)
               for p in range(w)]
    fill(parts, 1e-6, cos, sin, out=regions, impl="torch", payload_dtype=FP8)
    assert torch.equal(torch.cat(regions), got), f"seed {seed}: regions"
    plan = fp8.payload_plan(b, (s_r,) * w, d, (qr, kr, kr))
    assert plan == seq_to_head_plan(b, (s_r,) * w, d + 4, (qr, kr, kr)) and plan.tiled
    assert sum(plan.numel[0]) == got.numel()


def _satfinite_bytes(v: torch.Tensor) -> torch.Tensor:
    """The e4m3fn byte of ``cvt.rn.satfinite`` as PTX defines it, for finite fp64 ``v``: round
    to nearest even with 3 mantissa bits and no upper exponent bound (subnormal step 2⁻⁹ below
    2⁻⁶), then a magnitude past 448 saturated to 448."""
    a = v.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -6)))
    e = e - (torch.exp2(e) > a.clamp(min=2.0 ** -6)).double()  # log2 rounding near powers of 2
    ulp = torch.exp2(e - 3)
    q = (torch.round(a / ulp) * ulp).clamp(max=448.0)  # torch.round: ties to even
    vals, codes = _grid()
    code = codes[torch.searchsorted(vals, q)]
    return code | torch.where(torch.signbit(v), 0x80, 0)


def test_satfinite_conversion_is_the_rule():
    """The fill's epilogue converts with the hardware's ``cvt.rn.satfinite`` (round, then
    saturate) where the rule says clamp, then round: the same byte for every finite fp32
    quotient of the forms it meets. Exhaustive over every finite bf16 bit pattern, as it is and
    divided by scales (powers of two and amax / 448 of odd amaxes, rounded to fp32 once), and
    the interpreter's stand-in for the hardware (tests/_interp_rounding.py) gives the same."""
    import _interp_rounding
    bits = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16).float()
    x = x[torch.isfinite(x)]
    for d in (1.0, 2.0 ** -8, 2.0 ** 6, 3.0 / 448, 1.0078125 / 448, 300.5 / 448):
        v = x / torch.tensor(d, dtype=torch.float32)
        v = v[torch.isfinite(v)]
        rule = v.clamp(-448.0, 448.0).to(FP8).view(torch.uint8).long()
        hw = _satfinite_bytes(v.double())
        bad = (rule != hw).nonzero().flatten()
        assert bad.numel() == 0, [(v[i].item(), int(rule[i]), int(hw[i])) for i in bad[:5]]
        interp = torch.from_numpy(_interp_rounding.e4m3_satfinite(v.numpy())).long()
        assert torch.equal(interp, rule), f"divisor {d}"
        assert (v.abs() > 448).any() and (v.abs() < 2.0 ** -6).any(), "ranges not reached"


def test_fp8_epilogue_converts_with_the_hardware_from_sm89(monkeypatch):
    """The fill's FP8 epilogue uses sm_89's e4m3 instruction where the GPU has it, and the
    integer rounding elsewhere (older GPUs, the interpreter on CPU tensors): same bits."""
    from attncomm.ulysses import fill as fill_mod
    assert not fill_mod._hw_e4m3(torch.device("cpu"))
    for cap, hw in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=cap: c)
        assert fill_mod._hw_e4m3(torch.device("cuda", 0)) == hw, cap
