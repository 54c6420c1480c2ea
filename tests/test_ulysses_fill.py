"""The Ulysses fill (ulysses/fill.py): torch path against fp64 and a naive layout, the Triton
kernel under the interpreter bitwise against the torch path, its sm_90 PTX free of FMA."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from attncomm.ulysses.fill import (FillPart, FillPlan, fill_torch, rms_norm_rope, send_layout,
                                   triton_fill_reason)
from attncomm.ulysses.fill import fill

from _ptx_patterns import REG_STORE, REG_STORE_MASKED

HERE = os.path.dirname(os.path.abspath(__file__))


def _ref64(x, w, eps, cos, sin):
    x = x.double()
    if w is not None:
        x = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w.double()
    if cos is not None:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x = x * cos.double()[:, None, :] + rot * sin.double()[:, None, :]
    return x


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 8e-3)])
def test_rms_norm_rope_matches_fp64(dtype, tol, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((2, 9, 3, 16), generator=g).to(dtype)
    w = torch.randn(16, generator=g)
    cos, sin = torch.randn((9, 16), generator=g), torch.randn((9, 16), generator=g)
    for args in ((w, None, None), (None, cos, sin), (w, cos, sin)):
        got = rms_norm_rope(x, args[0], 1e-6, args[1], args[2])
        ref = _ref64(x, args[0], 1e-6, args[1], args[2])
        err = ((got.double() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
        assert got.dtype == dtype and err < tol, f"seed {seed}: {err}"
    # one rounding: fp32 compute, rounded once, equals the fp32 result rounded
    f32 = rms_norm_rope(x.float(), w, 1e-6, cos, sin)
    assert torch.equal(rms_norm_rope(x, w, 1e-6, cos, sin), f32.to(dtype))


def test_fill_torch_layout_is_destination_major(seed):
    """Region p of the send buffer is ``[S_r, B, htot_p, D]``: q heads, then k, then v."""
    g = torch.Generator().manual_seed(seed)
    b, s, d = 2, 5, 4
    q, k, v = (torch.randn((b, s, h, d), generator=g) for h in (6, 2, 2))
    qr, kr = ((0, 2), (2, 4), (4, 6)), ((0, 1), (0, 2), (1, 2))
    out = fill_torch([FillPart(q, qr), FillPart(k, kr), FillPart(v, kr)])
    htot, starts = send_layout(b, s, d, [qr, kr, kr])
    assert htot == [4, 6, 4] and starts[-1] == out.numel()
    for p in range(3):
        want = torch.cat([t[:, :, lo:hi] for t, (lo, hi) in
                          ((q, qr[p]), (k, kr[p]), (v, kr[p]))], dim=2).transpose(0, 1)
        assert torch.equal(out[starts[p]:starts[p + 1]].view(s, b, htot[p], d), want)


def test_fill_rejects_bad_parts():
    x = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="parts disagree on dtype"):
        fill_torch([FillPart(x, ((0, 2),)), FillPart(x.half(), ((0, 2),))])
    with pytest.raises(ValueError, match="out must be a contiguous flat"):
        fill_torch([FillPart(x, ((0, 2),))], out=torch.empty(5))
    with pytest.raises(ValueError, match="impl must be"):
        fill([FillPart(x, ((0, 2),))], impl="cuda")
    for bad in (dict(block_s=3), dict(num_warps=6), dict(heads_per_program=0),
                dict(block_s=True), dict(num_warps=4.0)):
        (name, value), = bad.items()
        with pytest.raises(ValueError, match=f"{name} must be None or a power of two.*{value!r}"):
            FillPlan([FillPart(x, ((0, 2),))], impl="torch", **bad)
    FillPlan([FillPart(x, ((0, 2),))], impl="torch", block_s=1, heads_per_program=8, num_warps=2)


@pytest.mark.slow
def test_fill_kernel_under_interpreter(seed):
    """Uneven heads, GQA with Hkv < W, MQA, non-contiguous q/k/v, with and without norm and
    RoPE, fp32/fp16/bf16, one and two head groups: bitwise equal to the torch path."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_fill_interp.py"), str(seed)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"seed {seed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert "0 failed" in proc.stdout


