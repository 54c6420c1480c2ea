"""symm_a2a without a GPU: slab layout arithmetic, block plans, eligibility agreement across
gloo ranks (one ineligible rank → every rank falls back under auto / raises under symm_a2a),
the kernels' exchange + combine math under the Triton interpreter, auto, env and bench on CPU."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from attncomm.dcp.lse_merge.symm_a2a import SymmConfig, ll_rows_for, plan_blocks, use_ll
from attncomm.dcp.lse_merge.symm_layout import ALIGN, SlabLayout

_MAX_BLOCK_ROWS = SymmConfig().max_block_rows

HERE = os.path.dirname(os.path.abspath(__file__))


# ------------------------------------------------------------------------------ layout / plans

@pytest.mark.parametrize("W,rows,D,item,ll", [(2, 4096, 512, 2, 512), (3, 7, 24, 4, 7),
                                              (8, 1, 1, 2, 0), (1, 0, 16, 2, 0),
                                              (5, 33, 100, 2, 10)])
def test_layout_regions_disjoint_aligned(W, rows, D, item, ll):
    L = SlabLayout(W, rows, D, item, ll)
    cells = L.cell_bytes()
    assert cells["o"] >= rows * D * item and cells["l"] >= rows * 4
    assert cells["f"] >= max(rows, 1) * 4 and cells["lll"] >= ll * 8
    assert cells["llo"] >= ll * L.row_words * 8
    spans = []
    for region, size in cells.items():
        for slot in (0, 1):
            for src in range(W):
                off = L.offset(region, slot, src)
                assert off % ALIGN == 0
                spans.append((off, off + size))
    spans.sort()
    for (_a0, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0, "regions overlap"
    assert spans[-1][1] == L.total_bytes
    st = L.kernel_strides()
    assert st["o_cell"] * item == cells["o"]
    assert st["l_base"] * 4 == L.l_offset(0, 0) and st["f_base"] * 4 == L.f_offset(0, 0)
    assert st["llo_base"] * 8 == L.offset("llo", 0, 0)
    assert st["lll_base"] * 8 + st["lll_cell"] * 8 * (2 * W - 1) == L.offset("lll", 1, W - 1)
    assert L.o_offset(1, W - 1) == (2 * W - 1) * cells["o"]


def test_layout_rejects_bad_arguments():
    for kwargs in (dict(world_size=0, max_rows=1, head_dim=1, itemsize=2),
                   dict(world_size=2, max_rows=-1, head_dim=1, itemsize=2),
                   dict(world_size=2, max_rows=4, head_dim=8, itemsize=2, ll_rows=5),
                   dict(world_size=2, max_rows=4, head_dim=3, itemsize=2, ll_rows=2)):
        with pytest.raises(ValueError):
            SlabLayout(**kwargs)
    L = SlabLayout(2, 4, 8, 2)
    with pytest.raises(ValueError):
        L.o_offset(2, 0)
    with pytest.raises(ValueError):
        L.offset("o", 0, 2)


@pytest.mark.parametrize("n_rows", [1, 2, 31, 32, 33, 127, 128, 129, 1000, 4096, 4097, 65536])
@pytest.mark.parametrize("n_prog", [1, 7, 132, 264])
def test_plan_blocks_cover_rows(n_rows, n_prog):
    br, n_blocks, grid = plan_blocks(n_rows, n_prog)
    assert br & (br - 1) == 0 and 1 <= br <= _MAX_BLOCK_ROWS
    assert (n_blocks - 1) * br < n_rows <= n_blocks * br
    assert 1 <= grid <= min(n_prog, n_blocks)
    if n_blocks > n_prog:  # more blocks than programs only at the largest block size
        assert br == _MAX_BLOCK_ROWS


def test_ll_rows_and_choice():
    assert ll_rows_for(4096, 512, 2, 512 * 1024) == 512
    assert ll_rows_for(10, 512, 2, 512 * 1024) == 10
    assert ll_rows_for(100, 3, 2, 1 << 20) == 0  # 6-byte rows cannot be split in words
    L = SlabLayout(2, 100, 8, 2, 40)
    assert use_ll(40, L) and not use_ll(41, L) and not use_ll(0, L)


def test_symm_config_env_defaults_and_validation(monkeypatch):
    from attncomm.dcp.lse_merge.symm_a2a import stagger
    from attncomm.symm import num_warps
    for k in [k for k in os.environ if k.startswith("ATTNCOMM_SYMM_")]:
        monkeypatch.delenv(k)
    assert SymmConfig.from_env() == SymmConfig()
    monkeypatch.setenv("ATTNCOMM_SYMM_MAX_BLOCK_ROWS", "32")
    monkeypatch.setenv("ATTNCOMM_SYMM_PDL", "0")
    cfg = SymmConfig.from_env()
    assert cfg.max_block_rows == 32 and cfg.enable_pdl is False and cfg.stagger_split == 50
    monkeypatch.setenv("ATTNCOMM_SYMM_WIDE_WARPS", "x")
    with pytest.raises(ValueError, match="ATTNCOMM_SYMM_WIDE_WARPS"):
        SymmConfig.from_env()
    for bad in (dict(max_block_rows=48), dict(max_warps=0), dict(stagger_split=-1)):
        with pytest.raises(ValueError):
            SymmConfig(**bad)
    # the knobs act in-process, through the object
    assert plan_blocks(4096, 8, SymmConfig(max_block_rows=16).max_block_rows)[0] == 16
    cfg = SymmConfig()
    assert num_warps(64 * 1024, cfg.max_warps, SymmConfig(wide_warps=0).wide_warps) == 16
    assert num_warps(64 * 1024, cfg.max_warps, cfg.wide_warps) == 32
    assert num_warps(4096, cfg.max_warps, cfg.wide_warps) == 8 and num_warps(1) == 1
    assert stagger(4096, 2, 2, 512, 2, SymmConfig(stagger_min_bytes=0)) == 0
    assert stagger(4096, 2, 2, 512, 2) == 50


# ------------------------------------------------------------------------------ interpreter

@pytest.mark.slow
@pytest.mark.parametrize("stagger", [None, "50", "25"])
def test_kernels_under_interpreter(stagger):
    """The real kernels on one CPU process: rank 0 runs, peers' stores are staged (see
    tests/_symm_interp.py): flag and LL protocols, W=1..4, fp16/bf16/fp32, both parity slots,
    −inf/NaN rows, bit-exact dispatch, the device epoch, its wrap and scrub, and the backend's
    host code at W=1; also with staggered sends at every size (two groups; groups of one
    program, chained)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.path.dirname(HERE))
    args = ["1", stagger] if stagger else []  # a SymmConfig built from them in the process
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_symm_interp.py"), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ok" in proc.stdout


