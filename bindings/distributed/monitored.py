"""gloo's monitored barrier, met on a group's torch store (``dist.monitored_barrier`` refuses every
backend but gloo before it reaches the group). Why on the store and not on the engine:
docs/ddp-backend.md."""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable

from .errors import ArgumentError

__all__ = ["meet_on_store", "timeout_seconds"]


def timeout_seconds(timeout: Any, what: str) -> float:
    """``timeout`` (a timedelta, or seconds as torch also takes) in seconds; ArgumentError unless positive."""
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)  # torch takes seconds as a float here too (with a warning)
    else:
        raise ArgumentError(f"{what}: timeout must be a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ArgumentError(f"{what}: timeout must be positive, got {timeout!r}")
    return seconds


def meet_on_store(store: Any, key: str, *, rank: int, size: int, seconds: float, wait_all_ranks: bool,
                  describe: Callable[[int], str]) -> None:
    """One monitored barrier under ``key`` on ``store``: every rank announces its arrival; rank 0
    waits for the others until ``seconds`` have passed, then releases them, or raises naming the
    first missing rank (every missing rank with ``wait_all_ranks``) and tells the others so. Every
    rank raises RuntimeError by its own deadline; nothing waits longer. ``describe``: a group rank
    as the errors name it."""
    deadline = time.monotonic() + seconds
    store.set(f"{key}.arrived.{rank}", b"1")
    if rank == 0:
        waiting = list(range(1, size))
        while True:
            waiting = [r for r in waiting if not store.check([f"{key}.arrived.{r}"])]
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                break
            time.sleep(min(0.005, left))
        if waiting:
            missing = waiting if wait_all_ranks else waiting[:1]
            names = ", ".join(describe(r) for r in missing)
            text = f"rank{'s' if len(missing) > 1 else ''} {names} of the group did not arrive within {seconds:g} s"
            store.set(f"{key}.released", ("failed: " + text).encode())
            raise RuntimeError(f"monitored_barrier: {text}")
        store.set(f"{key}.released", b"ok")
        return
    while not store.check([f"{key}.released"]):
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"monitored_barrier: rank {describe(rank)} arrived, but group rank 0 "
                               f"({describe(0)}) did not release it within {seconds:g} s: rank 0 did not "
                               "arrive, or failed; check its log")
        time.sleep(min(0.005, left))
    released = bytes(store.get(f"{key}.released")).decode()
    if released != "ok":
        raise RuntimeError(f"monitored_barrier: rank {describe(rank)} arrived, but group rank 0 reports: "
                           f"{released.removeprefix('failed: ')}")
