"""config.py's table is the one place ``ATTNCOMM_*`` variables are defined and read."""
from __future__ import annotations

import ast
import os
import pathlib
import re

import pytest

from attncomm import config

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "attncomm"
_NAME = re.compile(r"ATTNCOMM_[A-Z0-9_]*[A-Z0-9]")


def _sources():
    return sorted(PKG.rglob("*.py"))


def test_every_name_in_the_package_is_in_the_table():
    missing = {}
    for path in _sources():
        for m in _NAME.finditer(path.read_text()):
            # a trailing "_" is a prefix (config.overrides("ATTNCOMM_SYMM_")), not a name
            if m.group(0) not in config.VARS and path.read_text()[m.end():m.end() + 1] != "_":
                missing.setdefault(m.group(0), str(path.relative_to(ROOT)))
    assert not missing, f"ATTNCOMM_* names missing from config.VARS: {missing}"


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _environ_reads(tree) -> list[ast.AST]:
    """Expressions that read os.environ: ``os.environ[...]`` loaded, ``.get``, ``getenv``,
    ``in os.environ``, and wholesale reads (``items``, ``keys``, ``values``, ``copy``,
    ``dict(os.environ)``). Writes (``os.environ[k] = v``, ``pop``) set a child's environment and
    are allowed."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(
                node.ctx, ast.Load):
            out.append(node)
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and _is_environ(f.value) and f.attr in (
                    "get", "items", "keys", "values", "copy"):
                out.append(node)
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                    isinstance(f, ast.Name) and f.id in ("getenv", "dict")
                    and node.args and _is_environ(node.args[0])):
                out.append(node)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            out.append(node)
    return out


def _mentions_attncomm(node) -> bool:
    return any(isinstance(s, ast.Constant) and isinstance(s.value, str) and "ATTNCOMM" in s.value
               for s in ast.walk(node))


def _wholesale(node) -> bool:
    return not (isinstance(node, ast.Subscript) or (isinstance(node, ast.Call) and isinstance(
        node.func, ast.Attribute) and node.func.attr in ("get", "getenv")))


def test_only_config_reads_attncomm_variables():
    offenders = []
    for path in _sources():
        if path == PKG / "config.py":
            continue
        for node in _environ_reads(ast.parse(path.read_text())):
            # a read naming an ATTNCOMM_ variable, or one that takes every variable at once
            if _mentions_attncomm(node) or _wholesale(node) and not isinstance(node, ast.Compare):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"os.environ read for ATTNCOMM_* outside config.py: {offenders}"


def test_the_checker_sees_an_environ_read():
    reads = ('x = os.environ.get("ATTNCOMM_X", "1")', 'x = os.environ["ATTNCOMM_X"]',
             'x = os.getenv("ATTNCOMM_X")', 'x = "ATTNCOMM_X" in os.environ',
             'x = {k: v for k, v in os.environ.items()}')
    for src in reads:
        nodes = _environ_reads(ast.parse(src))
        assert nodes and (_mentions_attncomm(nodes[0]) or _wholesale(nodes[0])), src
    for src in ('os.environ["ATTNCOMM_X"] = "1"', 'os.environ.pop("ATTNCOMM_X", None)',
                'x = config.get("ATTNCOMM_X")', 'x = os.environ.get("TRITON_INTERPRET")'):
        nodes = _environ_reads(ast.parse(src))
        assert not any(_mentions_attncomm(n) or _wholesale(n) for n in nodes), src


def test_table_rows_are_well_formed():
    for name, var in config.VARS.items():
        assert name == var.name and name.startswith("ATTNCOMM_")
        assert var.type in (int, float, bool, str), name
        assert var.read in ("call", "plan", "once"), name
        assert isinstance(var.default, var.type), name
        assert var.doc.strip(), name
        if var.choices is not None:
            assert var.type is str and (var.default == "" or var.default in var.choices), name


def test_public_variables_are_documented():
    docs = (ROOT / "README.md").read_text() + (ROOT / "docs" / "API.md").read_text()
    undocumented = [n for n, v in config.VARS.items() if v.public and n not in docs]
    assert not undocumented, f"public ATTNCOMM_* variables missing from README/API.md: " \
                             f"{undocumented}"


def test_get_parses_each_type(monkeypatch):
    for name, var in config.VARS.items():
        monkeypatch.delenv(name, raising=False)
        assert config.get(name) == var.default
        monkeypatch.setenv(name, "  ")
        assert config.get(name) == var.default  # empty is unset
    monkeypatch.setenv("ATTNCOMM_SYMM_MAX_WARPS", " 8 ")
    assert config.get("ATTNCOMM_SYMM_MAX_WARPS") == 8
    monkeypatch.setenv("ATTNCOMM_TIMEOUT_S", "2.5")
    assert config.get("ATTNCOMM_TIMEOUT_S") == 2.5 and config.timeout_s() == 2.5
    for text, want in (("0", False), ("off", False), ("No", False), ("1", True), ("on", True)):
        monkeypatch.setenv("ATTNCOMM_SYMM_PDL", text)
        assert config.get("ATTNCOMM_SYMM_PDL") is want
    monkeypatch.setenv("ATTNCOMM_COMBINE_IMPL", "torch")
    assert config.get("ATTNCOMM_COMBINE_IMPL") == "torch"
    assert config.raw("ATTNCOMM_COMBINE_IMPL") == "torch"


@pytest.mark.parametrize("name, text, words", [
    ("ATTNCOMM_SYMM_MAX_WARPS", "many", "is not an integer"),
    ("ATTNCOMM_SYMM_MAX_WARPS", "0", "below its minimum"),
    ("ATTNCOMM_TIMEOUT_S", "soon", "is not a number"),
    ("ATTNCOMM_SYMM_PDL", "2", "expected one of"),
    ("ATTNCOMM_COMBINE_IMPL", "cuda", "is not one of"),
    ("ATTNCOMM_ULYSSES_CE_FLAGS", "fast", "is not one of"),
])
def test_get_rejects_bad_text_naming_it(monkeypatch, name, text, words):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError) as info:
        config.get(name)
    assert name in str(info.value) and repr(text) in str(info.value) and words in str(info.value)


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="ATTNCOMM_NOPE"):
        config.get("ATTNCOMM_NOPE")
    with pytest.raises(KeyError, match="ATTNCOMM_NOPE"):
        config.raw("ATTNCOMM_NOPE")


def test_raw_reads_the_environment_as_it_is_now(monkeypatch):
    """``raw`` reads ``os.environ``'s storage directly: each change made through
    ``os.environ`` (set, changed, deleted, a non-ASCII value) shows at the next read, as does
    an ``os.environ`` replaced by a plain mapping."""
    import os
    from unittest import mock
    name = "ATTNCOMM_COMBINE_IMPL"
    monkeypatch.delenv(name, raising=False)
    assert config.raw(name) == ""
    for text, want in ((" torch ", "torch"), ("triton", "triton"), ("é\t", "é"), ("", "")):
        monkeypatch.setenv(name, text)
        assert config.raw(name) == want == os.environ[name].strip()
    monkeypatch.delenv(name)
    assert config.raw(name) == ""
    with mock.patch.dict(os.environ, {name: "auto"}):
        assert config.raw(name) == "auto"
    assert config.raw(name) == ""
    monkeypatch.setattr(os, "environ", {name: " torch"})
    assert config.raw(name) == "torch"


def test_overrides_lists_set_variables(monkeypatch):
    for name in config.VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ATTNCOMM_SYMM_STAGGER_SPLIT", "34")
    monkeypatch.setenv("ATTNCOMM_TIMEOUT_S", "9")
    assert config.overrides("ATTNCOMM_SYMM_") == {"ATTNCOMM_SYMM_STAGGER_SPLIT": "34"}
    assert set(config.overrides()) == {"ATTNCOMM_SYMM_STAGGER_SPLIT", "ATTNCOMM_TIMEOUT_S"}


def test_symm_config_defaults_come_from_the_table(monkeypatch):
    """Every SymmConfig default is its ATTNCOMM_SYMM_* row's default, read from the table when
    a config is built (a changed row changes the default: no copy), except enable_pdl's None
    (the row's "unset: on where supported")."""
    pytest.importorskip("triton")
    import dataclasses

    from attncomm.dcp.lse_merge.symm_a2a import SymmConfig

    for name in config.VARS:
        monkeypatch.delenv(name, raising=False)
    fields = [f.name for f in dataclasses.fields(SymmConfig) if f.name != "enable_pdl"]
    for f in fields:
        name = f"ATTNCOMM_SYMM_{f.upper()}"
        assert getattr(SymmConfig(), f) == config.VARS[name].default, name
        var = config.VARS[name]
        moved = 4 * var.default if var.default else 16  # still valid (powers of two stay)
        monkeypatch.setitem(config.VARS, name, dataclasses.replace(var, default=moved))
        assert getattr(SymmConfig(), f) == moved, f"{name}: SymmConfig keeps its own default"
        monkeypatch.setitem(config.VARS, name, var)
    assert SymmConfig().enable_pdl is None and config.VARS["ATTNCOMM_SYMM_PDL"].default is True
    assert SymmConfig.from_env() == SymmConfig()
    monkeypatch.setenv("ATTNCOMM_SYMM_STAGGER_SPLIT", "34")
    monkeypatch.setenv("ATTNCOMM_SYMM_PDL", "0")
    assert SymmConfig.from_env() == SymmConfig(stagger_split=34, enable_pdl=False)


def test_setting_sets_and_restores_and_names_unknown_variables(monkeypatch):
    monkeypatch.setenv("ATTNCOMM_TIMEOUT_S", "7")
    monkeypatch.delenv("ATTNCOMM_VALIDATE", raising=False)
    with config.setting(ATTNCOMM_TIMEOUT_S=3, ATTNCOMM_VALIDATE=0):
        assert config.timeout_s() == 3.0 and not config.validate_enabled()
    assert config.timeout_s() == 7.0 and "ATTNCOMM_VALIDATE" not in os.environ
    with pytest.raises(RuntimeError), config.setting(ATTNCOMM_TIMEOUT_S=None):
        assert config.timeout_s() == config.DEFAULT_TIMEOUT_S
        raise RuntimeError("restored on the way out too")
    assert config.timeout_s() == 7.0
    with pytest.raises(ValueError, match="ATTNCOMM_NOT_A_VARIABLE"):
        config.set_var("ATTNCOMM_NOT_A_VARIABLE", 1)