# ------------------------------------------------------------------------------ agreement

def _eligibility(rank, world_size, bad_ranks):
    from attncomm import capability
    from attncomm.dcp import DcpMerger
    from attncomm.dcp.lse_merge.symm_a2a import SymmA2ABackend

    capability._override_probe(
        lambda group, device: "fake: no P2P here" if rank in bad_ranks else None)
    try:
        local = SymmA2ABackend.collective_unavailable_reason(None, torch.device("cuda"))
        agreed = capability.agree_reason(None, local, "symm_a2a")
        explicit = None
        try:
            DcpMerger(max_tokens=4, num_heads=2 * world_size, head_dim=8, dtype=torch.float32,
                      backend="symm_a2a")
        except ValueError as exc:
            explicit = str(exc)
        auto = DcpMerger(max_tokens=4, num_heads=2 * world_size, head_dim=8,
                         dtype=torch.float32)
        return local, agreed, explicit, auto.backend, auto.fallback_reason
    finally:
        capability._override_probe(None)


@pytest.mark.parametrize("world_size,bad", [(2, [1]), (3, [0, 2]), (2, [])])
def test_one_ineligible_rank_decides_for_all(pools, world_size, bad):
    res = pools.run(world_size, _eligibility, bad)
    locals_, agreed, explicit, backends, reasons = zip(*res)
    for r in range(world_size):
        assert (locals_[r] is not None) == (r in bad)
    assert len(set(agreed)) == 1 and len(set(explicit)) == 1, "ranks disagree"
    assert len(set(backends)) == 1 and len(set(reasons)) == 1
    assert backends[0] != "symm_a2a" and reasons[0]
    assert explicit[0] is not None and "symm_a2a" in explicit[0]
    for r in bad:
        assert f"rank {r}: fake: no P2P here" in agreed[0]
        assert f"rank {r}" in explicit[0]
    if not bad:  # eligible by the probe; on CPU ranks the merger still refuses, on every rank
        assert agreed[0] is None


def _collective_try(rank, world_size, fail_rank):
    from attncomm import capability

    def step():
        if rank == fail_rank:
            raise RuntimeError("out of memory (fake)")
        return rank

    return capability.collective_try(None, step, "alloc")


def test_collective_try_agrees(pools):
    res = pools.run(3, _collective_try, 1)
    assert all(v is None for v, _ in res)
    assert len({why for _, why in res}) == 1 and "rank 1: RuntimeError" in res[0][1]
    res = pools.run(3, _collective_try, -1)
    assert [v for v, _ in res] == [0, 1, 2] and all(w is None for _, w in res)


def _auto_cpu(rank, world_size):
    from attncomm.dcp import DcpMerger
    m = DcpMerger(max_tokens=4, num_heads=4, head_dim=8, dtype=torch.float32)
    return m.backend, m.fallback_reason, m.decision.times_us


def test_auto_rule_of_thumb_on_cpu(pools):
    """On gloo ranks nothing is timed: a2a (one collective) is the rule of thumb, and the
    reason names why symm_a2a was out."""
    for backend, why, times in pools.run(2, _auto_cpu):
        assert backend == "a2a" and times is None
        assert why and "not CUDA" in why, why