@pytest.mark.slow
def test_fill_kernel_fp8_under_interpreter(seed):
    """The FP8 payload: the kernel's epilogue (round to the dtype, row amax, scale, e4m3 bytes
    and the scale after them) bitwise equal to ``fill_torch`` with norm/no norm, RoPE/no RoPE,
    GQA ranges, odd row counts, regions in separate allocations and zero, NaN, ±inf, huge and
    tiny rows; the e4m3 conversion alone against torch's; fp32 rows at the quotients' rounding
    boundaries, and fp32 and bf16 rows with a NaN beside their amax, through the sm_89+
    epilogue (its FMAs rounded once and its maxima skipping NaNs, as the GPU's)."""
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_fill_interp.py"), str(seed),
                           "fp8"], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"seed {seed}\n{proc.stdout}\n{proc.stderr[-3000:]}"
    assert " 0 failed" in proc.stdout and "13 passed" in proc.stdout, proc.stdout


def test_fill_triton_fp8_reasons(monkeypatch):
    """The FP8 kernel path needs head_dim % 4 == 0; ``fill`` auto then takes the torch path
    (no kernel launched here: the reason is checked first)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(1, 3, 2, 2).bfloat16()
    parts = [FillPart(x, ((0, 1), (1, 2)))]
    assert triton_fill_reason(parts, x.device) is None
    why = triton_fill_reason(parts, x.device, torch.float8_e4m3fn)
    assert why is not None and "not a multiple of 4" in why
    got = fill(parts, impl="auto", payload_dtype=torch.float8_e4m3fn)
    assert got.dtype == torch.uint8 and torch.equal(
        got, fill_torch(parts, payload_dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="not a multiple of 4"):
        fill(parts, impl="triton", payload_dtype=torch.float8_e4m3fn)


def _fill_ptx(*args: str) -> dict:
    """``tests/_fill_ptx.py ARGS``'s JSON: the kernel compiled for sm_90 (or as ``ARGS`` say)
    by Triton's own ptxas, in a process without ``TRITON_INTERPRET`` (no GPU needed)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_fill_ptx.py"), *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_fill_kernel_ptx_has_no_fma():
    """With FMA contraction on, ``x * c + r * s`` would round once where torch rounds twice;
    the launcher turns it off. Compiled for sm_90 by Triton's own ptxas (no GPU needed), with
    ``PTX_WIDEN`` as the host sets it for a fill with norm and RoPE on a GPU."""
    ptx = _fill_ptx()
    assert re.search(r"\bfma\.", ptx["fused"]), "the check cannot fail: FMA never appears"
    for name in ("launched", "launched_full"):  # masked, and on full blocks (unmasked)
        assert not re.search(r"\bfma\.", ptx[name]), name
        assert "sqrt.rn.f32" in ptx[name] and "div.rn.f32" in ptx[name], name
        # the bf16 rows widened by _PTX_WIDEN (shl, and), not by cvt.f32.bf16
        assert re.search(r"and\.b32\s+%r\d+, %r\d+, 0xFFFF0000;", ptx[name]), name
        assert "cvt.f32.bf16" not in ptx[name], name
    # the norm's tree by warp shuffles: its sum rounded by add.rn, IEEE sqrt and reciprocal
    shuffled = ptx["launched_shuffle"]
    assert not re.search(r"\bfma\.", shuffled)
    assert "sqrt.rn.f32" in shuffled and "rcp.rn.f32" in shuffled
    assert "shfl.sync.bfly.b32" in shuffled and "shfl.sync.bfly.b32" not in ptx["launched_full"]


@pytest.mark.slow
def test_fill_kernel_fp8_compiles_without_hw_e4m3():
    """On a GPU with no e4m3 conversion instruction (sm_80: ``HW_E4M3`` off) the FP8 fill,
    plain and with norm + RoPE, compiles to the rule's IEEE divisions and integer rounding:
    no ``cvt`` to e4m3, no quotient FMAs."""
    for name, ptx in _fill_ptx("sm80").items():
        assert "div.rn.f32" in ptx, name
        assert not re.search(r"cvt\.rn\.satfinite\.e4m3x2|\bfma\.", ptx), name


@pytest.mark.slow
def test_fill_norm_shuffle_layout():
    """``_ptx_norm_inv``'s PTX holds for one register layout: 8 consecutive elements of a
    half-row in a thread's first 8 registers, the half-row's 8 threads in lanes whose bits 0-2
    are the chunk's index (``sizePerThread[2] = threadsPerWarp[2] = 8``, dim 2 first in
    ``order``). The compiled kernel has it in every case the host takes ``SHFL_NORM`` (masked
    and full blocks, bf16, fp16, the FP8 payload, the other pointers unaligned, sm_80 to
    sm_100), and not with fp32 parts (4 elements a thread), which the host excludes: the
    check can fail. The FP8 bytes' register stores (``fill_epilogue._store_words``: 32-bit
    words of 4 consecutive bytes of a row) are in that layout too."""
    layouts = _fill_ptx("layouts")

    def fits(layout):
        size, threads, order = layout
        return size[2] == 8 and threads[2] == 8 and order[0] == 2

    for name, layout in layouts.items():
        assert fits(layout) == (name != "sm90 fp32 full"), (name, layout)


