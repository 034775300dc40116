"""Chrome-trace timeline of every op (``MTRAIN_TIMELINE=path``, or ``start_timeline(path)``
and ``stop_timeline()`` at run time), written by rank 0.

Open the file in chrome://tracing or ui.perfetto.dev: one row per op name,
with its NEGOTIATE, MEMCPY_IN_FUSION_BUFFER, ALLREDUCE (the ring) and
MEMCPY_OUT_FUSION_BUFFER phases. Events are appended as they happen; the
file is a valid JSON array once ``close()`` runs (viewers also accept it
without the closing bracket, e.g. after a crash).
"""
from __future__ import annotations

import json
import os
import threading
import time


class Timeline:
    def __init__(self, path: str) -> None:
        self._file = open(path, "w", encoding="utf-8")
        self._file.write("[\n")
        self._rows: "dict[str, int]" = {}
        self._lock = threading.Lock()
        self._origin = time.monotonic()
        self._pid = os.getpid()

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "thread_name", "ph": "M", "pid": self._pid, "tid": row,
                         "args": {"name": name}})
        return row

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event) + ",\n")

    def span(self, name: str, phase: str, start: float, end: float, **args: object) -> None:
        """One phase of op ``name`` from ``start`` to ``end`` (time.monotonic() seconds)."""
        with self._lock:
            if self._file.closed:  # stopped (stop_timeline) while the engine was mid-op
                return
            self._write({"name": phase, "ph": "X", "pid": self._pid, "tid": self._row(name),
                         "ts": round((start - self._origin) * 1e6, 1),
                         "dur": round(max(end - start, 0.0) * 1e6, 1), "args": args})

    def negotiated(self, requests: "list", start: float, mark_cycle: bool) -> None:
        """Each op's NEGOTIATE phase, from its submit to ``start`` (a cycle's execution)."""
        if mark_cycle:
            self.mark("CYCLE_START")
        for request in requests:
            self.span(request.name, "NEGOTIATE", request.submitted, start)

    def ring(self, packed: "list", alone: "list", packed_bytes: int, times: "tuple[float, float, float, float]") -> None:
        """One ring's phases: packing (t0-t1), the ring (t1-t2), unpacking (t2-t3)."""
        t0, t1, t2, t3 = times
        ring_ops = len(packed) + len(alone)
        for request in packed:
            self.span(request.name, "MEMCPY_IN_FUSION_BUFFER", t0, t1)
            self.span(request.name, "ALLREDUCE", t1, t2, fused_bytes=packed_bytes, ring_ops=ring_ops)
            self.span(request.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
        for request in alone:
            self.span(request.name, "ALLREDUCE", t1, t2, bytes=request.nbytes, ring_ops=ring_ops)

    def mark(self, label: str) -> None:
        """An instant event across every row (``mark_cycles``: one per engine cycle that ran ops)."""
        with self._lock:
            if self._file.closed:
                return
            self._write({"name": label, "ph": "i", "pid": self._pid, "tid": 0,
                         "ts": round((time.monotonic() - self._origin) * 1e6, 1), "s": "g"})

    def close(self) -> None:
        with self._lock:
            if self._file.closed:
                return
            self._file.write(json.dumps({"name": "end", "ph": "i", "pid": self._pid, "tid": 0,
                                         "ts": round((time.monotonic() - self._origin) * 1e6, 1),
                                         "s": "g"}) + "\n]\n")
            self._file.close()
