"""How a collective's torch ``Work`` completes: a thread per group that waits on the runtime's
handles in submission order (``Completer``, completing ``Work``'s future), and a point-to-point
transfer's own ``TransferWork``. Why it is built so: docs/ddp-backend.md."""
from __future__ import annotations

import atexit
import queue
import threading
from typing import Any, Callable, List, Tuple

import torch
import torch.distributed as dist

import mtrain.ringreduce as rr

__all__ = ["Completer", "TransferWork", "Work", "finished_work"]


class Completer:
    """A daemon thread that waits on one group's runtime handles and completes the torch futures."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Tuple[List[Any], Callable[[], Any], torch.futures.Future]]" = \
            queue.SimpleQueue()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="mtrain-distributed-completer", daemon=True)
        self._thread.start()
        # A daemon thread still inside torch (completing a future) when the interpreter
        # finalizes is unwound through C++ frames that cannot be unwound: std::terminate,
        # SIGABRT. At exit it stops touching torch, and finishes what it is doing first.
        atexit.register(self._close)

    def _close(self) -> None:
        self._closing = True
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def finish_and_stop(self) -> None:
        """End the thread once the ops queued so far are completed (their Works still complete)."""
        self._queue.put(None)

    def add(self, handles: List[Any], finish: Callable[[], Any], future: torch.futures.Future) -> None:
        self._queue.put((handles, finish, future))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closing:
                return  # (a None after the last item: finish_and_stop)
            handles, finish, future = item
            try:
                for handle in handles:
                    rr.synchronize(handle)
                value = finish()
            except Exception as error:  # the op's own error goes to whoever waits on its Work
                if self._closing:
                    return
                future.set_exception(error)
            else:
                if self._closing:
                    return
                future.set_result(value)


class Work(dist.Work):
    """A collective's Work: its future, which the group's completer completes. ``wait()`` raises the
    op's error. (torch's ``_create_work_from_future`` makes a Work whose ``wait()`` returns True on a
    failed future: the error would be lost.) torch's Python ProcessGroup trampoline forwards
    ``wait``/``get_future`` to these methods when C++ (DDP's reducer) holds the Work."""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout: Any = None) -> bool:
        self._future.wait()  # raises the op's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def result(self) -> Any:
        return self._future.wait()


def finished_work(value: Any) -> Any:
    """A Work done already, with ``value`` (a collective with nothing to do)."""
    future = torch.futures.Future()
    future.set_result(value)
    return Work(future)


class TransferWork(dist.Work):
    """A send's or recv's Work: waits on the runtime's transfer itself (point-to-point ops of
    several groups and directions complete in any order, so they take no completer thread; a
    recv waited for first must not hold up a send issued before it). The future, if asked for,
    is completed by whichever thread finishes the transfer."""

    def __init__(self, transfer: Any, finish: Callable[[], Any]) -> None:
        super().__init__()
        self._transfer, self._finish = transfer, finish
        self._lock = threading.Lock()
        self._landed = False
        self._value: Any = None

    def _land(self) -> Any:
        with self._lock:
            if not self._landed:
                self._value, self._landed = self._finish(), True
            return self._value

    def wait(self, timeout: Any = None) -> bool:
        rr.synchronize(self._transfer)  # raises the transfer's error
        self._land()
        return True

    def is_completed(self) -> bool:
        return rr.poll(self._transfer)

    def is_success(self) -> bool:
        return self.is_completed() and self._transfer.error() is None

    def exception(self) -> Any:
        return self._transfer.error()

    def result(self) -> Any:
        self.wait()
        return self._value

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()

        def complete(transfer: Any) -> None:
            if transfer.error() is not None:
                future.set_exception(transfer.error())
            else:
                future.set_result(self._land())
        self._transfer.add_done_callback(complete)
        return future

