"""One GPU: the fill kernel bitwise against the torch path on CUDA, UlyssesAttention on a
one-rank group (fused fill vs unfused, grouped vs sequential) with no host sync in a steady-state
forward, and the one-GPU rehearsal's output bitwise against its sequential schedule."""
from __future__ import annotations

import importlib.util
import os
import warnings

import pytest
import torch

from attncomm.ulysses import UlyssesAttention
from attncomm.ulysses.fill import FillPart, fill_torch, rms_norm_rope, send_layout
from attncomm.ulysses.fill import fill_triton
from attncomm.ulysses.layout import group_head_ranges, kv_head_range

from _ptx_patterns import REG_STORE

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _make(g, shape, dtype, layout):
    b, s, h, d = shape
    if layout == "transposed":
        x = torch.randn((b, h, s, d), generator=g).to(dtype).cuda().transpose(1, 2)
    elif layout == "sliced":
        x = torch.randn((b, s, 2 * h, 2 * d), generator=g).to(dtype).cuda()[:, :, ::2, ::2]
    else:
        x = torch.randn(shape, generator=g).to(dtype).cuda()
    return x


@pytest.mark.parametrize("case", [
    (2, 56, 56, 128, 1, 4096, torch.bfloat16, True, "dense"),
    (3, 7, 7, 64, 2, 333, torch.bfloat16, True, "transposed"),   # uneven heads
    (3, 8, 2, 128, 1, 517, torch.float16, True, "sliced"),       # GQA, Hkv < W
    (4, 6, 1, 64, 1, 100, torch.float32, False, "dense"),        # MQA, plain pack
    (2, 12, 4, 128, 1, 1000, torch.bfloat16, False, "dense"),
])
def test_fill_kernel_bitwise_on_cuda(case, seed):
    _need_gpu()
    w, hq, hkv, d, b, s_r, dtype, norm, layout = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_make(g, (b, s_r, h, d), dtype, layout) for h in (hq, hkv, hkv))
    qw = torch.randn(d, generator=g).cuda() if norm else None
    kw = torch.randn(d, generator=g).to(dtype).cuda() if norm else None
    cos, sin = torch.randn((s_r, d), generator=g).cuda(), torch.randn((s_r, d), generator=g).cuda()
    for groups in (1, 2, 7):
        qr = tuple(group_head_ranges(hq, w, groups)[groups - 1])
        kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
        for rope in (True, False):
            parts = [FillPart(q, qr, qw, rope), FillPart(k, kr, kw, rope), FillPart(v, kr)]
            want = fill_torch(parts, 1e-6, cos, sin)
            got = fill_triton(parts, 1e-6, cos, sin,
                              out=torch.full_like(want, float("nan")))
            assert torch.equal(want, got), f"seed {seed} groups {groups} rope {rope}"
            _, starts = send_layout(b, s_r, d, [x.ranges for x in parts])
            regions = [torch.full((starts[p + 1] - starts[p],), float("nan"), dtype=dtype,
                                  device="cuda") for p in reversed(range(w))][::-1]
            fill_triton(parts, 1e-6, cos, sin, out=regions)
            assert torch.equal(torch.cat(regions), want), f"seed {seed}: regions"
    # the torch path itself against fp64
    ref = q.double() * torch.rsqrt((q.double() ** 2).mean(-1, keepdim=True) + 1e-6)
    if norm:
        got = rms_norm_rope(q, qw, 1e-6, None, None).double()
        err = (got - ref * qw.double()).abs().max().item()
        assert err < (2e-6 if dtype == torch.float32 else 0.1), f"seed {seed}: {err}"


