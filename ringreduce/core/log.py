"""The runtime's messages to the user, filtered by the log level (MTRAIN_LOG_LEVEL /
HOROVOD_LOG_LEVEL, read into ``EngineConfig.log_level`` at ``init()``).

Lines go to stderr as ``mtrain: <message>``, without a timestamp: the rank wrapper
prefixes them with the rank, and ``mtrain run --prefix-output-with-timestamp`` stamps
every line the job prints.
"""
from __future__ import annotations

import sys

from mtrain.common.settings import EngineConfig, LogLevel

_level = LogLevel.WARNING


def set_level(level: LogLevel) -> None:
    """Messages below ``level`` are dropped from now on."""
    global _level
    _level = level


def start(config: EngineConfig, rank: int) -> None:
    """Take ``config``'s level; say once (rank 0) what the settings are and what mtrain lacks."""
    set_level(config.log_level)
    if rank != 0:
        return
    debug(f"engine settings: {config.describe()}")
    if config.hierarchical_allgather:
        warning("HOROVOD_HIERARCHICAL_ALLGATHER is set, but mtrain has no hierarchical allgather; "
                "allgather runs on the ring")


def emit(level: LogLevel, message: str) -> None:
    if level >= _level:
        # Looked up per call: a test's (or a framework's) replacement of sys.stderr is honoured.
        sys.stderr.write(f"mtrain: {message}\n")
        sys.stderr.flush()


def debug(message: str) -> None:
    emit(LogLevel.DEBUG, message)


def warning(message: str) -> None:
    emit(LogLevel.WARNING, message)


def info(message: str) -> None:
    emit(LogLevel.INFO, message)
