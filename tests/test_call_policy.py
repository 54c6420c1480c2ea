"""The call path every exchange shares: first-sight argument checks (a steady-state call makes
only the exchange's own collectives), engines' group coordinators, the lifecycle (``close()``,
``with``, ``attncomm.release``), and the message when there is no process group."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import attncomm
from attncomm import config, dcp, ulysses
from attncomm.dp_attention import DpPaddingMode, dp_gather, dp_reduce_scatter

# The collectives a call can make (counted on the rank).
_COUNTED = ("all_gather_into_tensor", "all_gather_single", "all_to_all_single", "all_reduce",
            "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_object", "broadcast",
            "barrier", "all_gather", "new_group")


class _Counter:
    """Counts calls of torch.distributed's collectives (and ``new_group``) by name."""

    def __init__(self):
        self.counts: dict = {}
        self._real: dict = {}

    def __enter__(self):
        for name in _COUNTED:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self._real[name] = fn

            def counted(*a, _fn=fn, _name=name, **kw):
                self.counts[_name] = self.counts.get(_name, 0) + 1
                return _fn(*a, **kw)
            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, fn in self._real.items():
            setattr(dist, name, fn)

    def take(self) -> dict:
        out, self.counts = self.counts, {}
        return out


def _calls(rank, world):
    """Collectives per call of each functional exchange: first, second (steady state), and with
    ``validate=True``; the ``ATTNCOMM_VALIDATE=1`` debug mode."""
    # the pool's ranks outlive a test: what an earlier test's calls cached (objects, the
    # argument-check record) goes, so each first call below is a first sight
    attncomm.release()
    gen = torch.Generator().manual_seed(100 + rank)
    out, lse = torch.randn(4, 2 * world, 8, generator=gen), torch.randn(4, 2 * world,
                                                                          generator=gen)
    x = torch.randn(1, 3, 2 * world, 8, generator=gen)
    n = [2] * world
    rows = torch.randn(2, 4, generator=gen)
    partial = torch.randn(2 * world, 4, generator=gen)
    merged = torch.empty(4, 2, 8)
    gathered = torch.empty(1, 2 * world, 8)
    xh = torch.randn(1, 2 * world, 2, 8, generator=gen)
    mods: dict = {}
    jg = torch.Generator().manual_seed(7)  # joint rows: the same on every rank
    joint = tuple(torch.randn(1, 2, 2 * world, 8, generator=jg) for _ in range(3))

    def attention(groups, validate=None, payload=None, joint_rows=None):
        key = (groups, validate, payload, joint_rows is not None)
        if key not in mods:
            mods[key] = ulysses.UlyssesAttention(backend="all_to_all", pipeline_groups=groups,
                                                 validate=validate, payload_dtype=payload)
        return mods[key](x, x, x, joint=joint_rows)

    calls = {
        "dcp.merge[a2a]": lambda **kw: dcp.merge(out, lse, backend="a2a", **kw),
        "dcp.merge[ag_rs]": lambda **kw: dcp.merge(out, lse, backend="ag_rs", **kw),
        "dcp.merge[output]": lambda **kw: dcp.merge(out, lse, backend="a2a", output=merged,
                                                    **kw),
        "dcp.gather_heads": lambda **kw: dcp.gather_heads(out[:, :2], **kw),
        "dcp.gather_heads[T=1, output]": lambda **kw: dcp.gather_heads(
            out[:1, :2], output=gathered, **kw),
        "seq_to_head": lambda **kw: ulysses.seq_to_head(x, backend="all_to_all", **kw),
        "head_to_seq": lambda **kw: ulysses.head_to_seq(xh, backend="all_to_all", **kw),
        "UlyssesAttention": lambda **kw: attention(0, **kw),
        "UlyssesAttention[G=2]": lambda **kw: attention(2, **kw),
        "UlyssesAttention[joint, fp8]": lambda **kw: attention(0, payload=torch.float8_e4m3fn,
                                                               joint_rows=joint, **kw),
        "seq_to_head[fp8]": lambda **kw: ulysses.seq_to_head(x, backend="all_to_all",
                                                             payload_dtype=torch.float8_e4m3fn,
                                                             **kw),
        "dp_gather": lambda **kw: dp_gather(rows, n, None, mode=DpPaddingMode.SUM_LEN, **kw),
        "dp_gather[MAX_LEN]": lambda **kw: dp_gather(rows, n, None, mode="max_len", **kw),
        "dp_reduce_scatter[MAX_LEN]": lambda **kw: dp_reduce_scatter(
            partial, n, None, mode=DpPaddingMode.MAX_LEN, **kw),
        "dp_reduce_scatter[SUM_LEN]": lambda **kw: dp_reduce_scatter(
            partial, n, None, mode=DpPaddingMode.SUM_LEN, **kw),
    }
    res = {}
    with _Counter() as c:
        for name, call in calls.items():
            call()
            first = c.take()
            call()
            steady = c.take()
            call(validate=True)
            every = c.take()
            with config.setting(ATTNCOMM_VALIDATE=1):
                _replan(name, call, c)
                call()
            env_every = c.take()
            with config.setting(ATTNCOMM_VALIDATE=0):
                _replan(name, call, c)
                call()
            never = c.take()
            res[name] = (first, steady, every, env_every, never)
    return res


