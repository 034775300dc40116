"""No module reaches into another's underscored names: not the runtime (ringreduce/), the
launcher (launcher/), the bindings (bindings/), the benchmarks, the examples or the tests.

Two ways in are checked, statically:

* `from mtrain.x import _name` (or a relative import) of a module other than the file's own;
* `thing._name` where the file itself defines no `_name` (no `def _name`, `class _name`,
  `_name = ...` or `self._name = ...`): the name belongs to another module's object. A class
  may still use its own private names on another instance of itself (`other._x` in `__eq__`).
  `getattr(thing, "_name")` (and setattr, hasattr, delattr with the name as a literal) is the
  same reach-in spelled as a string, under the same rule.

What a module shares with others it makes public, under a name without the underscore.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.source_modules import REPO, import_source, module_name

FOLDERS = ("bindings", "ringreduce", "launcher", "benchmarks", "examples", "tests")
# Underscored names that are public API of the standard library or a dependency.
PUBLIC_ELSEWHERE = {
    "_replace", "_asdict", "_fields", "_make", "_field_defaults",  # namedtuple
    "_exit", "_getframe", "_current_frames", "_clear_type_cache",  # os, sys
    "_value_", "_name_", "_missing_", "_generate_next_value_", "_member_map_", "_value2member_map_",  # enum
}
# Private names of the frameworks and libraries we adapt to, which offer no public way to the
# same thing; each is named here with why, so a new one is a decision, not an accident. A key
# `owner._name` allows the name on that object only.
FRAMEWORK_PRIVATE = {
    "_Environ": "os: the type of os.environ",
    "_set_abort_status": "mpi4py: the status MPI_Abort gives when the interpreter exits with an error",
    "_plugins": "torch.distributed.Backend: whether a third-party backend is registered already",
    "_register_backend": "torch ProcessGroup: how a backend object is attached to a group",
    "_indices": "torch sparse COO tensors (uncoalesced access)",
    "_values": "torch sparse COO tensors (uncoalesced access)",
    "_BatchNorm": "torch.nn: the base class of the batch-norm layers SyncBatchNorm stands in for",
    "_make_nccl_premul_sum": "torch.distributed: the only way to build a PREMUL_SUM op",
    "_get_default_store": "torch.distributed: the default group's store",
    "_DistributedBackendOptions": "torch: what a backend's creator receives",
    "_get_control_flow_context": "TensorFlow graphs: whether an op is built inside a loop or cond",
    "_trainable_variables": "Keras 3 optimizers: the variables a built optimizer tracks",
    "_create_all_weights": "Keras 2 (tf_keras) optimizers: build the slots before the first step",
    "_hyper": "Keras 2 (tf_keras) optimizers: their hyperparameters",
    "_get_hyper": "Keras 2 (tf_keras) optimizers: one hyperparameter",
    "_compute_gradients": "Keras 2 (tf_keras) optimizers: the method Horovod's wrapper overrides",
    "_aggregate_gradients": "Keras 2 (tf_keras) optimizers: the hook Horovod's wrapper keeps from reducing twice",
    "_HAS_AGGREGATE_GRAD": "Keras 2 (tf_keras) optimizers: the flag Horovod's wrapped optimizer sets",
    "_agg_helper": "Horovod's wrapped Keras 2 optimizer: its gradient aggregation, which Horovod programs read",
    # Found once getattr/setattr/hasattr/delattr with a literal name counted too:
    "sys._base_executable": "CPython: the interpreter a virtualenv was made from, which tests/bindings/"
                        "test_spark_local.py makes a fresh virtualenv of (sys.executable is this one's, with mtrain)",
    "torch.cuda._sleep": "a kernel that spins the GPU for N cycles (torch's own tests' way to keep a stream "
              "busy); tests/gpu/test_gpu.py widens the window a missing stream wait would leave, when it exists",
}
OURS = ("mtrain", "tests", "benchmarks", "examples")


ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def named_attribute(node: ast.AST) -> "tuple[ast.expr, str] | None":
    """``(thing, "_name")`` for ``getattr(thing, "_name", ...)`` and its siblings, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[0], node.args[1].value
    return None


