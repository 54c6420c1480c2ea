"""The FP8 fill's epilogue on the GPU against the rule, bit for bit, over every (element, row amax)
pair of bf16 and fp16 rows and about a billion fp32 pairs (random and at the rounding
boundaries), through the plain fill's epilogue (``fill_epilogue._quotient``) and the PTX one of
the fills with norm or RoPE (``fill_epilogue._ptx_split_bytes`` for 16-bit rows,
``_ptx_bytes`` for fp32 ones); and the compiled kernels' quotient
instructions (two ``fma.rn.f32`` per element, or one with the split reciprocal of 16-bit rows,
next to the ``div_rn`` of the blocks with tiny rows).

Rows of D = 128 through ``FillPlan`` (plain pack, FP8 payload, the default launch shape): the
first element of each row is ± its amax, the others the elements paired with it; the reference
is ``fill_torch`` on the same GPU (``fp8.quantize_rows``: ``x / scale`` by IEEE division, then
``clamp(−448, 448).to(float8_e4m3fn)``, 0x7F for non-finite elements).

    python scripts/fp8_quotient_gpu.py [--json P] [--fp32-rows N] [--quick]

``--quick`` (and a CPU dry run under ``TRITON_INTERPRET=1``, which runs the sm_89+ epilogue in
the interpreter with its FMAs rounded once) checks every 4096th amax only.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

import torch  # noqa: E402

from attncomm.ulysses import fill as fill_mod  # noqa: E402
from attncomm.ulysses import fill_kernels  # noqa: E402
from attncomm.ulysses.fill import FillPart, FillPlan, fill_torch  # noqa: E402
from attncomm.ulysses.fp8 import FP8_DTYPE, FP8_MAX  # noqa: E402

D = 128
#: the largest finite bit pattern (sign clear) of each 16-bit dtype
_MAX_BITS = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}


def _fill_both(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel bytes, torch-path bytes) of rows ``x [R, D]`` as one part of one head."""
    parts = [FillPart(x[None, :, None, :], ((0, 1),))]
    want = fill_torch(parts, payload_dtype=FP8_DTYPE)
    got = torch.full_like(want, 0xA5)
    FillPlan(parts, impl="triton", payload_dtype=FP8_DTYPE)([parts[0].x], out=got)
    return got, want


def _compare(x: torch.Tensor, got, want, what: str, rec: dict) -> None:
    got, want = got.view(-1, D + 4), want.view(-1, D + 4)
    bad = (got != want).nonzero()
    rec["rows"] += x.shape[0]
    rec["elements"] += x.shape[0] * (D - 1)
    rec["mismatches"] += bad.shape[0]
    for r, c in bad[:max(0, 5 - len(rec["first"]))].tolist():
        xr = x[r].float()
        amax = xr[torch.isfinite(xr)].abs().max().item() if c < D else None
        rec["first"].append(f"{what}: row {r} byte {c}: element "
                            f"{xr[c].item() if c < D else 'scale'!r} amax {amax!r}: "
                            f"{int(got[r, c]):#x} vs {int(want[r, c]):#x}")