def _replan(name, call, counter) -> None:
    """The Ulysses calls read ``ATTNCOMM_*`` when a plan is made: after a change, release the
    group's plans and make the new one (its collectives not counted)."""
    if name.startswith(("seq_to_head", "head_to_seq", "UlyssesAttention")):
        attncomm.release()
        call()
        counter.take()


# The exchange's own collectives, per call, on gloo CPU ranks.
_OWN = {
    "dcp.merge[a2a]": {"all_to_all_single": 1},
    "dcp.merge[ag_rs]": {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1},
    "dcp.merge[output]": {"all_to_all_single": 1},
    "dcp.gather_heads": {"all_gather_into_tensor": 1},
    "dcp.gather_heads[T=1, output]": {"all_gather_into_tensor": 1},
    "seq_to_head": {"all_to_all_single": 1},
    "head_to_seq": {"all_to_all_single": 1},
    "UlyssesAttention": {"all_to_all_single": 2},        # q, k, v in; the output back
    "UlyssesAttention[G=2]": {"all_to_all_single": 4},   # per head group
    "UlyssesAttention[joint, fp8]": {"all_to_all_single": 3},  # + the joint rows' head gather
    "seq_to_head[fp8]": {"all_to_all_single": 1},
    "dp_gather": {"all_reduce": 1},
    "dp_gather[MAX_LEN]": {"all_gather_into_tensor": 1},
    "dp_reduce_scatter[MAX_LEN]": {"reduce_scatter_tensor": 1},
    "dp_reduce_scatter[SUM_LEN]": {"all_reduce": 1},
}


#: Calls whose signature an earlier call of the list already brought (no check on first sight).
_SEEN_SIGNATURE = {"dcp.merge[output]"}


def _strip(counts: dict) -> dict:
    # torch 2.13 names the single-tensor collectives *_single and calls them from the old
    # names' shims or the other way round: count one family once.
    out = {}
    for k, v in counts.items():
        k = k.replace("all_gather_single", "all_gather_into_tensor").replace(
            "reduce_scatter_single", "reduce_scatter_tensor")
        out[k] = max(out.get(k, 0), v)
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_steady_state_calls_make_only_the_exchanges_collectives(pools, world):
    for rank_res in pools.run(world, _calls):
        for name, (first, steady, every, env_every, never) in rank_res.items():
            own = _OWN[name]
            assert _strip(steady) == own, (name, steady)
            assert _strip(never) == own, (name, never)
            # first sight and validate=True / ATTNCOMM_VALIDATE=1: one all_gather more
            for label, got in (("validate=True", every), ("ATTNCOMM_VALIDATE=1", env_every)):
                extra = dict(_strip(got))
                extra["all_gather_into_tensor"] = extra.get("all_gather_into_tensor", 0) - 1
                assert {k: v for k, v in extra.items() if v} == own, (name, label, got)
            if name in _SEEN_SIGNATURE:  # output= is no part of the signature: seen before
                assert _strip(first) == own, (name, first)
            else:
                assert sum(first.values()) > sum(steady.values()), (name, first, steady)


def _object_calls(rank, world):
    """Collectives per steady-state call of the exchange objects (checked at construction)."""
    gen = torch.Generator().manual_seed(200 + rank)
    out, lse = torch.randn(3, 2 * world, 8, generator=gen), torch.randn(3, 2 * world,
                                                                          generator=gen)
    q = torch.randn(3, 2, 8, generator=gen)
    m = dcp.DcpMerger(max_tokens=4, num_heads=2 * world, head_dim=8, dtype=torch.float32,
                      backend="a2a")
    g = dcp.DcpQueryGather(max_tokens=4, num_heads=2 * world, head_dim=8, dtype=torch.float32)
    attn = dcp.DcpAttention(lambda qa: (qa, qa[..., 0]), max_tokens=4, num_heads=2 * world,
                            head_dim=8, dtype=torch.float32, merge_backend="a2a")
    calls = {"DcpMerger": lambda: m(out, lse), "DcpQueryGather": lambda: g(q),
             "DcpAttention": lambda: attn(q)}
    res = {}
    with _Counter() as c:
        for name, call in calls.items():
            call()
            c.take()
            call()
            res[name] = c.take()
    return res


