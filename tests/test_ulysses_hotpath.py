"""The Ulysses hot path on gloo CPU ranks: plans made once per shape and reused, the caller-owned
destination (``output=``), the warm-up error for a shape first seen inside CUDA graph capture
(the capture state mocked), and what drops plans (a setting changed, ``close()``,
``attncomm.release``, ``reset_transports``)."""
from __future__ import annotations

import pytest
import torch

import attncomm
from attncomm import config, ulysses
from attncomm.ulysses import UlyssesAttention, api, head_split, policy
from attncomm.ulysses.layout import head_offsets


def _shard(seed, b, lens, h, d, rank):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn((b, sum(lens), h, d), generator=g)
    o = head_offsets(lens)[rank]
    return full, full[:, o:o + lens[rank]].clone()


def _output(rank, world, seed):
    """``output=``: the result lands in the caller's tensor (poisoned first), which comes back;
    contiguous and strided destinations, B = 1 and B = 2; equal bit for bit to the call without
    it; a wrong destination raises the same ValueError on every rank."""
    res = {}
    for b, lens in ((1, (3,) * world), (2, tuple(range(2, 2 + world)))):
        full, x = _shard(seed + b, b, lens, 5, 4, rank)
        h_r = head_split(5, world)[rank]
        want = ulysses.seq_to_head(x, seq_lens=lens)
        ok = torch.equal(want, full[:, :, head_offsets(head_split(5, world))[rank]:][:, :, :h_r])
        for strided in (False, True):
            shape = (b, sum(lens), h_r, 4)
            dest = (torch.full((b, sum(lens), h_r, 8), float("nan"))[..., ::2] if strided
                    else torch.full(shape, float("nan")))
            got = ulysses.seq_to_head(x, seq_lens=lens, output=dest)
            ok = ok and got is dest and torch.equal(dest, want)
            back = torch.full((b, lens[rank], 10, 4), float("nan"))
            back = back[:, :, ::2] if strided else back[:, :, :5].contiguous()
            got = ulysses.head_to_seq(want, num_heads=5, seq_lens=lens, output=back)
            ok = ok and got is back and torch.equal(back, x)
        res[b] = ok
    bad = torch.empty(1, 3 * world, 2 + (rank == 1), 4)  # rank 1's is wrong
    try:
        ulysses.seq_to_head(torch.randn(1, 3, 2 * world, 4), output=bad)
        res["bad"] = "NO ERROR"
    except ValueError as exc:
        res["bad"] = str(exc)
    return res


@pytest.mark.parametrize("world", [2, 3])
def test_output_is_the_callers_tensor(pools, world, seed):
    results = pools.run(world, _output, seed)
    for res in results:
        assert res[1] and res[2], f"seed {seed}: {res}"
        assert "output must be a [1, " in res["bad"] and "rank 1" in res["bad"], res["bad"]
    assert len({r["bad"] for r in results}) == 1


