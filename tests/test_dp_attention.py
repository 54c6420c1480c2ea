"""DP attention: the sync (every path that runs on CPU), idle batches, padding modes, gather /
scatter / reduce_scatter, graph sizes and the rank layout. Gloo CPU ranks, W ∈ {1, 2, 3, 4}."""
from __future__ import annotations

import random

import pytest
import torch

from attncomm.dp_attention import (BatchView, DpPaddingMode, ForwardMode, MLPSyncBatchInfo,
                                   choose_padding_mode, compute_dp_attention_world_info,
                                   count_tokens, dp_gather, dp_reduce_scatter, dp_scatter,
                                   prepare_mlp_sync_batch, select_cuda_graph_bs)

IDLE = int(ForwardMode.IDLE)


# -- an independent reference of the rules (API.md, "DP attention") -------------------------

def _ref_row(b, disable_graph):
    """[n, n_logprob, can_graph, is_extend, can_tbo, mode] of one rank's batch."""
    if b is None:
        return [0, 0, int(not disable_graph), 0, 1, IDLE]
    mode = int(b.forward_mode)
    if mode == 2:                                  # DECODE
        n = lp = b.batch_size
    elif mode in (1, 3):                           # EXTEND, MIXED
        n = b.extend_num_tokens
        lp = (sum(max(e - s, 1) for e, s in zip(b.extend_lens, b.extend_logprob_start_lens))
              if b.return_logprob else b.batch_size)
    else:                                          # IDLE, PREBUILT
        n = lp = 0
    graph = int(mode in (2, 4, 5) and not disable_graph)
    tbo = 1 if n == 0 else int(b.batch_size >= 2)
    return [n, lp, graph, int(mode in (1, 3)), tbo, mode]


def _rand_batch(rng, kind):
    if kind == "none":
        return None
    if kind == "idle":
        return BatchView(ForwardMode.IDLE)              # no extend fields at all
    if kind == "prebuilt":
        return BatchView(ForwardMode.PREBUILT, batch_size=rng.randint(1, 4))
    if kind == "decode":
        return BatchView(ForwardMode.DECODE, batch_size=rng.randint(1, 6))
    bs = rng.randint(1, 4)
    lens = [rng.randint(1, 20) for _ in range(bs)]
    if kind == "mixed":
        lens += [1] * rng.randint(1, 3)
        bs = len(lens)
    lp = rng.random() < 0.6
    starts = [rng.randint(0, e + 2) for e in lens] if lp or rng.random() < 0.5 else None
    return BatchView(ForwardMode.MIXED if kind == "mixed" else ForwardMode.EXTEND, batch_size=bs,
                     extend_num_tokens=sum(lens), extend_lens=lens,
                     extend_logprob_start_lens=starts, return_logprob=lp)


_KINDS = ["none", "idle", "prebuilt", "decode", "extend", "mixed"]


