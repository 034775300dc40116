"""Bindings import no private names across packages: not from the runtime (mtrain.ringreduce.*),
and not from a bindings module of another package (mtrain.tensorflow.keras from
mtrain.tensorflow, say). Within one package, modules share what they make public there."""
import ast
from pathlib import Path

BINDINGS = Path(__file__).resolve().parents[2] / "bindings"


def _package_of(path: Path) -> str:
    parts = ["mtrain", *path.relative_to(BINDINGS).with_suffix("").parts]
    return ".".join(parts if path.name == "__init__.py" else parts[:-1]).removesuffix(".__init__")


def test_no_private_names_imported_across_packages():
    offenders = []
    for path in sorted(BINDINGS.rglob("*.py")):
        package = _package_of(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if not alias.name.startswith("_") or alias.name == "__future__":
                    continue
                if source == package or not source.startswith("mtrain"):  # same package; not ours
                    continue
                offenders.append(f"{path.relative_to(BINDINGS)}:{node.lineno} imports {alias.name} from {source}")
    assert not offenders, "\n".join(offenders)
