"""What the benchmarks take from the repository besides the installed `mtrain` package.

The benchmarks import `mtrain` as it is installed (``pip install -e .``), never the
repository's own folders: with the repository root on ``sys.path``, ``launcher`` and
``ringreduce`` would import as top-level packages, which an installed mtrain never
offers (tests/unit/test_packaging.py). Sibling benchmarks import by their file names
(Python puts a script's folder first on ``sys.path``), and the namespace test cluster,
tests/cluster/netcluster.py (standard library only), is loaded from its file.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
_NETCLUSTER = "mtrain_benchmarks_netcluster"


def netcluster() -> ModuleType:
    """tests/cluster/netcluster.py, loaded from its file once (the repository root stays off sys.path)."""
    loaded = sys.modules.get(_NETCLUSTER)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(_NETCLUSTER, ROOT / "tests" / "cluster" / "netcluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NETCLUSTER] = module  # dataclasses look their module up while the file runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[_NETCLUSTER]
        raise
    return module