# ------------------------------------------------------------------------------ env / bench

def test_env_runs_on_cpu(capsys):
    from attncomm.envinfo import collect, main
    info = collect()
    dcp = {b["backend"]: b for b in info["backends"]["dcp"]}
    assert dcp["ag_rs"]["available"] and not dcp["symm_a2a"]["available"]
    assert dcp["symm_a2a"]["why_not"]
    gather = {b["backend"]: b for b in info["backends"]["dcp_gather"]}
    assert gather["all_gather"]["available"] and not gather["symm"]["available"]
    assert gather["symm"]["why_not"] == dcp["symm_a2a"]["why_not"]
    assert info["multicast"]["NCCL_NVLS_ENABLE"] == "0"
    assert main(type("A", (), {"json": None})()) == 0
    printed = capsys.readouterr().out
    assert "symm_a2a" in printed and "dcp_gather backends:" in printed


def test_bench_dcp_on_cpu_ranks(pools, tmp_path):
    from attncomm.bench.dcp import add_speedups, markdown_table, run_rank
    cfg = dict(device="cpu", backends=["ag_rs", "a2a", "symm_a2a"], modes=["eager"], heads=4,
               head_dim=8, dtype="fp32", tokens=[1, 3], warmup=1, iters=3, per_graph=2,
               progress=False)
    res = pools.run(2, run_rank, cfg)
    records = res[0]
    assert res[1] is None
    assert {(r["backend"], r["tokens"]) for r in records} == {
        (b, t) for b in ("ag_rs", "a2a") for t in (1, 3)}  # symm_a2a skipped on CPU
    assert all(r["latency_us"] > 0 and r["world_size"] == 2 for r in records)
    rows = add_speedups(records)
    assert all(r["speedup"] is not None and r["speedup"] <= 1.0 + 1e-9 for r in rows)
    assert "| eager | 1 |" in markdown_table(records)


def test_bench_dcp_marks_host_bound_figures():
    from attncomm.bench.dcp import host_bound, markdown_table
    gpu = {"backend": "symm_a2a", "mode": "graph", "tokens": 8, "world_size": 2,
           "latency_us": 4.5, "gpu_idle_us": 0.30}  # the launch gap only
    nccl = dict(gpu, backend="a2a", latency_us=22.0, gpu_idle_us=0.28)
    host = dict(gpu, tokens=1, latency_us=7.4, gpu_idle_us=4.4)  # the GPU waited for a host
    eager = dict(gpu, mode="eager", latency_us=200.0)
    del eager["gpu_idle_us"]
    records = [gpu, nccl, host, eager]
    assert [host_bound(r, records) for r in records] == [False, False, True, False]
    table = markdown_table(records)
    assert "| graph | 1 | 7.4ʰ | - |" in table and "| graph | 8 | 4.5 | 22 |" in table
    assert "host-bound" in table
    assert "ʰ" not in markdown_table([gpu, nccl, eager])


@pytest.mark.parametrize("modes", [["graph"], ["eager", "graph-interleaved"]])
def test_bench_dcp_graph_modes_need_cuda(modes, capsys):
    import argparse

    from attncomm.bench.dcp import add_arguments, main
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert main(p.parse_args(["--device", "cpu", "--modes", *modes])) == 2
    err = capsys.readouterr().err
    assert "graph modes need --device cuda" in err and modes[-1] in err


# ------------------------------------------------------------------------------ PDL prologue

@pytest.mark.parametrize("kind", ["flag", "ll"])
def test_pdl_prologue_order_in_ptx(kind):
    """The kernels compiled for sm_90 (no GPU needed; tests/_symm_ptx.py, in a process without
    TRITON_INTERPRET). With PDL, only the epoch count-in comes before griddepcontrol.wait (every
    other global access after it), and the epoch's write-back is fenced and followed by a block
    barrier before launch_dependents (the first trigger of a block counts for all its warps);
    without PDL, none of it."""
    import json
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_symm_ptx.py"), kind], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout)
    lines = [ln.strip() for ln in ptx["pdl"].splitlines()]
    wait = next(i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait"))
    before = [ln for ln in lines[:wait]
              if ".global" in ln and ("ld." in ln or "st." in ln or "atom." in ln)]
    assert len(before) == 1 and "atom.global.gpu.relaxed.add.u64" in before[0], before
    trigger = next(i for i, ln in enumerate(lines)
                   if ln.startswith("griddepcontrol.launch_dependents"))
    exch = max(i for i, ln in enumerate(lines[:trigger])
               if "atom.global.gpu.relaxed.exch.b64" in ln)
    between = lines[exch:trigger]
    fence = next(i for i, ln in enumerate(between) if ln.startswith("fence.acq_rel.gpu"))
    assert any(ln.startswith("bar.sync") for ln in between[fence:]), between
    assert sum(ln.startswith("griddepcontrol") for ln in lines) == 2
    assert "griddepcontrol" not in ptx["plain"] and "fence.acq_rel.gpu" not in ptx["plain"]