def _layouts(world):
    out = [(world, 1, 1)]
    for tp in (2, 3, 4):
        if world % tp == 0 and world > 1:
            out.append((world // tp, tp, 1))
    if world % 4 == 0:
        out.append((world // 4, 2, 2))
    return out


def _scenario(rng, world, case):
    """Every rank's batch (same on every rank), plus the knobs of one case."""
    style = case % 5
    if style == 0:
        kinds = [rng.choice(_KINDS) for _ in range(world)]
    elif style == 1:                                   # every rank idle
        kinds = [rng.choice(["none", "idle", "prebuilt"]) for _ in range(world)]
    elif style == 2:                                   # one extends, the rest decode
        kinds = ["decode"] * world
        kinds[rng.randrange(world)] = "extend"
    elif style == 3:                                   # decode and idle only
        kinds = [rng.choice(["decode", "none", "idle"]) for _ in range(world)]
    else:
        kinds = [rng.choice(["decode", "prebuilt", "none"]) for _ in range(world)]
    batches = [_rand_batch(rng, k) for k in kinds]
    active = None
    if rng.random() < 0.3:
        active = [rng.random() < 0.7 for _ in range(world)]
    return batches, dict(active=active, enable_tbo=rng.random() < 0.7,
                         disable_graph=rng.random() < 0.2,
                         require_gather=rng.random() < 0.8)


def _expected(batches, dp, per_dp, knobs):
    rows = [_ref_row(b, knobs["disable_graph"]) for b in batches]
    if knobs["active"] is not None:
        rows = [r if a else [0, 0, 1, 0, 1, IDLE] for r, a in zip(rows, knobs["active"])]
    tp0 = [rows[d * per_dp] for d in range(dp)]
    busy = [r[5] for r in tp0 if r[5] != IDLE]
    agree = len(set(busy)) <= 1                    # API.md: vacuously true when all are idle
    return dict(tokens=[r[0] for r in tp0], logprob=[r[1] for r in tp0],
                graph=all(r[2] for r in tp0), extend=any(r[3] for r in tp0),
                tbo=knobs["enable_tbo"] and all(r[4] for r in tp0) and agree, tp0=tp0)


def _sync_cases(rank, world, sync, seed, n_cases):
    rng = random.Random(seed)
    checked = []
    for case in range(n_cases):
        for dp, tp, cp in _layouts(world):
            batches, knobs = _scenario(rng, world, case)
            exp = _expected(batches, dp, tp * cp, knobs)
            mine = batches[rank]
            idle = BatchView(ForwardMode.IDLE)
            got, info = prepare_mlp_sync_batch(
                mine, dp_size=dp, attn_tp_size=tp, attn_cp_size=cp, group=None,
                get_idle_batch=lambda: idle, disable_cuda_graph=knobs["disable_graph"],
                enable_tbo=knobs["enable_tbo"], require_mlp_tp_gather=knobs["require_gather"],
                sync=sync, active_ranks=knobs["active"])
            where = f"case {case} layout {(dp, tp, cp)} rank {rank} kinds {batches} {knobs}"
            my_row = _ref_row(mine, knobs["disable_graph"])
            if max(exp["tokens"]) == 0:
                assert got is None, where
            elif mine is None:
                assert got is idle, where
            else:
                assert got is mine, where
                if int(mine.forward_mode) == ForwardMode.PREBUILT:
                    assert mine.inner_idle_batch is idle, where
            want_tok, want_lp = exp["tokens"], exp["logprob"]
            if not knobs["require_gather"]:
                want_tok, want_lp = [my_row[0]], [my_row[1]]
            assert info.global_num_tokens == want_tok, where
            assert info.global_num_tokens_for_logprob == want_lp, where
            assert info.can_cuda_graph == exp["graph"], where
            assert info.is_extend_in_batch == exp["extend"], where
            assert info.can_run_tbo == exp["tbo"], where
            assert info.tp0_info.dtype == torch.int64 and info.tp0_info.tolist() == exp["tp0"], \
                where
            assert info.sync in ("shm", "cpu", "device")
            checked.append((case, dp, tp, cp, info.global_num_tokens, info.can_cuda_graph,
                            info.is_extend_in_batch, info.can_run_tbo, got is None))
    return checked


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sync_rules_every_path(pools, world, seed):
    for sync in ("shm", "cpu", "device", "auto"):
        res = pools.run(world, _sync_cases, sync, seed, 12 if world > 1 else 30)
        assert len(res[0]) >= 12
        # every rank made the same decisions (the global fields agree across ranks)
        glob = [[c[:4] + c[5:8] for c in r] for r in res]
        assert all(g == glob[0] for g in glob)
        assert any(c[-1] for c in res[0]) and not all(c[-1] for c in res[0])


def _sync_resolution(rank, world):
    from attncomm.dp_attention import resolve_sync
    return resolve_sync("auto"), resolve_sync("shm"), resolve_sync("cpu"), resolve_sync("device")


def test_auto_takes_shm_on_one_host(pools):
    assert pools.run(2, _sync_resolution) == [("shm", "shm", "cpu", "device")] * 2


def _fixed_case(rank, world, sync):
    """Hand-written cases with their right values."""
    out = {}
    idle = BatchView(ForwardMode.IDLE)
    get_idle = lambda: idle  # noqa: E731
    # rank 0 extends (logprob off), the others decode: no graph anywhere, SUM_LEN
    b = (BatchView(ForwardMode.EXTEND, batch_size=2, extend_num_tokens=9, extend_lens=[4, 5],
                   extend_logprob_start_lens=None, return_logprob=False) if rank == 0
         else BatchView(ForwardMode.DECODE, batch_size=3 + rank))
    _, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                     get_idle_batch=get_idle, sync=sync, enable_tbo=True)
    out["extend"] = (info.global_num_tokens, info.global_num_tokens_for_logprob,
                     info.can_cuda_graph, info.is_extend_in_batch, info.can_run_tbo,
                     choose_padding_mode(info.global_num_tokens, info.is_extend_in_batch))
    # every rank idle (None, IDLE without extend fields, PREBUILT): None everywhere
    b = [None, BatchView(ForwardMode.IDLE), BatchView(ForwardMode.PREBUILT, batch_size=2)][rank % 3]
    got, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                       get_idle_batch=get_idle, sync=sync)
    out["all_idle"] = (got, info.global_num_tokens, info.can_cuda_graph)
    # every rank IDLE (None or an IDLE batch): TBO is vacuously allowed (API.md)
    b = None if rank % 2 else BatchView(ForwardMode.IDLE)
    _, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                     get_idle_batch=get_idle, sync=sync, enable_tbo=True)
    out["all_idle_tbo"] = (info.can_run_tbo, info.global_forward_mode)
    # a PREBUILT batch while another rank decodes: the idle batch rides inside it
    b = (BatchView(ForwardMode.PREBUILT, batch_size=2) if rank == 0
         else BatchView(ForwardMode.DECODE, batch_size=1))
    got, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                       get_idle_batch=get_idle, sync=sync)
    out["prebuilt"] = (got is b, b.inner_idle_batch is idle, info.global_num_tokens,
                       info.can_cuda_graph)
    # an invalid batch on the last rank: ValueError on every rank, naming it
    b = (BatchView(ForwardMode.EXTEND, batch_size=1) if rank == world - 1
         else BatchView(ForwardMode.DECODE, batch_size=1))
    try:
        prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                               get_idle_batch=get_idle, sync=sync)
        out["invalid"] = "no error"
    except ValueError as exc:
        out["invalid"] = str(exc)
    # sizes that do not match the group
    try:
        MLPSyncBatchInfo(world + 1, 1, 1, 0, 0, True, False, True, IDLE).all_gather(
            None, None, sync=sync)
        out["sizes"] = "no error"
    except ValueError as exc:
        out["sizes"] = str(exc)
    # an inactive rank's garbage (even a batch that is invalid) is ignored
    b = (BatchView(ForwardMode.EXTEND, batch_size=5) if rank == world - 1
         else BatchView(ForwardMode.DECODE, batch_size=2 + rank))
    active = [True] * (world - 1) + [False]
    _, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                     get_idle_batch=get_idle, sync=sync, enable_tbo=True,
                                     active_ranks=torch.tensor(active))
    out["inactive"] = (info.global_num_tokens, info.tp0_info[-1].tolist(), info.can_run_tbo)
    # TBO: every busy rank decodes ≥ 2 requests, one rank idle → TBO runs; one rank with a
    # single request → it does not
    for name, one in (("tbo", 2), ("no_tbo", 1)):
        b = None if rank == 0 else BatchView(ForwardMode.DECODE,
                                             batch_size=one if rank == world - 1 else 3)
        _, info = prepare_mlp_sync_batch(b, dp_size=world, attn_tp_size=1, group=None,
                                         get_idle_batch=get_idle, sync=sync, enable_tbo=True)
        out[name] = (info.can_run_tbo, info.global_forward_mode)
    # still in step after the errors
    _, info = prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 1),
                                     dp_size=world, attn_tp_size=1, group=None,
                                     get_idle_batch=get_idle, sync=sync)
    out["after"] = info.global_num_tokens
    return out


