"""``attncomm bench --help`` says what each bench measures (one line each, not "benchmark X")."""
from __future__ import annotations

import pytest

from attncomm import cli


def test_bench_help_says_what_each_bench_measures(capsys):
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["bench", "--help"])
    assert info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert set(cli._BENCH_HELP) == set(cli._BENCHES)
    for name, text in cli._BENCH_HELP.items():
        assert f"benchmark {name}" not in out
        assert " ".join(text.split()) in out, name
