"""Topology: ranks of one machine acting as several hosts (the test-only ATTNCOMM_TEST_HOST),
what every ``auto`` does on a group that spans hosts, and the hierarchical DP sync (shared
memory inside each host, gloo between host leaders) against the flat gloo path.

Each multi-rank case sets the knob on its ranks and makes a fresh group, so the per-group caches
(host layout, sync plan) of the shared pools' default group are never touched."""
from __future__ import annotations

import os
import random
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

from attncomm import PeerTimeoutError, capability, config
from attncomm.dp_attention import (BatchView, ForwardMode, MLPSyncBatchInfo, close_shm_channels,
                                   prepare_mlp_sync_batch, resolve_sync, sync_decision)
from attncomm.dp_attention import hier
from attncomm.dp_attention.rows import auto_path, exchange_rows

IDLE = int(ForwardMode.IDLE)
HOST_MAPS = {"2x2": (0, 0, 1, 1), "interleaved": (0, 1, 0, 1), "3+1": (0, 0, 0, 1),
             "2x4": (0, 0, 0, 0, 1, 1, 1, 1)}


# -- local: the knob and the layout --------------------------------------------------------

def test_knob_splits_a_machine_never_joins_two(monkeypatch):
    assert not config.VARS["ATTNCOMM_TEST_HOST"].public
    assert "Tests only" in config.VARS["ATTNCOMM_TEST_HOST"].doc
    monkeypatch.delenv("ATTNCOMM_TEST_HOST", raising=False)
    real = capability.host_identity()
    monkeypatch.setenv("ATTNCOMM_TEST_HOST", "a")
    a = capability.host_identity()
    monkeypatch.setenv("ATTNCOMM_TEST_HOST", "b")
    b = capability.host_identity()
    assert len({real, a, b}) == 3 and a.startswith(real) and b.startswith(real)


def test_host_layout_and_auto_rule():
    lay = capability.HostLayout.from_identities(["m/1/test:y", "m/1/test:x", "m/1/test:y",
                                                 "m/1/test:x"])
    assert lay.num_hosts == 2 and lay.ranks == ((0, 2), (1, 3)) and lay.leaders == (0, 1)
    assert lay.names == ("m/test:y", "m/test:x")
    assert "span 2 hosts" in lay.reason() and "m/test:x: ranks 1, 3" in lay.reason()
    one = capability.HostLayout.from_identities(["m/1"] * 3)
    assert one.reason() is None and one.describe() == "1 host (m: ranks 0-2)"
    assert auto_path(one, None) == ("shm", None)
    assert auto_path(one, "not x86") == ("cpu", "not x86")
    assert auto_path(lay, None) == ("hier", lay.reason())
    path, why = auto_path(lay, "not x86")
    assert path == "cpu" and "span 2 hosts" in why and "not x86" in why
    alone = capability.HostLayout.from_identities(["a", "b", "c"])
    path, why = auto_path(alone, None)
    assert path == "cpu" and "every host holds one rank" in why


# -- on gloo ranks: what every auto decides ---------------------------------------------------

def _fresh_group(rank, hosts):
    config.set_var("ATTNCOMM_TEST_HOST", f"h{hosts[rank]}")
    return dist.new_group(backend="gloo")


def _autos_on_simulated_hosts(rank, world, hosts):
    from attncomm import dcp, envinfo, ulysses
    from attncomm.ulysses.api import ce_reason

    out = {}
    try:
        g = _fresh_group(rank, hosts)
        out["same_host"] = capability.same_host(g)
        out["ranks"] = capability.group_hosts(g).ranks
        out["symm"] = capability.symm_unavailable_reason(g, torch.device("cpu"))
        out["ce"] = ce_reason(g, torch.device("cpu"))
        out["merger"] = dcp.DcpMerger(g, max_tokens=4, num_heads=2 * world, head_dim=8,
                                      dtype=torch.float32).fallback_reason
        out["gather"] = dcp.DcpQueryGather(g, max_tokens=4, num_heads=2 * world, head_dim=8,
                                           dtype=torch.float32).fallback_reason
        attn = ulysses.UlyssesAttention(group=g)
        q = torch.randn(1, 2, 2 * world, 8, generator=torch.Generator().manual_seed(rank))
        attn(q, q[:, :, :world], q[:, :, :world])
        out["ulysses"] = attn.fallback_reason
        d = sync_decision("auto", g)
        out["dp"] = (d.backend, d.fallback_reason, resolve_sync("auto", g))
        try:
            resolve_sync("shm", g)
            out["shm"] = "no error"
        except ValueError as exc:
            out["shm"] = str(exc)
        out["topology"] = envinfo.group_topology(g)
        # the control: one host (every rank the same name) keeps the single-host paths
        config.set_var("ATTNCOMM_TEST_HOST", "same")
        one = dist.new_group(backend="gloo")
        out["one"] = (capability.group_hosts(one).num_hosts, resolve_sync("auto", one),
                      capability.symm_unavailable_reason(one, torch.device("cpu")))
    finally:
        config.set_var("ATTNCOMM_TEST_HOST", None)
        close_shm_channels()
    return out