def _plans(rank, world):
    """A steady-state call builds nothing (the plan of its shape is reused); a new shape, a
    changed setting, close() and attncomm.release() plan anew; an ``ATTNCOMM_*`` variable is
    read when a plan is made, so its change takes effect after release()."""
    made = []
    real_fp, real_cp = api._plan_seq_to_head, UlyssesAttention._make_plan

    def count_fp(*a, **kw):
        made.append("seq_to_head")
        return real_fp(*a, **kw)

    def count_cp(self, *a, **kw):
        made.append("attention")
        return real_cp(self, *a, **kw)

    api._plan_seq_to_head, UlyssesAttention._make_plan = count_fp, count_cp
    try:
        attncomm.release()  # plans earlier tests on these ranks made
        x = torch.randn(1, 2, 2 * world, 4)
        mod = UlyssesAttention(backend="all_to_all", pipeline_groups=2)
        steps = {}
        for name, call in (
                ("first", lambda: (ulysses.seq_to_head(x), mod(x, x, x))),
                ("again", lambda: (ulysses.seq_to_head(x), mod(x, x, x))),
                ("seq_lens list", lambda: ulysses.seq_to_head(x, seq_lens=[2] * world)),
                ("same list", lambda: ulysses.seq_to_head(x, seq_lens=[2] * world)),
                ("new shape", lambda: mod(x[:, :1], x[:, :1], x[:, :1]))):
            made.clear()
            call()
            steps[name] = list(made)
        made.clear()
        mod.pipeline_groups = 0  # a setting a plan was made from
        mod(x, x, x)
        steps["setting"] = list(made) + [mod.last_pipeline_groups]
        made.clear()
        with config.setting(ATTNCOMM_ULYSSES_BACKEND="all_to_all"):
            ulysses.seq_to_head(x)  # read when a plan is made: this one was made before
            steps["env"] = list(made)
            made.clear()
            attncomm.release()
            ulysses.seq_to_head(x)
            steps["env, released"] = list(made)
        made.clear()
        attncomm.release()
        ulysses.seq_to_head(x)
        mod(x, x, x)
        steps["release"] = list(made)
        mod.close()
        try:
            mod(x, x, x)
            steps["closed"] = "NO ERROR"
        except RuntimeError as exc:
            steps["closed"] = str(exc)
        steps["closed plans"] = len(mod._plans)
    finally:
        api._plan_seq_to_head, UlyssesAttention._make_plan = real_fp, real_cp
    return steps


def test_plans_are_made_once_per_shape(pools):
    for steps in pools.run(2, _plans):
        assert steps["first"] == ["seq_to_head", "attention"], steps
        assert steps["again"] == [] and steps["same list"] == [], steps
        assert steps["seq_lens list"] == ["seq_to_head"] and steps["new shape"] == ["attention"]
        assert steps["setting"] == ["attention", 1] and steps["env"] == []
        assert steps["env, released"] == ["seq_to_head"], steps
        assert steps["release"] == ["seq_to_head", "attention"], steps
        assert "UlyssesAttention is closed" in steps["closed"] and steps["closed plans"] == 0


def _capture(rank, world):
    """Inside (mocked) CUDA graph capture: a warmed-up shape runs and gives the eager bits; a
    new shape raises the warm-up error on every rank, with no collective started."""
    attncomm.release()  # no plans from earlier tests on these ranks
    x = torch.randn(1, 4, 2 * world, 4, generator=torch.Generator().manual_seed(rank))
    mod = UlyssesAttention(pipeline_groups=2)
    want = (ulysses.seq_to_head(x), ulysses.head_to_seq(x), mod(x, x, x))
    real = policy.capturing
    policy.capturing = lambda t: True
    msgs = {}
    try:
        got = (ulysses.seq_to_head(x), ulysses.head_to_seq(x), mod(x, x, x))
        same = all(torch.equal(a, b) for a, b in zip(want, got))
        new = x[:, :2]
        for name, fn in (("seq_to_head", lambda: ulysses.seq_to_head(new)),
                         ("head_to_seq", lambda: ulysses.head_to_seq(new)),
                         ("UlyssesAttention", lambda: mod(new, new, new))):
            try:
                fn()
                msgs[name] = "NO ERROR"
            except ValueError as exc:
                msgs[name] = str(exc)
    finally:
        policy.capturing = real
    after = torch.equal(ulysses.seq_to_head(x), want[0])  # the group still works
    return same, msgs, after


def test_shape_first_seen_during_capture_raises_warm_up_error(pools):
    for same, msgs, after in pools.run(2, _capture):
        assert same and after
        for name, msg in msgs.items():
            assert msg.startswith(name) or msg.startswith(f"ulysses.{name}"), msg
            assert "first time inside CUDA graph capture" in msg and "eagerly" in msg, msg


