"""The ``attncomm`` command: ``demo``, ``bench dcp|ulysses|dp-sync|ring|overhead``, ``env``.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) ->
int``; this file only wires them up. The process it runs in is one attncomm starts: NVLink
multicast is forced off (``config.force_safe_env``) before any subcommand runs.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import config

_BENCHES = {"dcp": "attncomm.bench.dcp", "ulysses": "attncomm.bench.ulysses",
            "dp-sync": "attncomm.bench.dp_sync", "ring": "attncomm.bench.ring",
            "overhead": "attncomm.bench.overhead"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attncomm",
        description="Communication around parallel attention: DCP merge, Ulysses all-to-all, "
                    "DP-attention sync.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a real model's attention in parallel and check it "
                                       "against one process (the main job)")
    importlib.import_module("attncomm.demo").add_arguments(demo)
    demo.set_defaults(_main="attncomm.demo")
    bench = sub.add_parser("bench", help="benchmark an exchange (tables, JSON, plots)")
    bench_sub = bench.add_subparsers(dest="exchange", required=True)
    for name, mod in _BENCHES.items():
        p = bench_sub.add_parser(name, help=f"benchmark {name}")
        importlib.import_module(mod).add_arguments(p)
        p.set_defaults(_main=mod)
    env = sub.add_parser("env", help="what can run here, and why not")
    importlib.import_module("attncomm.envinfo").add_arguments(env)
    env.set_defaults(_main="attncomm.envinfo")
    return parser


def main(argv: list[str] | None = None) -> int:
    config.force_safe_env()
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args._main).main(args) or 0)
    except ValueError as exc:  # bad input (attncomm's rule: ValueError names the values)
        print(f"attncomm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