@pytest.mark.slow
def test_every_auto_keeps_single_host_backends_off_two_hosts(pools):
    hosts = HOST_MAPS["2x2"]
    res = pools.run(4, _autos_on_simulated_hosts, hosts)
    for r, out in enumerate(res):
        where = f"rank {r}: {out}"
        assert out["same_host"] is False and out["ranks"] == ((0, 1), (2, 3)), where
        assert "span 2 hosts" in out["symm"] and "test:h0: ranks 0-1" in out["symm"], where
        for key in ("ce", "merger", "gather", "ulysses"):
            assert out[key] and "span 2 hosts" in out[key], (key, where)
        assert out["dp"][0] == out["dp"][2] == "hier" and "span 2 hosts" in out["dp"][1], where
        assert "sync='shm' cannot run" in out["shm"] and "span 2 hosts" in out["shm"], where
        topo = out["topology"]
        assert [h["ranks"] for h in topo["hosts"]] == [[0, 1], [2, 3]], where
        assert not any(row["available"] for row in topo["single_host"]), where
        assert all("span 2 hosts" in row["why_not"] for row in topo["single_host"]), where
        assert topo["dp_sync_auto"]["path"] == "hier", where
        assert out["one"][:2] == (1, "shm") and "not CUDA" in out["one"][2], where
    assert all(out["topology"] == res[0]["topology"] for out in res)


# -- on gloo ranks: the hierarchical sync decides what the flat one does ---------------------

def _random_row(rng):
    mode = rng.choice([1, 2, 3, 4, 5])
    busy = mode in (1, 2, 3)
    n = rng.randint(1, 300) if busy else 0
    return (n, rng.randint(0, n) if busy else 0, int(rng.random() < 0.7),
            int(mode in (1, 3)), int(rng.random() < 0.8), mode)


def _reference(rows, dp, per_dp, active, enable_tbo):
    rows = [r if a else (0, 0, 1, 0, 1, IDLE) for r, a in zip(rows, active)]
    tp0 = [rows[d * per_dp] for d in range(dp)]
    busy = {r[5] for r in tp0 if r[5] != IDLE}
    mode = (ForwardMode(busy.pop()) if len(busy) == 1 else None) if busy else ForwardMode.IDLE
    return ([r[0] for r in tp0], [r[1] for r in tp0], all(r[2] for r in tp0),
            any(r[3] for r in tp0), bool(enable_tbo and mode is not None and
                                          all(r[4] for r in tp0)), mode, [list(r) for r in tp0])


def _result(info):
    return (info.global_num_tokens, info.global_num_tokens_for_logprob, info.can_cuda_graph,
            info.is_extend_in_batch, info.can_run_tbo, info.global_forward_mode,
            info.tp0_info.tolist())


