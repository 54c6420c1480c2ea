"""The ``symm`` query gather without a GPU: slab layout arithmetic, the kernels' stores, flags,
LL words, epochs and RoPE bits under the Triton interpreter with staged peers
(tests/_gather_interp.py), the backend's host code on one rank, the sm_90 compile (no fused
multiply-add in the rotation), and ``auto`` falling back on CPU ranks."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from attncomm.dcp.query_gather.symm import GatherLayout, ll_rows_for, use_ll

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("W,T,H,D,item,ll", [(2, 128, 64, 576, 2, 227), (3, 7, 6, 24, 4, 14),
                                              (8, 1, 8, 1, 2, 0), (1, 4, 2, 16, 2, 8)])
def test_gather_layout_regions(W, T, H, D, item, ll):
    L = GatherLayout(W, T, H, D, item, ll)
    sizes = L.region_bytes()
    assert sizes["out"] >= T * H * D * item
    assert sizes["f"] >= 2 * W * L.max_rows * 4 and sizes["ready"] >= 4 * W
    assert sizes["ll"] >= 2 * W * ll * L.row_words * 8
    bases = [L.base(r) for r in sizes]
    assert bases[0] == 0 and all(b % 128 == 0 for b in bases)
    assert all(a + sizes[r] <= b for (r, a), b in zip(zip(sizes, bases), bases[1:]))
    assert L.total_bytes == bases[-1] + sizes["ready"]
    st = L.kernel_strides
    assert st["f_base"] * 4 == L.base("f") and st["ll_base"] * 8 == L.base("ll")
    assert st["ready_base"] * 4 == L.base("ready")


def test_ll_threshold():
    # Kimi-K2.5 at W=2: 32 heads × 576 bf16 per token → 7 tokens (227 rows) fit 256 KiB
    rows = ll_rows_for(128 * 32, 576, 2)
    assert rows == 227
    L = GatherLayout(2, 128, 64, 576, 2, rows)
    assert use_ll(7 * 32, L) and not use_ll(8 * 32, L) and not use_ll(0, L)
    assert ll_rows_for(100, 3, 2) == 0  # 6-byte rows cannot be cut into 32-bit words
    with pytest.raises(ValueError):
        GatherLayout(2, 4, 3, 8, 2)  # H not divisible by W


@pytest.mark.slow
def test_symm_gather_kernels_under_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_gather_interp.py")], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "ok" in proc.stdout


def test_symm_gather_compiles_for_sm90_without_fma():
    """No fused multiply-add in the compiled kernels: the rotation's two products and sum are
    rounded as rotate_tail's torch ops are, so the bits match (with fusion on, Triton emits
    fma.rn.f32 for it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.path.dirname(HERE)
    proc = subprocess.run([sys.executable, os.path.join(HERE, "_gather_ptx.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout)
    # the flag kernel's tiles (column_block, TILE_ELEMENTS) stay in registers: no spills
    spills = ptx.pop("flag_spills")
    assert spills and all(n == 0 for n in spills.values()), spills
    for name, text in ptx.items():
        assert "fma.rn.f32" not in text, name
        assert "%globaltimer" in text, f"{name}: waits not bounded by time"
    # READY handshake: a relaxed poll of READY, which the ORDERED variant drops; flags are
    # published with a release and waited for with an acquire, at system scope
    assert "ld.global.sys.relaxed" in ptx["flag"]
    assert "ld.global.sys.relaxed" not in ptx["flag_ordered"]
    for name in ("flag", "flag_ordered", "flag_fp8"):
        assert "atom.global.sys.release.exch" in ptx[name] and \
            "ld.global.sys.acquire" in ptx[name], name
    # FP8: the scale division is IEEE (div.rn.f32, not the approximate div.full.f32), and the
    # e4m3 conversion is the kernel's integer code (no cvt to e4m3, whose NaN differs)
    for name in ("flag_fp8", "ll_fp8"):
        assert "div.rn.f32" in ptx[name] and "div.full" not in ptx[name], name
        assert "e4m3" not in ptx[name], name


def _auto_on_cpu(rank, W):
    from attncomm import dcp
    g = dcp.DcpQueryGather(max_tokens=4, num_heads=2 * W, head_dim=8, dtype=torch.float16,
                           backend="auto")
    return g.backend, g.fallback_reason


def test_auto_falls_back_on_cpu_ranks(pools):
    for backend, reason in pools.run(2, _auto_on_cpu):
        assert backend == "all_gather" and "CUDA" in reason


def test_column_block_fits_the_tile_and_covers_the_row_when_it_can():
    from attncomm.dcp.query_gather.symm import TILE_ELEMENTS, column_block
    for d in (1, 2, 3, 8, 24, 72, 100, 128, 200, 576, 1024, 4096):
        cover = 1 << (d - 1).bit_length()
        for br in (1, 2, 4, 8, 16, 32, 64):
            bd = column_block(d, br)
            assert bd & (bd - 1) == 0 and bd >= 1, (d, br, bd)
            assert br * bd <= max(TILE_ELEMENTS, br * 32), (d, br, bd)
            # one column step whenever a whole (padded) row fits the tile
            assert bd == cover if br * cover <= TILE_ELEMENTS else bd < cover, (d, br, bd)


def test_launch_gather_rejects_a_bad_column_block_override():
    from attncomm.dcp.query_gather.symm import launch_gather
    for bad in (3, 0, -64, True, 2.0):
        with pytest.raises(ValueError, match="column_block_override"):
            launch_gather(torch.zeros(1, 1, 8), None, None, slab=None, rank=0, layout=None,
                          n_programs_max=1, column_block_override=bad)
