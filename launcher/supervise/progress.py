"""`mtrain run --progress`: where the job is, on one line.

On a terminal, one live line at the bottom of the screen (drawn by `rich`), which the ranks'
output scrolls above; elsewhere (a log file, CI), a plain `mtrain: progress: …` line every
--progress-interval seconds.  The line says how many ranks are up, how many steps every rank
has done and how many per second over the last 10 s, how many bytes per second each rank's
collectives moved, and which rank computes longest between its steps (launcher/supervise/stragglers.py).
"""
from __future__ import annotations

import sys
import threading
from typing import IO, Callable

from mtrain.launcher.supervise.stragglers import RATE_WINDOW, Progress

REFRESH_PER_SECOND = 2


def describe(progress: Progress, up: int, expected: int) -> str:
    """The status line's text."""
    parts = [f"ranks {up}/{expected} up"]
    if progress.steps:
        parts.append(f"step {progress.steps}")
        if progress.steps_per_second:
            parts.append(f"{progress.steps_per_second:.1f} steps/s over {RATE_WINDOW:g} s")
            parts.append(f"{_rate(progress.bytes_per_second)} reduced per rank")
        slowest = progress.slowest
        if slowest is not None:
            parts.append(f"slowest rank {slowest.rank} ({slowest.host}, {slowest.compute * 1000:.1f} ms compute, "
                         f"{slowest.ratio:.1f}x the median)")
    else:
        parts.append("no step measured yet")
    return " · ".join(parts)


def _rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{bytes_per_second / 1e9:.2f} GB/s"
    return f"{bytes_per_second / 1e6:.1f} MB/s"


class ProgressDisplay:
    """The live line (a terminal) or the periodic plain line (anything else) for one job."""

    def __init__(self, status: Callable[[], str], interval: float, say: Callable[[str], None],
                 stream: "IO[str] | None" = None) -> None:
        self._status = status
        self._interval = interval
        self._say = say  # writes one of mtrain's lines, in turn with the ranks' output
        self._stream = stream or sys.stderr
        self._stop = threading.Event()
        self._live = None
        self._console = None
        self._thread: "threading.Thread | None" = None
        self.live = bool(getattr(self._stream, "isatty", lambda: False)())

    def start(self) -> None:
        if self.live:
            from rich.console import Console  # only here: rich takes a while to import
            from rich.live import Live
            from rich.text import Text
            self._console = Console(file=self._stream, highlight=False, markup=False, emoji=False, soft_wrap=True)
            self._live = Live(get_renderable=lambda: Text(self._status(), no_wrap=True, overflow="ellipsis"),
                              console=self._console, refresh_per_second=REFRESH_PER_SECOND, transient=True,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        else:
            self._thread = threading.Thread(target=self._plain, name="mtrain-progress", daemon=True)
            self._thread.start()

    def _plain(self) -> None:
        while not self._stop.wait(self._interval):
            self._say(f"mtrain: progress: {self._status()}")

    def write(self, line: bytes, stream: "IO[bytes] | None" = None) -> bool:
        """Write one output line above the live line; False when the caller should write it
        itself (no live line, or ``stream`` is not a terminal: a redirected stdout)."""
        console = self._console
        if console is None or (stream is not None and not getattr(stream, "isatty", lambda: False)()):
            return False
        console.print(line.decode(errors="replace"), end="")
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._live is not None:
            self._live.stop()
            self._live = self._console = None
        if self._thread is not None:
            self._thread.join(timeout=1.0)