def _hier_matches_flat(rank, world, hosts, seed, cases):
    try:
        g = _fresh_group(rank, hosts)
        assert resolve_sync("auto", g) == "hier"
        layouts = [(world, 1, 1)] + [(world // tp, tp, 1) for tp in (2, 4)
                                     if world % tp == 0 and tp < world]
        rng = random.Random(seed)  # the same stream on every rank: every rank's rows known
        seen = []
        for case in range(cases):
            dp, tp, cp = layouts[case % len(layouts)]
            rows = [_random_row(rng) for _ in range(world)]
            active = [rng.random() < 0.8 for _ in range(world)] if case % 3 == 0 else \
                [True] * world
            tbo = rng.random() < 0.7
            want = _reference(rows, dp, tp * cp, active, tbo)
            got = {}
            for sync in ("auto", "cpu"):
                info = MLPSyncBatchInfo(dp, tp, cp, *rows[rank][:2], *map(bool, rows[rank][2:5]),
                                        rows[rank][5])
                info.all_gather(None, g, enable_tbo=tbo, sync=sync,
                                active_ranks=active if case % 3 == 0 else None)
                got[sync] = _result(info)
                assert info.sync == ("hier" if sync == "auto" else "cpu")
            assert got["auto"] == got["cpu"] == want, f"seed {seed} case {case} rank {rank}"
            seen.append(got["auto"][:6])
        # an invalid batch on the last rank: the same ValueError on every rank, both paths
        bad = BatchView(ForwardMode.EXTEND, batch_size=1) if rank == world - 1 else \
            BatchView(ForwardMode.DECODE, batch_size=1)
        for sync in ("auto", "cpu"):
            try:
                prepare_mlp_sync_batch(bad, dp_size=world, attn_tp_size=1, group=g, sync=sync,
                                       get_idle_batch=lambda: BatchView(ForwardMode.IDLE))
                seen.append("no error")
            except ValueError as exc:
                seen.append(str(exc).split(" (this rank")[0])
        assert seen[-1] == seen[-2] and f"rank(s) [{world - 1}]" in seen[-1], seen[-2:]
        # exchange_rows moves any int64 row unchanged, in group rank order
        for s in range(20):
            row = [s, rank, -(1 << 63) + s, (1 << 63) - 1, -rank, s * 7 + rank]
            got = exchange_rows(row, g, sync="hier")
            assert got == [[s, q, -(1 << 63) + s, (1 << 63) - 1, -q, s * 7 + q]
                           for q in range(world)], (seed, s)
        return seen
    finally:
        config.set_var("ATTNCOMM_TEST_HOST", None)
        close_shm_channels()


@pytest.mark.parametrize("layout", ["2x2", "interleaved", "3+1"])
def test_hier_decisions_equal_the_flat_path(pools, layout, seed):
    hosts = HOST_MAPS[layout]
    res = pools.run(len(hosts), _hier_matches_flat, hosts, seed, 40)
    assert all(r == res[0] for r in res), f"seed {seed}: ranks disagree"
    assert len(res[0]) == 42


@pytest.mark.slow
def test_hier_decisions_equal_the_flat_path_w8(pools, seed):
    res = pools.run(8, _hier_matches_flat, HOST_MAPS["2x4"], seed, 24)
    assert all(r == res[0] for r in res), f"seed {seed}: ranks disagree"


def _groups_keep_counts_uniform(rank, world, hosts):
    # The hier path makes two groups on every member, so a later lazy group among the same
    # members (torch names it from each member's group count) can still be created.
    from torch.distributed import distributed_c10d as c10d

    try:
        g = _fresh_group(rank, hosts)
        before = len(c10d._world.pg_names)
        assert resolve_sync("auto", g) == "hier"
        counts = [None] * world
        dist.all_gather_object(counts, (before, len(c10d._world.pg_names)), group=g)
        return counts
    finally:
        config.set_var("ATTNCOMM_TEST_HOST", None)
        close_shm_channels()


def test_hier_groups_leave_group_counts_uniform(pools):
    counts = pools.run(4, _groups_keep_counts_uniform, HOST_MAPS["3+1"])[0]
    # equal on every member (the point); at least the hier path's two more than before
    assert len(set(counts)) == 1 and counts[0][1] >= counts[0][0] + 2, counts


def _counts_differ(rank, world, hosts):
    # rank 0 has one group more than the others: the leader groups cannot be made lazily
    try:
        g = _fresh_group(rank, hosts)
        resolve_sync("cpu", g)  # the group's own lazy groups (argument checks) made first
        if rank == 0:
            dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        d = sync_decision("auto", g)
        try:
            resolve_sync("hier", g)
            err = "no error"
        except ValueError as exc:
            err = str(exc)
        rows = exchange_rows([rank] * 6, g, sync="auto")
        return d.backend, d.fallback_reason, err, rows
    finally:
        if rank != 0:  # every member one more: the pool's counts are equal again
            dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        config.set_var("ATTNCOMM_TEST_HOST", None)
        close_shm_channels()


def test_auto_falls_back_to_gloo_when_groups_cannot_be_made(pools):
    for backend, why, err, rows in pools.run(4, _counts_differ, HOST_MAPS["2x2"]):
        assert backend == "cpu" and "span 2 hosts" in why, why
        assert "different numbers of process groups" in why, why
        assert "sync='hier' cannot run" in err and "different numbers" in err, err
        assert rows == [[q] * 6 for q in range(4)]


# -- a dead host leader ----------------------------------------------------------------------

def _step(rank, world, timeout_s):
    return prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 1),
                                  dp_size=world, attn_tp_size=1, group=None, sync="auto",
                                  get_idle_batch=lambda: BatchView(ForwardMode.IDLE),
                                  timeout_s=timeout_s)[1]


def _fault_rank(rank, world, path, hosts, victim, when, timeout_s, results):
    from attncomm.launch import init_distributed

    config.set_var("ATTNCOMM_TEST_HOST", f"h{hosts[rank]}")
    config.set_var("ATTNCOMM_TIMEOUT_S", None)  # the groups keep the 60 s default
    try:
        init_distributed(rank, world, "cpu", f"file://{path}")
        warm = [_step(rank, world, timeout_s).sync for _ in range(3)]
        if rank == victim:
            if when == "before":
                os._exit(17)
            # "mid": it dies as its exchange reaches the leaders' all_gather (its row is out)
            hier.all_gather_tensor = lambda *a, **k: os._exit(17)
        t0 = time.monotonic()
        try:
            _step(rank, world, timeout_s)
            out = ("returned", None, time.monotonic() - t0, "")
        except PeerTimeoutError as exc:
            out = ("PeerTimeoutError", exc.peer_ranks, time.monotonic() - t0, str(exc))
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out = (type(exc).__name__, None, time.monotonic() - t0, str(exc))
        results.put((rank, warm, out))
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, None, ("setup failed", None, 0.0, repr(exc))))
    os._exit(0)


