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
#: What each bench measures, for ``attncomm bench --help`` (the module docstrings say more).
_BENCH_HELP = {
    "dcp": "latency of every DCP merge backend over decode token counts, eager and in CUDA "
           "graphs (--op gather: the query gather; --op layer: gather + merge per step)",
    "ulysses": "the Ulysses all-to-all per transport over message sizes, eager and in CUDA "
               "graphs (--layer: a whole attention layer; --fill: the fill kernel; --payload "
               "fp8: FP8 error; --dit-model: a Flux model)",
    "dp-sync": "DP-attention per-step sync latency per sync path, and dp_gather / dp_scatter / "
               "dp_reduce_scatter time per padding mode over token counts",
    "ring": "forward time of ring attention, Ulysses and USP on the same shapes, and the ring's "
            "per-step compute against its transfer",
    "overhead": "host cost of one eager call of each exchange, in units of one torch.add, "
                "against the host-cost targets (GPU figures)",
}


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
        p = bench_sub.add_parser(name, help=_BENCH_HELP[name], description=_BENCH_HELP[name])
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