def test_objects_make_only_their_exchanges_collectives(pools):
    own = {"DcpMerger": {"all_to_all_single": 1},
           "DcpQueryGather": {"all_gather_into_tensor": 1},
           "DcpAttention": {"all_gather_into_tensor": 1, "all_to_all_single": 1}}
    for rank_res in pools.run(2, _object_calls):
        for name, counts in rank_res.items():
            assert _strip(counts) == own[name], (name, counts)


def _mismatch_still_checked(rank, world):
    """A new signature is checked even after others were seen: a disagreement raises
    ValueError on every rank."""
    out, lse = torch.randn(4, 2 * world, 8), torch.randn(4, 2 * world)
    dcp.merge(out, lse, backend="a2a")
    T = 5 if rank == 0 else 6
    try:
        dcp.merge(torch.randn(T, 2 * world, 8), torch.randn(T, 2 * world), backend="a2a")
    except ValueError as exc:
        return str(exc)
    return None


def test_a_new_signature_is_checked(pools):
    msgs = pools.run(2, _mismatch_still_checked)
    assert all(m and "T (tokens)" in m and "5 (rank 0)" in m and "6 (rank 1)" in m
               for m in msgs), msgs


class _Coordinator:
    """An engine's group coordinator: ``device_group`` and ``cpu_group``."""

    def __init__(self, device_group, cpu_group):
        self.device_group, self.cpu_group = device_group, cpu_group


def _coordinator(rank, world):
    from attncomm import _dist
    ranks = list(range(world))
    device_group = dist.new_group(ranks, backend="gloo")
    cpu_group = dist.new_group(ranks, backend="gloo")
    coord = _Coordinator(device_group, cpu_group)
    gen = torch.Generator().manual_seed(7 + rank)
    out, lse = torch.randn(3, 2 * world, 8, generator=gen), torch.randn(3, 2 * world,
                                                                          generator=gen)
    with _Counter() as c:
        merged = dcp.merge(out, lse, coord, backend="a2a", validate=True)
        y = ulysses.seq_to_head(torch.randn(1, 2, world, 4, generator=gen), coord,
                                backend="all_to_all")
        m = dcp.DcpMerger(coord, max_tokens=4, num_heads=2 * world, head_dim=8,
                          dtype=torch.float32)
        attn = ulysses.UlyssesAttention(group=coord, backend="all_to_all")
        q = torch.randn(1, 2, 2 * world, 4, generator=gen)
        o = attn(q, q, q)
        shapes = _dcp_dp_with(coord, gen, world)
        counts = c.take()
    ref = dcp.merge(out, lse, device_group, backend="a2a")
    return (counts.get("new_group", 0), torch.equal(merged, ref),
            _dist.validation_group(device_group) is cpu_group, tuple(y.shape), m.backend,
            tuple(o.shape), shapes)


def _dcp_dp_with(group, gen, world):
    """The other DCP and DP calls on ``group``: their result shapes."""
    q = torch.randn(2, 2, 8, generator=gen)
    rows = torch.randn(2, 4, generator=gen)
    n = [2] * world
    g = dcp.DcpQueryGather(group, max_tokens=4, num_heads=2 * world, head_dim=8,
                           dtype=torch.float32)
    a = dcp.DcpAttention(lambda qa: (qa, qa[..., 0]), group, max_tokens=4,
                         num_heads=2 * world, head_dim=8, dtype=torch.float32)
    return [tuple(t.shape) for t in (
        dcp.gather_heads(q, group), g(q), a(q),
        dp_gather(rows, n, group, mode="sum_len"),
        dp_reduce_scatter(rows.repeat(world, 1), n, group, mode="max_len"))]


def test_group_coordinator_is_accepted_without_a_new_gloo_group(pools):
    for new_groups, same, check_is_cpu, y_shape, backend, o_shape, shapes in pools.run(
            2, _coordinator):
        assert new_groups == 0  # the coordinator's cpu_group serves the checks
        assert same and check_is_cpu and backend == "a2a"
        assert y_shape == (1, 4, 1, 4) and o_shape == (1, 2, 4, 4)
        assert shapes == [(2, 4, 8), (2, 4, 8), (2, 2, 8), (4, 4), (2, 4)]


