"""mtrain.spark.run on a local-mode Spark (no cluster, no root): what a new user tries first.
(A standalone cluster on two namespace hosts: tests/cluster/test_spark.py.)"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bindings.requires import require

require("pyspark", "pip install '.[spark]'")

JOB = Path(__file__).with_name("spark_local_job.py")


def spark_job(scale: int, **env: str) -> subprocess.CompletedProcess:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        if os.environ.get("CI"):
            pytest.fail("Java 17+ is needed for the Spark tests in CI")
        pytest.skip("no Java: pyspark cannot start")
    environment = {**os.environ, "PYSPARK_PYTHON": sys.executable, **env}
    return subprocess.run([sys.executable, str(JOB), str(scale)], env=environment, capture_output=True, text=True,
                          timeout=240)


def test_run_in_local_mode_returns_each_ranks_result_in_rank_order() -> None:
    done = spark_job(3)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULTS "))
    # rank r contributes [30r, 30r+1, 30r+2]: the sum over ranks 0 and 1 is [30, 32, 34] on both
    assert line == "RESULTS [(0, [30.0, 32.0, 34.0]), (1, [30.0, 32.0, 34.0])]"


def python_without_mtrain(folder: Path) -> Path:
    """A Python that cannot import mtrain where the executors run: a fresh virtualenv (no pip, none of
    this environment's packages) of the interpreter this one was made from, so one can always be had,
    in CI too. Spark's own pyspark reaches it (Spark puts its pyspark.zip on the workers' PYTHONPATH);
    mtrain does not, unless this environment puts it on every Python's path (PYTHONPATH, say): then
    the test skips, and in CI (CI=true, where nothing does) it fails."""
    interpreter = getattr(sys, "_base_executable", sys.executable)
    made = subprocess.run([interpreter, "-m", "venv", "--without-pip", str(folder)], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    python = folder / "bin" / "python"
    # As the executors run it: this process's environment and working folder.
    probe = subprocess.run([str(python), "-c", "import mtrain; print(mtrain.__file__)"], capture_output=True,
                           text=True, env=dict(os.environ), timeout=60)
    if probe.returncode == 0:
        reason = (f"even a fresh virtualenv's Python imports mtrain here ({probe.stdout.strip()}): "
                  "no Python without it to point Spark at")
        (pytest.fail if os.environ.get("CI") else pytest.skip)(reason)
    assert "No module named 'mtrain'" in probe.stderr, probe.stderr
    return python


def test_executors_whose_python_lacks_mtrain_are_named_in_one_line(tmp_path) -> None:
    bare = python_without_mtrain(tmp_path / "bare")
    done = spark_job(1, PYSPARK_PYTHON=str(bare))
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mtrain.launcher.tasks.call_service.CallServerError: mtrain.spark.run: the Spark job of the "
                           "tasks failed: RuntimeError: mtrain.spark: the Spark executors' Python"), last
    assert "cannot import mtrain" in last and "PYSPARK_PYTHON" in last, last
