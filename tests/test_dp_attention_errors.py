"""DP-attention sync under errors that only some ranks see: every rank raises the same way (no
rank left waiting), a row that did not arrive is never read as data, and out-of-range values are
named. Gloo CPU ranks (the session pool); every case ends with a normal step to prove the ranks
are still in step."""
from __future__ import annotations

import pytest
import torch

from attncomm import PeerTimeoutError
from attncomm.dp_attention import BatchView, ForwardMode, MLPSyncBatchInfo, prepare_mlp_sync_batch

IDLE = int(ForwardMode.IDLE)
T = 20.0  # the bound a rank left waiting would hit (the fixed code never waits for it)


def _decode(rank, world, sync, **kw):
    return prepare_mlp_sync_batch(BatchView(ForwardMode.DECODE, batch_size=rank + 1),
                                  dp_size=kw.pop("dp_size", world), attn_tp_size=1, group=None,
                                  get_idle_batch=lambda: BatchView(ForwardMode.IDLE), sync=sync,
                                  timeout_s=T, **kw)


def _outcome(fn):
    try:
        fn()
        return "ok"
    except ValueError as exc:
        return "ValueError: " + str(exc)


def _one_rank_errors(rank, world, sync):
    out = {}
    # one rank's sizes do not match the group
    out["sizes"] = _outcome(lambda: _decode(rank, world, sync,
                                            dp_size=world + 1 if rank == 1 else world))
    # one rank's active_ranks has the wrong length
    act = [True] * (world + 1 if rank == world - 1 else world)
    out["active_len"] = _outcome(lambda: _decode(rank, world, sync, active_ranks=act))
    # an inactive rank with bad sizes still makes every rank raise (it is not masked away)
    act = [r != 0 for r in range(world)]
    out["inactive_sizes"] = _outcome(lambda: _decode(rank, world, sync, active_ranks=act,
                                                     dp_size=0 if rank == 0 else world))
    # one rank's count outside the int64 range
    big = (1 << 63) if rank == 1 else rank
    out["big"] = _outcome(lambda: MLPSyncBatchInfo(world, 1, 1, big, 0, True, False, True,
                                                   int(ForwardMode.DECODE)).all_gather(
        None, None, sync=sync, timeout_s=T))
    # a batch whose batch_size is not an int (TypeError inside the count) on one rank
    b = BatchView(ForwardMode.DECODE, batch_size=None if rank == 0 else 2)
    out["type"] = _outcome(lambda: prepare_mlp_sync_batch(
        b, dp_size=world, attn_tp_size=1, group=None, sync=sync, timeout_s=T,
        get_idle_batch=lambda: BatchView(ForwardMode.IDLE)))
    out["after"] = _decode(rank, world, sync)[1].global_num_tokens
    return out


@pytest.mark.parametrize("sync", ["shm", "cpu", "device"])
def test_error_on_one_rank_raises_everywhere(pools, sync):
    world = 3
    for r, out in enumerate(pools.run(world, _one_rank_errors, sync)):
        assert out["sizes"].startswith("ValueError: dp_attention sync: invalid input on "
                                       "rank(s) [1] — rank 1: dp_size·tp_size·cp_size does not "
                                       "match"), out
        assert ("must equal the group size 3" in out["sizes"]) == (r == 1), out
        assert "rank(s) [2] — rank 2: invalid active_ranks" in out["active_len"], out
        assert ("active_ranks has 4 entries" in out["active_len"]) == (r == 2), out
        assert "rank(s) [0] — rank 0: dp_size·tp_size·cp_size" in out["inactive_sizes"], out
        assert "rank(s) [1] — rank 1: invalid batch" in out["big"], out
        assert ("2**63 - 1" in out["big"]) == (r == 1), out
        assert "rank(s) [0] — rank 0: invalid batch" in out["type"], out
        assert out["after"] == [1, 2, 3]


class _Done:
    def wait(self, *args, **kwargs):
        return True


def _drop_rows(missing, how):
    """A stand-in for the gather that returns without writing the rows of ``missing``."""
    from attncomm import collectives

    def gather(output, input, group=None, async_op=False):
        if how == "nothing":
            return _Done()
        full = torch.empty_like(output)
        collectives.all_gather_tensor(full, input, group)
        rows = full.view(-1, input.numel())
        keep = [r for r in range(rows.shape[0]) if r not in missing]
        output.view(-1, input.numel())[keep] = rows[keep]
        return _Done()
    return gather


def _unsent_rows(rank, world, sync):
    from attncomm.dp_attention import rows as sync_mod  # where the gather is called

    out = {}
    real = sync_mod.all_gather_tensor
    _decode(rank, world, sync)  # a previous step's rows may sit in a reused block
    cases = [("one", [world - 1], None), ("one_masked", [0], [False] + [True] * (world - 1)),
             ("nothing", list(range(world)), None)]
    for name, missing, active in cases:
        sync_mod.all_gather_tensor = _drop_rows(missing, "nothing" if name == "nothing" else "")
        try:
            _decode(rank, world, sync, active_ranks=active)
            out[name] = "no error"
        except PeerTimeoutError as exc:
            out[name] = (exc.peer_ranks, str(exc))
        finally:
            sync_mod.all_gather_tensor = real
    out["after"] = _decode(rank, world, sync)[1].global_num_tokens
    return out


