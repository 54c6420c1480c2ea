"""scripts/ab_tree.py, the A/B of two trees' scripts, with a toy script in two toy trees: each
tree's own script in its own process per round, dumps compared bit for bit (a one-bit
difference is found and named), times summarised per key, a failing run fails the A/B, and a
tree whose script cannot dump is driven by this tree's script with ``--tree``."""
from __future__ import annotations

import json
import os
import sys

import pytest

pytestmark = pytest.mark.slow  # subprocesses that import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import ab_tree  # noqa: E402

TOY = '''
import argparse, json, os, sys
import torch
p = argparse.ArgumentParser()
p.add_argument("--label"); p.add_argument("--json"); p.add_argument("--dump")
p.add_argument("--tree", default=None); p.add_argument("--n", type=int, default=3)
a = p.parse_args()
tree = a.tree or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
flip = int(open(os.path.join(tree, "FLIP")).read())
if flip < 0:
    sys.exit(3)
x = torch.arange(a.n, dtype=torch.float32)
x.view(torch.int32)[0] ^= flip  # a one-bit difference when FLIP is 1
if a.dump:
    torch.save({"x": x, "big": "sha256 0 same"}, a.dump)
recs = [{"key": f"n={a.n}", "gpu_us": 10.0 + flip, "host_us": 2.0, "tree": tree}]
json.dump({"records": recs}, open(a.json, "w"))
'''


def _tree(path, flip, dump_capable=True):
    os.makedirs(path / "scripts")
    text = TOY if dump_capable else TOY.replace('p.add_argument("--dump")',
                                                'p.add_argument("--d" "ump")')
    (path / "scripts" / "toy.py").write_text(text)
    (path / "FLIP").write_text(str(flip))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("flip,want", [(0, 0), (1, 1), (-1, 1)])
def test_ab_compares_bits_and_times(tmp_path, capsys, flip, want):
    base = _tree(tmp_path / "base", 0)
    this = _tree(tmp_path / "this", flip)
    out = tmp_path / "out"
    rc = ab_tree.main(os.path.join(this, "scripts", "toy.py"), base,
                      ["--n", "4", "--ab", base, "--rounds", "2", "--json", "x"], rounds=2,
                      out=str(out))
    printed = capsys.readouterr().out
    assert rc == want, printed
    summary = json.loads((out / "toy-summary.json").read_text())
    if flip == 0:
        assert summary["bitwise_equal"] and "bitwise equal" in printed
        assert summary["keys"]["n=4"]["gpu_us"]["ratio"] == 1.0
        assert [r["round"] for r in summary["runs"]["this"]] == [0, 1]
    elif flip == 1:
        assert not summary["bitwise_equal"] and "x: 1 bytes differ" in printed
        assert summary["keys"]["n=4"]["gpu_us"]["ratio"] == 11.0 / 10.0
    else:
        assert summary["failed"] == ["round 0 this: rc=3", "round 1 this: rc=3"]


def test_a_tree_without_dumps_runs_this_trees_script(tmp_path, capsys):
    base = _tree(tmp_path / "base", 0, dump_capable=False)
    this = _tree(tmp_path / "this", 0)
    assert ab_tree.command(base, "toy.py", this) == (
        [os.path.join(this, "scripts", "toy.py"), "--tree", base],
        "this tree's script (--tree)")
    rc = ab_tree.main(os.path.join(this, "scripts", "toy.py"), base, [], rounds=1,
                      out=str(tmp_path / "out"))
    assert rc == 0, capsys.readouterr().out
    runs = json.loads((tmp_path / "out" / "toy-summary.json").read_text())["runs"]
    assert runs["base"][0]["tree"] == base and runs["this"][0]["tree"] == this


def test_strip_drops_the_drivers_own_options():
    assert ab_tree.strip(["--ab", "main", "--tokens", "1", "2", "--rounds=3", "--json", "j",
                          "--pdl", "--tree", "t", "--out", "o"]) == ["--tokens", "1", "2",
                                                                      "--pdl"]