def test_no_fallback_decision_while_tracing():
    """The traced decision of ``auto`` is the eager call's, looked up, never made: a shape no
    eager call has decided raises the warm-up error (``_traced_decision`` is what torch.compile
    runs while tracing)."""
    key = ("no group", "seq_to_head", (1, 2, 3, 4), torch.float32, "cpu", None, "auto", None)
    assert key not in api._DECISIONS
    with pytest.raises(ValueError, match="first time inside CUDA graph capture or torch.compile"):
        api._traced_decision("seq_to_head", _Group(), (1, 2, 3, 4), torch.float32, "cpu",
                             None, "auto", None)


class _Group:
    """A stand-in group coordinator (the lookup needs no process group)."""

    device_group = cpu_group = None


def _no_reference_kept(rank, world, seed):
    """After a forward, no plan holds the caller's cos/sin (or views of them): inductor's CUDA
    graphs copy a graph's inputs into their pool and refuse a graph whose copies outlive it.
    W ranks slice their positions (views); the whole tables at W=1."""
    import gc
    import weakref
    g = torch.Generator().manual_seed(seed + rank)
    s_r, d = 4, 8
    x = torch.randn((1, s_r, 2 * world, d), generator=g)
    norm = (torch.randn(d, generator=g), torch.randn(d, generator=g), 1e-6)
    mod = UlyssesAttention(pipeline_groups=2, qk_norm=norm)
    refs = []
    outs = []
    for _ in range(2):  # the first forward plans, the second reuses the plan
        cos, sin = torch.randn((s_r * world, d), generator=g), torch.randn((s_r * world, d),
                                                                          generator=g)
        outs.append(mod(x, x, x, rope=(cos, sin)))
        refs += [weakref.ref(cos), weakref.ref(sin)]
        del cos, sin
    gc.collect()
    return [r() is None for r in refs], all(torch.isfinite(o).all().item() for o in outs)


@pytest.mark.parametrize("world", [1, 2])
def test_forward_keeps_no_reference_to_the_rope_tables(pools, world, seed):
    for freed, finite in pools.run(world, _no_reference_kept, seed):
        assert all(freed) and finite, f"seed {seed}: {freed}"


def _copies(rank, world, seed):
    """``copy.deepcopy`` and a pickle round trip of a module that has run: the copy plans anew
    (its own group resolution, plans and traced-graph name) and gives the original's bits."""
    import copy
    import pickle
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn((1, 3, 2 * world, 8), generator=g)
    norm = (torch.randn(8, generator=g), torch.randn(8, generator=g), 1e-6)
    mod = UlyssesAttention(pipeline_groups=2, qk_norm=norm)
    want = mod(x, x, x)
    res = {}
    for name, make in (("deepcopy", lambda: copy.deepcopy(mod)),
                       ("pickle", lambda: pickle.loads(pickle.dumps(mod)))):
        twin = make()
        fresh = len(twin._plans) == 0 and twin._op_name is None
        res[name] = fresh and torch.equal(twin(x, x, x), want) and twin._op_name != mod._op_name
    return res


def test_copies_of_a_used_module_plan_anew(pools, seed):
    for res in pools.run(2, _copies, seed):
        assert all(res.values()), f"seed {seed}: {res}"



