"""The DCP and DP-attention hot path on ONE GPU (W=1 NCCL rank): steady-state eager calls make
no host sync (``torch.cuda.set_sync_debug_mode("error")``, behind a GPU sleep the host must run
ahead of), the symmetric-memory launches go through the compiled kernel after the first call of
a shape (bit for bit what the JIT path gives), ``torch.compile(mode="reduce-overhead")`` of
every exchange equals eager bit for bit, ``DcpMerger(backend="auto")`` allocates ``symm_a2a``
once, and ``attncomm bench overhead`` runs. Run on the device: ``pytest -m gpu tests/gpu``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import attncomm

pytestmark = pytest.mark.gpu

_SLEEP_CYCLES = int(3e9)  # ~1.5 s of GPU time at H200 clocks: the host must not wait for it
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def one_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pool = attncomm.RankPool(1, device="cuda")
    yield pool
    pool.close(force=not pool.alive)


def _dev():
    return torch.device("cuda", torch.cuda.current_device())


def _exchanges(gen, T=8, H=16, D=128, Dq=192):
    """name → a call of each DCP/DP exchange at W=1 (warmed up: decisions made)."""
    from attncomm import dcp
    from attncomm.dp_attention import DpPaddingMode, dp_gather, dp_reduce_scatter, dp_scatter
    dev, bf = _dev(), torch.bfloat16
    out = torch.randn(T, H, D, generator=gen, device=dev).to(bf)
    lse = torch.randn(T, H, generator=gen, device=dev) * 2
    q = torch.randn(T, H, Dq, generator=gen, device=dev).to(bf)
    ang = torch.rand(T, 64, generator=gen, device=dev) * 6
    rope = (ang.cos(), ang.sin())
    buf = torch.empty(T, H, D, dtype=bf, device=dev)
    symm = dcp.DcpMerger(max_tokens=16, num_heads=H, head_dim=D, dtype=bf, backend="symm_a2a")
    auto = dcp.DcpMerger(max_tokens=16, num_heads=H, head_dim=D, dtype=bf)
    gq = dcp.DcpQueryGather(max_tokens=16, num_heads=H, head_dim=Dq, dtype=bf, rope_dim=64)
    layer = dcp.DcpAttention(lambda qa: (qa[..., :D].contiguous(), qa[..., 0].float()),
                             max_tokens=16, num_heads=H, head_dim=Dq, v_head_dim=D, dtype=bf,
                             rope_dim=64)
    rows = torch.randn(T, 256, generator=gen, device=dev).to(bf)
    calls = {
        "dcp.merge": lambda: dcp.merge(out, lse),
        "dcp.merge[output]": lambda: dcp.merge(out, lse, output=buf),
        "DcpMerger.symm_a2a": lambda: symm(out, lse, return_lse=True),
        "DcpMerger.auto": lambda: auto(out, lse),
        "dcp.gather_heads": lambda: dcp.gather_heads(q, rope=rope),
        "DcpQueryGather": lambda: gq(q, rope=rope),
        "DcpAttention": lambda: layer(q, rope=rope),
        "dp_gather[MAX_LEN]": lambda: dp_gather(rows, [T], None, mode=DpPaddingMode.MAX_LEN),
        "dp_gather[SUM_LEN]": lambda: dp_gather(rows, [T], None, mode="sum_len"),
        "dp_scatter": lambda: dp_scatter(rows, [T], 0, mode="sum_len"),
        "dp_reduce_scatter": lambda: dp_reduce_scatter(rows, [T], None, mode="max_len"),
    }
    for call in calls.values():
        call()
        call()
    torch.cuda.synchronize()
    return calls, (symm, auto, gq, layer)


def _no_host_sync(rank, world):
    calls, objs = _exchanges(torch.Generator(device=_dev()).manual_seed(5))
    res = {}
    for name, call in calls.items():
        torch.cuda.synchronize()
        torch.cuda._sleep(_SLEEP_CYCLES)
        asleep = torch.cuda.Event()
        asleep.record()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                call()
            res[name] = "ahead" if not asleep.query() else "the host waited for the GPU"
        except Exception as exc:  # noqa: BLE001 - the row says what synced
            res[name] = f"{type(exc).__name__}: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    for o in objs:
        o.check()
    return res


def test_steady_state_eager_calls_make_no_host_sync(one_gpu):
    res = one_gpu.run(_no_host_sync)[0]
    bad = {name: v for name, v in res.items() if v != "ahead"}
    assert not bad, bad


def _compiled_launches(rank, world):
    """symm_a2a and the symm gather at W=1: after the first call of a shape, launches go through
    the compiled kernel (``LaunchCache``), and give the bits of the JIT path: the merge of one
    source is ``combine_torch``'s, the gather of one rank is the rotated query."""
    from attncomm.dcp import DcpMerger, DcpQueryGather
    from attncomm.compiled_launch import alignment_key
    from attncomm.dcp.lse_merge.combine import combine_torch
    from attncomm.dcp.query_gather.query_math import rotate_tail
    dev, bf = _dev(), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(11)
    m = DcpMerger(max_tokens=16, num_heads=8, head_dim=128, dtype=bf, backend="symm_a2a")
    g = DcpQueryGather(max_tokens=16, num_heads=8, head_dim=192, dtype=bf, rope_dim=64,
                       backend="symm")
    bad = []
    for T in (1, 5, 16):
        for i in range(3):
            out = torch.randn(T, 8, 128, generator=gen, device=dev).to(bf)
            lse = torch.randn(T, 8, generator=gen, device=dev) * 3
            o, l = m(out, lse, return_lse=True)
            ref, ref_lse = combine_torch(out[None], lse[None], bf)
            if not (torch.equal(o, ref) and torch.equal(l, ref_lse)):
                bad.append(("merge", T, i))
            q = torch.randn(T, 8, 192, generator=gen, device=dev).to(bf)
            ang = torch.rand(T, 64, generator=gen, device=dev) * 6
            cos, sin = ang.cos(), ang.sin()
            got = g(q, rope=(cos, sin))
            if not torch.equal(got, rotate_tail(q, cos, sin)):
                bad.append(("gather", T, i))
        key = (T, *alignment_key((out, lse, m._impl.res, m._impl.res_lse)))
        if not m._impl._launches.replayable(key):
            bad.append(("merge not replayed", T))
        if not g._impl._launches.replayable((T, *alignment_key((q, cos, sin, q)))):
            bad.append(("gather not replayed", T))
    torch.cuda.synchronize()
    m.check()
    g.check()
    return bad


