"""autoprec's imports flow one way: no module imports, at any depth, a module that imports it back, whether the import
sits at the top of the file or inside a function (a deferred import hides a cycle; it does not remove it).
docs/architecture.md draws the layers. Imports under `if TYPE_CHECKING:` name types for annotations and never run;
they are not counted as running, and they close no loop either: two modules that name each other's types are one
module split in two, or hold what a protocol should name."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autoprec"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.AST) -> set[int]:
    """The nodes inside `if TYPE_CHECKING:` blocks."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            inside.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return inside


def imports_of(path: Path, modules: set[str], *, types: bool = False) -> set[str]:
    source = path.read_text(encoding="utf-8")
    return imports_in(source, module_name(path), path.name == "__init__.py", modules, types=types)


def imports_in(source: str, name: str, is_package: bool, modules: set[str], *, types: bool = False) -> set[str]:
    """The modules among `modules` that module `name` (of `source`) imports where it runs (with `types`, also those
    it imports under `if TYPE_CHECKING:`): `from a.b import c` is a.b.c where that is a module, else a.b (the names
    come from a.b itself); relative imports resolved."""
    tree = ast.parse(source)
    skip = set() if types else _type_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import autoprec.tune._x.y` where y is a name
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def import_graph(*, types: bool = False) -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: imports_of(path, set(paths), types=types) for name, path in paths.items()}


def test_no_module_of_autoprec_imports_one_that_imports_it_back():
    graph = import_graph()
    assert "autoprec.tune._core._goal" in graph["autoprec.tune._core._config"]  # the graph sees what it should
    found = cycles(graph)
    assert not found, "import cycles (each line: the modules of one):\n" + "\n".join(
        "  " + " <-> ".join(c) + "\n    " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a] & set(c))) for c in found
    )


def test_no_two_modules_name_each_others_types_either():
    graph = import_graph(types=True)
    assert "autoprec.tune._core._space" in graph["autoprec.tune._decide._flops"]  # a type-only import is in it
    found = cycles(graph)
    assert not found, "type-only import loops:\n" + "\n".join("  " + " <-> ".join(c) for c in found)


def test_the_check_finds_a_cycle_a_deferred_import_hides():
    """A function-level import back up is the cycle the flat tuner grew (_task -> _profiler -> _task)."""
    modules = {"p", "p.task", "p.profiler", "p.types"}
    task = (
        "from typing import TYPE_CHECKING\nfrom . import types\n"
        "if TYPE_CHECKING:\n    from p.profiler import Profile\n"  # a type only: never runs
        "def metric(w):\n    from p.profiler import checked\n    return checked(w)\n"
    )
    assert imports_in(task, "p.task", False, modules) == {"p.types", "p.profiler"}
    graph = {"p.task": imports_in(task, "p.task", False, modules), "p.profiler": {"p.task"}, "p.types": set(), "p": set()}
    assert cycles(graph) == [["p.profiler", "p.task"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def documented_stages() -> list[list[str]]:
    """docs/architecture.md's tuner table: per stage (a package, or the front), bottom up, its modules in order (the
    backticked names of the row's last cell that start with `_` or are a module of its package), then the package."""
    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    table = doc.split("## The tuner, bottom up", 1)[1].split("\n## ", 1)[0]
    stages = []
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in ("package", "---"):
            continue
        package = re.fullmatch(r"`([a-z_]+)`", cells[0])
        prefix = f"autoprec.tune.{package.group(1)}" if package else "autoprec.tune"
        names = re.findall(r"`([^`(]+)`(?:,|$| \()", cells[2])
        stage = [n if n.startswith("autoprec.") else f"{prefix}.{n}" for n in names]
        stages.append(stage + ([prefix] if package else []))
    return stages


def test_the_tuners_imports_run_down_the_stages_architecture_md_draws():
    graph = import_graph()
    place = {name: (i, j) for i, stage in enumerate(documented_stages()) for j, name in enumerate(stage)}
    tuner = {name for name in graph if name.startswith("autoprec.tune")}
    assert tuner <= set(place), f"modules docs/architecture.md does not place: {sorted(tuner - set(place))}"
    assert set(place) <= tuner, f"docs/architecture.md places modules that do not exist: {sorted(set(place) - tuner)}"
    up = [f"{a} -> {b}" for a in sorted(tuner) for b in sorted(graph[a] & tuner) if place[b] >= place[a]]
    assert not up, "imports that run up docs/architecture.md's stages (move the name down instead):\n  " + "\n  ".join(up)


def test_a_configuration_built_in_a_fresh_process_finds_the_default_goal():
    """The goal registry is at the bottom (_core._goal) and the built-in goals register from above it: importing the
    configuration's module alone must still leave them registered (autoprec.tune's __init__ runs first)."""
    import subprocess
    import sys

    code = (
        "from autoprec.tune._core._config import SearchConfig\n"
        "print(SearchConfig(budget=0.1).objective.name, SearchConfig(budget=0.1, objective='memory').objective.name)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.split() == ["speed", "memory"]
