"""The ``attncomm bench`` commands share one scaffold: the same common options, with the
same defaults, and a help text for every option."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from attncomm import cli
from attncomm.bench import report
from attncomm.bench.common import markdown_lines, print_table
from attncomm.bench import dcp as dcp_bench
from attncomm.bench import dp_sync as dp_bench
from attncomm.bench import ring as ring_bench
from attncomm.bench import ulysses as ulysses_bench

BENCHES = {"dcp": dcp_bench, "ulysses": ulysses_bench, "dp-sync": dp_bench, "ring": ring_bench}
COMMON = ("--world-size", "--device", "--backends", "--json", "--markdown", "--plot",
          "--no-progress")


def _parser(mod) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench")
    mod.add_arguments(p)
    return p


def _options(p):
    return {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("name", list(BENCHES))
def test_every_option_has_help(name):
    p = _parser(BENCHES[name])
    missing = [a.option_strings for a in p._actions
               if a.option_strings and not (a.help and a.help.strip())]
    assert not missing, f"bench {name}: options without help: {missing}"


def test_common_options_agree():
    parsers = {n: _parser(m) for n, m in BENCHES.items()}
    for opt in COMMON:
        seen = {}
        for n, p in parsers.items():
            a = _options(p).get(opt)
            assert a is not None, f"bench {n} has no {opt}"
            seen[n] = (a.default, a.nargs, type(a).__name__, a.choices if opt != "--backends"
                       else None)
        assert len(set(seen.values())) == 1, f"{opt} differs: {seen}"
    for n, p in parsers.items():
        args = p.parse_args([])
        assert args.device == report.default_device() and args.world_size == 2, n


def test_backends_are_space_separated_and_checked(capsys):
    p = _parser(ulysses_bench)
    assert p.parse_args(["--backends", "ce", "all_to_all"]).backends == ["ce", "all_to_all"]
    # the older spelling and commas keep working
    assert p.parse_args(["--transports", "all_to_all,ce"]).backends == ["all_to_all", "ce"]
    assert _parser(dp_bench).parse_args(["--syncs", "shm", "cpu"]).backends == ["shm", "cpu"]
    assert _parser(dcp_bench).parse_args(["--backends", "a2a", "ag_rs"]).backends == \
        ["a2a", "ag_rs"]
    with pytest.raises(SystemExit) as info:
        p.parse_args(["--backends", "nccl"])
    assert info.value.code == 2 and "'nccl' is not one of all_to_all ce" in capsys.readouterr().err


def test_cli_wires_the_benches():
    parser = cli.build_parser()
    for name in BENCHES:
        args = parser.parse_args(["bench", name, "--device", "cpu", "--backends",
                                  {"dcp": "a2a", "ulysses": "all_to_all", "dp-sync": "cpu",
                                   "ring": "ring"}[name]])
        assert args._main == cli._BENCHES[name]


def test_emit_writes_what_was_asked(tmp_path, capsys):
    args = argparse.Namespace(json=str(tmp_path / "a" / "r.json"),
                              markdown=str(tmp_path / "b" / "r.md"), plot=None)
    rep = report.emit(args, report.Report(meta={"device": "cpu"}, records=[{"x": 1}],
                                          markdown="# title", plot={"series": {}}))
    assert json.loads((tmp_path / "a" / "r.json").read_text()) == {
        "meta": {"device": "cpu"}, "records": [{"x": 1}]}
    assert (tmp_path / "b" / "r.md").read_text() == "# title\n"
    assert rep.written == [args.json, args.markdown]
    assert capsys.readouterr().out.count("wrote ") == 2
    assert report.usage_error("dcp", "bad --tokens") == 2
    assert capsys.readouterr().err == "attncomm bench dcp: error: bad --tokens\n"


def test_table_columns_share_one_format(capsys):
    # What a user saw: `8436` beside `1.559e+04` in one column, and `0.0` for every busbw up to
    # 16 KiB. Each column now has one format, with the digits its smallest value needs.
    rows = [dict(backend="a2a", tokens=1, latency_us=8436.2, busbw_gbps=0.0021, note=None),
            dict(backend="symm", tokens=64, latency_us=15590.4, busbw_gbps=0.0163, note="x"),
            dict(backend="ce", tokens=128, latency_us=3.05, busbw_gbps=12.5, note=None)]
    cols = ["backend", "tokens", "latency_us", "busbw_gbps", "note"]
    text = print_table(rows, cols)
    assert text in capsys.readouterr().out
    body = [line.split() for line in text.splitlines()[2:]]
    md = [line.strip("| ").split(" | ") for line in markdown_lines(cols, [
        [r[c] for c in cols] for r in rows])[2:]]
    for cells in (body, md):
        assert [c[1] for c in cells] == ["1", "64", "128"]
        assert [c[4] for c in cells] == ["-", "x", "-"]
        for i, key in ((2, "latency_us"), (3, "busbw_gbps")):
            shown = [c[i] for c in cells]
            assert len({s.index(".") - len(s) for s in shown}) == 1, shown  # same decimals
            assert not any("e" in s for s in shown), shown
            for s, r in zip(shown, rows):  # every value to 0.5 %
                assert abs(float(s) - r[key]) <= 0.005 * r[key], (shown, r[key])


def test_graph_skip_reason_only_for_staged_collective_backends(monkeypatch):
    """On ranks that share a GPU (a gloo group) a collective backend's calls go through host
    copies, which a CUDA graph cannot capture: its graph mode is skipped with the reason; the
    peer-mapped backends, and every backend where collectives take device tensors, are timed."""
    import types

    from attncomm import collectives
    from attncomm.bench.common import graph_skip_reason
    cuda_like = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    staged = {"value": True}
    monkeypatch.setattr(collectives, "needs_host", lambda group, *t: staged["value"])
    for name in ("reference", "ag_rs", "a2a", "all_gather", "all_to_all"):
        assert "host copies" in graph_skip_reason(name, cuda_like), name
    for name in ("symm_a2a", "symm", "ce"):
        assert graph_skip_reason(name, cuda_like) is None, name
    assert graph_skip_reason("a2a", torch.zeros(1)) is None  # a CPU bench has no graph mode
    staged["value"] = False  # NCCL: collectives take device tensors
    assert graph_skip_reason("a2a", cuda_like) is None
