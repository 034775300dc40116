"""Handles shared by the framework adapters.

A framework op is a runtime op plus a last step that turns the runtime's NumPy
result into a framework tensor (or copies it back into the caller's tensor).
``Handle`` carries both, so ``synchronize`` is one call for every adapter.
"""
from __future__ import annotations

from typing import Any, Callable

import ringreduce as rr


class _Completed:
    """A finished op, for a runtime without the asynchronous engine."""

    def __init__(self, run: Callable[[], Any]) -> None:
        self.result, self.error = None, None
        try:
            self.result = run()
        except Exception as error:  # re-raised by synchronize, like the engine's handles
            self.error = error


def start(op: str, *args: Any, **kwargs: Any) -> Any:
    """Start runtime op ``op`` (e.g. "allreduce_") asynchronously; returns the runtime's handle.

    Until the runtime has its background engine, the synchronous op runs now.
    """
    async_op = getattr(rr, op[:-1] + "_async_" if op.endswith("_") else op + "_async", None)
    if async_op is not None:
        return async_op(*args, **kwargs)
    sync_op = getattr(rr, op, None)
    if sync_op is None and op.startswith("grouped_allreduce"):  # one op per array
        single = rr.allreduce_ if op.endswith("_") else rr.allreduce
        arrays, rest = args[0], args[1:]
        return _Completed(lambda: [single(a, *rest, **kwargs) for a in arrays])
    return _Completed(lambda: sync_op(*args, **kwargs))


def _wait(inner: Any) -> Any:
    if isinstance(inner, _Completed):
        if inner.error is not None:
            raise inner.error
        return inner.result
    return rr.synchronize(inner)


def _ready(inner: Any) -> bool:
    return True if isinstance(inner, _Completed) else rr.poll(inner)


class Handle:
    """An op in flight. ``wait()`` returns the framework-level result (once computed, cached)."""

    __slots__ = ("_inner", "_finish", "_done", "_result")

    def __init__(self, inner: Any, finish: Callable[[Any], Any]) -> None:
        self._inner, self._finish = inner, finish
        self._done, self._result = False, None

    def poll(self) -> bool:
        return self._done or _ready(self._inner)

    def wait(self) -> Any:
        if not self._done:
            result = self._finish(_wait(self._inner))
            self._done, self._result, self._inner = True, result, None
        return self._result


def synchronize(handle: Handle) -> Any:
    """Wait for ``handle``'s op and return its result; raises the op's error."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize() takes a handle returned by an *_async op, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: Handle) -> bool:
    """True once ``handle``'s op has finished (``synchronize`` will not block)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"poll() takes a handle returned by an *_async op, got {type(handle).__name__}")
    return handle.poll()
