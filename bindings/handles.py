"""Handles shared by the framework adapters.

A framework op is a runtime op plus a last step that turns the runtime's NumPy
result into a framework tensor (or copies it back into the caller's tensor).
``FrameworkHandle`` carries both, so ``synchronize`` is one call for every adapter.
"""
from __future__ import annotations

from typing import Any, Callable

import mtrain.ringreduce as rr


class FrameworkHandleBase:
    """What ``synchronize`` and ``poll`` accept: an op in flight with ``wait()`` and ``poll()``.

    No fields (empty slots), so a binding may also derive its handle from the runtime's own
    op (``mtrain.ringreduce.AllreduceOp``): one object per tensor on the per-gradient path."""

    __slots__ = ()

    def poll(self) -> bool:
        raise NotImplementedError

    def wait(self) -> Any:
        raise NotImplementedError


class FrameworkHandle(FrameworkHandleBase):
    """An op in flight. ``wait()`` returns the framework-level result (once computed, cached)."""

    __slots__ = ("_inner", "_finish", "_done", "_result")

    def __init__(self, inner: Any, finish: Callable[[Any], Any]) -> None:
        self._inner, self._finish = inner, finish
        self._done, self._result = False, None

    def poll(self) -> bool:
        return self._done or rr.poll(self._inner)

    def wait(self) -> Any:
        if not self._done:
            result = self._finish(rr.synchronize(self._inner))
            self._done, self._result, self._inner = True, result, None
        return self._result


class DeferredHandle(FrameworkHandle):
    """Several handles whose results one function combines (e.g. a sparse all-reduce: an
    all-gather of indices and one of values). Callable too, as Horovod's sparse handle is."""

    __slots__ = ("_parts",)

    def __init__(self, parts: "list[FrameworkHandle]", finish: Callable[..., Any]) -> None:
        super().__init__(None, finish)
        self._parts = parts

    def poll(self) -> bool:
        return self._done or all(part.poll() for part in self._parts)

    def wait(self) -> Any:
        if not self._done:
            result = self._finish(*[part.wait() for part in self._parts])
            self._done, self._result, self._parts = True, result, []
        return self._result

    def __call__(self) -> Any:
        return self.wait()


def synchronize(handle: FrameworkHandleBase) -> Any:
    """Wait for ``handle``'s op and return its result; raises the op's error."""
    if not isinstance(handle, FrameworkHandleBase):
        raise TypeError(f"synchronize() takes a handle returned by an *_async op, got {type(handle).__name__}")
    return handle.wait()


def poll(handle: FrameworkHandleBase) -> bool:
    """True once ``handle``'s op has finished (``synchronize`` will not block)."""
    if not isinstance(handle, FrameworkHandleBase):
        raise TypeError(f"poll() takes a handle returned by an *_async op, got {type(handle).__name__}")
    return handle.poll()