@pytest.mark.parametrize("sync", ["cpu", "device"])
def test_rows_that_did_not_arrive_raise(pools, sync):
    world = 3
    for out in pools.run(world, _unsent_rows, sync):
        assert out["one"][0] == [2] and "rank(s) [2]" in out["one"][1], out
        assert out["one_masked"][0] == [0], out      # an inactive rank must still deliver
        assert out["nothing"][0] == [0, 1, 2], out
        assert out["after"] == [1, 2, 3]


def _bad_idle_batch(rank, world, sync):
    got = {}
    bad = [BatchView(ForwardMode.DECODE, batch_size=1), None, "idle"]
    for i, b in enumerate(bad):
        mine = None if rank == 1 else BatchView(ForwardMode.DECODE, batch_size=2)
        try:
            batch, info = prepare_mlp_sync_batch(mine, dp_size=world, attn_tp_size=1,
                                                 group=None, get_idle_batch=lambda: b,
                                                 sync=sync, timeout_s=T)
            got[i] = ("ok", info.global_num_tokens)
        except ValueError as exc:
            got[i] = ("ValueError", str(exc))
    got["after"] = _decode(rank, world, sync)[1].global_num_tokens
    return got


@pytest.mark.parametrize("sync", ["shm", "cpu"])
def test_bad_idle_batch_raises_on_its_rank_only(pools, sync):
    """Documented: ``get_idle_batch`` runs after the exchange, only where API.md says; a bad
    result raises on that rank alone, and nothing collective follows, so the ranks stay in
    step."""
    world = 3
    res = pools.run(world, _bad_idle_batch, sync)
    for r, out in enumerate(res):
        for i in range(3):
            if r == 1:
                assert out[i][0] == "ValueError" and "must return an IDLE" in out[i][1], out
            else:
                assert out[i] == ("ok", [2, 0, 2]), out
        assert out["after"] == [1, 2, 3]


def _shm_range(rank, world):
    from attncomm.dp_attention.shm import ShmRowExchange
    from attncomm.dp_attention.sync import exchange_rows
    from attncomm import cpu_group

    ch = ShmRowExchange(cpu_group(None), 6, timeout_s=T)
    out = {}
    try:
        for name, row in (("high", [0, 0, 1 << 63, 0, 0, 0]),
                          ("low", [0, -(1 << 63) - 1] + [0] * 4), ("type", [0, 0, 0, "x", 0, 0])):
            try:
                ch.exchange_flat(row, timeout_s=T)
                out[name] = "no error"
            except ValueError as exc:
                out[name] = str(exc)
        lim = [(1 << 63) - 1, -(1 << 63), rank, 0, 0, 0]
        out["limits"] = list(ch.exchange_flat(lim, timeout_s=T))   # still in step
    finally:
        ch.close()
    try:
        exchange_rows([0, 0, 0, 0, 1 << 64, 0], None, sync="cpu")
        out["rows"] = "no error"
    except ValueError as exc:
        out["rows"] = str(exc)
    return out


def test_out_of_range_row_values_are_named(pools):
    world = 2
    hi, lo = (1 << 63) - 1, -(1 << 63)
    for out in pools.run(world, _shm_range):
        assert "row field 2 = 9223372036854775808" in out["high"], out
        assert "row field 1 = -9223372036854775809" in out["low"], out
        assert "row field 3 = 'x'" in out["type"], out
        assert out["limits"] == [hi, lo, 0, 0, 0, 0, hi, lo, 1, 0, 0, 0]
        assert "field 4 = 18446744073709551616" in out["rows"], out


def _sync_values(rank, world):
    from attncomm.dp_attention import close_shm_channels
    out = {}
    for name, values in (("differ", ["shm", "cpu", "shm"]), ("invalid", ["cpu", "cpu", "nope"])):
        close_shm_channels()  # forget the plans: the check runs on a value's first use
        out[name] = _outcome(lambda: _decode(rank, world, values[rank]))
    out["after"] = _decode(rank, world, "cpu")[1].global_num_tokens
    return out


def test_sync_argument_differing_across_ranks_raises_everywhere(pools):
    for out in pools.run(3, _sync_values):
        assert out["differ"].startswith("ValueError: dp_attention sync: ranks disagree"), out
        assert "= 1 (rank 0), 2 (rank 1), 1 (rank 2)" in out["differ"], out
        assert ("ValueError: dp_attention sync: invalid arguments — rank 2: sync must be one of"
                in out["invalid"] and "'nope'" in out["invalid"]), out
        assert out["after"] == [1, 2, 3]
