"""A/B of this tree against another revision's: each tree's script in processes of its own,
their results compared bit for bit and their times side by side (one device call).

    python scripts/<script>.py --ab REV|PATH [--rounds 2] [--out DIR] [the script's options]

``REV`` is ``git archive``d into ``.ab/<commit>/`` (git-ignored) once; ``PATH`` is a tree already
extracted (e.g. an archive carried to a device machine, which has no git). Every round runs the
base tree, then this one (odd rounds the other way round), each as
``python <tree>/scripts/<script>.py ... --json --dump``, so both import their own ``attncomm``
and compile their own kernels. A tree whose script has no ``--dump`` (the simulators before
this protocol) is driven by this tree's script with ``--tree <tree>``: its kernels and wrappers,
this tree's harness (which still speaks the earlier launch interfaces). The first round's dumps
(every output, fixed seeds) must be equal bit for bit; the times are medians over the rounds,
per key (token count, variant), with the ratio this / base. Exit status 1 when any run fails or
any bit differs.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

#: Options the driver sets itself in every run (each with one value).
_OWN = ("--ab", "--rounds", "--out", "--json", "--dump", "--label", "--tree")


def resolve(base: str, root: str) -> str:
    """The base tree: ``base`` if it is a directory, else ``git archive`` of revision ``base``
    of the repository at ``root``, extracted into ``root/.ab/<commit>`` (reused)."""
    if os.path.isdir(base):
        return os.path.abspath(base)
    sha = subprocess.run(["git", "-C", root, "rev-parse", "--verify", f"{base}^{{commit}}"],
                         check=True, capture_output=True, text=True).stdout.strip()
    dest = os.path.join(root, ".ab", sha[:12])
    if not os.path.isdir(dest):
        tmp = dest + ".part"
        os.makedirs(tmp, exist_ok=True)
        archive = subprocess.Popen(["git", "-C", root, "archive", sha], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", tmp], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {sha} failed")
        os.replace(tmp, dest)
    return dest


def strip(argv: list[str]) -> list[str]:
    """``argv`` without the options the driver sets (``_OWN``)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x in _OWN:
            skip = True
        elif not any(x.startswith(o + "=") for o in _OWN):
            out.append(x)
    return out


def command(tree: str, name: str, this: str) -> tuple[list[str], str]:
    """How to run script ``name`` on ``tree``: its own, or the one of tree ``this`` with
    ``--tree``."""
    own = os.path.join(tree, "scripts", name)
    if os.path.exists(own) and "--dump" in open(own).read():
        return [own], "its own script"
    return [os.path.join(this, "scripts", name), "--tree", tree], "this tree's script (--tree)"


def same_bits(a_path: str, b_path: str) -> tuple[bool, list[str]]:
    """Whether two dumps hold the same keys and bytes; the differences found (first 10)."""
    import torch
    a, b = torch.load(a_path), torch.load(b_path)
    diffs = []
    if set(a) != set(b):
        diffs.append(f"keys differ: only base {sorted(set(a) - set(b))[:5]}, only this "
                     f"{sorted(set(b) - set(a))[:5]}")
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if isinstance(x, str) or isinstance(y, str):  # digests of large outputs
            if x != y:
                diffs.append(f"{k}: {x} vs {y}")
        elif x.dtype != y.dtype or x.shape != y.shape:
            diffs.append(f"{k}: {x.dtype} {list(x.shape)} vs {y.dtype} {list(y.shape)}")
        elif not torch.equal(x.view(torch.uint8), y.view(torch.uint8)):
            n = int((x.view(torch.uint8) != y.view(torch.uint8)).sum())
            diffs.append(f"{k}: {n} bytes differ")
    return not diffs, diffs[:10]


def _medians(records: list[dict], field: str) -> dict:
    by = {}
    for r in records:
        if r.get(field) is not None:
            by.setdefault(r["key"], []).append(r[field])
    return {k: statistics.median(v) for k, v in by.items()}


