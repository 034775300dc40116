"""What the benchmarks take from the repository besides the installed `mtrain` package.

The benchmarks import `mtrain` as it is installed (``pip install -e .``), never the
repository's own folders: with the repository root on ``sys.path``, ``launcher`` and
``ringreduce`` would import as top-level packages, which an installed mtrain never
offers (tests/unit/test_packaging.py). Sibling benchmarks import by their file names
(Python puts a script's folder first on ``sys.path``), and the namespace test cluster,
tests/cluster/netcluster.py, and its Slurm, slurmcluster.py (standard library only), are
loaded from their files.
"""
from __future__ import annotations

from pathlib import Path
from types import ModuleType

from mtrain.launcher.cli.module_files import load_module_file

ROOT = Path(__file__).resolve().parent.parent
_NETCLUSTER = "mtrain_benchmarks_netcluster"


def _load(name: str, filename: str) -> ModuleType:
    """tests/cluster/`filename`, loaded from its file once as `name` (the repository root stays off sys.path)."""
    return load_module_file(name, ROOT / "tests" / "cluster" / filename)


def netcluster() -> ModuleType:
    """tests/cluster/netcluster.py: the namespace test cluster (sshd hosts)."""
    return _load(_NETCLUSTER, "netcluster.py")


def slurmcluster() -> ModuleType:
    """tests/cluster/slurmcluster.py: a real Slurm on the namespace cluster (it imports netcluster as loaded here)."""
    netcluster()
    return _load("mtrain_benchmarks_slurmcluster", "slurmcluster.py")