@pytest.mark.slow
def test_fill_kernel_fp8_ptx():
    """The FP8 variant compiles for sm_90 with the launch options: IEEE division for the
    scale and the tiny rows' quotients; the other quotients of these bf16 rows by the split
    reciprocal (``_ptx_split_bytes``: one FMA each, and one per row's ``y_lo`` beside its
    ``rcp.rm``) and no other FMA (the norm and RoPE products round as torch's); the e4m3 bytes
    stored 4 at a time (the rows' 4-byte alignment is known to the compiler: without it every
    byte is its own store) beside the scales' 32-bit words; with ``SHFL_NORM``, masked and
    full, from the registers that hold them (``REG_STORE``), as the host launches it."""
    for name, ptx in _fill_ptx("fp8").items():  # masked, full; with SHFL_NORM full, masked
        # each conversion takes two elements and is there twice (the PTX branch, the div_rn one)
        cvts = len(re.findall(r"cvt\.rn\.satfinite\.e4m3x2\.f32", ptx))
        rcps = len(re.findall(r"rcp\.rm\.f32", ptx))
        assert cvts > 0 and rcps > 0, name
        assert len(re.findall(r"\bfma\.", ptx)) == cvts + rcps, name
        assert len(re.findall(r"\bfma\.rn\.f32", ptx)) == cvts + rcps, name
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx, name
        assert re.search(r"st\.global(\.\w+)*\.b32", ptx), f"{name}: no 32-bit store of the scales"
        assert not re.search(r"st\.global(\.\w+)*\.[bu]8", ptx), f"{name}: byte stores"
        # with SHFL_NORM: the bytes of 2 heads × 2 halves in 2 words a thread, on the fast and
        # the general path, and the 2 heads' scales, each predicated on its row when masked
        stores = len(REG_STORE.findall(ptx))
        assert stores == (18 if "shuffle" in name else 0), (name, stores)
        masked = len(REG_STORE_MASKED.findall(ptx))
        assert masked == (18 if name == "fp8_shuffle_masked" else 0), (name, masked)


def test_descriptor_derived_on_the_device_equals_the_uploaded_one():
    """Inside CUDA graph capture a new region layout's descriptor is derived from a cached one
    (``fill_descriptor.derived_table``: no host-to-device copy): the same words as the one
    uploaded."""
    from attncomm.ulysses import fill_descriptor as fill_mod
    dev = torch.device("cpu")
    common = dict(ranges=(((0, 3), (3, 5)), ((0, 1), (1, 2))), htot=(4, 3), batch=2, row=64,
                  hb=2, s_r=7, eps=1e-6, flags=1, strides=((896, 320, 64, 1),) * 2,
                  rope_strides=(0, 0, 0, 0))
    a = fill_mod.descriptor(dev, starts=(0, 4096), **common)
    b = fill_mod.descriptor(dev, starts=(8192, 12288 + 64), **common)
    assert a.words != b.words
    fill_mod._TABLES.pop(next(k for k, v in fill_mod._TABLES.items() if v is b))
    derived, source = fill_mod.derived_table(b.words, dev)  # from a: the latest of that length
    assert source is a.table
    assert torch.equal(derived, b.table) and derived.data_ptr() != a.table.data_ptr()
    assert torch.equal(a.table, torch.tensor(a.words))  # the source is left as it was
    with pytest.raises(ValueError, match="inside CUDA graph capture"):
        fill_mod.derived_table(list(b.words) + [0], dev)