def _lifecycle(rank, world):
    res = {}
    with dcp.DcpMerger(max_tokens=4, num_heads=2 * world, head_dim=8,
                       dtype=torch.float32) as m:
        m(torch.randn(2, 2 * world, 8), torch.randn(2, 2 * world))
    try:
        m(torch.randn(2, 2 * world, 8), torch.randn(2, 2 * world))
    except RuntimeError as exc:
        res["DcpMerger"] = str(exc)
    g = dcp.DcpQueryGather(max_tokens=4, num_heads=2 * world, head_dim=8, dtype=torch.float32)
    g.close()
    g.close()  # idempotent
    try:
        g(torch.randn(2, 2, 8))
    except RuntimeError as exc:
        res["DcpQueryGather"] = str(exc)
    with dcp.DcpAttention(lambda qa: (qa, qa[..., 0]), max_tokens=4, num_heads=2 * world,
                          head_dim=8, dtype=torch.float32) as a:
        a(torch.randn(2, 2, 8))
    try:
        a(torch.randn(2, 2, 8))
    except RuntimeError as exc:
        res["DcpAttention"] = str(exc)
    attn = ulysses.UlyssesAttention(backend="all_to_all")
    with attn:
        pass
    try:
        attn(torch.randn(1, 2, 2 * world, 4), torch.randn(1, 2, 2 * world, 4),
             torch.randn(1, 2, 2 * world, 4))
    except RuntimeError as exc:
        res["UlyssesAttention"] = str(exc)
    # attncomm.release: the functional calls' cached objects go (closed), the next call builds
    from attncomm.dcp.lse_merge import functional as merge_api
    out, lse = torch.randn(3, 2 * world, 8), torch.randn(3, 2 * world)
    before = dcp.merge(out, lse, backend="a2a")
    cached = list(merge_api._MERGERS["world"].values())
    attncomm.release()
    res["released"] = ("world" not in merge_api._MERGERS and all(c._closed for c in cached))
    res["after"] = torch.equal(dcp.merge(out, lse, backend="a2a"), before)
    return res


def test_close_with_and_release(pools):
    for res in pools.run(2, _lifecycle):
        for name in ("DcpMerger", "DcpQueryGather", "DcpAttention", "UlyssesAttention"):
            assert name in res and f"{name} is closed" in res[name], res
        assert res["released"] and res["after"]


def test_no_process_group_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="attncomm.launch.*init_process_group.*merge_states"):
        dcp.merge(torch.randn(2, 2, 4), torch.randn(2, 2))
    with pytest.raises(ValueError, match="ulysses.seq_to_head: no process group"):
        ulysses.seq_to_head(torch.randn(1, 2, 2, 4))
    with pytest.raises(ValueError, match="DcpMerger: no process group"):
        dcp.DcpMerger(max_tokens=2, num_heads=2, head_dim=4, dtype=torch.float32)


def _diverged(rank, world):
    """Rank 0 repeats a seen call (its check skipped) whose gatherer the LRU evicted, so it
    builds one again, and that construction's check meets rank 1's check of a new signature:
    both raise a ValueError that names each rank's call, instead of reading one call's
    signature as the other's."""
    gen = torch.Generator().manual_seed(11 + rank)
    q = torch.randn(3, 2, 8, generator=gen)
    dcp.gather_heads(q)
    for h in range(3, 12):  # nine other gatherers: the LRU (8 per group) evicts q's
        dcp.gather_heads(torch.randn(1, h, 8, generator=gen))
    try:
        dcp.gather_heads(q if rank == 0 else torch.randn(5, 2, 8, generator=gen))
    except ValueError as exc:
        return str(exc)
    finally:
        attncomm.release()
    return None


def test_diverged_calls_name_each_ranks_call(pools):
    msgs = pools.run(2, _diverged)
    for m in msgs:
        assert m and "different calls" in m and "rank 0 in DcpQueryGather" in m \
            and "rank 1 in dcp.gather_heads" in m, msgs


def test_call_plans_lookup_refreshes_lru_order():
    from attncomm._plans import CallPlans

    plans = CallPlans(size=2)
    plans.put(None, None, "a", "plan a")
    plans.put(None, None, "b", "plan b")
    assert plans.get(None, "a") == "plan a"  # now the most recently used
    plans.put(None, None, "c", "plan c")     # evicts the least recently used: b
    assert plans.get(None, "b") is None
    assert plans.get(None, "a") == "plan a" and plans.get(None, "c") == "plan c"
    assert plans.get(None, None) is None and plans.get("other group", "a") is None
    plans.forget("world")
    assert plans.get(None, "a") is None
