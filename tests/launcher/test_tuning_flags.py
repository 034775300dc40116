"""horovodrun's tuning flags in a real `mtrain run` job: what the ranks' engines end up with."""
from __future__ import annotations

import json
import re

import pytest

from tests.launcher.test_local_run import PYTHON, mtrain

pytestmark = pytest.mark.timeout(120)

PROGRAM = """
import numpy as np, mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
rr.init()
for _ in range(3):
    out = rr.allreduce(np.full(4, rr.rank() + 1.0), op=rr.Sum, name="grad.w")
engine = runtime.current().engine
c = engine.config
print("settings", c.fusion_threshold_bytes, f"{c.cycle_time_s * 1000:g}", c.cache_capacity,
      f"{c.stall_warning_s:g}", c.log_level.name, engine.cache.next_bit, out.tolist(),
      f"{c.stall_shutdown_s:g}", int(c.timeline_mark_cycles))
"""


def test_flags_and_horovod_variables_reach_every_ranks_engine(tmp_path):
    program = tmp_path / "prog.py"
    program.write_text(PROGRAM)
    # HOROVOD_STALL_CHECK_TIME_SECONDS is given only under Horovod's name; HOROVOD_CYCLE_TIME loses to the flag.
    timeline = tmp_path / "timeline.json"
    done = mtrain("-np", "2", "--fusion-threshold-mb", "1", "--cycle-time-ms", "3", "--cache-capacity", "0",
                  "--gloo", "--log-level", "DEBUG", "-prefix-timestamp", "--timeline-filename", str(timeline),
                  "--timeline-mark-cycles", "--stall-check-shutdown-time-seconds", "40",
                  "--binding-args", "--bind-to none --map-by slot", PYTHON, str(program),
                  extra_env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "7", "HOROVOD_CYCLE_TIME": "9"})
    assert done.returncode == 0, done.stderr
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"  # time.asctime(), as Horovod stamps lines
    for rank in (0, 1):
        line = f"[{rank}]<stdout>:settings 1048576 3 0 7 DEBUG 0 [3.0, 3.0, 3.0, 3.0] 40 1"
        assert re.search(f"^{stamp}{re.escape(line)}$", done.stdout, re.MULTILINE), done.stdout
    # Rank 0's engine says its settings at debug level; the launcher says once that --gloo is not needed.
    assert re.search(rf"^{stamp}\[0\]<stderr>:mtrain: engine settings: cycle_time_ms=3 fusion_threshold_bytes=1048576 "
                     r".*cache_capacity=0 stall_warning_seconds=7 ", done.stderr, re.MULTILINE), done.stderr
    assert [line for line in done.stderr.splitlines() if "--gloo" in line] == [
        "mtrain: --gloo: mtrain runs on MPI; --gloo is not needed"]
    # Rank 0 wrote Horovod's timeline: a Chrome trace naming the op, with the engine's cycles marked.
    events = json.loads(timeline.read_text())
    names = {str(event.get("name", "")) for event in events} | {str(event.get("args", "")) for event in events}
    assert any("grad.w" in name for name in names), events[:20]
    assert any("CYCLE" in name.upper() for name in names), events[:20]
    # Every rank's events, each rank on its own thread (tid) of the op's process.
    assert {event.get("tid") for event in events if event.get("name") == "ALLREDUCE"} == {0, 1}, events[:20]
