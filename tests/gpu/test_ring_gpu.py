"""Ring attention on one CUDA GPU: the default ``attn_fn`` (SDPA's kernel with its LSE) and the
Triton merge step against fp64, and ``ring_attention`` on a one-rank NCCL group. Run on the
device: ``pytest -m gpu tests/gpu/test_ring_gpu.py``. Two or more GPUs (a real ring) are the
multi-GPU issue's."""
from __future__ import annotations

import pytest
import torch
from _ring_helpers import gen, max_err, rand, ref_attention_lse, special_blocks

import attncomm
from attncomm.ring import attn as ring_attn
from attncomm.ring import attention_with_lse, positions, ring_attention
from attncomm.ring.merge import merge_block_torch, merge_block_triton, new_state

pytestmark = [pytest.mark.gpu, pytest.mark.gpus(1)]

def _need_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


# (B, S, Hq, Hkv, D, Dv, dtype)
_CASES = [
    (2, 256, 8, 8, 64, 64, torch.bfloat16),
    (1, 384, 8, 2, 128, 128, torch.bfloat16),   # GQA, expanded inside attn_fn
    (2, 200, 4, 4, 64, 64, torch.float16),      # S not a multiple of the kernel's tiles
    (1, 256, 4, 4, 64, 32, torch.bfloat16),     # D ≠ Dv: not flash
    (1, 128, 4, 2, 32, 32, torch.float32),      # fp32: efficient or math
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: f"{c[6]}-D{c[4]}-Dv{c[5]}-Hkv{c[3]}")
@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_matches_fp64(case, causal, seed):
    _need_gpu()
    b, s, hq, hkv, d, dv, dtype = case
    g = gen(seed)
    q, k, v = (rand(g, (b, s, h, dd), dtype) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
    out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), causal)
    kernel = ring_attn.last_kernel()
    ref, ref_lse = ref_attention_lse(q, k, v, causal)
    where = f"seed {seed}, {case}, causal={causal}, kernel {kernel}"
    assert tuple(out.shape) == (b, s, hq, dv) and lse.dtype == torch.float32, where
    err = _excess(out, ref, v, dtype)
    assert err <= 0, f"{where}: out err over the tolerance by {err}"
    assert max_err(lse.cpu(), ref_lse) < 1e-3, f"{where}: lse err"
    if dtype != torch.float32:
        assert kernel in ("flash", "efficient", "cudnn"), where


def _excess(out, ref, v, dtype):
    """How far ``out`` is beyond the tolerance (≤ 0: within). Fused kernels round the softmax
    weights to the input dtype before P·V (FlashAttention, cuDNN), so an element may be off by
    about eps/2 of max|v| besides its own rounding; fp32 by accumulation only."""
    if dtype == torch.float32:
        tol = 2e-5 + 1e-5 * ref.abs()
    else:
        eps = torch.finfo(dtype).eps
        tol = eps / 2 * (ref.abs() + v.double().abs().max())
    return ((out.cpu().double() - ref).abs() - tol).max().item()


def test_merge_step_cuda_matches_torch_path(seed):
    _need_gpu()
    blocks = special_blocks(seed, (2, 37, 5, 96), torch.bfloat16)
    states = []
    for device, merge in (("cpu", merge_block_torch), ("cuda", merge_block_triton)):
        acc, acc_lse = new_state(2, 37, 5, 96, device)
        for lo, hi, out, lse in blocks:
            merge(acc[:, lo:hi], acc_lse[:, lo:hi], out.to(device), lse.to(device))
        states.append((acc.cpu(), acc_lse.cpu()))
    (a, al), (t, tl) = states
    empty = torch.isneginf(al)
    assert torch.equal(torch.isneginf(tl), empty), f"seed {seed}"
    assert torch.equal(t[empty], torch.zeros_like(t[empty])), f"seed {seed}"
    assert not bool(t.isnan().any()) and not bool(tl.isnan().any()), f"seed {seed}"
    # fp32 on both; the GPU may fuse a multiply-add (one rounding less)
    assert max_err(t[~empty], a[~empty]) < 1e-5, f"seed {seed}"
    assert max_err(tl[~empty], al[~empty]) < 1e-5, f"seed {seed}"


def _ring_one_rank(rank, world, seed):
    g = gen(seed)
    res = []
    for layout in ("contiguous", "zigzag"):
        for causal in (False, True):
            q, k, v = (rand(g, (1, 512, h, 64), torch.bfloat16) for h in (8, 2, 2))
            ref = ref_attention_lse(q, k, v, causal)[0]
            pos = positions(512, world, rank, layout)
            out = ring_attention(*(t[:, pos].cuda() for t in (q, k, v)), causal=causal,
                                 layout=layout)
            res.append((layout, causal, _excess(out, ref[:, pos], v, torch.bfloat16),
                        ring_attn.last_kernel()))
    return res