@pytest.mark.parametrize("sync", ["shm", "cpu", "device"])
def test_sync_fixed_values(pools, sync):
    world = 3
    res = pools.run(world, _fixed_case, sync)
    for r, out in enumerate(res):
        assert out["extend"] == ([9, 4, 5], [2, 4, 5], False, True, False,
                                 DpPaddingMode.SUM_LEN)
        assert out["all_idle"] == (None, [0, 0, 0], True)
        assert out["prebuilt"] == (True, True, [0, 1, 1], True) if r == 0 else \
            out["prebuilt"][2:] == ([0, 1, 1], True)
        assert "invalid input on rank(s) [2] — rank 2: invalid batch" in out["invalid"]
        assert ("extend_num_tokens" in out["invalid"]) == (r == 2)
        assert "must equal the group size 3" in out["sizes"]
        assert "rank(s) [0, 1, 2]" in out["sizes"] and "does not match" in out["sizes"]
        assert out["all_idle_tbo"] == (True, ForwardMode.IDLE)
        assert out["after"] == [1, 2, 3]
        assert out["inactive"] == ([2, 3, 0], [0, 0, 1, 0, 1, IDLE], True)
        assert out["tbo"] == (True, ForwardMode.DECODE)
        assert out["no_tbo"] == (False, ForwardMode.DECODE)


