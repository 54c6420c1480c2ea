"""UlyssesAttention for diffusion transformers (issue 22) on gloo CPU ranks: joint rows against an
fp64 attention over the concatenation (front and back, GQA, uneven heads and sequences, G ∈ {0,
2, 4}), pipelined bitwise equal to sequential with joint rows (fused norm + RoPE, the FP8
payload), the FP8 payload of ``seq_to_head`` and of the module (exactly the dequantized rows'
attention, within the payload's bound, different from the plain exchange), the measured
pipeline decision wired into the module (fake timer), plans made once per joint shape, and bad
input raised on every rank alike."""
from __future__ import annotations

import random

import pytest
import torch

import attncomm
from attncomm import ulysses
from attncomm.testing.reference import ref_attention
from attncomm.ulysses import UlyssesAttention, fp8, head_split
from attncomm.ulysses import attention as attn_mod
from attncomm.ulysses import forward_plan, pipeline_choice
from attncomm.ulysses.fill import rms_norm_rope
from attncomm.ulysses.layout import head_gather_plan, head_offsets

FP8 = torch.float8_e4m3fn


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data(seed, b, lens, s_j, hq, hkv, d, dv, dtype=torch.float32):
    """Full q, k, v ``[B, S, H, D]`` and joint rows ``[B, S_j, H, D]`` (the same on every rank:
    one seed), in ``dtype``."""
    g = _gen(seed)
    s = sum(lens)
    full = [torch.randn((b, s, h, dd), generator=g).to(dtype)
            for h, dd in ((hq, d), (hkv, d), (hkv, dv))]
    joint = tuple(torch.randn((b, s_j, h, dd), generator=g).to(dtype)
                  for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
    return full, joint


def _shard(full, lens, rank):
    o = head_offsets(lens)[rank]
    return [t[:, o:o + lens[rank]] for t in full]


def _cat(joint, seq, front):
    return torch.cat((joint, seq), 1) if front else torch.cat((seq, joint), 1)


def _ref(full, joint, front, s_j, causal=False):
    """fp64 attention over the concatenation → (sequence rows, joint rows)."""
    ref = ref_attention(*(_cat(j.double(), x.double(), front) for j, x in zip(joint, full)),
                        causal)
    s = full[0].shape[1]
    return (ref[:, s_j:], ref[:, :s_j]) if front else (ref[:, :s], ref[:, s:])


def _maxerr(a, b) -> float:
    return float((a.double() - b).abs().max()) if a.numel() else 0.0


def _lens(rng, world):
    lens = [rng.randint(0, 6) for _ in range(world)]
    lens[rng.randrange(world)] += 3
    return lens


# (Hq, Hkv, D, Dv): uneven heads at W = 3 (7 → 3, 2, 2), GQA with Hkv < W, Dv ≠ D (q/k and v in
# two exchanges), MQA
_CASES = [(7, 7, 8, 8), (6, 2, 8, 4), (4, 1, 4, 8)]


def _joint_vs_fp64(rank, world, seed):
    """Every case, front and back, G ∈ {0, 2, 4}: out and joint_out against fp64 over the
    concatenation; every G bitwise equal to G = 0; joint_out the same bits on every rank (the
    caller compares across ranks)."""
    rng = random.Random(seed)
    errs, bad, joint_bits = [], [], []
    for i, (hq, hkv, d, dv) in enumerate(_CASES):
        lens, s_j, b = _lens(rng, world), rng.randint(1, 4), rng.choice((1, 2))
        full, joint = _data(seed + i, b, lens, s_j, hq, hkv, d, dv)
        local = _shard(full, lens, rank)
        for front in (True, False):
            ref_seq, ref_joint = _ref(full, joint, front, s_j)
            want = _shard([ref_seq], lens, rank)[0]
            base = None
            for groups in (0, 2, 4):
                mod = UlyssesAttention(pipeline_groups=groups, fill_impl="torch")
                out, jout = mod(*local, seq_lens=lens, joint=joint,
                                joint_position="front" if front else "back")
                errs.append(max(_maxerr(out, want), _maxerr(jout, ref_joint)))
                if mod.last_pipeline_groups != max(1, groups) or \
                        set(mod.last_backends) != {"in", "out", "joint"}:
                    bad.append((i, front, groups, mod.last_pipeline_groups, mod.last_backends))
                if base is None:
                    base = (out, jout)
                    joint_bits.append(jout)
                elif not (torch.equal(out, base[0]) and torch.equal(jout, base[1])):
                    bad.append((i, front, groups, "differs from G = 0"))
    return max(errs), bad, joint_bits


@pytest.mark.parametrize("world", [2, 3])
def test_joint_attention_against_fp64(pools, world, seed):
    res = pools.run(world, _joint_vs_fp64, seed)
    for err, bad, _ in res:
        assert not bad, f"seed {seed}: {bad}"
        assert err < 2e-5, f"seed {seed}: max error {err:.3e} against fp64"
    for r in res[1:]:  # joint_out: every head on every rank, the same bits
        assert all(torch.equal(a, b) for a, b in zip(r[2], res[0][2])), f"seed {seed}"


def _joint_pipelined_bitwise(rank, world, seed):
    """Joint rows with fused norm + RoPE, with the norm as its own pass, and with the FP8
    payload: G = 2, 4 bitwise equal to sequential, two calls each (the plan reused)."""
    hq, hkv, d = 8, 2, 8
    lens = [3, 0, 5, 2][:world]
    full, joint = _data(seed, 1, lens, 3, hq, hkv, d, d)
    local = _shard(full, lens, rank)
    gw = _gen(seed + 1)
    norm = (torch.randn(d, generator=gw), torch.randn(d, generator=gw), 1e-5)
    rope = (torch.randn((sum(lens), d), generator=gw), torch.randn((sum(lens), d), generator=gw))
    bad = []
    for fused in (True, False):
        for payload in (None, FP8):
            ref = None
            for groups in (0, 2, 4):
                # torch fill: the kernel's bits equal it (test_ulysses_fill), and the
                # interpreter would cost most of this test's time
                mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm,
                                       fuse_qk_norm_rope=fused, payload_dtype=payload,
                                       fill_impl="torch")
                for call in range(2):
                    got = mod(*local, seq_lens=lens, rope=rope, joint=joint,
                              joint_position="back")
                    ref = ref or got
                    if not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])):
                        bad.append((fused, payload, groups, call))
    return bad


