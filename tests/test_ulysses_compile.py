"""torch.compile of the Ulysses exchanges on gloo CPU ranks: ``seq_to_head`` / ``head_to_seq``
(a round trip, ``output=``) and ``UlyssesAttention`` (sequential and pipelined, GQA, norm +
RoPE) inside ``torch.compile(fullgraph=True)`` with zero graph breaks, bit for bit equal to
eager, with ``aot_eager`` and ``inductor``; the graph holds the transport an eager call
decided (no decision, and no fallback, while tracing); a shape no eager call has seen raises
the warm-up error."""
from __future__ import annotations

import pytest
import torch

from attncomm import ulysses
from attncomm.ulysses import UlyssesAttention

_GRAPHS: list = []


def _recording(gm, example_inputs):
    """A backend that keeps the traced graph's custom-op calls and runs the graph as it is."""
    _GRAPHS.append([(str(n.target), [a for a in n.args if not isinstance(a, torch.fx.Node)])
                    for n in gm.graph.nodes
                    if n.op == "call_function" and "attncomm" in str(n.target)])
    return gm.forward


def _round_trip(x, out, y_out):
    y = ulysses.seq_to_head(x)
    ulysses.seq_to_head(x, output=y_out)
    return ulysses.head_to_seq(y, num_heads=x.shape[2], output=out), y


def _warm_up_error(fn, *args):
    try:
        torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    except Exception as exc:  # noqa: BLE001 - dynamo wraps the ValueError
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _functional(rank, world, seed, backends):
    """Round trip (with and without ``output=``) compiled before and after the eager warm-up of
    its shapes (W = 2)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn((1, 3, 2 * world + 1, 8), generator=g)
    h_r = 2 + (rank == 0)  # head_split(2W + 1, W) at W = 2

    def bufs():
        return torch.full_like(x, float("nan")), torch.full((1, 6, h_r, 8), float("nan"))

    res = {"cold": _warm_up_error(_round_trip, x, *bufs())}
    want_back, want_y = _round_trip(x, *bufs())  # the eager warm-up
    _GRAPHS.clear()
    torch.compile(_round_trip, fullgraph=True, backend=_recording)(x, *bufs())
    res["ops"], res["rank"] = _GRAPHS[-1], rank
    res["breaks"] = torch._dynamo.explain(_round_trip)(x, *bufs()).graph_break_count
    for backend in backends:
        torch._dynamo.reset()
        out, y_out = bufs()
        back, y = torch.compile(_round_trip, fullgraph=True, backend=backend)(x, out, y_out)
        res[backend] = (torch.equal(back, want_back) and back is out and torch.equal(y, want_y)
                        and torch.equal(y_out, want_y) and torch.equal(back, x))
    # explicit all_to_all: nothing to decide, no warm-up needed
    torch._dynamo.reset()
    z = torch.randn((2, 2, world, 4), generator=g)
    got = torch.compile(lambda t: ulysses.seq_to_head(t, backend="all_to_all"), fullgraph=True,
                        backend="aot_eager")(z)
    res["explicit"] = torch.equal(got, ulysses.seq_to_head(z, backend="all_to_all"))
    return res


@pytest.mark.slow
def test_round_trip_compiles_without_graph_breaks(pools, seed):
    for res in pools.run(2, _functional, seed, ("aot_eager", "inductor")):
        assert "first time inside CUDA graph capture or torch.compile tracing" in res["cold"] \
            and "ValueError" in res["cold"], res["cold"]
        names = [name.removesuffix(".default") for name, _ in res["ops"]]
        assert names == ["attncomm.ulysses_seq_to_head", "attncomm.ulysses_seq_to_head_out",
                         "attncomm.ulysses_head_to_seq_out"], res["ops"]
        # the transport in the graph is the one the eager call decided (gloo: all_to_all)
        assert all("all_to_all" in args for _, args in res["ops"]), res["ops"]
        assert all(res["rank"] in args for _, args in res["ops"]), res["ops"]
        assert res["breaks"] == 0
        assert res["aot_eager"] and res["inductor"] and res["explicit"], f"seed {seed}: {res}"


def _attention(rank, world, seed, backends):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed + rank)
    d = 8
    q, k, v = (torch.randn((1, 4, h, d), generator=g) for h in (4 * world, world, world))
    norm = (torch.randn(d, generator=g), torch.randn(d, generator=g), 1e-6)
    rope = tuple(torch.randn((4 * world, d), generator=torch.Generator().manual_seed(seed + i))
                 for i in range(2))
    res = {}
    for groups in (0, 2):
        mod = UlyssesAttention(pipeline_groups=groups, qk_norm=norm)
        res[(groups, "cold")] = _warm_up_error(mod, q, k, v)
        want = mod(q, k, v, rope=rope, causal=True)
        call = (q, k, v)
        res[(groups, "breaks")] = torch._dynamo.explain(mod)(*call, rope=rope,
                                                             causal=True).graph_break_count
        for backend in backends:
            torch._dynamo.reset()
            compiled = torch.compile(mod, fullgraph=True, backend=backend)
            got = [compiled(*call, rope=rope, causal=True) for _ in range(2)]
            res[(groups, backend)] = all(torch.equal(o, want) for o in got)
    mod.close()
    torch._dynamo.reset()
    res["closed"] = _warm_up_error(mod, q, k, v)
    never_run = UlyssesAttention(pipeline_groups=0)
    never_run.close()
    torch._dynamo.reset()
    res["closed cold"] = _warm_up_error(never_run, q, k, v)  # closed before any plan
    return res


@pytest.mark.slow
def test_attention_compiles_without_graph_breaks(pools, seed):
    for res in pools.run(2, _attention, seed, ("aot_eager", "inductor")):
        for groups in (0, 2):
            cold = res[(groups, "cold")]
            assert "UlyssesAttention: the forward shape" in cold and "eagerly" in cold, cold
            assert res[(groups, "breaks")] == 0
            assert res[(groups, "aot_eager")] and res[(groups, "inductor")], f"seed {seed}"
        assert "UlyssesAttention is closed" in res["closed"], res["closed"]
        assert "UlyssesAttention is closed" in res["closed cold"], res["closed cold"]
