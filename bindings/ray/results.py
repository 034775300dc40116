"""ResultBox: an async Ray actor that turns a call the driver makes into ObjectRefs.

RayExecutor.run_remote returns, as Horovod's does, one ObjectRef per rank; the call itself
runs through the driver's CallServer, so the refs are this actor's `get` calls, which wait
until the driver `put`s the call's outcome.  A call's error crosses two processes on its way
to whoever ray.get()s the refs: `portable` makes it one that pickles.
"""
from __future__ import annotations

import asyncio
import pickle
from typing import Any

from mtrain.launcher.tasks.call_service import RankFailed


class RemoteRankFailed(RankFailed):
    """RankFailed as ray.get raises it from run_remote's refs (the same fields; it pickles)."""

    def __reduce__(self):
        return type(self), (self.rank, self.remote_type, self.remote_message, self.remote_traceback)


def portable(error: BaseException) -> BaseException:
    """`error`, or one like it that survives pickling (Ray sends errors between processes)."""
    if isinstance(error, RankFailed):
        return RemoteRankFailed(error.rank, error.remote_type, error.remote_message, error.remote_traceback)
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


class ResultBox:
    """Holds each call's outcome: (True, [result per rank]) or (False, the exception)."""

    def __init__(self) -> None:
        self.outcomes: dict[int, tuple[bool, Any]] = {}
        self.arrived: dict[int, asyncio.Event] = {}

    def _event(self, call: int) -> asyncio.Event:
        return self.arrived.setdefault(call, asyncio.Event())

    async def put(self, call: int, outcome: tuple[bool, Any]) -> None:
        self.outcomes[call] = outcome
        self._event(call).set()

    async def get(self, call: int, rank: int) -> Any:
        await self._event(call).wait()
        ok, value = self.outcomes[call]
        if not ok:
            raise value
        return value[rank]