@pytest.mark.parametrize("world", [2, 3])
def test_joint_pipelined_bitwise_equals_sequential(pools, world, seed):
    for bad in pools.run(world, _joint_pipelined_bitwise, seed):
        assert not bad, f"seed {seed}: (fused, payload, groups, call) differing: {bad}"


def test_head_gather_plan():
    plan = head_gather_plan(2, 3, 4, (2, 1, 0))
    assert plan.recv_numel == (2 * 3 * 3 * 4,) * 3 and not plan.tiled
    assert [len(plan.pieces[s][p]) for s in range(3) for p in range(3)] == [2] * 6 + [0] * 3
    x = plan.pieces[1][2][1]  # source 1's batch 1: after source 0's two heads, pitch 3 heads
    assert (x.rows, x.cols, x.dst_offset, x.dst_pitch) == (3, 4, (1 * 3 * 3 + 2) * 4, 12)
    assert head_gather_plan(1, 1, 4, (2, 2)).tiled  # one row: a plain concatenation


# ------------------------------------------------------------------------------ FP8 payload
def _fp8_seq_to_head(rank, world, seed):
    """seq_to_head with the FP8 payload: bitwise the dequantized rows of the full tensor (the
    exchange moves bytes), within the payload's bound of x, different from the plain exchange;
    ``output=`` (strided) gets the same bits."""
    res = []
    for i, dtype in enumerate((torch.bfloat16, torch.float32)):
        lens = [4, 1, 3][:world]
        g = _gen(seed + i)
        full = (torch.randn((2, sum(lens), 5, 8), generator=g)
                * torch.logspace(-3, 3, 5)[:, None]).to(dtype)
        x = _shard([full], lens, rank)[0]
        y = ulysses.seq_to_head(x, seq_lens=lens, payload_dtype=FP8)
        lo = head_offsets(head_split(5, world))[rank]
        hi = lo + head_split(5, world)[rank]
        q, scale = fp8.quantize_rows(full)
        deq = fp8.dequantize_rows(q, scale, dtype)
        bound = fp8.roundtrip_bound(full, scale, deq)[:, :, lo:hi]
        within = bool(((y.double() - full[:, :, lo:hi].double()).abs() <= bound).all())
        plain = ulysses.seq_to_head(x, seq_lens=lens)
        dest = torch.full((2, sum(lens), 5, 8), float("nan"), dtype=dtype)[:, :, :hi - lo]
        got = ulysses.seq_to_head(x, seq_lens=lens, payload_dtype=FP8, output=dest)
        res.append((torch.equal(y, deq[:, :, lo:hi]), within, not torch.equal(y, plain),
                    got is dest and torch.equal(dest, y)))
    return res


