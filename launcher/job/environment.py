"""Which environment variables the ranks receive (pure)."""
from __future__ import annotations

from typing import Iterable, Mapping

FORWARDED_NAMES = ("PATH", "PYTHONPATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED")
# HOROVOD_*: the runtime reads Horovod's variables too (ours win), so they reach every host, as in horovodrun.
FORWARDED_PREFIXES = ("NCCL_", "CUDA_", "OMP_", "MTRAIN_", "HOROVOD_")


def forwarded_names(env: Mapping[str, str]) -> list[str]:
    """Names from `env` the ranks get by default, sorted for a stable argv."""
    names = [name for name in env
             if name in FORWARDED_NAMES or name.startswith(FORWARDED_PREFIXES)]
    return sorted(names)


def rank_environment(env: Mapping[str, str], user_items: Iterable[str]) -> tuple[list[str], dict[str, str]]:
    """Split what ranks get into names taken from `env` and explicit NAME=value pairs.

    `-x VAR=value` wins over a forwarded VAR; `-x VAR` of an unset VAR is skipped
    (Open MPI would refuse it; Horovod silently ignores it).
    """
    values: dict[str, str] = {}
    names = forwarded_names(env)
    for item in user_items:
        name, eq, value = item.partition("=")
        if eq:
            values[name] = value
        elif name in env and name not in names:
            names.append(name)
    names = [name for name in names if name not in values]
    return names, values