def test_ring_attention_one_rank_cuda(seed):
    _need_gpu()
    with attncomm.RankPool(1, device="cuda") as pool:
        res = pool.run(_ring_one_rank, seed, timeout_s=300)[0]
    for layout, causal, err, kernel in res:
        assert err <= 0, f"seed {seed}: {layout} causal={causal} over by {err} ({kernel})"


@pytest.mark.parametrize("causal", [False, True])
def test_attention_with_lse_mask_and_segments_match_fp64(causal, seed):
    """The default ``attn_fn``'s CUDA paths for a key-padding mask (a batch row with every key
    masked among them) and for a packed block's segments, against fp64 of the whole masked or
    packed attention."""
    _need_gpu()
    from attncomm.ring.layout import Segment
    g = gen(seed)
    b, s, hq, hkv, d, dtype = 2, 192, 4, 2, 64, torch.bfloat16
    q, k, v = (rand(g, (b, s, h, d), dtype) for h in (hq, hkv, hkv))
    valid = torch.rand(b, s, generator=g) > 0.3
    valid[1] = False  # a row of the batch with no key at all: 0 with LSE -inf
    out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), causal,
                                  key_padding_mask=valid.cuda())
    ref, ref_lse = ref_attention_lse(q, k, v, causal, key_valid=valid)
    where = f"seed {seed}, causal={causal}, kernel {ring_attn.last_kernel()}"
    assert torch.equal(out[1].float().cpu(), torch.zeros_like(out[1].float().cpu())), where
    assert bool(torch.isneginf(lse[1]).all()), where
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), live), where
    assert _excess(out, ref, v, dtype) <= 0, f"{where}: masked out err over the tolerance"
    assert max_err(lse.cpu()[live], ref_lse[live]) < 1e-3, f"{where}: masked lse err"

    cu = [0, 40, 41, 130, s]  # a one-token sequence among them
    segs = [Segment(a, z, a, z, causal) for a, z in zip(cu, cu[1:])]
    out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), False, segments=segs)
    ref, ref_lse = ref_attention_lse(q, k, v, causal, cu_seqlens=torch.tensor(cu))
    where = f"seed {seed}, causal={causal}, segments {cu}, kernel {ring_attn.last_kernel()}"
    assert _excess(out, ref, v, dtype) <= 0, f"{where}: packed out err over the tolerance"
    assert max_err(lse.cpu(), ref_lse) < 1e-3, f"{where}: packed lse err"


@pytest.mark.parametrize("path", ["flash-varlen", "one by one"])
def test_segments_with_gaps_and_flags_match_fp64(path, seed, monkeypatch):
    """A ring block's segments as the varlen kernel and as the one-by-one fallback: causal and
    non-causal segments in one block, query and key rows that no segment uses, B = 2, GQA."""
    _need_gpu()
    from attncomm.ring.layout import Segment
    g = gen(seed)
    b, sq, sk, hq, hkv, d, dtype = 2, 160, 150, 4, 2, 64, torch.bfloat16
    q = rand(g, (b, sq, hq, d), dtype)
    k, v = (rand(g, (b, sk, hkv, d), dtype) for _ in range(2))
    segs = [Segment(0, 50, 0, 30, False), Segment(60, 100, 40, 90, False),
            Segment(100, 150, 100, 150, True)]  # rows 50..60 and 150..160 in none
    if path != "flash-varlen":
        monkeypatch.setattr(ring_attn, "_varlen", lambda *a: None)
    out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), False, segments=segs)
    ref = torch.zeros(b, sq, hq, d, dtype=torch.float64)
    ref_lse = torch.full((b, sq, hq), float("-inf"), dtype=torch.float64)
    for q_lo, q_hi, k_lo, k_hi, causal in segs:
        ref[:, q_lo:q_hi], ref_lse[:, q_lo:q_hi] = ref_attention_lse(
            q[:, q_lo:q_hi], k[:, k_lo:k_hi], v[:, k_lo:k_hi], causal)
    where = f"seed {seed}, path {path}, kernel {ring_attn.last_kernel()}"
    if path == "flash-varlen":
        assert ring_attn.last_kernel() == "flash-varlen", where
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), live), where
    assert torch.equal(out.cpu()[~live].float(), torch.zeros_like(out.cpu()[~live].float())), where
    assert _excess(out, ref, v, dtype) <= 0, f"{where}: out err over the tolerance"
    assert max_err(lse.cpu()[live], ref_lse[live]) < 1e-3, f"{where}: lse err"