def test_fp8_seq_to_head(pools, seed):
    for res in pools.run(3, _fp8_seq_to_head, seed):
        for exact, within, differs, output in res:
            assert exact and within and differs and output, f"seed {seed}: {res}"


def _fp8_module(rank, world, seed):
    """The module with the FP8 payload (GQA, fused norm + RoPE, joint rows): its output is the
    attention over the dequantized q, k, v (the rows the fill quantizes: normed, rotated and
    rounded to the input dtype), with the joint rows as passed, to fp32 rounding; the plain
    payload differs. Returns the errors against that reference and against the unquantized
    fp64 attention."""
    hq, hkv, d = 6, 2, 16
    lens = [5, 2, 6][:world]
    s_j = 3
    full, joint = _data(seed, 1, lens, s_j, hq, hkv, d, d)
    local = _shard(full, lens, rank)
    gw = _gen(seed + 7)
    norm = (torch.randn(d, generator=gw), torch.randn(d, generator=gw), 1e-6)
    rope = (torch.randn((sum(lens), d), generator=gw), torch.randn((sum(lens), d), generator=gw))
    mod = UlyssesAttention(qk_norm=norm, payload_dtype=FP8, pipeline_groups=0)
    out, jout = mod(*local, seq_lens=lens, rope=rope, joint=joint)
    plain, pjout = UlyssesAttention(qk_norm=norm, pipeline_groups=0)(*local, seq_lens=lens,
                                                                     rope=rope, joint=joint)
    nq = rms_norm_rope(full[0], norm[0], norm[2], *rope)
    nk = rms_norm_rope(full[1], norm[1], norm[2], *rope)
    deq = [fp8.dequantize_rows(*fp8.quantize_rows(t), t.dtype) for t in (nq, nk, full[2])]
    ref_q, ref_qj = _ref(deq, joint, True, s_j)
    exact = max(float((out.double() - _shard([ref_q], lens, rank)[0]).abs().max()),
                float((jout.double() - ref_qj).abs().max()))
    ref, _ = _ref((nq, nk, full[2]), joint, True, s_j)
    against_fp64 = float((out.double() - _shard([ref], lens, rank)[0]).abs().max())
    return exact, against_fp64, not torch.equal(out, plain), not torch.equal(jout, pjout)


def test_fp8_module_is_attention_over_the_dequantized_rows(pools, seed):
    for exact, against_fp64, differs, jdiffers in pools.run(3, _fp8_module, seed):
        assert exact < 2e-5, f"seed {seed}: {exact:.3e} from attention over dequantized rows"
        # the rows move by ≤ 3.6 % of their amax (fp8.py's bound); attention outputs move
        # by far less than the values' spread (|v| ≲ 4): a loose sanity bound
        assert against_fp64 < 0.5 and differs and jdiffers, f"seed {seed}: {against_fp64}"


# ------------------------------------------------------------------------------ measured choice
def _measured(rank, world, faster):
    """pipeline_groups=-1 with measurement forced on CPU (``_measurement``) and a fake timer
    that reports ``faster`` ("pipelined" or "sequential") as 5 µs and the other as 10 µs: the
    module runs the decision's groups, reports it, measures once per shape (a second module of
    the same settings reuses it), and gives the sequential module's bits."""
    attncomm.release()  # no plans or decisions from earlier tests on these ranks
    ran, timed = [], []
    real_run, real_meas, real_sms = (forward_plan.ForwardPlan.run, pipeline_choice._measurement,
                                     pipeline_choice._sm_count)

    def run(self, *a, **kw):
        ran.append(self.n_groups)
        return real_run(self, *a, **kw)

    def timer(fn):
        fn()
        pipelined = ran[-1] > 1
        timed.append(pipelined)
        return 5.0 if pipelined == (faster == "pipelined") else 10.0

    forward_plan.ForwardPlan.run = run
    pipeline_choice._measurement = lambda device: (True, timer)
    pipeline_choice._sm_count = lambda device: 1  # auto_groups: 2 groups of 2 heads at this size
    try:
        full, joint = _data(11, 1, [6] * world, 2, 4 * world, world, 8, 8)
        local = _shard(full, [6] * world, rank)
        mod = UlyssesAttention()
        out = mod(*local, joint=joint)
        first = (len(timed), mod.last_pipeline_groups, mod.pipeline_decision)
        again = mod(*local, joint=joint)
        other = UlyssesAttention()
        other(*local, joint=joint)
        counts = (len(timed), other.pipeline_decision == mod.pipeline_decision)
    finally:
        forward_plan.ForwardPlan.run = real_run
        pipeline_choice._measurement, pipeline_choice._sm_count = real_meas, real_sms
    seq = UlyssesAttention(pipeline_groups=0)(*local, joint=joint)
    cpu = UlyssesAttention()
    cpu(*local[:1] * 3)  # a new shape, measurement not forced: CPU decides without running
    same = all(torch.equal(a, b) for a, b in zip(out, seq)) and \
        all(torch.equal(a, b) for a, b in zip(again, seq))
    return first, counts, same, cpu.pipeline_decision


