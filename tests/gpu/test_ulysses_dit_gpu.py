"""Ulysses for DiT on GPUs (issue 22): on one GPU, joint rows with the FP8 payload through the
Triton fill (pipelined bitwise equal to sequential, against attention over the dequantized rows),
``pipeline_groups=-1`` measured on CUDA, a CUDA-graph replay of a joint forward, the rehearsal
with joint rows and FP8; on two CUDA ranks (``cuda_pools``: a GPU each, or two processes sharing
one GPU), ``ce`` bitwise equal to ``all_to_all`` with joint rows and the FP8 payload."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from attncomm.testing.reference import ref_attention
from attncomm.ulysses import UlyssesAttention, fp8
from attncomm.ulysses.fill import rms_norm_rope
from _gpu_ranks import dev

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP8 = torch.float8_e4m3fn


def _inputs(seed, s=1024, s_j=77, hq=24, hkv=8, d=128, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn((1, s, h, d), generator=g).to(torch.bfloat16).to(device)
               for h in (hq, hkv, hkv))
    joint = tuple(torch.randn((1, s_j, h, d), generator=g).to(torch.bfloat16).to(device)
                  for h in (hq, hkv, hkv))
    norm = (torch.randn(d, generator=g).to(device), torch.randn(d, generator=g).to(device), 1e-6)
    rope = (torch.randn((s, d), generator=g).to(device), torch.randn((s, d), generator=g)
            .to(device))
    return (q, k, v), joint, norm, rope


def test_joint_fp8_one_gpu(one_rank_group, seed):
    (q, k, v), joint, norm, rope = _inputs(seed)
    ref = None
    for groups in (0, 2, 4):
        mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm, payload_dtype=FP8)
        for call in range(2):
            out = mod(q, k, v, rope=rope, joint=joint, joint_position="back")
            ref = ref or tuple(t.clone() for t in out)
            assert all(torch.equal(a, b) for a, b in zip(out, ref)), (seed, groups, call)
    # attention over the dequantized rows (the fill's: normed, rotated, rounded to bf16)
    nq, nk = (rms_norm_rope(x, w, 1e-6, *rope) for x, w in ((q, norm[0]), (k, norm[1])))
    deq = [fp8.dequantize_rows(*fp8.quantize_rows(t), t.dtype) for t in (nq, nk, v)]
    want = ref_attention(*(torch.cat((x, j), 1).cpu() for x, j in zip(deq, joint)), False)
    got = torch.cat(ref, 1).cpu().double()
    assert (got - want).abs().max().item() < 3e-2, seed  # bf16 attention


def test_measured_decision_on_cuda(one_rank_group):
    (q, k, v), joint, _, _ = _inputs(1, s=4096, hq=28, hkv=4)
    mod = UlyssesAttention()
    out = mod(q, k, v, joint=joint)
    dec = mod.pipeline_decision
    assert dec is not None and dec.fallback_reason != "CPU: not measured"
    if dec.candidate_groups >= 2:
        assert dec.sequential_us is not None and dec.pipelined_us is not None
        assert dec.sequential_us > 0 and dec.pipelined_us > 0
    seq = UlyssesAttention(pipeline_groups=0)(q, k, v, joint=joint)
    assert all(torch.equal(a, b) for a, b in zip(out, seq))
    assert mod.last_pipeline_groups == dec.groups


def test_joint_forward_in_a_cuda_graph(one_rank_group):
    (q, k, v), joint, norm, rope = _inputs(2)
    mod = UlyssesAttention(pipeline_groups=2, qk_norm=norm, payload_dtype=FP8)
    eager = mod(q, k, v, rope=rope, joint=joint)  # the warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mod(q, k, v, rope=rope, joint=joint)
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))


def test_rehearsal_joint_fp8_bitwise():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    spec = importlib.util.spec_from_file_location(
        "ulysses_one_gpu", os.path.join(ROOT, "scripts", "ulysses_one_gpu.py"))
    reh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reh)
    for payload in ("none", "fp8"):
        sim = reh.Rehearsal(2, 2048, 8, norm=True, scale=0.1, seed=3, joint=64, payload=payload)
        seq = [o.clone() for o in sim.layer(1)] + [sim.joint_out.clone()]
        for groups in (2, 4):
            got = sim.layer(groups) + [sim.joint_out]
            assert all(torch.equal(a, b) for a, b in zip(seq, got)), (payload, groups)


def _ce_vs_a2a(rank, world, seed):
    lens = (700, 324)
    (q, k, v), joint, norm, rope = _inputs(seed, s=sum(lens), hq=12, hkv=4, d=64,
                                          device=dev())
    off = (0, lens[0])[rank]
    local = [t[:, off:off + lens[rank]] for t in (q, k, v)]
    outs, bad = {}, []
    for backend in ("ce", "all_to_all"):
        for payload in (None, FP8):
            for groups in (0, 2):
                mod = UlyssesAttention(backend=backend, pipeline_groups=groups, qk_norm=norm,
                                       payload_dtype=payload)
                outs[(backend, payload, groups)] = mod(*local, seq_lens=lens, rope=rope,
                                                       joint=joint)
                if backend == "ce" and set(mod.last_backends.values()) != {"ce"}:
                    bad.append((payload, groups, mod.last_backends))
    for (backend, payload, groups), o in outs.items():
        ref = outs[("all_to_all", payload, 0)]
        if not all(torch.equal(a, b) for a, b in zip(o, ref)):
            bad.append((backend, payload, groups))
    torch.cuda.synchronize()
    return bad


@pytest.mark.gpus(1)
def test_ce_joint_fp8_bitwise_equals_all_to_all(cuda_pools, seed):
    for bad in cuda_pools.run(2, _ce_vs_a2a, seed, timeout_s=240):
        assert not bad, f"seed {seed}: {bad}"
