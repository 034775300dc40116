"""What runs inside each rank of an mtrain.ray job (launcher/tasks/call_worker.py serves the calls).

Stdlib only, and nothing here imports Ray: the ranks are MPI processes under the node's
actor, and importing Ray there would cost each rank seconds for nothing.  The functions are
shipped to the ranks by reference (cloudpickle), so they must stay importable here.
"""
from __future__ import annotations

from typing import Any, Callable

# The executable_cls instance of this rank (RayExecutor.start), what execute() hands to fn.
executable: Any = None


def create_executable(cls: "type | None", args: "list | tuple", kwargs: dict) -> None:
    """Make this rank's executable (None without a class), as Horovod's worker actor does at start()."""
    global executable
    executable = cls(*args, **kwargs) if cls is not None else None


def call_with_executable(fn: Callable[[Any], Any]) -> Any:
    """fn(this rank's executable): RayExecutor.execute / execute_single."""
    return fn(executable)