def test_local_rules(seed):
    assert [m.is_extend() for m in ForwardMode] == [True, False, True, False, False]
    assert [m.is_decode_or_idle() for m in ForwardMode] == [False, True, False, True, False]
    assert ForwardMode.IDLE.is_idle() and ForwardMode.PREBUILT.is_prebuilt()
    rng = random.Random(seed)
    for _ in range(200):
        b = _rand_batch(rng, rng.choice(_KINDS))
        assert list(count_tokens(b)) == _ref_row(b, False)[:2]
    # return_logprob off on an extend batch: one logprob row per request
    b = BatchView(ForwardMode.EXTEND, batch_size=3, extend_num_tokens=30, extend_lens=[10] * 3,
                  extend_logprob_start_lens=[0, 0, 0], return_logprob=False)
    assert count_tokens(b) == (30, 3)
    b.return_logprob = True
    assert count_tokens(b) == (30, 30)
    b.extend_logprob_start_lens = [10, 12, 3]
    assert count_tokens(b) == (30, 1 + 1 + 7)
    with pytest.raises(ValueError, match="extend_num_tokens"):
        count_tokens(BatchView(ForwardMode.MIXED, batch_size=2))
    with pytest.raises(ValueError, match="forward_mode"):
        count_tokens(BatchView(9, batch_size=2))


def test_padding_mode_and_graph_size(seed):
    rng = random.Random(seed)
    for _ in range(300):
        dp = rng.randint(1, 8)
        n = [rng.choice([0, rng.randint(0, 64)]) for _ in range(dp)]
        ext = rng.random() < 0.3
        want = (DpPaddingMode.SUM_LEN if ext or 2 * sum(n) < max(n) * dp
                else DpPaddingMode.MAX_LEN)
        assert choose_padding_mode(n, ext) is want
        caps = sorted(rng.sample(range(1, 80), rng.randint(0, 6)))
        fit = [c for c in caps if c >= max(n)]
        assert select_cuda_graph_bs(n, caps) == (fit[0] if fit else None)
    assert choose_padding_mode([4, 0], False) is DpPaddingMode.MAX_LEN   # 8 ≥ 8
    assert choose_padding_mode([5, 0, 0], False) is DpPaddingMode.SUM_LEN  # 10 < 15
    assert select_cuda_graph_bs([3, 5, 4], [1, 2, 4, 8, 16]) == 8  # from the max 5, not Σ 12
    assert select_cuda_graph_bs([33], [8, 16, 32]) is None
    with pytest.raises(ValueError):
        choose_padding_mode([], False)
    with pytest.raises(ValueError):
        select_cuda_graph_bs([-1, 2], [4])