def every_16_bit_pair(dtype, dev, stride: int, rows_per_chunk: int = 1 << 20) -> dict:
    """Every element of ``dtype`` against every amax (every ``stride``-th one): per amax bit
    pattern ``a``, rows ``[±amax, the 2(a + 1) patterns with |g| ≤ amax, zero padding]``."""
    rec = dict(key=f"every {dtype} pair", rows=0, elements=0, mismatches=0, first=[])
    top = _MAX_BITS[dtype]
    amaxes = torch.arange(1, top + 1, stride, device=dev, dtype=torch.int64)
    per = (2 * (amaxes + 1) + D - 2) // (D - 1)                 # rows per amax
    ends = torch.cumsum(per, 0)
    start = 0
    while start < amaxes.numel():
        stop = int(torch.searchsorted(ends, ends[start] - per[start] + rows_per_chunk).item())
        stop = max(stop, start + 1)
        a, p = amaxes[start:stop], per[start:stop]
        row_a = torch.repeat_interleave(a, p)
        first = torch.repeat_interleave(torch.cumsum(p, 0) - p, p)
        k = torch.arange(row_a.numel(), device=dev) - first      # row within its amax
        idx = k[:, None] * (D - 1) + torch.arange(D - 1, device=dev)[None, :]
        am = row_a[:, None]
        bits = torch.where(idx <= am, idx, 0x8000 | (idx - am - 1))
        bits = torch.where(idx < 2 * (am + 1), bits, 0)
        sign = (k % 2) * 0x8000                                  # ± the amax element
        rows = torch.cat([(row_a | sign)[:, None], bits], dim=1)
        x = rows.to(torch.int32).to(torch.int16).view(dtype)
        got, want = _fill_both(x)
        _compare(x, got, want, str(dtype), rec)
        start = stop
    return rec


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def fp32_rows(dev, n_rows: int, seed: int, chunk: int = 1 << 20) -> dict:
    """fp32 rows: amaxes of random bit patterns (every exponent, subnormals included, in runs
    of rows apart) and of all-ones, one and one-ulp significands; elements e4m3 values,
    midpoints, 448–464 and random quotients times the row's divisor, one to three ulps either
    side, random patterns under the amax, a few zeros, NaNs and infinities."""
    rec = dict(key="fp32 rows", rows=0, elements=0, mismatches=0, first=[])
    g = torch.Generator(device=dev).manual_seed(seed)
    grid = torch.arange(0, 0x7F, dtype=torch.uint8, device=dev).view(FP8_DTYPE).double()
    targets = torch.cat([grid, (grid[1:] + grid[:-1]) / 2,
                         torch.tensor([448.0, 456.0, 464.0, 2.0 ** -10], device=dev)])
    done = 0
    while done < n_rows:
        r = min(chunk, n_rows - done)
        # exponents from 2⁻⁷⁰ up (divisors ≥ _DV_MIN), but every 8th run of 64 rows from 0
        # (tiny rows and subnormals: their blocks divide with div_rn; the others must not)
        tiny = (torch.arange(r, device=dev) // 64) % 8 == 0
        ab = torch.randint(57 << 23, 0x7F800000, (r,), generator=g, device=dev)
        ab = torch.where(tiny, torch.randint(1, 0x7F800000, (r,), generator=g, device=dev), ab)
        kind = torch.randint(0, 8, (r,), generator=g, device=dev)
        ab = torch.where(kind == 0, ab | 0x7FFFFF, torch.where(kind == 1, ab & ~0x7FFFFF,
                         torch.where(kind == 2, (ab & ~0x7FFFFF) | 1, ab)))
        ab = torch.where(kind == 3, torch.randint(0xF0 << 23, 0x7F800000, (r,), generator=g,
                                                  device=dev), ab)   # scales near the largest
        amax = _f32(ab)
        scale = amax / torch.tensor(FP8_MAX, device=dev)
        dv = torch.where(scale > 0, scale, 1.0).double()[:, None]
        shape = (r, D - 1)
        pick = torch.randint(0, targets.numel(), shape, generator=g, device=dev)
        t = torch.where(torch.rand(shape, generator=g, device=dev) < 0.7, targets[pick],
                        torch.exp2(torch.rand(shape, generator=g, device=dev).double() * 40 - 31))
        x = (t * dv).float()
        x = _f32(x.view(torch.int32).long() + torch.randint(-3, 4, shape, generator=g, device=dev))
        under = _f32(torch.randint(0, 1 << 62, shape, generator=g, device=dev) % (ab[:, None] + 1))
        x = torch.where(torch.rand(shape, generator=g, device=dev) < 0.2, under, x)
        x = torch.minimum(x.abs(), amax[:, None])
        x = torch.where(torch.rand(shape, generator=g, device=dev) < 0.5, -x, x)
        special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")], device=dev)
        sp = torch.rand(shape, generator=g, device=dev) < 1e-3
        x = torch.where(sp, special[torch.randint(0, 5, shape, generator=g, device=dev)], x)
        rows = torch.cat([torch.where(kind[:, None] % 2 == 0, amax[:, None], -amax[:, None]), x],
                         dim=1).contiguous()
        got, want = _fill_both(rows)
        _compare(rows, got, want, "fp32", rec)
        done += r
    return rec


def compiled_quotients() -> list:
    """Per compiled FP8 fill kernel: its registers, spills and the instructions of the
    quotient (``fma.rn.f32`` against the e4m3 conversions: two per element in the FMA
    branch, none in the ``div_rn`` one; with the split reciprocal of 16-bit rows,
    ``_ptx_split_bytes``, one per element and one per ``rcp.rm.f32`` of a row's ``y_hi``)."""
    out = []
    for _, entry in fill_kernels.fill_kernel.device_caches.items():
        for ck in entry[0].values():
            ptx = ck.asm.get("ptx", "")
            if "cvt.rn.satfinite.e4m3x2" not in ptx:
                continue
            rec = dict(key="compiled", regs=getattr(ck, "n_regs", None),
                       spills=getattr(ck, "n_spills", None),
                       fma=len(re.findall(r"\bfma\.rn\.f32", ptx)),
                       other_fma=len(re.findall(r"\bfma\.", ptx))
                       - len(re.findall(r"\bfma\.rn\.f32", ptx)),
                       cvt=len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx)),
                       div_rn=len(re.findall(r"div\.rn\.f32", ptx)),
                       rcp_rm=len(re.findall(r"rcp\.rm\.f32", ptx)))
            try:
                rec["sass_ffma"] = len(re.findall(r"\bFFMA\b", ck.asm["sass"]))
            except Exception as e:  # noqa: BLE001 - no disassembler: the PTX counts stand
                rec["sass"] = repr(e)[:200]
            # the PTX epilogue (its lop3 mask) on 16-bit parts must take the split reciprocal;
            # fp32 parts and the plain epilogue the two-FMA quotient
            rec["parts"] = getattr(getattr(ck, "src", None), "signature", {}).get("x0")
            split = "0x80808080" in ptx and rec["parts"] in ("*bf16", "*fp16")
            rec["split"] = split
            quotients = rec["cvt"] + rec["rcp_rm"] if split else 2 * rec["cvt"]
            rec["ok"] = (rec["fma"] == quotients and rec["other_fma"] == 0
                         and (rec["rcp_rm"] > 0) == split)
            out.append(rec)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--fp32-rows", type=int, default=1 << 23)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    if torch.cuda.is_available():
        dev = "cuda"
        if not fill_mod._hw_e4m3(torch.device("cuda")):
            print("this GPU has no e4m3 conversion (before sm_89): the FMA path is not used")
    elif os.environ.get("TRITON_INTERPRET") == "1":  # dry run: the sm_89+ path, interpreted
        import _interp_rounding  # noqa: F401  (the FMAs round once, as on the GPU)
        dev, a.quick, a.fp32_rows = "cpu", True, min(a.fp32_rows, 256)
        fill_mod._hw_e4m3 = lambda device: True
    else:
        print("needs a GPU (or TRITON_INTERPRET=1 for a dry run)", file=sys.stderr)
        return 2
    stride = 4096 if a.quick else 1
    recs = []
    epilogue = fill_mod._fp8_epilogue
    # the plain fill's epilogue, then (GPU) the PTX one that fills with norm or RoPE use,
    # rounding to the parts' dtype in PTX (an identity on these rows, but its instructions)
    for ptx in (False, True) if dev == "cuda" else (False,):
        if ptx:
            fill_mod._fp8_epilogue = lambda device, rounds: dict(
                epilogue(device, True), EXACT=False)
        try:
            for fn in (lambda: every_16_bit_pair(torch.bfloat16, dev, stride),
                       lambda: every_16_bit_pair(torch.float16, dev, stride),
                       lambda: fp32_rows(dev, a.fp32_rows, a.seed,
                                         1 << 20 if dev == "cuda" else 128)):
                t0 = time.time()
                rec = fn()
                rec["seconds"] = round(time.time() - t0, 1)
                rec["epilogue"] = "ptx" if ptx else "plain"
                recs.append(rec)
                print(json.dumps(rec), flush=True)
        finally:
            fill_mod._fp8_epilogue = epilogue
    if dev == "cuda":
        n = len(recs)
        recs += compiled_quotients()
        for r in recs[n:]:
            print(json.dumps(r), flush=True)
    meta = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu (interpreter)",
            "torch": torch.__version__, "triton": __import__("triton").__version__}
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "records": recs}, f, indent=1)
    ok = all(not r.get("mismatches") and r.get("ok", True) for r in recs) and \
        (dev != "cuda" or any(r["key"] == "compiled" for r in recs))
    print("fp8 quotient check:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
