"""The scaffold every ``attncomm bench`` command shares: its common options and its report.

Each bench module's ``add_arguments`` starts with ``add_common_arguments`` (the same
``--world-size``, ``--device``, ``--backends``, output and progress options, with the same
defaults and help texts in every bench), prints its own tables, and ends with ``emit``, which
writes ``--json``, ``--markdown`` and ``--plot`` the same way for all of them.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from collections.abc import Sequence

import torch

from .. import config
from .common import plot_lines, write_json

__all__ = ["default_device", "add_common_arguments", "NameList", "Report", "emit", "usage_error"]


def default_device() -> str:
    """``"cuda"`` when this process sees a GPU, else ``"cpu"`` (every bench's ``--device``
    default)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class NameList(argparse.Action):
    """``nargs="+"`` names, space separated (commas are accepted too: ``a,b`` = ``a b``), each
    checked against ``choices``; stores a list without duplicates, in the order given."""

    def __init__(self, option_strings, dest, *, names: Sequence[str], **kw):
        self.names = tuple(names)
        super().__init__(option_strings, dest, nargs="+", **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        out = []
        for v in values:
            for name in filter(None, (x.strip() for x in v.split(","))):
                if name not in self.names:
                    parser.error(f"{option_string}: {name!r} is not one of "
                                 f"{' '.join(self.names)}")
                if name not in out:
                    out.append(name)
        if not out:
            parser.error(f"{option_string}: give at least one of {' '.join(self.names)}")
        setattr(namespace, self.dest, out)


def add_common_arguments(p: argparse.ArgumentParser, *, backends: Sequence[str],
                         default_backends: str, aliases: Sequence[str] = ()) -> None:
    """Add the options every bench has. ``backends``: the names ``--backends`` accepts;
    ``default_backends``: what runs without it (for the help text); ``aliases``: older
    spellings of ``--backends`` that keep working."""
    p.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=default_device(),
                   help="cuda: NCCL ranks, one GPU each (more ranks than GPUs share them: not a "
                        "speed figure); cpu: gloo ranks (default: cuda when "
                        f"this machine has a GPU, here {default_device()})")
    p.add_argument("--backends", *aliases, dest="backends", action=NameList, names=backends,
                   default=None, metavar="NAME",
                   help=f"space separated, from: {' '.join(backends)} "
                        f"(default: {default_backends})")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the run's metadata and records as JSON")
    p.add_argument("--markdown", metavar="PATH", default=None,
                   help="write the results as a Markdown page")
    p.add_argument("--plot", metavar="PATH", default=None, help="write a PNG plot")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class Report:
    """What a bench writes: ``meta`` and ``records`` (JSON), a Markdown page (or None), and a
    plot: ``plot_lines`` keyword arguments (``series``, ``xlabel``, ``ylabel``, ``title``,
    ``logx``, ``logy``) or None."""

    meta: dict
    records: list
    markdown: str | None = None
    plot: dict | None = None
    written: list = field(default_factory=list)


def emit(args, report: Report) -> Report:
    """Write the outputs the options asked for (folders created), printing each path."""
    if getattr(args, "json", None):
        write_json(args.json, report.meta, report.records)
        report.written.append(args.json)
    if getattr(args, "markdown", None) and report.markdown is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.markdown)), exist_ok=True)
        with open(args.markdown, "w") as f:
            f.write(report.markdown if report.markdown.endswith("\n")
                    else report.markdown + "\n")
        report.written.append(args.markdown)
    if getattr(args, "plot", None) and report.plot and report.plot.get("series"):
        plot_lines(args.plot, **report.plot)
        report.written.append(args.plot)
    for path in report.written:
        print(f"wrote {path}")
    return report


def usage_error(bench: str, message: str) -> int:
    """Print ``attncomm bench <bench>: error: <message>`` to stderr; return 2 (bad options)."""
    return _command_error(f"bench {bench}", message)


def _command_error(command: str, message: str) -> int:
    print(f"attncomm {command}: error: {message}", file=sys.stderr)
    return 2


def command_options(args, parse, command: str):
    """A command's options: ``parse(args)`` after ``config.force_safe_env()``; None when it
    raised ``ValueError`` (bad options), after printing ``attncomm <command>: error:
    <message>`` to stderr (the command then returns 2)."""
    config.force_safe_env()
    try:
        return parse(args)
    except ValueError as exc:
        _command_error(command, str(exc))
        return None