def test_world_info():
    for tp, dp, cp in [(8, 2, 1), (8, 2, 2), (8, 8, 1), (8, 1, 1), (6, 3, 1), (12, 2, 3)]:
        a = tp // dp // cp
        seen = set()
        for r in range(tp):
            t, size, d = compute_dp_attention_world_info(r, tp, dp, cp)
            assert size == a and 0 <= t < a and 0 <= d < dp
            assert r == d * cp * a + (r // a) % cp * a + t     # DP major, TP fastest
            seen.add((d, (r // a) % cp, t))
        assert len(seen) == tp
    for bad in [(0, 6, 4, 1), (0, 8, 3, 1), (0, 8, 2, 3), (8, 8, 2, 1), (-1, 8, 2, 1),
                (0, 8, 0, 1)]:
        with pytest.raises(ValueError):
            compute_dp_attention_world_info(*bad)


# -- gather / scatter / reduce_scatter --------------------------------------------------------

def _rows(seed, d, n, shape, dtype):
    g = torch.Generator().manual_seed(seed * 1000 + d)
    return torch.randn((n, *shape), generator=g, dtype=torch.float64).to(dtype)


def _gather_cases(rank, world, seed, n_cases):
    import torch.distributed as dist
    rng = random.Random(seed)
    done = 0
    for case in range(n_cases):
        for a in [t for t in (1, 2, 4) if world % t == 0]:
            dp = world // a
            d, t = rank // a, rank % a
            n = [rng.choice([0, rng.randint(0, 9)]) for _ in range(dp)]
            if case % 3 == 0:
                n[rng.randrange(dp)] = 0                       # a zero-token rank
            shape = rng.choice([(5,), (2, 3)])
            dtype = rng.choice([torch.float32, torch.bfloat16, torch.float64])
            mode = rng.choice(list(DpPaddingMode))
            cs = rng.randrange(1 << 20)
            local = _rows(cs, d, n[d], shape, dtype)
            if t != 0:
                local = torch.full_like(local, float("nan"))   # only attn-TP rank 0's copy counts
            buf = dp_gather(local, n, None, mode=mode, attn_tp_size=a)
            m = max(n)
            rows = sum(n) if mode is DpPaddingMode.SUM_LEN else m * dp
            assert buf.shape == (rows, *shape) and buf.dtype == dtype, (case, n, mode)
            for q in range(dp):
                want = _rows(cs, q, n[q], shape, dtype)
                off = sum(n[:q]) if mode is DpPaddingMode.SUM_LEN else q * m
                assert torch.equal(buf[off:off + n[q]], want), (case, n, mode, a, q)
                got = dp_scatter(buf, n, q, mode=mode)
                assert torch.equal(got, want)
                poisoned = torch.full_like(want, float("nan"))
                assert dp_scatter(buf, n, q, mode=mode, out=poisoned) is poisoned
                assert torch.equal(poisoned, want)
            # reduce_scatter of per-rank partials, against an fp64 sum over every rank's partial
            part = _rows(cs + 7, rank, rows, shape, dtype)
            before = part.clone()
            red = dp_reduce_scatter(part, n, None, mode=mode, attn_tp_size=a)
            assert torch.equal(part, before)
            ref = sum(_rows(cs + 7, r, rows, shape, torch.float64) for r in range(world))
            ref = dp_scatter(ref, n, d, mode=mode)
            tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 6e-2}[dtype]
            assert red.shape == ref.shape and red.dtype == dtype
            assert torch.allclose(red.double(), ref, atol=tol * 4, rtol=tol), (case, n, mode)
            done += 1
    dist.barrier()
    return done


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_gather_scatter_reduce_scatter(pools, world, seed):
    res = pools.run(world, _gather_cases, seed, 8)
    assert res[0] >= 8 and len(set(res)) == 1


def _gather_errors(rank, world):
    out = {}
    n = [2] * world
    local = torch.randn(3 if rank == 1 else 2, 4)          # rank 1's shape is wrong
    for validate in (True,):
        try:
            dp_gather(local, n, None, mode=DpPaddingMode.MAX_LEN, validate=validate)
            out["shape"] = "no error"
        except ValueError as exc:
            out["shape"] = str(exc)
    try:                                                    # 3 counts · attn_tp 2 ≠ 4 ranks
        dp_gather(torch.randn(1, 4), [1, 1, 1], None, mode="sum_len", attn_tp_size=2)
        out["sizes"] = "no error"
    except ValueError as exc:
        out["sizes"] = str(exc)
    try:
        dp_reduce_scatter(torch.randn(5, 4), [2] * world, None, mode=DpPaddingMode.SUM_LEN)
        out["rs"] = "no error"
    except ValueError as exc:
        out["rs"] = str(exc)
    try:
        dp_gather(torch.randn(2, 4), n, None, mode="middle")
        out["mode"] = "no error"
    except ValueError as exc:
        out["mode"] = str(exc)
    return out


def test_gather_errors_on_every_rank(pools):
    for out in pools.run(4, _gather_errors):
        assert "rank 1" in out["shape"] and "global_num_tokens[1] = 2" in out["shape"]
        assert "must equal the group size 4" in out["sizes"]
        assert "needs 8 rows" in out["rs"]
        assert "MAX_LEN or SUM_LEN" in out["mode"]


def test_scatter_bad_input():
    buf = torch.randn(6, 3)
    with pytest.raises(ValueError, match="needs 9 rows"):
        dp_scatter(buf, [3, 2, 1], 0, mode=DpPaddingMode.MAX_LEN)
    with pytest.raises(ValueError, match="dp_rank=3"):
        dp_scatter(buf, [3, 2, 1], 3, mode=DpPaddingMode.SUM_LEN)
    with pytest.raises(ValueError, match="out has shape"):
        dp_scatter(buf, [3, 2, 1], 1, mode=DpPaddingMode.SUM_LEN, out=torch.empty(3, 3))
    assert torch.equal(dp_scatter(buf, [3, 0, 3], 1, mode="sum_len"), buf[3:3])


def _shm_stress(rank, world, steps, seed):
    import time

    from attncomm.dp_attention import close_shm_channels
    from attncomm.dp_attention.sync import exchange_rows

    rng = random.Random(seed + rank)
    for rounds in range(2):                    # the second round runs on a fresh segment
        for s in range(1, steps + 1):
            if rng.random() < 0.02:            # skew: this rank falls behind for a while
                time.sleep(rng.random() * 2e-3)
            salt = (seed * 31 + s * 7 + rounds) % 1000003
            rows = exchange_rows([s, rank, salt, -s, rank * s, 1 << 62], None, sync="shm")
            want = [[s, q, salt, -s, q * s, 1 << 62] for q in range(world)]
            assert rows == want, (rounds, s, rows)
        close_shm_channels()
    return steps


@pytest.mark.parametrize("world,steps", [(2, 1500), (4, 600)])
def test_shm_exchange_under_skew(pools, world, steps, seed):
    assert pools.run(world, _shm_stress, steps, seed) == [steps] * world
