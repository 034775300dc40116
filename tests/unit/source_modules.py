"""Where the repository's Python files install: `bindings/` is `mtrain`, `launcher/`
`mtrain.launcher`, `ringreduce/` `mtrain.ringreduce` (pyproject's package-dir), and the other
folders are importable from the repository's root. For the static checks of the tests."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
INSTALLED = {"bindings": "mtrain", "ringreduce": "mtrain.ringreduce", "launcher": "mtrain.launcher"}


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[0] in INSTALLED:
        parts = (*INSTALLED[parts[0]].split("."), *parts[1:])
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_source(here: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = here.split(".")
    if not is_package:
        package = package[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def installed_modules(root: Path = REPO) -> "dict[str, Path]":
    """Every module of the installed package, by its dotted name (of the repository, or of a
    made-up tree with the same folders under ``root``)."""
    return {module_name(path, root): path for folder in INSTALLED for path in sorted((root / folder).rglob("*.py"))}


class Import(NamedTuple):
    """One module an import statement names, as ``imports_in`` resolves it."""

    target: str     # a dotted module name (ours or another's); for ``from X import y``: X, or X.y when that is a module
    line: int
    attribute: bool  # the statement takes a name out of ``target``'s namespace (``from X import y``, y not a module)


def imports_in(tree: ast.AST, here: str, is_package: bool, known: "set[str] | dict[str, Path]") -> "list[Import]":
    """Every import in ``tree`` (module ``here``), at any depth (inside functions too), and every
    ``importlib.import_module("...")`` / ``__import__("...")`` of a literal name.

    ``from X import y`` is the module X.y when ``known`` has it, else the name y out of X (whose
    ``__init__`` defines it). Importing a module also runs the ``__init__`` of each package above
    it; ``packages_above`` names those."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend(Import(alias.name, node.lineno, False) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = import_source(here, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if alias.name != "*" and sub in known:
                    found.append(Import(sub, node.lineno, False))
                else:
                    found.append(Import(base, node.lineno, True))
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module")
                   or isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")):
            found.append(Import(node.args[0].value, node.lineno, False))
    return found


def packages_above(name: str) -> "list[str]":
    """The packages whose ``__init__`` runs before module ``name`` (outermost first)."""
    parts = name.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts))]