@pytest.mark.parametrize("faster", ["pipelined", "sequential"])
def test_measured_decision_in_the_module(pools, faster):
    res = pools.run(2, _measured, faster)
    assert res[0][0][2] == res[1][0][2], "ranks decided differently"
    for (n_timed, groups, dec), (n_after, shared), same, cpu in res:
        assert n_timed == 2 and n_after == 2, "not measured exactly once per shape"
        assert shared and same
        assert dec.candidate_groups == 2 and (dec.sequential_us, dec.pipelined_us) == (
            (10.0, 5.0) if faster == "pipelined" else (5.0, 10.0))
        if faster == "pipelined":
            assert groups == 2 and dec.groups == 2 and dec.fallback_reason is None
        else:
            assert groups == 1 and dec.groups == 1 and "measured slower" in dec.fallback_reason
        assert cpu.groups == 1 and cpu.fallback_reason == "CPU: not measured"
        assert cpu.sequential_us is None and cpu.candidate_groups == 1


def test_auto_pipeline_flag_is_gone():
    assert not hasattr(attn_mod, "AUTO_PIPELINE")
    with pytest.raises(ValueError, match="payload_dtype must be None or torch.float8_e4m3fn"):
        UlyssesAttention(payload_dtype=torch.float16)


# ------------------------------------------------------------------------------ plans, bad input
def _plans_once(rank, world):
    """A joint call plans once per shape: new joint contents of the same shape reuse the plan;
    another S_j or position plans anew."""
    made = []
    real = UlyssesAttention._make_plan

    def count(self, *a, **kw):
        made.append(1)
        return real(self, *a, **kw)

    UlyssesAttention._make_plan = count
    try:
        full, joint = _data(3, 1, [2] * world, 2, 2 * world, world, 4, 4)
        local = _shard(full, [2] * world, rank)
        mod = UlyssesAttention()
        steps = []
        for j, pos in ((joint, "front"), (tuple(t * 2 for t in joint), "front"),
                       (joint, "back"), (tuple(t[:, :1] for t in joint), "back")):
            made.clear()
            mod(*local, joint=j, joint_position=pos)
            steps.append(len(made))
    finally:
        UlyssesAttention._make_plan = real
    return steps


def test_joint_plans_once_per_shape(pools):
    for steps in pools.run(2, _plans_once):
        assert steps == [1, 0, 1, 1], steps


