"""What mtrain writes for the user: the ranks' lines (and their copies in --output-filename's
folder), the MPI launcher's own lines, and mtrain's own verbose log lines.
"""
from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from mtrain.launcher.supervise.progress import ProgressDisplay

# The prefix mpirun puts before every line of a rank's output (--tag-output): which rank, which stream.
RANK_PREFIX = re.compile(rb"^\[(\d+)\]<(stdout|stderr)>:")


def log(verbose: bool, message: str) -> None:
    """One of mtrain's own log lines on stderr, with the time, when `verbose`."""
    if verbose:
        print(f"mtrain: [{_stamp()}] {message}", file=sys.stderr, flush=True)


def _stamp() -> str:
    now = time.time()
    return time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"


class OutputSink:
    """Writes rank lines to our streams and, optionally, to DIR/rank.N/{stdout,stderr};
    the MPI launcher's own lines go to DIR/mpirun.log (and to our stderr with `verbose`)."""

    def __init__(self, output_dir: Path | None, ranks: int, verbose: bool, timestamp: bool = False) -> None:
        self.output_dir, self.verbose = output_dir, verbose
        self.timestamp = timestamp  # --prefix-output-with-timestamp: Horovod's `{asctime}[rank]<stream>:`
        self.files: dict[tuple[int, str], IO[bytes]] = {}
        self.launcher_log: IO[bytes] | None = None
        self.lock = threading.Lock()
        self.display: ProgressDisplay | None = None  # --progress: the ranks' lines scroll above its line
        if output_dir is not None:
            # Every rank gets both files, even one that never prints: scripts can rely on them.
            for rank in range(ranks):
                for stream in ("stdout", "stderr"):
                    self._file(rank, stream)
            self.launcher_log = open(output_dir / "mpirun.log", "ab")

    def _file(self, rank: int, stream: str) -> IO[bytes]:
        handle = self.files.get((rank, stream))
        if handle is None:
            directory = self.output_dir / f"rank.{rank}"
            directory.mkdir(parents=True, exist_ok=True)
            handle = self.files[(rank, stream)] = open(directory / stream, "ab")
        return handle

    def write(self, line: bytes, stream: IO[bytes]) -> None:
        match = RANK_PREFIX.match(line)
        with self.lock:
            if match is None:
                self._launcher_line(line)
                return
            shown = time.asctime().encode() + line if self.timestamp else line
            if self.display is None or not self.display.write(shown, stream):
                stream.write(shown)
                stream.flush()
            if self.output_dir is not None:
                handle = self._file(int(match.group(1)), match.group(2).decode())
                handle.write(line[match.end():])
                handle.flush()

    def say(self, lines: Sequence[str]) -> None:
        """mtrain's own lines on stderr, together, between the ranks' lines."""
        with self.lock:
            for line in lines:
                if self.display is None or not self.display.write(f"{line}\n".encode()):
                    sys.stderr.write(f"{line}\n")
            sys.stderr.flush()

    def _launcher_line(self, line: bytes) -> None:
        if self.verbose:
            sys.stderr.buffer.write(line)
            sys.stderr.flush()
        if self.launcher_log is not None:
            self.launcher_log.write(line)
            self.launcher_log.flush()

    def close(self) -> None:
        with self.lock:
            for handle in [*self.files.values(), *([self.launcher_log] if self.launcher_log else [])]:
                handle.close()