def _one_rank(rank, world, seed):
    """W = 1 with one head group returns ``attn_fn``'s output itself (no output exchange) when
    it is a contiguous ``[B, S, Hq, Dv]`` tensor of q's dtype, else a contiguous copy in q's
    dtype; bitwise the pipelined forward's result, which goes through the exchange. ``attn_fn``
    results: SDPA's (contiguous), a non-contiguous view, fp64 (rounded to fp32 as the
    exchange's copy rounds it)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn((2, 5, 4, 8), generator=g), torch.randn((2, 5, 2, 8), generator=g)
    v = torch.randn((2, 5, 2, 8), generator=g)
    made = []

    def plain(q, k, v, causal):
        made.append(ulysses.sdpa_attention(q, k, v, causal).contiguous())
        return made[-1]

    def strided(q, k, v, causal):  # heads-major storage seen as [B, S, h, Dv]
        made.append(plain(q, k, v, causal).transpose(1, 2).contiguous().transpose(1, 2))
        return made[-1]

    def wide(q, k, v, causal):
        made.append(plain(q.double(), k.double(), v.double(), causal))
        return made[-1]

    res = {}
    for name, fn in (("plain", plain), ("strided", strided), ("fp64", wide)):
        got = UlyssesAttention(fn, pipeline_groups=0)(q, k, v, causal=True)
        own = got.data_ptr() == made[-1].data_ptr()
        want = UlyssesAttention(fn, pipeline_groups=2)(q, k, v, causal=True)
        res[name] = (torch.equal(got, want), got.is_contiguous(), got.dtype == q.dtype,
                     tuple(got.shape) == (2, 5, 4, 8), own == (name == "plain"))
    return res


def test_one_rank_returns_attention_output(pools, seed):
    res = pools.run(1, _one_rank, seed)[0]
    for name, checks in res.items():
        assert all(checks), f"seed {seed}: {name} (equal, contiguous, dtype, shape, own): {checks}"


def _direct(rank, world, seed):
    """One rank: the fused fill's storage is the received buffer (the transport's
    ``keeps_send_buffer``), so no send buffer is taken and no input exchange started, unless a
    landing buffer takes the rows (joint rows of the parts' dtype); rows with nothing to do on
    the way are not packed at all. Per case: (send buffers
    taken with it, without it, the outputs bitwise equal)."""
    from attncomm.ulysses.all_to_all import AllToAllTransport
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn((1, 6, h, 8), generator=g) for h in (4, 2, 2))
    norm = (torch.randn(8, generator=g), torch.randn(8, generator=g), 1e-6)
    rope = (torch.randn((6, 8), generator=g), torch.randn((6, 8), generator=g))
    joint = tuple(torch.randn((1, 3, h, 8), generator=g) for h in (4, 2, 2))
    fp8 = torch.float8_e4m3fn
    cases = {"plain": ({}, {}), "norm rope g2": (dict(qk_norm=norm, pipeline_groups=2),
                                                 dict(rope=rope)),
             "fp8": (dict(payload_dtype=fp8), {}), "joint": ({}, dict(joint=joint)),
             "joint fp8 g2": (dict(payload_dtype=fp8, pipeline_groups=2), dict(joint=joint))}
    taken = []
    real_buffer, real_keeps = AllToAllTransport.send_buffer, AllToAllTransport.keeps_send_buffer

    def send_buffer(self, *a, **kw):
        taken.append(1)
        return real_buffer(self, *a, **kw)

    res = {}
    AllToAllTransport.send_buffer = send_buffer
    try:
        for name, (ctor, call) in cases.items():
            outs, counts = [], []
            for keeps in (real_keeps, lambda self, plan: False):
                AllToAllTransport.keeps_send_buffer = keeps
                mod = UlyssesAttention(**{"pipeline_groups": 0, **ctor})
                mod(q, k, v, **call)  # plan made
                taken.clear()
                got = mod(q, k, v, **call)
                outs.append(got if isinstance(got, tuple) else (got,))
                counts.append(len(taken))
            same = all(torch.equal(a, b) for a, b in zip(*outs))
            res[name] = (counts[0], counts[1], same)
    finally:
        AllToAllTransport.send_buffer, AllToAllTransport.keeps_send_buffer = (real_buffer,
                                                                              real_keeps)
    return res


def test_one_rank_fills_the_received_buffer(pools, seed):
    res = pools.run(1, _direct, seed)[0]
    for name, (direct, started, same) in res.items():
        want = 0 if name != "joint" else started
        packs = name != "plain"  # plain rows are not packed at W = 1: attention reads q, k, v
        assert direct == want and (started > 0) == packs and same, \
            f"seed {seed}: {name}: send buffers {direct} (want {want}), {started} without; " \
            f"equal {same}"
