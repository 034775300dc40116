"""Lightning, Accelerate and Transformers' Trainer under a real ``mtrain run -np 2`` (CPU, tiny models),
their gradients on the "mtrain" torch.distributed backend, each checked against a single-process run.

The programs are in trainer_jobs.py; none of them imports mtrain (docs/trainers.md says how the
backend and Lightning's devices reach them). A trainer's start-up costs seconds on two cores, so
each case is one job. The examples (examples/train_*.py) run unchanged under example_weights.py,
which reports each rank's trained weights, and are checked against the same job on gloo.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bindings.requires import require
from tests.jobs import run_job

for _module, _extra in (("torch", "torch"), ("lightning", "lightning"), ("accelerate", "accelerate"),
                        ("transformers", "transformers")):
    require(_module, f"pip install '.[{_extra}]'")

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "trainer_jobs.py"
_RESULT = re.compile(r"^\[(\d+)\]<stdout>:RESULT (.*)$")
# Both runs see the same weights to float32 rounding; a wrong average (a sum, one rank's gradient,
# a rank training alone on its half) moves them by more than 1e-2 here.
TOLERANCE = 1e-5


def job_env() -> "dict[str, str]":
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # Two ranks share two cores; nothing is downloaded.
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    return env


def mtrain_run(args: "list[str]", timeout: float = 120) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", sys.executable, str(JOBS), *args]
    return run_job(argv, timeout, " ".join(["mtrain run -np 2 trainer_jobs.py", *args]), env=job_env(), cwd=REPO)


def results(done: subprocess.CompletedProcess, ranks: int = 2) -> "list[dict]":
    """Each rank's RESULT line, by rank; fails with the job's output when one is missing."""
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    found = {int(m.group(1)): json.loads(m.group(2)) for m in map(_RESULT.match, done.stdout.splitlines()) if m}
    assert sorted(found) == list(range(ranks)), done.stdout[-3000:] + done.stderr[-3000:]
    return [found[rank] for rank in range(ranks)]


def test_lightning_defaults_train_on_the_mtrain_backend():
    """The issue's line, ``Trainer(accelerator="cpu", strategy=DDPStrategy(process_group_backend="mtrain"))``,
    without ``import mtrain.distributed`` and with Lightning's default devices: both ranks train as one
    job, on mtrain's group, to the weights one process reaches with the global batch."""
    ranks = results(mtrain_run(["lightning", "mtrain"]))
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world"], result["backend"]) == (rank, 2, "mtrain"), result
        assert result["environment"] == "TorchElasticEnvironment", result
        assert result["distance"] < TOLERANCE < result["moved"], result


def test_accelerate_trains_on_the_mtrain_group():
    ranks = results(mtrain_run(["accelerate", "mtrain"]))
    for rank, result in enumerate(ranks):
        assert (result["rank"], result["world"], result["backend"]) == (rank, 2, "mtrain"), result
        assert (result["distributed_type"], result["wrapped"]) == ("DistributedType.MULTI_CPU",
                                                                   "DistributedDataParallel"), result
        assert result["distance"] < TOLERANCE < result["moved"], result


def test_transformers_trainer_loss_equals_a_single_process_run():
    """Two ranks with batch 4 each log, step by step, the losses one process logs with batch 8. The Trainer
    steps with plain SGD and no clipping (trainer_jobs.py), so only the mean of the ranks' gradients takes
    the single process's steps: their sum, or each rank's own, logs other losses from the second step on."""
    ranks = results(mtrain_run(["transformers", "mtrain", "4"]))
    single = run_job([sys.executable, str(JOBS), "transformers", "none", "8"], 120, "transformers, one process",
                     env=job_env(), cwd=REPO)
    assert single.returncode == 0, single.stderr[-3000:]
    [reference] = [json.loads(line[len("RESULT "):]) for line in single.stdout.splitlines()
                   if line.startswith("RESULT ")]
    assert reference["world"] == 1 and len(reference["losses"]) == 6, reference
    for result in ranks:
        assert (result["world"], result["backend"]) == (2, "mtrain"), result
        assert result["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE), (result, reference)
    # The losses change from step to step, so equal lists say the two runs took the same steps.
    assert len(set(reference["losses"])) == 6, reference


@pytest.mark.parametrize("args, message", [
    # torch's words: a CPU build has no NCCL; a CUDA build finds no GPU.
    (["lightning", "nccl"], r"RuntimeError: (Distributed package doesn't have NCCL|.*no GPUs found)"),
    (["transformers", "nccl", "4"], r"ValueError: Your assigned backend nccl is not available"),
], ids=["lightning", "transformers"])
def test_nccl_on_a_cpu_only_host_ends_with_the_trainers_error(args, message):
    """Asking for NCCL where there is none: the job ends (no hang) and names the trainer's own error."""
    done = mtrain_run(args, timeout=90)
    assert done.returncode != 0, done.stdout[-2000:]
    failure = [line for line in done.stderr.splitlines() if line.startswith("mtrain: job failed; first failure:")]
    assert len(failure) == 1 and re.search(message, failure[0]), done.stderr[-3000:]


EXAMPLE_WEIGHTS = Path(__file__).resolve().parent / "example_weights.py"
_WEIGHTS = re.compile(r"^\[(\d+)\]<stdout>:WEIGHTS (.*)$")


def run_example(example: str, args: "list[str]", backend: str) -> subprocess.CompletedProcess:
    """``mtrain run -np 2`` of the example, unchanged, on `backend`; each rank reports its trained weights."""
    argv = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", "-np", "2", sys.executable,
            str(EXAMPLE_WEIGHTS), str(REPO / "examples" / example), "--backend", backend, *args]
    done = run_job(argv, 120, f"{example} on {backend}", env=job_env(), cwd=REPO)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def rank_weights(done: subprocess.CompletedProcess) -> "list[dict]":
    found = {int(m.group(1)): json.loads(m.group(2)) for m in map(_WEIGHTS.match, done.stdout.splitlines()) if m}
    assert sorted(found) == [0, 1], done.stdout[-3000:] + done.stderr[-3000:]
    return [found[0], found[1]]


@pytest.mark.parametrize("example, args", [("train_lightning.py", ["--epochs", "3"]),
                                           ("train_accelerate.py", ["--epochs", "3"]),
                                           ("train_transformers.py", [])], ids=["lightning", "accelerate",
                                                                                "transformers"])
def test_example_learns_on_two_ranks(example, args):
    """The example learns on mtrain's backend, and every rank ends with the weights the same job reaches
    on torch's gloo backend: the ranks' mean gradient, step by step (ranks that exchange nothing end
    apart, and a sum of gradients ends elsewhere, though both may still learn the digits)."""
    done = run_example(example, args, "mtrain")
    found = re.search(r"^\[0\]<stdout>:2 ranks on mtrain: test accuracy ([0-9.]+)$", done.stdout, re.MULTILINE)
    assert found and float(found.group(1)) > 0.85, done.stdout[-3000:]
    ranks, gloo = rank_weights(done), rank_weights(run_example(example, args, "gloo"))
    assert ranks[0]["sha256"] == ranks[1]["sha256"], ranks  # every rank holds the same weights
    assert gloo[0]["sha256"] == gloo[1]["sha256"], gloo
    for result in ranks:
        assert result["count"] == gloo[0]["count"] and result["moved"] > 1e-2, (result, gloo[0])
        assert result["projections"] == pytest.approx(gloo[0]["projections"], rel=1e-4, abs=1e-4), (result, gloo[0])
