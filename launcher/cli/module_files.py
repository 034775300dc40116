"""Load a Python module from its file, under a name of our choosing.

For modules that must not be imported through their package: the runtime's settings in the
launcher (importing ``mtrain.ringreduce`` starts MPI), and the test clusters' helpers in the
benchmarks (the repository root stays off ``sys.path``).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType


class NotAModuleFile(ImportError):
    """The file cannot be loaded as a module at all (as opposed to a module that fails as it runs)."""


def load_module_file(name: str, path: "str | os.PathLike[str]") -> ModuleType:
    """The module in the file `path`, run once and kept in ``sys.modules`` as `name` (later calls
    return that one); nothing is kept when running it raises (and its error propagates).
    NotAModuleFile when `path` cannot be loaded as a module."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise NotAModuleFile(f"cannot load {path} as a module", name=name, path=str(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
