"""Where the repository's Python files install: `bindings/` is `mtrain`, `launcher/`
`mtrain.launcher`, `ringreduce/` `mtrain.ringreduce` (pyproject's package-dir), and the other
folders are importable from the repository's root. For the static checks of the tests."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
INSTALLED = {"bindings": "mtrain", "ringreduce": "mtrain.ringreduce", "launcher": "mtrain.launcher"}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
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


def installed_modules() -> "dict[str, Path]":
    """Every module of the installed package, by its dotted name."""
    return {module_name(path): path for folder in INSTALLED for path in sorted((REPO / folder).rglob("*.py"))}
