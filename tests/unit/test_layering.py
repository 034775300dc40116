"""The one-way rule between mtrain's halves, statically, counting imports made inside functions
too (a lazy import is a dependency all the same):

* the runtime (ringreduce/, ``mtrain.ringreduce.*``) imports neither the launcher, nor the
  bindings (any ``mtrain.*`` other than ``mtrain.ringreduce.*``, ``mtrain.common.*`` and the bare
  ``mtrain`` package), nor a deep-learning framework;
* the launcher (launcher/, ``mtrain.launcher.*``) imports neither the runtime, nor the bindings,
  nor a framework;
* ``mtrain.common`` (bindings/common/), which both halves import, imports nothing of mtrain but
  itself (and the bare ``mtrain`` package) and nothing outside the standard library;
* the bindings (every other ``mtrain.*``) take of the launcher only its top-level entry points
  (``mtrain.launcher`` and its rank-side modules) and the task relay ``mtrain.launcher.tasks.*``
  (mtrain.ray's and mtrain.spark's), never its cli/job/supervise/ssh/elastic internals.

``from X import y`` is the module X.y when there is one, else X itself (whose ``__init__``
defines y); an import of a module also runs the ``__init__`` of every package above it, and
those are checked too (tests/unit/source_modules.py: ``imports_in``, ``packages_above``).
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.unit.source_modules import REPO, installed_modules, imports_in, packages_above

RUNTIME, LAUNCHER, COMMON = "mtrain.ringreduce", "mtrain.launcher", "mtrain.common"
# The deep-learning frameworks (and the trainers on top of them) that only the bindings adapt to.
FRAMEWORKS = frozenset({
    "torch", "torchvision", "torchaudio", "tensorflow", "tensorflow_addons", "keras", "tf_keras", "jax", "jaxlib",
    "flax", "optax", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate",
    "deepspeed", "mxnet", "paddle", "oneflow",
})
# What the bindings may import of the launcher: the rank-side entry points at its top, and the task relay.
LAUNCHER_ENTRY_POINTS = frozenset({LAUNCHER} | {f"{LAUNCHER}.{name}" for name in (
    "rank", "pymain", "remote_guard", "process_tools")})
TASK_RELAY = f"{LAUNCHER}.tasks"


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def half(module: str) -> "str | None":
    """Which part of mtrain ``module`` belongs to: RUNTIME, LAUNCHER, COMMON, "mtrain" (the bare
    package), "bindings" (any other mtrain module), or None (not mtrain's)."""
    for part in (RUNTIME, LAUNCHER, COMMON):
        if under(module, part):
            return part
    if module == "mtrain":
        return "mtrain"
    return "bindings" if module.startswith("mtrain.") else None


def refusal(importer: str, target: str) -> "str | None":
    """Why module ``importer`` may not import module ``target`` (None: it may)."""
    side, other = half(importer), half(target)
    top = target.split(".")[0]
    if side in (RUNTIME, LAUNCHER):
        opposite = LAUNCHER if side == RUNTIME else RUNTIME
        if other == opposite:
            return f"{'the runtime' if side == RUNTIME else 'the launcher'} imports {opposite}"
        if other == "bindings":
            return "imports the bindings"
        if top in FRAMEWORKS:
            return f"imports the framework {top}"
    elif side == COMMON:
        if other not in (None, COMMON, "mtrain"):
            return f"mtrain.common imports {other}"
        if other is None and top not in sys.stdlib_module_names:
            return f"mtrain.common imports {top}, outside the standard library"
    elif side == "bindings" and other == LAUNCHER:
        if target not in LAUNCHER_ENTRY_POINTS and not under(target, TASK_RELAY):
            return "the bindings import the launcher's internals (only its entry points and mtrain.launcher.tasks)"
    return None


def breaches_in(text: str, where: str, here: str, is_package: bool, known: "set[str]") -> "list[str]":
    """The imports in one module's source ``text`` (``here`` is its dotted name) that break the rule."""
    found = []
    for imported in imports_in(ast.parse(text, where), here, is_package, known):
        # The module itself, then each package whose __init__ runs before it (innermost first).
        for target in [imported.target, *reversed(packages_above(imported.target))]:
            why = refusal(here, target)
            if why:
                found.append(f"{where}:{imported.line}: {here} imports {imported.target}: {why}")
                break
    return found


def breaches(root: Path = REPO) -> "list[str]":
    known = installed_modules(root)
    return [line for name, path in known.items()
            for line in breaches_in(path.read_text(), str(path.relative_to(root)), name, path.name == "__init__.py",
                                    set(known))]


def test_the_halves_import_one_way():
    found = breaches()
    assert not found, f"{len(found)} imports against the layering:\n" + "\n".join(found)


def test_the_check_sees_every_folder():
    known = installed_modules()
    assert {half(name) for name in known} == {RUNTIME, LAUNCHER, COMMON, "mtrain", "bindings"}
    assert f"{COMMON}.settings" in known and f"{RUNTIME}.observe.recorder" in known


@pytest.mark.parametrize("here, code, bad", [
    # (a) the runtime
    ("mtrain.ringreduce.observe.probe", "def f():\n    import mtrain.launcher.job.hosts\n", True),
    ("mtrain.ringreduce.observe.probe", "from mtrain.launcher import rank\n", True),
    ("mtrain.ringreduce.observe.probe", "from mtrain import torch\n", True),
    ("mtrain.ringreduce.observe.probe", "from mtrain.torch import allreduce\n", True),
    ("mtrain.ringreduce.observe.probe", "from ...elastic import state\n", True),  # relative, out of the runtime
    ("mtrain.ringreduce.observe.probe", "def f():\n    import torch\n", True),
    ("mtrain.ringreduce.observe.probe", "import tensorflow.keras as k\n", True),
    ("mtrain.ringreduce.observe.probe", "import importlib\nimportlib.import_module('jax.numpy')\n", True),
    ("mtrain.ringreduce.observe.probe", "from mtrain.common.settings import Setting\nfrom mtrain import __version__\n"
                                         "from ..core import errors\nimport numpy\nfrom mpi4py import MPI\n", False),
    # (b) the launcher
    ("mtrain.launcher.job.probe", "def f():\n    from mtrain.ringreduce.observe import recorder\n", True),
    ("mtrain.launcher.job.probe", "import mtrain.ringreduce as rr\n", True),
    ("mtrain.launcher.job.probe", "from mtrain.elastic import job\n", True),
    ("mtrain.launcher.job.probe", "from mtrain import distributed\n", True),
    ("mtrain.launcher.job.probe", "import keras\n", True),
    ("mtrain.launcher.job.probe", "from ..supervise import outcome\nfrom mtrain.common.records import base\n"
                                  "import click, paramiko\n", False),
    # (c) mtrain.common
    ("mtrain.common.probe", "import numpy\n", True),
    ("mtrain.common.probe", "def f():\n    import yaml\n", True),
    ("mtrain.common.probe", "from mtrain.ringreduce.core import errors\n", True),
    ("mtrain.common.probe", "from mtrain.launcher import rank\n", True),
    ("mtrain.common.probe", "from mtrain import elastic\n", True),
    ("mtrain.common.probe", "from .. import autoload\n", True),
    ("mtrain.common.probe", "import os, json\nfrom .records import base\nfrom mtrain import __version__\n", False),
    # (d) the bindings
    ("mtrain.torch.probe", "from mtrain.launcher.job import hosts\n", True),
    ("mtrain.torch.probe", "def f():\n    from mtrain.launcher.cli.main import entry\n", True),
    ("mtrain.ray.probe", "import mtrain.launcher.supervise.outcome\n", True),
    ("mtrain.ray.probe", "from mtrain.launcher import ssh\n", True),
    ("mtrain.ray.probe", "from mtrain.launcher import elastic\n", True),
    ("mtrain.ray.probe", "from mtrain.launcher.tasks.call_service import RankFailed\n"
                         "from mtrain.launcher import process_tools, rank\nimport mtrain.launcher.pymain\n"
                         "from mtrain.launcher import __version__\nimport torch\n"
                         "from mtrain.ringreduce.core.requests import UNNAMED_PREFIX\n", False),
])
def test_the_check_sees_a_breach(here, code, bad):
    known = {"mtrain", "mtrain.torch", "mtrain.elastic", "mtrain.elastic.state", "mtrain.distributed",
             "mtrain.autoload",
             "mtrain.launcher", "mtrain.launcher.rank", "mtrain.launcher.process_tools", "mtrain.launcher.ssh",
             "mtrain.launcher.elastic", "mtrain.launcher.job", "mtrain.launcher.job.hosts",
             "mtrain.ringreduce", "mtrain.ringreduce.observe", "mtrain.ringreduce.observe.recorder",
             "mtrain.ringreduce.core", "mtrain.ringreduce.core.errors", "mtrain.launcher.supervise",
             "mtrain.launcher.supervise.outcome", "mtrain.common", "mtrain.common.records",
             "mtrain.common.records.base"}
    found = breaches_in(code, "probe.py", here, False, known)
    assert bool(found) is bad, found


def test_the_check_reads_a_tree(tmp_path):
    """A made-up tree laid out as the repository's: one breach of each rule, found where it is."""
    files = {
        "bindings/__init__.py": "",
        "bindings/common/__init__.py": "",
        "bindings/common/bad.py": "def f():\n    import numpy\n",
        "bindings/torch/__init__.py": "from mtrain.launcher import job\n",
        "launcher/__init__.py": "from mtrain import __version__\n",
        "launcher/job/__init__.py": "",
        "launcher/job/bad.py": "from mtrain.ringreduce import observe\n",
        "launcher/tasks/__init__.py": "from ..job import bad\n",
        "ringreduce/__init__.py": "from . import observe\n",
        "ringreduce/observe/__init__.py": "",
        "ringreduce/observe/bad.py": "def f():\n    from mtrain import torch\n",
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert sorted(line.split(":")[0] for line in breaches(tmp_path)) == [
        "bindings/common/bad.py", "bindings/torch/__init__.py", "launcher/job/bad.py", "ringreduce/observe/bad.py"]
