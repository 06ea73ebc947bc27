"""No two of our source files import each other, directly or around a loop.

import-linter's layers contract keeps the four packages pointing down (tests -> api_proc -> detok_proc ->
engine_core -> kernels) but says nothing about files within a package, and no contract can say "no cycles".
A cycle there means neither file can be read, tested or moved without the other; module-level imports on both
sides can fail at import time, so such cycles tend to hide behind imports inside functions or under
TYPE_CHECKING. This test counts every import of `pagoda.*`: module-level, inside functions, and type-only
ones, since each is a dependency of one file on the other."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("api_proc", "detok_proc", "engine_core", "kernels")


def _module_files() -> dict[str, Path]:
    """Every source file by its import name: pagoda.engine_core.request for engine_core/request.py, the
    package's name for its __init__.py."""
    modules = {}
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(["pagoda", *parts])] = path
    return modules


def _file_of(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that importing `name` reads: `name` itself, or the nearest enclosing one that is a
    file (`pagoda.kernels.ops.configure` -> pagoda.kernels.ops)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(path: Path, module: str, modules: dict[str, Path]) -> Iterator[tuple[int, str]]:
    """(line, module of ours) for every import of `pagoda.*` anywhere in the file. `from a.b import c` is
    the file a/b/c.py where there is one (c is a submodule), else a.b (c is a name in it)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:  # relative: from the file's package, one level up per dot after the first
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                source = f"{base}.{source}" if source else base
            names = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
        else:
            continue
        for name in names:
            target = _file_of(name, modules) if name.startswith("pagoda.") else None
            if target is not None and target != module:
                yield node.lineno, target


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """For each of our modules, the modules of ours it imports, each with the line of its first import."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, target in sorted(_imports(path, module, modules)):
            edges.setdefault(target, line)
    return graph


def strongly_connected_components(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that each reach every other module of their group."""
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                lowest[node] = min(lowest[node], lowest[target])
            elif target in on_stack:
                lowest[node] = min(lowest[node], index[target])
        if lowest[node] == index[node]:  # `node` is the root of a component: everything above it on the stack
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _describe(component: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path]) -> str:
    """The cycle's files, then each import between them (file:line imports file)."""

    def file(module: str) -> str:
        return str(modules[module].relative_to(ROOT))

    lines = ["cycle: " + ", ".join(file(m) for m in component)]
    for source in component:
        for target, line in sorted(graph[source].items()):
            if target in component:
                lines.append(f"    {file(source)}:{line} imports {file(target)}")
    return "\n".join(lines)


def test_no_import_cycles_between_our_files():
    modules = _module_files()
    graph = import_graph(modules)
    cycles = [c for c in strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, "files that import each other (move what they share into a module both can import):\n" + (
        "\n".join(_describe(c, graph, modules) for c in cycles)
    )


def test_the_graph_sees_imports_in_functions_and_from_packages():
    """Two cases the check depends on, read from files whose imports are known."""
    graph = import_graph(_module_files())
    # `from pagoda.kernels import cpu` inside a function body: the package pagoda.kernels.cpu
    assert "pagoda.kernels.cpu" in graph["pagoda.kernels.ops"]
    # `from pagoda.engine_core.request import Request`: the file engine_core/request.py
    assert "pagoda.engine_core.request" in graph["pagoda.engine_core.scheduler"]


def test_the_graph_counts_type_checking_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagoda.pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from . import a\n    from .a import f\n")
    modules = {
        "pagoda.pkg": package / "__init__.py",
        "pagoda.pkg.a": package / "a.py",
        "pagoda.pkg.b": package / "b.py",
    }
    assert import_graph(modules) == {
        "pagoda.pkg": {},
        "pagoda.pkg.a": {"pagoda.pkg.b": 3},
        "pagoda.pkg.b": {"pagoda.pkg.a": 2},
    }


def test_a_cycle_is_found_and_named():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert sorted(strongly_connected_components(graph)) == [["a", "b", "c"], ["d"]]