def test_prepared_fill_cached_launch_bitwise(seed):
    """``FillPlan`` on CUDA launches through the compiled kernel once Triton compiled a
    specialization (``compiled_launch.LaunchCache``): calls that alternate layouts (dense,
    transposed, sliced, 2-byte misaligned views), cos/sin dtypes and destinations each equal
    the torch path bit for bit (some replayed), and so do the same calls with every launch
    through the JIT (``compiled_launch.REPLAY`` off: none replayed)."""
    _need_gpu()
    from attncomm import compiled_launch
    from attncomm.ulysses import fill as fill_mod
    g = torch.Generator().manual_seed(seed)
    w, hq, hkv, d, s_r = 2, 8, 2, 64, 77
    qr = tuple(group_head_ranges(hq, w, 2)[1])
    kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
    norm = (torch.randn(d, generator=g).cuda(), torch.randn(d, generator=g).cuda())

    def inputs(layout, shift):
        big = [_make(g, (1, s_r + 1, h, d), torch.bfloat16, layout) for h in (hq, hkv, hkv)]
        return [x[:, shift:shift + s_r] for x in big]  # shift 1: misaligned base pointers

    calls = [(lay, shift, cdt) for lay in ("dense", "transposed", "sliced") for shift in (0, 1)
             for cdt in (torch.float32, torch.bfloat16)] * 2
    for cached in (True, False):
        compiled_launch.REPLAY = cached
        try:
            q, k, v = inputs("dense", 0)
            parts = [FillPart(q, qr, norm[0], True), FillPart(k, kr, norm[1], True),
                     FillPart(v, kr)]
            plan = fill_mod.FillPlan(parts, 1e-6, rope=True, impl="triton")
            for i, (lay, shift, cdt) in enumerate(calls):
                xs = inputs(lay, shift)
                cos, sin = (torch.randn((s_r, d), generator=g).to(cdt).cuda() for _ in "cs")
                want = fill_torch([FillPart(x, p.ranges, p.weight, p.rope)
                                   for x, p in zip(xs, parts)], 1e-6, cos, sin)
                out = torch.full_like(want, float("nan"))
                plan(xs, cos, sin, out)
                assert torch.equal(out, want), f"seed {seed}: cached={cached} call {i}"
            launches = plan.layout.launches
            replayed = [k for k in launches._handles if launches.replayable(k)]
            assert bool(replayed) == cached, (cached, list(launches._handles))
        finally:
            compiled_launch.REPLAY = True

