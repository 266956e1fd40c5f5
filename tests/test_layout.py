"""The package rules of the architecture (docs/architecture.md), checked on the source, not kept by habit.

The module graph is read from the source with `ast` (every import, at module level or inside a
function; those under `if TYPE_CHECKING:` are annotations only and do not count):

- who may import whom, package by package;
- no cycle between modules, so no function-level import can be one that only dodges a cycle;
- no module imports another module's `_private` names;
- no source file much over 500 lines, no prefixed siblings where a folder belongs, and every package
  opens with a docstring that says what to read first.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("actors", "buffer", "common", "demo", "launch", "learner", "weight_sync")
# package -> the packages of the project it may import (itself always)
ALLOWED = {
    "common": set(),
    "demo": {"common"},
    "buffer": {"common"},
    "weight_sync": {"common"},
    "learner": {"buffer", "weight_sync", "common"},
    "actors": {"buffer", "weight_sync", "common", "learner.modeling", "learner.vision"},
    "launch": {"actors", "buffer", "common", "demo", "learner", "weight_sync"},
}
MAX_LINES = 520


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _owner(dotted: str) -> str | None:
    """The project module that `dotted` (a module, or a name inside one) lives in."""
    while dotted and dotted not in MODULES:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def _imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import of the file, TYPE_CHECKING blocks aside."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.append((full, []) if full in MODULES else (node.module, [alias.name]))
    return out


def _graph() -> dict[str, set[str]]:
    graph = defaultdict(set)
    for name, path in MODULES.items():
        for target, _ in _imports(path):
            owner = _owner(target)
            if owner and owner != name:
                graph[name].add(owner)
    return graph


def test_packages_import_only_what_the_rules_allow():
    broken = []
    for name, targets in _graph().items():
        package = name.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other == package:
                continue
            if not any(target == allowed or target.startswith(allowed + ".") for allowed in ALLOWED[package]):
                broken.append(f"{name} imports {target}")
    assert not broken, "imports the package rules forbid:\n" + "\n".join(sorted(broken))


def test_no_import_cycle_between_modules():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in MODULES:
        if name not in index:
            visit(name)
    assert not cycles, "modules that import each other (directly or round about): " + "; ".join(map(str, cycles))


def test_no_module_imports_another_modules_private_names():
    found = []
    for name, path in MODULES.items():
        for target, names in _imports(path):
            owner = _owner(target)
            if owner and owner != name:
                found += [f"{name} imports {n} from {owner}" for n in names
                          if n.startswith("_") and not n.startswith("__")]
    assert not found, "\n".join(found)


def test_source_files_stay_readable_in_size():
    long = {str(p.relative_to(ROOT)): n for p in MODULES.values() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along their ideas): {long}"


@pytest.mark.parametrize("package", PACKAGES)
def test_no_prefixed_siblings_where_a_folder_belongs(package):
    """Three or more files of a folder sharing a prefix (`ray_run.py`, `ray_scale.py`, ...) want a subpackage."""
    for folder in [ROOT / package, *(p.parent for p in (ROOT / package).rglob("*/__init__.py"))]:
        prefixes = defaultdict(list)
        for path in folder.glob("*_*.py"):
            prefixes[path.name.split("_")[0]].append(path.name)
        crowded = {p: names for p, names in prefixes.items() if len(names) >= 3}
        assert not crowded, f"{folder.relative_to(ROOT)}: {crowded}"


def test_every_package_opens_with_a_reading_order():
    for name, path in MODULES.items():
        if path.name == "__init__.py":
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            assert len(doc.split()) >= 8, (f"{path.relative_to(ROOT)}: its docstring should say what the package is "
                                           "and what to read first")


def test_moved_modules_keep_their_old_names():
    from common.moved import MOVED, current_name

    for old, new in MOVED.items():
        assert importlib.util.find_spec(new) is not None, f"{old} moved to {new}, which does not exist"
        assert old not in MODULES, f"{old} still exists beside its new place {new}"
    assert current_name("actors.vllm_worker.WorkerExtension") == "actors.engines.vllm.worker.WorkerExtension"
    assert current_name("actors.env:Environment") == "actors.envs.api:Environment"
    assert current_name("actors.envs.api:Environment") == "actors.envs.api:Environment"


def test_the_rules_see_real_imports():
    """The checks above read what they should (a check that reads nothing passes everything)."""
    graph = _graph()
    assert "buffer.messages" in graph["buffer.service"]
    assert "actors.envs.api" in graph["actors.envs.loader"]
    assert re.fullmatch(r"[\w.]+", next(iter(graph["launch.local"])))