def _run_fault(hosts, victim, when, timeout_s):
    from attncomm.testing.faults import _context

    ctx = _context()
    fd, path = tempfile.mkstemp(prefix="attncomm-topology-")
    os.close(fd)
    os.unlink(path)
    results = ctx.SimpleQueue()
    world = len(hosts)
    procs = [ctx.Process(target=_fault_rank, daemon=True,
                         args=(r, world, path, hosts, victim, when, timeout_s, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got, deadline = {}, time.monotonic() + timeout_s + 120
    while len(got) < world - 1 and time.monotonic() < deadline:
        if not results.empty():
            rank, warm, out = results.get()
            got[rank] = (warm, out)
        else:
            time.sleep(0.02)
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)
    codes = [p.exitcode for p in procs]
    try:
        os.unlink(path)
    except OSError:
        pass
    return got, codes


@pytest.mark.slow
@pytest.mark.parametrize("victim,when,named", [
    (2, "mid", {0: [2], 1: [2], 3: [2]}),      # the leader of host 1, inside its exchange
    (2, "before", {0: [2], 1: [2], 3: [2]}),   # the leader of host 1, before the step
    (3, "before", {0: [2], 1: [2], 2: [3]}),   # a rank that is not a leader
])
def test_dead_rank_raises_peer_timeout_on_every_rank(victim, when, named):
    timeout_s = 2.0
    got, codes = _run_fault(HOST_MAPS["2x2"], victim, when, timeout_s)
    assert codes[victim] == 17, codes
    assert sorted(got) == sorted(named), (got, codes)
    for rank, (warm, out) in got.items():
        kind, peers, elapsed, msg = out
        assert warm == ["hier"] * 3, (rank, warm, out)
        assert kind == "PeerTimeoutError", (rank, out)
        assert peers == named[rank], (rank, out)
        assert elapsed <= timeout_s + 5, (rank, out)


# -- the CLI: env and the bench on simulated hosts ----------------------------------------------

@pytest.mark.slow
def test_env_lists_the_hosts_of_a_live_group(tmp_path, capsys):
    import argparse
    import json

    from attncomm import envinfo

    path = tmp_path / "env.json"
    assert envinfo.main(argparse.Namespace(json=str(path), world_size=4, hosts=2)) == 0
    text = capsys.readouterr().out
    assert "live group: 4 ranks (gloo, cpu) on 2 host(s):" in text, text
    assert "test:sim1: ranks [2, 3]" in text and "DP sync auto: hier" in text, text
    topo = json.loads(path.read_text())["topology"]
    assert [h["ranks"] for h in topo["hosts"]] == [[0, 1], [2, 3]]
    assert {r["backend"]: r["available"] for r in topo["single_host"]} == {
        "symm_a2a": False, "symm": False, "ce": False, "shm": False}
    with pytest.raises(ValueError, match="--hosts"):
        envinfo.main(argparse.Namespace(json=None, world_size=2, hosts=3))


@pytest.mark.slow
def test_bench_dp_sync_on_simulated_hosts(tmp_path):
    import argparse
    import json
    import math

    from attncomm.bench import dp_sync as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "dp.json"
    args = p.parse_args(["--device", "cpu", "--world-size", "4", "--hosts", "2", "--steps",
                         "40", "--block", "20", "--hidden", "64", "--tokens", "1", "--iters",
                         "2", "--warmup", "1", "--ops", "dp_scatter", "--json", str(out),
                         "--no-progress", "--markdown", str(tmp_path / "dp.md")])
    assert bench.main(args) == 0
    doc = json.loads(out.read_text())
    syncs = {r["sync"]: r for r in doc["records"] if "sync" in r}
    assert sorted(syncs) == ["cpu", "device", "hier"]
    assert all(r["hosts"] == 2 and math.isfinite(r["sync_us"]) and r["sync_us"] > 0
               for r in syncs.values())
    assert doc["meta"]["hosts"] == 2 and "after" in doc["meta"]["load_average"]
    assert "W=4 as 2 simulated hosts" in (tmp_path / "dp.md").read_text()
    for bad in (["--hosts", "2", "--backends", "shm"], ["--hosts", "5"]):
        assert bench.main(p.parse_args(["--device", "cpu", "--world-size", "4", *bad])) == 2
