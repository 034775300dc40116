"""Autotune in real `mtrain run` jobs: Horovod's log file, settings that change, results that do not."""
from __future__ import annotations

import re

import pytest

from tests.launcher.test_local_run import PYTHON, mtrain

pytestmark = pytest.mark.timeout(180)

# Six gradients of distinct per-rank, per-step values, reduced every step; a digest of every
# result on each rank. The values are small whole numbers in float32, so every order of
# summation gives the same bits: any difference is a wrong result, not rounding.
PROGRAM = """
import hashlib, sys, numpy as np, mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
rr.init()
r = rr.rank()
sizes = [3, 1000, 70000, 5, 300000, 17]
digest = hashlib.sha256()
for step in range(int(sys.argv[1])):
    handles = [rr.allreduce_async(np.arange(n, dtype=np.float32) % 97 + (r + 1) * (i + 1) + step % 5,
                                  op=rr.Sum, name=f"grad.{i}") for i, n in enumerate(sizes)]
    for handle in handles:
        digest.update(rr.synchronize(handle).tobytes())
print("result", r, digest.hexdigest(), "tuning" if runtime.current().engine.tuner is not None else "tuned")
"""
STEPS = "150"
SMALL = ["--autotune-warmup-samples", "1", "--autotune-steps-per-sample", "2",
         "--autotune-bayes-opt-max-samples", "2"]
HEADER = ("hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,"
          "cycle_time_ms,tensor_fusion_threshold,score")
YIELD = {"OMPI_MCA_mpi_yield_when_idle": "1"}  # more ranks than cores


def results(stdout: str, np_: int) -> "dict[int, tuple[str, str]]":
    found = {int(m[1]): (m[2], m[3]) for m in re.finditer(r"^\[\d+\]<stdout>:result (\d+) (\w+) (\w+)$",
                                                          stdout, re.MULTILINE)}
    assert sorted(found) == list(range(np_)), stdout
    return found


def check_log(path, stderr: str) -> "list[list[str]]":
    lines = path.read_text().splitlines()
    assert lines[0] == HEADER
    rows = [line.split(",") for line in lines[1:]]
    assert all(len(row) == 7 for row in rows), lines
    # One line per scored sample (rank 0 logs each at INFO), then the best one.
    samples = re.findall(r"^\[0\]<stderr>:mtrain: autotune: \[.*\] (\S+)$", stderr, re.MULTILINE)
    assert len(rows) == len(samples) + 1 >= 2 + 1, (lines, stderr)
    assert [float(row[6]) for row in rows[:-1]] == pytest.approx([float(s) for s in samples], rel=1e-5)
    best = max(rows[:-1], key=lambda row: float(row[6]))
    assert rows[-1] == best
    # The settings tried differ: the cycle time and fusion threshold move from sample to sample.
    assert len({(row[4], row[5]) for row in rows[:-1]}) > 1, lines
    assert "autotune: best params [" in stderr
    return rows


@pytest.mark.parametrize("np_", [2, 3])
def test_autotune_logs_like_horovod_and_changes_no_result(tmp_path, np_):
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    plain = mtrain("-np", str(np_), PYTHON, str(program), STEPS, extra_env=YIELD, timeout=120)
    assert plain.returncode == 0, plain.stderr
    log = tmp_path / "autotune.csv"
    tuned = mtrain("-np", str(np_), "--autotune", "--autotune-log-file", str(log), *SMALL,
                   "--log-level", "INFO", PYTHON, str(program), STEPS, extra_env=YIELD, timeout=120)
    assert tuned.returncode == 0, tuned.stderr
    check_log(log, tuned.stderr)
    expected = results(plain.stdout, np_)
    got = results(tuned.stdout, np_)
    assert {d for d, _ in expected.values()} == {d for d, _ in got.values()} and len(set(expected.values())) == 1
    assert all(state == "tuned" for _, state in got.values())  # tuning ended and the best setting stayed


def test_horovods_variables_turn_autotune_on(tmp_path):
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    log = tmp_path / "hvd.csv"
    env = {"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": str(log), "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "1",
           "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "2", "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "2",
           "HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.5", "HOROVOD_LOG_LEVEL": "info"}
    done = mtrain("-np", "2", PYTHON, str(program), STEPS, extra_env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    check_log(log, done.stderr)
    assert all(state == "tuned" for _, state in results(done.stdout, 2).values())


def test_a_bad_autotune_variable_is_a_usage_error_naming_it(tmp_path):
    """The launcher reads the runtime's variables as every rank's init() will: a value the ranks
    would refuse is one line and exit status 2 before anything starts (set in the environment
    of `mtrain run` or with -x)."""
    program = tmp_path / "train.py"
    program.write_text(PROGRAM)
    for extra, args in (({"HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "abc"}, ()),
                        ({}, ("-x", "HOROVOD_AUTOTUNE_WARMUP_SAMPLES=abc"))):
        done = mtrain(*args, "-np", "2", PYTHON, str(program), "1", extra_env=extra)
        assert done.returncode == 2, done.stderr
        assert done.stderr.count("\n") == 1, done.stderr
        assert "HOROVOD_AUTOTUNE_WARMUP_SAMPLES='abc' is not a whole number of samples >= 0" in done.stderr
        assert "Traceback" not in done.stderr and not done.stdout


def test_a_bad_autotune_flag_is_a_usage_error(tmp_path):
    done = mtrain("--autotune", "--autotune-warmup-samples", "abc", PYTHON, "-c", "pass")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "--autotune-warmup-samples" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_rank_dying_mid_tuning_ends_the_job_with_the_usual_report(tmp_path):
    program = tmp_path / "train.py"
    # Rank 1 leaves in the middle of the first scored sample (warm-up: 11 steps).
    program.write_text(PROGRAM.replace("    for handle in handles:",
                                       "    if step == 15 and r == 1:\n        import os; os._exit(7)\n"
                                       "    for handle in handles:"))
    done = mtrain("-np", "2", "--autotune", *SMALL, PYTHON, str(program), STEPS, timeout=120)
    assert done.returncode == 7, done.stderr
    assert "mtrain: job failed; first failure: rank 1" in done.stderr and "exit code 7" in done.stderr


def test_the_config_files_autotune_section_reaches_the_ranks(tmp_path):
    config = tmp_path / "hvd.yaml"
    config.write_text("autotune:\n  enabled: true\n  log_file: at.csv\n  warmup_samples: 2\n"
                      "  steps_per_sample: 5\n  bayes_opt_max_samples: 6\n  gaussian_process_noise: 0.3\n")
    done = mtrain("-np", "2", "--dry-run", "--config-file", str(config), "--autotune-warmup-samples", "1",
                  PYTHON, "-c", "pass", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    settings = re.findall(r"^rank setting (MTRAIN_AUTOTUNE\w*)=(\S+) \((.*)\)$", done.stdout, re.MULTILINE)
    assert sorted(settings) == [
        ("MTRAIN_AUTOTUNE", "1", "--config-file autotune.enabled"),
        ("MTRAIN_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "6", "--config-file autotune.bayes_opt_max_samples"),
        ("MTRAIN_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0.3", "--config-file autotune.gaussian_process_noise"),
        ("MTRAIN_AUTOTUNE_LOG", str(tmp_path / "at.csv"), "--config-file autotune.log_file"),
        ("MTRAIN_AUTOTUNE_STEPS_PER_SAMPLE", "5", "--config-file autotune.steps_per_sample"),
        ("MTRAIN_AUTOTUNE_WARMUP_SAMPLES", "1", "--autotune-warmup-samples"),  # the flag wins
    ], done.stdout
