"""The distribution installs one top-level package, `mtrain`, in both install modes."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _python(code: str, cwd: Path, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_wheel_holds_only_mtrain_and_works_from_its_own_install(tmp_path):
    pytest.importorskip("setuptools", minversion="77")
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(wheels), str(REPO)], capture_output=True, text=True, timeout=180)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("mtrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith(".dist-info")} == {"mtrain"}, tops
    for module in ("mtrain/__init__.py", "mtrain/torch/__init__.py", "mtrain/torch/bridge.py",
                   "mtrain/torch/mpi_ops.py", "mtrain/torch/optimizer.py", "mtrain/torch/functions.py",
                   "mtrain/torch/sync_batch_norm.py", "mtrain/distributed/__init__.py", "mtrain/keras.py",
                   "mtrain/tensorflow/__init__.py", "mtrain/tensorflow/mpi_ops.py",
                   "mtrain/tensorflow/gradient_tape.py", "mtrain/tensorflow/keras/__init__.py",
                   "mtrain/launcher/rank.py", "mtrain/common/records/__init__.py", "mtrain/launcher/ssh/agent.py",
                   "mtrain/ringreduce/transport/ring.py", "mtrain/ringreduce/engine/cycle.py"):
        assert module in names, module
    import mtrain
    assert wheel.name.startswith(f"mtrain-{mtrain.__version__}-")  # the one version, read from mtrain

    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                                str(target), str(wheel)], capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    done = _python("import mtrain, mtrain.launcher.rank, mtrain.launcher.cli.main, mtrain.ringreduce, mtrain.common.records\n"
                   "print(mtrain.__file__)\n"
                   "for name in ('launcher', 'bindings', 'ringreduce'):\n"
                   "    try:\n        __import__(name)\n    except ModuleNotFoundError:\n        continue\n"
                   "    raise SystemExit(f'{name} is importable')\n", empty, str(target))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(target)), done.stdout


def test_editable_install_exposes_only_mtrain(tmp_path):
    done = _python("import mtrain.torch, mtrain.ringreduce, mtrain.launcher.rank\n"
                   "for name in ('launcher', 'bindings', 'ringreduce'):\n"
                   "    try:\n        __import__(name)\n    except ModuleNotFoundError:\n        continue\n"
                   "    raise SystemExit(f'{name} is importable')\n", tmp_path)
    assert done.returncode == 0, done.stderr


def test_every_package_folder_is_listed_in_pyproject():
    """A sub-package missing from pyproject's list would be left out of a wheel (and of an
    editable install's finder) while the repository's own checkout still imports it."""
    import tomllib  # (Python 3.11+; CI's Python)
    from tests.unit.source_modules import installed_modules

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in installed_modules().items() if path.name == "__init__.py"}
    assert packages == listed, f"in the tree, not listed: {sorted(packages - listed)}; listed, not in the tree: {sorted(listed - packages)}"