def _key_masks(g, b, sk):
    """``[b, sk]`` masks: row 0 all True, row 1 no key, row 2 padded at the end (a quarter),
    the rest random holes."""
    m = torch.rand(b, sk, generator=g) > 0.5
    for i, row in enumerate((torch.ones(sk), torch.zeros(sk),
                             torch.arange(sk) < sk * 3 // 4)[:b]):
        m[i] = row.bool()
    return m


# (B, Sq, Sk, Hq, Hkv, D, dtype)
_MASK_CASES = [
    (4, 256, 256, 8, 8, 128, torch.bfloat16),
    (4, 192, 320, 8, 2, 128, torch.bfloat16),   # GQA, Sq ≠ Sk
    (3, 200, 200, 4, 1, 64, torch.float16),     # MQA, tiles not full
    (4, 1, 320, 8, 2, 128, torch.bfloat16),     # one query row (decode), GQA
]


@pytest.mark.parametrize("case", _MASK_CASES, ids=lambda c: f"B{c[0]}-Hkv{c[4]}-D{c[5]}")
def test_masked_varlen_matches_fp64(case, seed):
    """A non-causal block with a key-padding mask as a variable-length batch (each row's
    attended keys gathered to the front, FlashAttention-2's varlen kernel): against fp64 of the
    masked attention, with an all-True row, a row with no key (0, LSE −inf), end padding and
    random holes; through ``attention_with_lse`` where the block is square."""
    _need_gpu()
    b, sq, sk, hq, hkv, d, dtype = case
    g = gen(seed)
    q = rand(g, (b, sq, hq, d), dtype)
    k, v = (rand(g, (b, sk, hkv, d), dtype) for _ in range(2))
    m = _key_masks(g, b, sk)
    if sq == sk:
        out, lse = attention_with_lse(q.cuda(), k.cuda(), v.cuda(), False,
                                      key_padding_mask=m.cuda())
    else:
        out, lse = ring_attn.masked_varlen(q.cuda(), k.cuda(), v.cuda(), m.cuda())
    kind = "flash-varlen"
    where = f"seed {seed}, {case}, kernel {ring_attn.last_kernel()}"
    assert ring_attn.last_kernel() == kind, where
    ref, ref_lse = ref_attention_lse(q, k, v, False, key_valid=m)
    assert tuple(out.shape) == (b, sq, hq, d) and out.dtype == dtype, where
    assert torch.equal(out[1].float().cpu(), torch.zeros(sq, hq, d)), f"{where}: empty row"
    assert bool(torch.isneginf(lse[1]).all()), f"{where}: empty row's LSE"
    live = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), live), where
    assert _excess(out, ref, v, dtype) <= 0, f"{where}: out err over the tolerance"
    assert max_err(lse.cpu()[live], ref_lse[live]) < 1e-3, f"{where}: lse err"


@pytest.mark.parametrize("causal", [False, True])
def test_ulysses_masked_default_matches_fp64(causal, seed):
    """Ulysses' default ``attn_fn`` with a key-padding mask on CUDA (non-causal: the
    variable-length path; causal: cuDNN's kernel with a −inf bias) against fp64, GQA, B = 3 with an
    all-True row and a row with no key (0); an all-True mask against the unmasked call."""
    _need_gpu()
    from attncomm.ulysses import sdpa_attention
    g = gen(seed)
    b, s, hq, hkv, d, dtype = 3, 256, 8, 2, 128, torch.bfloat16
    q, k, v = (rand(g, (b, s, h, d), dtype) for h in (hq, hkv, hkv))
    m = _key_masks(g, b, s)
    out = sdpa_attention(q.cuda(), k.cuda(), v.cuda(), causal, key_padding_mask=m.cuda())
    ref, _ = ref_attention_lse(q, k, v, causal, key_valid=m)
    where = f"seed {seed}, causal={causal}"
    assert out.dtype == dtype and tuple(out.shape) == (b, s, hq, d), where
    assert torch.equal(out[1].float().cpu(), torch.zeros(s, hq, d)), f"{where}: empty row"
    assert _excess(out, ref, v, dtype) <= 0, f"{where}: out err over the tolerance"
    ones = torch.ones(b, s, dtype=torch.bool, device="cuda")
    dense = sdpa_attention(q.cuda(), k.cuda(), v.cuda(), causal)
    full = sdpa_attention(q.cuda(), k.cuda(), v.cuda(), causal, key_padding_mask=ones)
    ref, _ = ref_attention_lse(q, k, v, causal)
    assert _excess(full, ref, v, dtype) <= 0 and _excess(dense, ref, v, dtype) <= 0, \
        f"{where}: all-True mask or dense over the tolerance"
