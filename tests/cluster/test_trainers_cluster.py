"""Lightning, Accelerate and Transformers' Trainer on two hosts (one rank each) under `mtrain run`,
on the "mtrain" torch.distributed backend: the programs of tests/bindings/trainer_jobs.py, unchanged.

The hosts' names do not resolve on each other, so a rendezvous only works through the job's
MASTER_ADDR: Lightning must take it (and GROUP_RANK as its node rank) from the job.
"""
from __future__ import annotations

import json
import subprocess

import pytest

from tests.bindings.requires import require
from tests.bindings.test_trainers import JOBS, TOLERANCE, job_env as local_env
from tests.cluster.conftest import PYTHON, assert_no_leftovers, run_mtrain

for _module in ("torch", "lightning", "accelerate", "transformers"):
    require(_module, f"pip install '.[{_module}]'")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
HOSTS = ["-H", "mtr-a:1,mtr-b:1", "-x", "OMP_NUM_THREADS=1", "-x", "HF_HUB_OFFLINE=1"]


def results(done: subprocess.CompletedProcess) -> "list[dict]":
    assert done.returncode == 0, done.stderr[-3000:]
    found = {}
    for line in done.stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("RESULT "):
            data = json.loads(rest[len("RESULT "):])
            found[data["rank"]] = data
    assert sorted(found) == [0, 1], done.stdout[-3000:]
    return [found[0], found[1]]


def test_lightning_and_accelerate_train_across_two_hosts(cluster, tmp_path, token):
    lightning = results(run_mtrain(cluster, *HOSTS, PYTHON, str(JOBS), "lightning", "mtrain", token, cwd=tmp_path,
                                   timeout=180))
    for rank, result in enumerate(lightning):
        assert (result["world"], result["backend"], result["environment"]) == (2, "mtrain",
                                                                               "TorchElasticEnvironment"), result
        assert result["node_rank"] == rank, result  # one rank per host: each its own node
        assert result["distance"] < TOLERANCE < result["moved"], result
    accelerate = results(run_mtrain(cluster, *HOSTS, PYTHON, str(JOBS), "accelerate", "mtrain", token,
                                    cwd=tmp_path, timeout=180))
    for result in accelerate:
        assert (result["world"], result["backend"], result["wrapped"]) == (2, "mtrain", "DistributedDataParallel")
        assert result["distance"] < TOLERANCE < result["moved"], result
    assert_no_leftovers(cluster, token, within=10)


def test_transformers_trainer_across_two_hosts_logs_the_single_process_losses(cluster, tmp_path, token):
    ranks = results(run_mtrain(cluster, *HOSTS, PYTHON, str(JOBS), "transformers", "mtrain", "4", token,
                               cwd=tmp_path, timeout=180))
    single = subprocess.run([PYTHON, str(JOBS), "transformers", "none", "8"], env=local_env(), capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert single.returncode == 0, single.stderr[-3000:]
    [reference] = [json.loads(line[len("RESULT "):]) for line in single.stdout.splitlines()
                   if line.startswith("RESULT ")]
    assert reference["world"] == 1 and len(reference["losses"]) == 6, reference
    for result in ranks:
        assert (result["world"], result["backend"]) == (2, "mtrain"), result
        # (Plain SGD, no clipping: a sum of the ranks' gradients, or none exchanged, logs other losses.)
        assert result["losses"] == pytest.approx(reference["losses"], rel=TOLERANCE), (result, reference)
    # The losses change from step to step, so equal lists say the two runs took the same steps.
    assert len(set(reference["losses"])) == 6, reference
    assert_no_leftovers(cluster, token, within=10)