@pytest.mark.parametrize("case", [
    (2, 56, 56, 128, 1, 4096, torch.bfloat16, True, "dense"),
    (3, 8, 2, 64, 2, 333, torch.float16, True, "sliced"),        # GQA, odd rows
    (2, 12, 4, 128, 1, 1000, torch.bfloat16, False, "transposed"),
])
def test_fill_kernel_fp8_bitwise_on_cuda(case, seed):
    """The FP8 payload (ulysses/fp8.py): the kernel's bytes and scales equal the torch path's,
    with zero, NaN, inf and tiny rows among the random ones."""
    _need_gpu()
    w, hq, hkv, d, b, s_r, dtype, norm, layout = case
    g = torch.Generator().manual_seed(seed)
    q, k, v = (_make(g, (b, s_r, h, d), dtype, layout) for h in (hq, hkv, hkv))
    q[0, 1, 0] = 0.0
    k[0, 2, 0, 3] = float("nan")
    v[0, 3, 0, 5] = float("inf")
    q[0, 4, 1] *= 2.0 ** -20
    qw = torch.randn(d, generator=g).cuda() if norm else None
    kw = torch.randn(d, generator=g).to(dtype).cuda() if norm else None
    cos, sin = torch.randn((s_r, d), generator=g).cuda(), torch.randn((s_r, d), generator=g).cuda()
    for groups in (1, 2):
        qr = tuple(group_head_ranges(hq, w, groups)[groups - 1])
        kr = tuple(kv_head_range(lo, hi, hq // hkv) for lo, hi in qr)
        for rope in (True, False):
            parts = [FillPart(q, qr, qw, rope), FillPart(k, kr, kw, rope), FillPart(v, kr)]
            want = fill_torch(parts, 1e-6, cos, sin, payload_dtype=torch.float8_e4m3fn)
            got = fill_triton(parts, 1e-6, cos, sin, out=torch.full_like(want, 0xA5),
                              payload_dtype=torch.float8_e4m3fn)
            assert torch.equal(want, got), f"seed {seed} groups {groups} rope {rope}"


def _compiled_fills() -> list:
    """The PTX of every fill kernel compiled in this process (Triton's in-memory cache)."""
    from attncomm.ulysses import fill_kernels
    return [ck.asm.get("ptx", "") for _, entry in fill_kernels.fill_kernel.device_caches.items()
            for ck in entry[0].values()]


@pytest.mark.parametrize("payload", [None, torch.float8_e4m3fn])
def test_fill_norm_tree_by_shuffles_on_cuda(payload, seed, monkeypatch):
    """D = 128 rows of contiguous, 16-byte aligned bf16 parts take the norm's tree by warp
    shuffles (``SHFL_NORM``: the compiled kernel's PTX has ``_ptx_norm_inv``'s ``rcp.rn``),
    on full blocks (304 rows, runs of 2 heads) and masked ones (300 rows, 5 heads a region),
    with eps 1e-6 and 0: its bits (bf16 as int16: NaNs and signed zeros too) equal Triton's
    tree's (the same launch with the shuffles forced off) and the torch path's, with rows
    holding a NaN, an infinity, only zeros, and values whose squares are subnormal. The same
    parts with a strided head dim take Triton's tree. The FP8 payload is stored from the
    registers with the shuffles (``REG_STORE``: ``_store_words``' asm in the PTX) and by
    Triton's stores without them. Outputs are poisoned first. Triton's in-memory kernel cache
    is emptied before each launch checked, so its one kernel is that launch's."""
    _need_gpu()
    from attncomm.ulysses import fill as fill_mod
    from attncomm.ulysses import fill_kernels
    g = torch.Generator().manual_seed(seed)
    d = 128
    qw, kw = (torch.randn(d, generator=g).cuda() for _ in "qk")
    as_int = (lambda t: t.view(torch.int16)) if payload is None else (lambda t: t)
    for layout, s_r, h, shuffled in (("dense", 304, 8, True), ("dense", 300, 10, True),
                                     ("sliced", 300, 10, False)):
        cos, sin = (torch.randn((s_r, d), generator=g).cuda() for _ in "cs")
        q, k, v = (_make(g, (1, s_r, h, d), torch.bfloat16, layout) for _ in "qkv")
        for x in (q, k):
            x[0, 3, 0, 5] = float("nan")
            x[0, 4, 1, 7] = float("inf")
            x[0, 5, 0] = 0.0
            x[0, 6, 1] *= 2.0 ** -70  # squares below fp32's normal range
        ranges = ((0, h // 2), (h // 2, h))
        parts = [FillPart(q, ranges, qw, True), FillPart(k, ranges, kw, True),
                 FillPart(v, ranges)]
        for eps in (1e-6, 0.0):
            case = f"seed {seed}: {layout}, {s_r} rows, eps {eps}, payload {payload}"
            want = fill_torch(parts, eps, cos, sin, payload_dtype=payload)
            n = want.numel()
            poison = float("nan") if payload is None else 0xA5
            # poisoned guard elements after the buffer: a store past its end shows there
            buf = torch.full((n + 4096,), poison, dtype=want.dtype, device=want.device)
            fill_kernels.fill_kernel.device_caches.clear()  # then only this launch's kernel
            got = fill_triton(parts, eps, cos, sin, out=buf[:n].view(want.shape),
                              payload_dtype=payload)
            guard = buf[n:]
            assert bool((guard.isnan() if payload is None else guard == poison).all()), case
            ptxs = _compiled_fills()
            assert len(ptxs) == 1 and ("rcp.rn.f32" in ptxs[0]) == shuffled, case
            reg_store = bool(REG_STORE.search(ptxs[0]))
            assert reg_store == (shuffled and payload is not None), case
            with monkeypatch.context() as m:
                m.setattr(fill_mod, "_ROWS_SPEC", -1)  # Triton's tree
                tree = fill_triton(parts, eps, cos, sin, out=torch.full_like(want, poison),
                                   payload_dtype=payload)
            assert torch.equal(as_int(got), as_int(tree)), case
            if payload is None:  # NaN where the torch path has one (its payload bits differ)
                nan = want.isnan()
                assert torch.equal(nan, got.isnan()), case
                want, got = want.masked_fill(nan, 0.0), got.masked_fill(nan, 0.0)
            assert torch.equal(as_int(want), as_int(got)), case


def _layer_inputs(seed, s, hq, hkv, d=128):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn((1, s, h, d), generator=g).to(torch.bfloat16).cuda()
               for h in (hq, hkv, hkv))
    norm = (torch.randn(d, generator=g).cuda(), torch.randn(d, generator=g).cuda(), 1e-6)
    rope = (torch.randn((s, d), generator=g).cuda(), torch.randn((s, d), generator=g).cuda())
    return q, k, v, norm, rope


def test_attention_fused_grouped_bitwise(one_rank_group, seed):
    q, k, v, norm, rope = _layer_inputs(seed, 1024, 28, 4)
    ref = None
    for groups in (0, 2, 7):
        for fused in (True, False):
            mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm, fuse_qk_norm_rope=fused)
            for call in range(3):
                out = mod(q, k, v, rope=rope)
                ref = out.clone() if ref is None else ref
                assert torch.equal(out, ref), f"seed {seed}: G={groups} fused={fused} {call}"


@pytest.mark.parametrize("groups", [0, 7])
def test_forward_has_no_host_sync(one_rank_group, groups):
    """A steady-state forward (sequential and 7 head groups, fused fill, qk_norm + RoPE) makes
    no synchronizing CUDA call: none reported by torch's sync debug mode, none in the
    profiler's runtime calls."""
    from torch.profiler import ProfilerActivity, profile, record_function
    q, k, v, norm, rope = _layer_inputs(1, 2048, 28, 28)
    mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm)
    for _ in range(2):
        mod(q, k, v, rope=rope)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                with record_function("forward"):
                    mod(q, k, v, rope=rope)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    syncs = [str(w.message) for w in caught
             if "called a synchronizing CUDA operation" in str(w.message)]
    assert not syncs, syncs
    events = prof.events()
    fwd = [e for e in events if e.name == "forward"][0].time_range
    runtime = [e.name for e in events
               if ("Synchronize" in e.name or e.name in ("cudaMemcpy", "cudaMemcpy2D"))
               and fwd.start <= e.time_range.start <= fwd.end]
    assert not runtime, runtime
    assert mod.last_pipeline_groups == max(groups, 1)


def _rehearsal():
    spec = importlib.util.spec_from_file_location(
        "ulysses_one_gpu", os.path.join(ROOT, "scripts", "ulysses_one_gpu.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rehearsal_bitwise_and_host_ahead(tmp_path, seed):
    _need_gpu()
    reh = _rehearsal()
    sim = reh.Rehearsal(2, 2048, 8, norm=True, scale=0.1, seed=seed)
    seq = [o.clone() for o in sim.layer(1)]
    for groups in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(seq, sim.layer(groups))), groups
    # sequential against plain torch: fill reference + attention over the whole sequence
    full = [torch.cat([sim.qkv[r][i] for r in range(2)], dim=1) for i in range(3)]
    qn = rms_norm_rope(full[0], sim.w[0], sim.eps, sim.cos, sim.sin)
    kn = rms_norm_rope(full[1], sim.w[1], sim.eps, sim.cos, sim.sin)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qn.transpose(1, 2), kn.transpose(1, 2), full[2].transpose(1, 2)).transpose(1, 2)
    got = torch.cat(seq, dim=1)
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    summary = reh.profile(sim, 4, 2, str(tmp_path / "t.json"))
    assert summary["host_syncs_in_window"] == 0
    assert summary["host"]["lead_us"] > 0
    # the layer captured in a CUDA graph (--graph): replays equal the eager layer
    graph, outs = reh.captured(sim, 4)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, seq))


