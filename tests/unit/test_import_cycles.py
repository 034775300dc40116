"""No import cycle among mtrain's modules: dependencies run one way (cli → launch → supervise …,
bindings → runtime → engine …), counting imports made inside functions too, since a lazy
import that closes a cycle is a cycle all the same.

A module's import of a package also runs that package's `__init__`, so `from mtrain.torch
import x` is an edge to `mtrain.torch`; an import of a submodule (`from mtrain.torch import
functions`) is an edge to that submodule and to the packages above it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.source_modules import import_source, installed_modules



def imports_of(name: str, path: Path, known: "set[str]") -> "set[str]":
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bases = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = import_source(name, path.name == "__init__.py", node)
            bases = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in bases:
            # A module, or an object in one: the nearest enclosing module we have.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                targets.add(target)  # (a submodule importing its own package's parts is not an edge back)
    return targets


def cycles(graph: "dict[str, set[str]]") -> "list[list[str]]":
    """Every strongly connected component of more than one module (Tarjan's algorithm)."""
    index: "dict[str, int]" = {}
    low: "dict[str, int]" = {}
    stack: "list[str]" = []
    on_stack: "set[str]" = set()
    found: "list[list[str]]" = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle():
    known = installed_modules()
    graph = {name: imports_of(name, path, set(known)) for name, path in known.items()}
    assert not cycles(graph), "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles(graph))


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
])
def test_the_check_finds_cycles(graph, expected):
    assert cycles(graph) == expected