def test_symm_launches_replay_the_compiled_kernel_bit_for_bit(one_gpu):
    bad = one_gpu.run(_compiled_launches)[0]
    assert not bad, bad


def _reduce_overhead(rank, world):
    calls, objs = _exchanges(torch.Generator(device=_dev()).manual_seed(9))
    res = {}
    for name, call in calls.items():
        torch._dynamo.reset()
        try:
            compiled = torch.compile(call, mode="reduce-overhead", fullgraph=True)
            ok = True
            for _ in range(4):  # warm-up runs, the capture, then replays
                got = compiled()
                got = tuple(t.clone() for t in got) if isinstance(got, tuple) else got.clone()
                ref = call()
                ref = ref if isinstance(ref, tuple) else (ref,)
                got = got if isinstance(got, tuple) else (got,)
                ok = ok and all(torch.equal(a, b) for a, b in zip(got, ref))
            res[name] = "equal" if ok else "differs"
        except Exception as exc:  # noqa: BLE001 - the row says what failed
            res[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    torch.cuda.synchronize()
    for o in objs:
        o.check()
    return res


def test_reduce_overhead_compile_of_each_exchange(one_gpu):
    res = one_gpu.run(_reduce_overhead)[0]
    bad = {name: v for name, v in res.items() if v != "equal"}
    assert not bad, bad


def _auto_allocations(rank, world):
    from attncomm import symm
    from attncomm.dcp import DcpMerger
    real, count = symm.SymmWorkspace.__init__, [0]

    def counting(self, *a, **kw):
        count[0] += 1
        real(self, *a, **kw)
    symm.SymmWorkspace.__init__ = counting
    try:
        m = DcpMerger(max_tokens=16, num_heads=16, head_dim=128, dtype=torch.bfloat16)
    finally:
        symm.SymmWorkspace.__init__ = real
    built = m.backend == "symm_a2a" or "symm_a2a" in (m.decision.times_us or {})
    return count[0], built, m.backend, m.fallback_reason


def test_dcp_merger_auto_allocates_symm_a2a_once(one_gpu):
    count, built, backend, why = one_gpu.run(_auto_allocations)[0]
    assert built, f"symm_a2a was not a candidate at W=1: {backend}, {why}"
    assert count == 1, f"{count} symmetric workspaces for one DcpMerger(backend='auto')"


def test_overhead_bench_runs(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    path = tmp_path / "overhead.json"
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "attncomm.cli", "bench", "overhead",
                           "--repeats", "20", "--warmup", "3", "--extra", "--time-budget", "120",
                           "--json", str(path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert path.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = {r["op"]: r for r in json.loads(path.read_text())["records"]}
    from attncomm.bench.overhead import OPS
    assert set(OPS) <= set(records), sorted(records)
    for op in ("dcp.merge", "DcpMerger.symm_a2a", "dcp.gather_heads", "dcp.merge[output]",
               "DcpQueryGather", "DcpAttention", "dp_gather", "dp_reduce_scatter"):
        r = records[op]
        assert r["error"] is None and r["host_us"] > 0 and r["gpu_us"] > 0, r
        assert r["unit_host_us"] > 0 and r["world_size"] == 1 and r["shape"], r
