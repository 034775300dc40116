"""The engine's settings: defaults, and the environment variables that change them.

One frozen ``EngineConfig`` per engine, read once at ``init()``; the engine
never reads the environment itself.
"""
from __future__ import annotations

import dataclasses
import os

# Chosen by measurement on the 2-core development VM (benchmarks/fusion.py; docs/benchmarks.md):
DEFAULT_CYCLE_TIME_MS = 1.0
DEFAULT_FUSION_THRESHOLD_BYTES = 8 << 20
# Tensors at least this big skip the fusion buffer: copying them in and out
# costs more than the per-ring overhead that fusing saves.
DEFAULT_INPLACE_MIN_BYTES = 1 << 20
DEFAULT_STALL_WARNING_SECONDS = 60.0


def env_number(name: str, default: float) -> float:
    """A non-negative number from the environment, or ``default`` when unset or empty."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number; unset it or give a number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How one engine cycles, fuses and watches for stalls."""

    cycle_time_s: float = DEFAULT_CYCLE_TIME_MS / 1000
    fusion_threshold_bytes: int = DEFAULT_FUSION_THRESHOLD_BYTES
    inplace_min_bytes: int = DEFAULT_INPLACE_MIN_BYTES
    stall_warning_s: float = DEFAULT_STALL_WARNING_SECONDS
    stall_shutdown_s: float = 0.0
    timeline_path: "str | None" = None

    @staticmethod
    def from_environment() -> "EngineConfig":
        return EngineConfig(
            cycle_time_s=env_number("MTRAIN_CYCLE_TIME_MS", DEFAULT_CYCLE_TIME_MS) / 1000,
            fusion_threshold_bytes=int(env_number("MTRAIN_FUSION_THRESHOLD_BYTES", DEFAULT_FUSION_THRESHOLD_BYTES)),
            inplace_min_bytes=int(env_number("MTRAIN_FUSION_INPLACE_MIN_BYTES", DEFAULT_INPLACE_MIN_BYTES)),
            stall_warning_s=env_number("MTRAIN_STALL_WARNING_SECONDS", DEFAULT_STALL_WARNING_SECONDS),
            stall_shutdown_s=env_number("MTRAIN_STALL_SHUTDOWN_SECONDS", 0.0),
            timeline_path=os.environ.get("MTRAIN_TIMELINE") or None,
        )
