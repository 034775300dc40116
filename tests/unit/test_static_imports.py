"""Every `mtrain.*` import in the repository resolves against the package as it installs.

The repository's folders install under other names (pyproject's package-dir: bindings/ is
`mtrain`, launcher/ `mtrain.launcher`, ringreduce/ `mtrain.ringreduce`), and the default
editable install maps them with an import hook that static checkers cannot follow. This
test lays out the installed tree itself, from symlinks to the repository's files (what
setuptools' strict editable mode builds, see docs/contributing.md), and runs mypy over it
and over tests/, benchmarks/ and examples/. Only import resolution is judged: a missing
`mtrain` module, or a name imported from an `mtrain` module that does not define it.
Third-party packages are not looked up at all (--no-site-packages), so the check is fast
and needs none of the frameworks.

A canary file with one bad import of each kind rides along: the test also fails when
mypy stops reporting them, so a change in mypy's messages cannot make it pass vacuously.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECKED_FOLDERS = ("tests", "benchmarks", "examples")  # checked besides the package itself
pytestmark = pytest.mark.timeout(180)

# mypy's one-line messages (`path:line: error: message  [code]`) that say an `mtrain` import
# does not resolve.
_UNRESOLVED = [
    re.compile(r'module named "mtrain(\.[\w.]+)?"\s+\[import-not-found\]$'),
    re.compile(r'for "mtrain(\.[\w.]+)?"\s+\[import-untyped\]$'),
    re.compile(r'Module "mtrain(\.[\w.]+)?" (has no|does not explicitly export) attribute "\w+"\s+\[attr-defined\]$'),
]
_CANARY = (
    "import mtrain.launcher.no_such_module\n"
    "from mtrain.ringreduce import no_such_name\n"
)
_CANARY_ERRORS = {
    (1, 'Cannot find implementation or library stub for module named "mtrain.launcher.no_such_module"'),
    (2, 'Module "mtrain.ringreduce" has no attribute "no_such_name"'),
}


def _package_layout() -> "tuple[dict[str, str], list[str]]":
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        tomllib = pytest.importorskip("tomli")
    settings = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    packages = settings.get("packages")
    if not isinstance(packages, list):
        pytest.fail("pyproject.toml no longer lists [tool.setuptools] packages: teach this test how "
                    "the package's tree is now found")
    return settings.get("package-dir", {}), packages


def installed_tree(site: Path) -> "list[Path]":
    """Lay out under `site` the modules `pip install .` would install, as symlinks to the
    repository's files; the module files, in the tree."""
    package_dir, packages = _package_layout()
    files = []
    for package in packages:
        # The longest package-dir entry that holds this package gives its folder.
        owner = max((name for name in package_dir if package == name or package.startswith(name + ".")),
                    key=len, default="")
        source = REPO / package_dir.get(owner, "")
        rest = package[len(owner):].lstrip(".") if owner else package
        if rest:
            source = source.joinpath(*rest.split("."))
        if not (source / "__init__.py").is_file():
            pytest.fail(f"pyproject.toml lists package {package}, but {source.relative_to(REPO)} has no __init__.py")
        target = site.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in sorted(source.glob("*.py")):
            (target / module.name).symlink_to(module)
            files.append(target / module.name)
    return files


def unresolved_imports(output: str) -> "list[tuple[str, int, str]]":
    """(file, line, message) of every mypy error saying an `mtrain` import does not resolve."""
    found = []
    for line in output.splitlines():
        match = re.match(r"(?P<file>[^:]+):(?P<line>\d+): error: (?P<message>.*)$", line)
        if match and any(pattern.search(match["message"]) for pattern in _UNRESOLVED):
            message = re.sub(r"\s+\[[\w-]+\]$", "", match["message"])
            found.append((match["file"], int(match["line"]), message))
    return found


def test_every_mtrain_import_resolves(tmp_path):
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is not installed: pip install -e '.[dev]' (docs/contributing.md)")
    site = tmp_path / "site"
    package_files = installed_tree(site)
    assert site / "mtrain" / "__init__.py" in package_files
    others = sorted(path for folder in CHECKED_FOLDERS for path in (REPO / folder).rglob("*.py"))
    canary = tmp_path / "canary" / "mtrain_import_canary.py"
    canary.parent.mkdir()
    canary.write_text(_CANARY, encoding="utf-8")
    sources = [*package_files, *others, canary]
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "MYPYPATH")}
    env["MYPYPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-site-packages", "--follow-imports=skip", "--show-error-codes",
         "--no-pretty", "--no-color-output", "--cache-dir", str(tmp_path / "mypy-cache"), *map(str, sources)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    summary = re.search(r"(?:no issues found in|checked) (\d+) source files?", done.stdout)
    assert done.returncode in (0, 1) and summary, f"mypy did not run through:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert int(summary.group(1)) == len(sources), summary.group(0)

    found = unresolved_imports(done.stdout)
    canary_name = str(canary.relative_to(tmp_path))
    assert {(line, message) for file, line, message in found if file == canary_name} == _CANARY_ERRORS, (
        f"mypy no longer reports the canary's bad imports as this test expects:\n{done.stdout[-4000:]}")

    def where(file: str) -> str:  # the repository's path of a file mypy names
        path = (tmp_path / file).resolve()
        return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else file

    broken = [f"{where(file)}:{line}: {message}" for file, line, message in found if file != canary_name]
    assert not broken, "mtrain imports that do not resolve in the installed package:\n" + "\n".join(broken)
