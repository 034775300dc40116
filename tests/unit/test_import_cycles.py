"""No import cycle among mtrain's modules: dependencies run one way (cli → launch → supervise …,
bindings → runtime → engine …), counting imports made inside functions too, since a lazy
import that closes a cycle is a cycle all the same.

An import of a module runs the `__init__` of every package above it first, so `from
mtrain.torch import functions` is an edge to `mtrain.torch.functions` and to `mtrain.torch`;
`from mtrain.torch import x` (x defined by the package's `__init__`) is an edge to `mtrain.torch`.
The one exception is a package above the importer itself, whose `__init__` is already running
(`P.a` importing `P.b` needs nothing more of P) -- unless the importer takes something out of that
package (`from P import X`, `import P`): then P's `__init__` importing P.a closes a cycle.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.source_modules import imports_in, installed_modules, packages_above



def inside(name: str, package: str) -> bool:
    """Whether module ``name`` is ``package`` or lies under it."""
    return name == package or name.startswith(package + ".")


def imports_of(name: str, path: Path, known: "set[str]") -> "set[str]":
    """The modules that ``name`` needs run, as edges of the import graph.

    An import of module T is an edge to T and to each package above T whose ``__init__`` is not
    already running when ``name`` runs: Python runs every package's ``__init__`` before a module in
    it, so a package above ``name`` itself is no edge (``P.a`` importing ``P.b`` adds nothing for P:
    P's ``__init__`` started before P.a could). But a module that takes something out of a package
    above it (``from P import X``, X defined by P's ``__init__``, or ``import P`` for ``P.X``) needs
    that ``__init__`` to have run: that is an edge, and it closes a cycle when P's ``__init__``
    imports the module."""
    targets = set()
    tree = ast.parse(path.read_text(), str(path))
    for imported in imports_in(tree, name, path.name == "__init__.py", known):
        target = imported.target
        # A module, or an object in one: the nearest enclosing module we have.
        while target and target not in known:
            target = target.rpartition(".")[0]
        if not target or target == name:
            continue
        if not inside(name, target) or imported.attribute or imported.target == target:
            targets.add(target)
        targets.update(package for package in packages_above(target) if not inside(name, package))
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


def graph_of(root: Path, files: "dict[str, str]") -> "dict[str, set[str]]":
    """The import graph of a made-up tree under ``root``: {relative path: source}."""
    known = {}
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = Path(relative).with_suffix("").parts
        known[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: imports_of(name, path, set(known)) for name, path in known.items()}


@pytest.mark.parametrize("files, expected", [
    # P's __init__ imports P.a, and P.a takes from P a name P's __init__ defines: a real cycle.
    ({"p/__init__.py": "from .a import f\nX = 1\n", "p/a.py": "from p import X\ndef f(): pass\n"}, [["p", "p.a"]]),
    ({"p/__init__.py": "from .a import f\nX = 1\n", "p/a.py": "def f():\n    from . import X\n"}, [["p", "p.a"]]),
    # ... or the package object itself, for P.X.
    ({"p/__init__.py": "from .a import f\n", "p/a.py": "import p\ndef f(): return p.g\n"}, [["p", "p.a"]]),
    # Importing P.a from outside P runs P's __init__ first: q -> p.a is q -> p too.
    ({"p/__init__.py": "from q import g\n", "p/a.py": "h = 1\n", "q.py": "def g():\n    from p.a import h\n"},
     [["p", "q"]]),
    ({"p/__init__.py": "from q import g\n", "p/a.py": "h = 1\n", "q.py": "from p import a\ng = 1\n"}, [["p", "q"]]),
    # The normal patterns: a package's __init__ importing its modules, which import each other.
    ({"p/__init__.py": "", "p/a.py": "from p import b\nfrom . import c\nimport p.b\n", "p/b.py": "", "p/c.py": ""}, []),
    ({"p/__init__.py": "from .a import f\n", "p/a.py": "from . import b\ndef f(): pass\n", "p/b.py": "x = 1\n"}, []),
    ({"p/__init__.py": "from .a import f\n", "p/a.py": "from .b import x\ndef f(): pass\n", "p/b.py": "x = 1\n"}, []),
    # A module of a sub-package reaching a sibling package: that package's __init__ runs, nothing comes back.
    ({"p/__init__.py": "from .s.m import f\n", "p/s/__init__.py": "", "p/s/m.py": "from p.t import g\nf = 1\n",
      "p/t/__init__.py": "from .n import g\n", "p/t/n.py": "g = 1\n"}, []),
    # ... and through one that does come back.
    ({"p/__init__.py": "", "p/s/__init__.py": "from .m import f\n", "p/s/m.py": "from p.t.n import g\nf = 1\n",
      "p/t/__init__.py": "from p.s import f\n", "p/t/n.py": "g = 1\n"}, [["p.s", "p.s.m", "p.t"]]),
])
def test_the_check_finds_cycles_through_a_package_init(tmp_path, files, expected):
    assert cycles(graph_of(tmp_path, files)) == expected