def _targets(statement: ast.stmt) -> "list[str]":
    """The plain names a module- or class-level statement binds."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    targets = statement.targets if isinstance(statement, ast.Assign) else (
        [statement.target] if isinstance(statement, (ast.AnnAssign, ast.AugAssign)) else [])
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


def own_private_names(tree: ast.Module) -> set[str]:
    """What a module defines as its own: what it binds at module level or in a class body (a
    local variable does not count: `_x = other._x` in a function still reaches in), every
    function's name, what it reads or sets on `self` / `cls`, and the names in `__slots__`."""
    names = set()
    bodies = [tree.body] + [node.body for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    for body in bodies:
        for statement in body:
            names.update(_targets(statement))
            if isinstance(statement, ast.Assign) and "__slots__" in _targets(statement):
                names.update(n.value for n in ast.walk(statement.value)
                             if isinstance(n, ast.Constant) and isinstance(n.value, str))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id in ("self", "cls")):
            names.add(node.attr)  # a class's own (set here, or read here and set by a factory beside it)
        elif named_attribute(node):
            thing, name = named_attribute(node)
            if isinstance(thing, ast.Name) and thing.id in ("self", "cls"):
                names.add(name)  # getattr(self, "_x"): as self._x
    return {name for name in names if name.startswith("_")}


def private(name: str, owner: "ast.expr | None" = None) -> bool:
    """Whether ``name`` (read on ``owner``, where known) is someone's private name. A FRAMEWORK_PRIVATE
    entry ``owner._name`` allows the name on that object only (``torch.cuda._sleep``)."""
    on = f"{ast.unparse(owner)}.{name}" if owner is not None else None
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__")) \
        and name not in PUBLIC_ELSEWHERE and name not in FRAMEWORK_PRIVATE and on not in FRAMEWORK_PRIVATE


def offenders_in(text: str, where: str, here: str, is_package: bool = False) -> list[str]:
    """The reach-ins in one module's source `text` (`here` is its dotted name)."""
    tree = ast.parse(text, where)
    own = own_private_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = import_source(here, is_package, node)
            for alias in node.names:
                if private(alias.name) and source != here and source.split(".")[0] in OURS:
                    found.append(f"{where}:{node.lineno} imports {alias.name} from {source}")
        elif isinstance(node, ast.Attribute) and private(node.attr, node.value) and node.attr not in own:
            found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
        elif named_attribute(node):
            thing, name = named_attribute(node)
            if private(name, thing) and name not in own:
                found.append(f"{where}:{node.lineno} uses {ast.unparse(node)}")
    return found


def offenders_in_file(path: Path) -> list[str]:
    return offenders_in(path.read_text(), str(path.relative_to(REPO)), module_name(path), path.name == "__init__.py")


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (REPO / folder).rglob("*.py"))


def test_no_underscored_name_is_used_across_modules():
    offenders = [line for path in sources() for line in offenders_in_file(path)]
    assert not offenders, f"{len(offenders)} uses of another module's private names:\n" + "\n".join(offenders)


@pytest.mark.parametrize("code, bad", [
    ("from mtrain.ringreduce.runtime import _rt\n", True),
    ("from .engine import _Thing\n", True),
    ("import mtrain.ringreduce.runtime as runtime\nruntime._rt()\n", True),
    ("class A:\n    def __init__(self):\n        self._x = 1\n    def same(self, other):\n        return other._x\n", False),
    ("from collections import namedtuple\nP = namedtuple('P', 'a')\nP(1)._replace(a=2)\n", False),
    ("import os\nos._exit(0)\n", False),
    ("def f(engine):\n    return engine._flight\n", True),
    ("def f(master, watch):\n    master._gate = watch\n", True),
    ("def f(engine):\n    _flight = engine._flight\n", True),
    ("class A:\n    __slots__ = ('_x',)\n    def same(self, other):\n        return other._x\n", False),
    # The same reach-ins spelled as strings.
    ("def f(variable):\n    return getattr(variable, '_shared_name', None)\n", True),
    ("def f(engine):\n    setattr(engine, '_flight', None)\n", True),
    ("def f(engine):\n    return hasattr(engine, '_flight')\n", True),
    ("def f(engine):\n    delattr(engine, '_flight')\n", True),
    ("class A:\n    def __init__(self):\n        setattr(self, '_x', 1)\n    def same(self, other):\n"
     "        return getattr(other, '_x')\n", False),
    ("def f(thing, name):\n    return getattr(thing, name), getattr(thing, '__dict__'), getattr(thing, 'x')\n", False),
    ("def f(p):\n    return getattr(p, '_asdict')()\n", False),
    ("import torch\ntorch.cuda._sleep(1)\ngetattr(torch.cuda, '_sleep', None)\n", False),  # allowed on that object
    ("def f(engine):\n    return engine._sleep\n", True),  # ... and on no other
])
def test_the_check_sees_a_reach_in(code, bad):
    found = offenders_in(code, "probe.py", "mtrain.ringreduce.probe")
    assert bool(found) is bad, found