def _bad(rank, world):
    """Each bad call raises ValueError on every rank; the group works afterwards."""
    full, joint = _data(5, 1, [3] * world, 2, 2 * world, world, 4, 4)
    q, k, v = _shard(full, [3] * world, rank)
    other = tuple(t.clone() for t in joint)
    other[1][0, 1, 0, 2] += 1 if rank == 1 else 0  # rank 1's k_j differs in one element
    short = tuple(t[:, :1] for t in joint) if rank == 1 else joint  # a valid S_j of its own
    narrow = (joint[0][:, :, :1], *joint[1:]) if rank == 1 else joint  # Hq heads wrong
    calls = {
        "causal": lambda m: m(q, k, v, causal=True, joint=joint),
        "shape": lambda m: m(q, k, v, joint=narrow),
        "S_j": lambda m: m(q, k, v, joint=short),
        "not a triple": lambda m: m(q, k, v, joint=joint[:2]),
        "dtype": lambda m: m(q, k, v, joint=(joint[0].double(), *joint[1:])),
        "differs": lambda m: m(q, k, v, joint=other),
        "position": lambda m: m(q, k, v, joint=joint, joint_position="middle"),
        "fp8 float64": lambda m: UlyssesAttention(payload_dtype=FP8)(q.double(), k.double(),
                                                                     v.double()),
    }
    msgs = {}
    for name, call in calls.items():
        try:
            call(UlyssesAttention())
            msgs[name] = "NO ERROR"
        except ValueError as exc:
            msgs[name] = str(exc)
    # validate=True: the checksum of every call's joint rows
    mod = UlyssesAttention(validate=True)
    mod(q, k, v, joint=joint)
    try:
        mod(q, k, v, joint=other)
        msgs["every call"] = "NO ERROR"
    except ValueError as exc:
        msgs["every call"] = str(exc)
    try:
        ulysses.seq_to_head(q.double(), payload_dtype=FP8)
        msgs["seq_to_head fp8"] = "NO ERROR"
    except ValueError as exc:
        msgs["seq_to_head fp8"] = str(exc)
    out, jout = UlyssesAttention()(q, k, v, joint=joint)
    return msgs, tuple(jout.shape)


def test_bad_joint_input_raises_on_every_rank(pools):
    res = pools.run(2, _bad)
    assert res[0][0] == res[1][0], "ranks raised different errors"
    msgs, shape = res[0]
    want = {"causal": "causal=True with joint rows", "shape": "rank 1: joint shapes must be",
            "not a triple": "joint must be (q_j, k_j, v_j)", "dtype": "q_j is torch.float64",
            "differs": "joint rows (CRC-32 of their bytes)",
            "S_j": "S_j (joint rows, -1: none) = 2 (rank 0), 1 (rank 1)",
            "position": "joint_position must be 'front' or 'back'",
            "fp8 float64": "needs fp16/bf16/fp32 inputs",
            "every call": "joint rows (CRC-32 of their bytes)",
            "seq_to_head fp8": "needs fp16/bf16/fp32 inputs"}
    for name, text in want.items():
        assert text in msgs[name], (name, msgs[name])
    assert "disagree" in msgs["differs"] and "(rank 1)" in msgs["differs"]
    assert shape == (1, 2, 4, 4)


def _compiled(rank, world, seed):
    torch._dynamo.reset()
    full, joint = _data(seed, 1, [4] * world, 3, 2 * world, world, 8, 8)
    local = _shard(full, [4] * world, rank)
    mod = UlyssesAttention(pipeline_groups=2, payload_dtype=FP8)
    want = mod(*local, joint=joint, joint_position="back")  # the eager warm-up
    fn = torch.compile(mod, fullgraph=True, backend="aot_eager")
    got = fn(*local, joint=joint, joint_position="back")
    breaks = torch._dynamo.explain(mod)(*local, joint=joint,
                                        joint_position="back").graph_break_count
    same = all(torch.equal(a, b) for a, b in zip(got, want))
    # seq_to_head with the FP8 payload: one custom op carrying it
    x = local[0].contiguous()
    eager = ulysses.seq_to_head(x, payload_dtype=FP8)
    torch._dynamo.reset()
    traced = torch.compile(lambda t: ulysses.seq_to_head(t, payload_dtype=FP8), fullgraph=True,
                           backend="aot_eager")(x)
    return same and torch.equal(traced, eager), breaks


@pytest.mark.slow
def test_joint_and_fp8_compile_without_graph_breaks(pools, seed):
    for same, breaks in pools.run(2, _compiled, seed):
        assert same and breaks == 0, f"seed {seed}: {same}, {breaks}"


def test_rehearsal_script_parses_dit_options(capsys):
    """scripts/ulysses_one_gpu.py --joint and --payload: imported and parsed on CPU (the
    rehearsal itself needs a GPU: tests/gpu/test_ulysses_dit_gpu.py)."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "scripts", "ulysses_one_gpu.py")
    spec = importlib.util.spec_from_file_location("ulysses_one_gpu", path)
    reh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reh)
    if not torch.cuda.is_available():
        assert reh.main(["--joint", "16", "--payload", "none", "fp8", "--seq", "64"]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    for bad in (["--joint", "-1"], ["--payload", "int8"]):
        with pytest.raises(SystemExit):
            reh.main(bad)