def summarize(runs: dict) -> dict:
    """Per key: median GPU µs and host µs of each tree over the rounds, and this / base."""
    rows = {}
    for field in ("gpu_us", "host_us"):
        base, this = _medians(runs["base"], field), _medians(runs["this"], field)
        for k in base:
            if k in this:
                rows.setdefault(k, {})[field] = {"base": base[k], "this": this[k],
                                                 "ratio": this[k] / base[k]}
    print(f"\n{'key':>28} {'GPU µs base':>11} {'this':>8} {'ratio':>6} "
          f"{'host µs base':>12} {'this':>8} {'ratio':>6}")
    for k, v in rows.items():
        g, h = v.get("gpu_us"), v.get("host_us")
        gs = f"{g['base']:>11.2f} {g['this']:>8.2f} {g['ratio']:>6.3f}" if g else " " * 27
        hs = f"{h['base']:>12.2f} {h['this']:>8.2f} {h['ratio']:>6.3f}" if h else ""
        print(f"{k:>28} {gs} {hs}")
    return rows


def main(script: str, base: str, argv: list[str], *, rounds: int = 2,
         out: str | None = None) -> int:
    """Run the A/B of ``script`` (a path in this tree) against ``base`` (see the module
    docstring); ``argv``: the script's arguments (the driver's own are dropped). The summary
    (``<script>-summary.json`` in ``out``) is rewritten after every run, so a call cut short
    keeps what ran."""
    name = os.path.basename(script)
    stem = name[:-3]
    root = os.path.dirname(os.path.dirname(os.path.abspath(script)))
    trees = {"base": resolve(base, root), "this": root}
    out = out or tempfile.mkdtemp(prefix="attncomm-ab-")
    os.makedirs(out, exist_ok=True)
    args = strip(argv)
    dumps = [os.path.join(out, f"{stem}-{t}.pt") for t in ("base", "this")]
    state = {"script": name, "base": trees["base"], "this": root, "rounds": rounds,
             "args": args, "bitwise_equal": None, "differences": [], "failed": [],
             "keys": {}, "runs": {"base": [], "this": []}}
    for rnd in range(max(1, rounds)):
        for label in (("base", "this") if rnd % 2 == 0 else ("this", "base")):
            cmd, how = command(trees[label], name, root)
            js = os.path.join(out, f"{stem}-{label}-{rnd}.json")
            extra = ["--label", label, "--json", js]
            if rnd == 0:
                extra += ["--dump", os.path.join(out, f"{stem}-{label}.pt")]
            env = dict(os.environ, PYTHONPATH=trees[label], PYTHONUNBUFFERED="1")
            print(f"===== round {rnd} {label}: {trees[label]} ({how})", flush=True)
            t0 = time.monotonic()
            rc = subprocess.run([sys.executable, *cmd, *args, *extra], env=env).returncode
            print(f"===== round {rnd} {label}: rc={rc} in {time.monotonic() - t0:.0f} s",
                  flush=True)
            if rc != 0:
                state["failed"].append(f"round {rnd} {label}: rc={rc}")
            elif os.path.exists(js):
                with open(js) as f:
                    state["runs"][label] += [dict(r, round=rnd) for r in json.load(f)["records"]]
            if state["bitwise_equal"] is None and all(os.path.exists(p) for p in dumps):
                state["bitwise_equal"], state["differences"] = same_bits(*dumps)
            with open(os.path.join(out, f"{stem}-summary.json"), "w") as f:
                json.dump(state, f, indent=1)
    print(f"\n{name}: base {trees['base']} vs this {root}; {rounds} rounds")
    same = bool(state["bitwise_equal"])
    print("bitwise equal: every output of every key" if same else
          "RESULTS DIFFER (or a run left no dump):\n  " + "\n  ".join(state["differences"]))
    state["keys"] = summarize(state["runs"])
    if state["failed"]:
        print("failed runs: " + "; ".join(state["failed"]))
    with open(os.path.join(out, f"{stem}-summary.json"), "w") as f:
        json.dump(state, f, indent=1)
    return 0 if same and not state["failed"] else 1
