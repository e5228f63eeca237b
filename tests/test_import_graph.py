"""No import circles inside ``megatron_pp_ext``: the package's modules form a DAG (issue 28).

Every module is read with :mod:`ast` (nothing is imported). An edge ``a -> b`` means module ``a``
imports package module ``b``:

* ``import megatron_pp_ext.x.y`` and ``from megatron_pp_ext.x.y import name`` depend on the module
  ``x/y.py`` (or on the package ``x/y/__init__.py`` when ``x.y`` is a package);
* ``from megatron_pp_ext.x import y`` (or ``from . import y``) depends on the submodule ``y`` when
  ``y`` is a module, and on ``x/__init__.py`` when ``y`` is a name defined there;
* relative imports are resolved against the importing module's package.

Imports at module level and inside functions count alike: a function-local import only delays the
circle to the first call, the two modules still depend on each other and cannot be understood (or
moved) apart. Imports under ``if TYPE_CHECKING:`` are left out: they never run and exist only for
annotations. The parents' ``__init__`` modules that Python runs before a submodule are not edges
of their own, so a package whose ``__init__`` re-exports its submodules is not a circle by itself
(it becomes one when a submodule imports a name back from that ``__init__``).

The strongly connected components (Tarjan) must all be single modules without a self-loop; each
circle found is printed as a chain. The longest path of the module DAG is printed too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"
ROOT = PACKAGE.name


@lru_cache(maxsize=1)
def module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, at any depth, except the bodies of
    ``if TYPE_CHECKING:`` (their ``else:`` branches do run, so they count)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, (ast.Import, ast.ImportFrom)):
            yield current
            continue
        if isinstance(current, ast.If) and is_type_checking(current.test):
            stack.extend(current.orelse)
            continue
        stack.extend(ast.iter_child_nodes(current))


def owning_module(name: str, modules: dict[str, Path]) -> str | None:
    """The package module a dotted name lives in: the longest prefix that is a module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def dependencies(module: str, modules: dict[str, Path]) -> set[str]:
    """The package modules ``module`` imports (see the module docstring for the rules)."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    targets: set[str] = set()
    for node in import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # ``from base import y``: the submodule y when it is one, else base itself.
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
            ]
        for name in names:
            if name == ROOT or name.startswith(ROOT + "."):
                target = owning_module(name, modules)
                if target is not None:
                    targets.add(target)
    return targets


@lru_cache(maxsize=1)
def import_graph() -> dict[str, frozenset[str]]:
    modules = module_files()
    return {module: frozenset(dependencies(module, modules)) for module in modules}


def strongly_connected_components(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (no recursion limit), in a deterministic order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def circle_in(component: list[str], graph: dict[str, frozenset[str]]) -> list[str]:
    """One readable circle through the component: a shortest path from its first module back to it
    (breadth-first, inside the component), as a chain ``a, b, ..., a``."""
    members = set(component)
    start = component[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    chain = [start]
                    while node != start:
                        chain.append(node)
                        node = previous[node]
                    return [start, *reversed(chain[1:]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return component


def short(module: str) -> str:
    return module.removeprefix(ROOT + ".") or ROOT


def circles(graph: dict[str, frozenset[str]]) -> list[str]:
    found = []
    for component in strongly_connected_components(graph):
        if len(component) > 1 or component[0] in graph[component[0]]:
            chain = circle_in(component, graph)
            text = " -> ".join(short(m) for m in chain)
            if len(chain) - 1 < len(component):  # the circle shown leaves some members out
                text += f" (one circle of {len(component)} modules: {', '.join(map(short, component))})"
            found.append(text)
    return found


def longest_path(graph: dict[str, frozenset[str]]) -> list[str]:
    """The longest import chain of the (acyclic) module graph, as a list of modules."""
    best: dict[str, list[str]] = {}
    # Tarjan emits components in reverse topological order: dependencies first.
    for component in strongly_connected_components(graph):
        for node in component:
            tails = [best[child] for child in graph[node] if child in best and child != node]
            best[node] = [node, *max(tails, key=len, default=[])]
    return max(best.values(), key=len)


def test_the_graph_is_read() -> None:
    graph = import_graph()
    assert len(graph) > 50
    runtime = f"{ROOT}.runtime"
    # Absolute, relative, ``from . import module`` and function-local imports are all seen.
    assert f"{ROOT}.schedule.ir" in graph[f"{ROOT}.schedule.validate"]
    assert any(dep.startswith(runtime + ".") for dep in graph[runtime])
    assert f"{runtime}.weight_grad" in graph[f"{runtime}.memory"]  # imported inside a function
    assert all(dep in graph for deps in graph.values() for dep in deps)


def test_tarjan_finds_circles_and_self_loops() -> None:
    graph = {
        "a": frozenset({"b"}),
        "b": frozenset({"c"}),
        "c": frozenset({"a", "d"}),
        "d": frozenset(),
        "e": frozenset({"e"}),
    }
    components = sorted(strongly_connected_components(graph))
    assert components == [["a", "b", "c"], ["d"], ["e"]]
    assert circles(graph) == ["a -> b -> c -> a", "e -> e"]
    assert longest_path({"a": frozenset({"b", "d"}), "b": frozenset({"d"}), "d": frozenset()}) == [
        "a",
        "b",
        "d",
    ]


def test_type_checking_imports_are_left_out() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden\nelse:\n    import shown\n"
        "def f():\n    import local\n"
    )
    names = {alias.name for node in import_nodes(tree) for alias in node.names}
    assert names == {"TYPE_CHECKING", "shown", "local"}


def test_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    for chain in found:
        print("import circle:", chain)
    assert not found, "import circles in the package:\n  " + "\n  ".join(found)


def test_longest_import_chain() -> None:
    graph = import_graph()
    path = longest_path(graph)
    print(f"longest import chain: {len(path) - 1} edges, {len(path)} modules:")
    print("  " + " -> ".join(short(m) for m in path))
    assert 1 <= len(path) <= len(graph)
    for importer, imported in zip(path, path[1:]):
        assert imported in graph[importer]