def test_an_eager_call_never_takes_a_descriptor_derived_in_capture(monkeypatch):
    """A descriptor derived inside CUDA graph capture holds its words only once the graph
    replays; an eager call of that layout (before any replay) gets an uploaded one, a capture
    the derived one, and a later derivation never copies from a derived table."""
    from attncomm.ulysses import fill as fill_mod
    from attncomm.ulysses import fill_descriptor
    parts = [FillPart(torch.randn(2, 7, 5, 64), ((0, 3), (3, 5)))]
    lay = fill_mod._LaunchLayout(parts, 1e-6, False)
    strides, rope = (parts[0].x.stride(),) * 3, (0, 0, 0, 0)
    warm = lay.desc((0, 4096), strides, rope)
    monkeypatch.setattr(fill_descriptor, "capturing", lambda device: True)
    captured = lay.desc((8192, 12288), strides, rope)
    assert captured.source is warm.table
    again = lay.desc((16384, 20480), strides, rope)  # derived from an uploaded one only
    assert again.source is warm.table
    monkeypatch.setattr(fill_descriptor, "capturing", lambda device: False)
    eager = lay.desc((8192, 12288), strides, rope)
    assert eager.source is None and eager.words == captured.words
    assert eager.table.data_ptr() != captured.table.data_ptr()
    assert torch.equal(eager.table, torch.tensor(eager.words))
    assert lay.desc((8192, 12288), strides, rope) is eager
    monkeypatch.setattr(fill_descriptor, "capturing", lambda device: True)
    assert lay.desc((8192, 12288), strides, rope) is captured


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA: what a fill launch reads of a CUDA call (addresses,
    strides, dtypes), without a GPU."""

    is_cuda = True
    __torch_function__ = torch._C._disabled_torch_function_impl


class _Launches:
    """The layout's ``LaunchCache`` stand-in: records each launch (its key and its tensors'
    addresses) without running it, and replays the keys it recorded."""

    def __init__(self):
        self.launched, self.replayed = [], []

    def launch(self, key, wrapper, dynamic):
        self.launched.append((key, [t.data_ptr() for t in dynamic]))

    def replay(self, key, addresses):
        if key not in [k for k, _ in self.launched]:
            return False
        self.replayed.append((key, list(addresses)))
        return True


def test_fill_launch_replays_by_strides_dtypes_and_alignment(monkeypatch, seed):
    """A CUDA call of a ``FillPlan`` is replayed with its own addresses (in the kernel's
    argument order, the descriptor's table among them) under the key its first launch
    recorded; another alignment, other strides or another dtype launch anew; a tensor off
    CUDA never replays."""
    from attncomm.ulysses import fill as fill_mod
    if fill_mod._fk is None:
        pytest.skip(fill_mod._triton.REASON)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def on(t):
        return t.as_subclass(_OnCuda)

    def qkv(layout="dense", dtype=bf):
        if layout == "transposed":
            return [on(torch.randn((1, h, 4, 8), generator=g).to(dtype).transpose(1, 2))
                    for h in (2, 1, 1)]
        return [on(torch.randn((1, 4, h, 8), generator=g).to(dtype)) for h in (2, 1, 1)]

    wq, wk = on(torch.randn(8, generator=g)), on(torch.randn(8, generator=g))
    ranges = (((0, 2),), ((0, 1),), ((0, 1),))
    xs = qkv()
    plan = fill_mod.FillPlan([fill_mod.FillPart(x, r, w, i < 2) for i, (x, r, w) in
                              enumerate(zip(xs, ranges, (wq, wk, None)))], 1e-6, True, "triton")
    rec = plan.layout.launches = _Launches()
    n = send_layout(1, 4, 8, ranges)[1][-1]

    def call(xs, out=None, rope=None):
        cos, sin = rope or (on(torch.randn((4, 8), generator=g)),
                            on(torch.randn((4, 8), generator=g)))
        out = on(torch.empty(n, dtype=bf)) if out is None else out
        plan(xs, cos, sin, out)
        return [t.data_ptr() for t in (*xs, out)], [cos.data_ptr(), sin.data_ptr()]

    call(xs)
    assert (len(rec.launched), len(rec.replayed)) == (1, 0), f"seed {seed}"
    key, first = rec.launched[0]
    for _ in range(2):  # new tensors of the same layout: replayed with their addresses
        own, rope = call(qkv())
        assert rec.replayed[-1] == (key, own + [first[4], wq.data_ptr(), wk.data_ptr(),
                                                wq.data_ptr()] + rope), f"seed {seed}"
    assert (len(rec.launched), len(rec.replayed)) == (1, 2), f"seed {seed}"
    wide = on(torch.empty(n + 1, dtype=bf))
    for args in ((qkv(), on(wide[1:])), (qkv("transposed"),), (qkv(dtype=torch.float16),)):
        call(*args)  # misaligned destination, other strides, another dtype: a new launch
        assert len(rec.launched) == 2 and rec.launched[-1][0] != key, f"seed {seed}"
        assert len(rec.replayed) == 2, f"seed {seed}"
        rec.launched.pop()
    plain = [x.as_subclass(torch.Tensor) for x in qkv()]
    for _ in range(2):  # off CUDA: through the launch cache every time
        call(plain)
    assert [k for k, _ in rec.launched[1:]] == [key, key] and len(rec.replayed) == 2, \
        f"seed {seed}"