@pytest.mark.parametrize("d", [128, 96, 80])
def test_torch_path_rounds_alike_on_cuda_and_cpu(d, seed):
    """``fp8.quantize_rows`` and ``rms_norm_rope`` give the same bits on CUDA as on the CPU
    (and so as the kernel's IEEE divisions): torch's CUDA division by a Python scalar multiplies
    by its reciprocal, which differs in the last bit (amax / 448; the mean over a D that is not a
    power of two)."""
    _need_gpu()
    from attncomm.ulysses import fp8
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((2, 333, 6, d), generator=g).to(torch.bfloat16) * 3
    x[0, 1, 0] = 0.0
    x[0, 2, 0, 3] = float("nan")
    w = torch.randn(d, generator=g)
    cos, sin = torch.randn((333, d), generator=g), torch.randn((333, d), generator=g)
    cpu = rms_norm_rope(x, w, 1e-6, cos, sin)
    gpu = rms_norm_rope(x.cuda(), w.cuda(), 1e-6, cos.cuda(), sin.cuda()).cpu()
    nan = cpu.isnan()  # NaN rows: NaN on both (their sign and payload bits may differ)
    assert torch.equal(nan, gpu.isnan()), f"seed {seed} d {d}"
    assert torch.equal(cpu[~nan].view(torch.int16), gpu[~nan].view(torch.int16)), \
        f"seed {seed} d {d}"
    qc, sc = fp8.quantize_rows(cpu)
    qg, sg = fp8.quantize_rows(cpu.cuda())
    assert torch.equal(sc.view(torch.int32), sg.cpu().view(torch.int32)), f"seed {seed} d {d}"
    assert torch.equal(qc.view(torch.uint8), qg.cpu().view(torch.uint8)), f"seed {seed} d {d}"
