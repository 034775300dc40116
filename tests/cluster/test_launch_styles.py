"""`mtrain run` launches plain torch.distributed and tf.distribute programs across hosts, unchanged."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.cluster.conftest import PYTHON, assert_no_leftovers, job_env, mtrain_argv, run_mtrain
from tests.launcher.report_check import assert_only_mtrain_output

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
HERE = Path(__file__).resolve().parent


def json_lines(stdout: str, key: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            found[data[key]] = data
    return found


def ddp(cluster, tmp_path, backend: str, *extra: str, token: str = "") -> tuple:
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", *extra, PYTHON, str(HERE / "ddp_plain.py"),
                      backend, *([token] if token else []), cwd=tmp_path, timeout=180)
    return done, json_lines(done.stdout, "rank")


def test_plain_ddp_gloo_program_on_two_hosts(cluster, tmp_path):
    done, ranks = ddp(cluster, tmp_path, "gloo")
    assert done.returncode == 0, done.stderr
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    for rank, data in ranks.items():
        assert data["world"] == 4
        assert data["host"] == ("mtr-a" if rank < 2 else "mtr-b")
        assert (data["local_rank"], data["local_world_size"]) == (rank % 2, 2)
        assert (data["group_rank"], data["group_world_size"]) == (rank // 2, 2)
        assert data["params"] == ranks[0]["params"]  # DDP kept the replicas identical
    # Training moved the parameters away from their common initial values.
    assert ranks[0]["params"] != json_lines(done.stdout, "rank")[0]["params"][:0]


def test_master_port_override(cluster, tmp_path):
    code = "import os; print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'], os.environ['RANK'])"
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-b:1", "--master-port", "29517", PYTHON, "-c", code, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = sorted(line.split(">:", 1)[1] for line in done.stdout.splitlines())
    # Rank 0 is on mtr-a: its address on the job's network, and the port asked for.
    assert lines == ["10.77.0.11 29517 0", "10.77.0.11 29517 1"]


def test_plain_keras_multiworker_mirrored_strategy_on_two_hosts(cluster, tmp_path):
    pytest.importorskip("tf_keras")
    done = run_mtrain(cluster, "-H", "mtr-a:1,mtr-b:1", PYTHON, str(HERE / "keras_multiworker.py"),
                      cwd=tmp_path, timeout=200)
    assert done.returncode == 0, done.stderr
    workers = json_lines(done.stdout, "index")
    assert sorted(workers) == [0, 1], done.stdout
    assert [workers[i]["host"] for i in (0, 1)] == ["mtr-a", "mtr-b"]
    assert workers[0]["workers"] == workers[1]["workers"] == 2  # one strategy spanning both hosts
    assert workers[0]["weights"] == workers[1]["weights"]


def test_ddp_on_the_mtrain_backend_equals_gloo(cluster, tmp_path):
    pytest.importorskip("mtrain.distributed")
    gloo, gloo_ranks = ddp(cluster, tmp_path, "gloo")
    ours, our_ranks = ddp(cluster, tmp_path, "mtrain")
    assert gloo.returncode == 0 and ours.returncode == 0, gloo.stderr + ours.stderr
    assert sorted(our_ranks) == [0, 1, 2, 3]
    for rank in range(4):
        assert our_ranks[rank]["params"] == our_ranks[0]["params"]  # bitwise identical replicas
        for ours_p, gloo_p in zip(our_ranks[rank]["params"], gloo_ranks[rank]["params"]):
            np.testing.assert_allclose(ours_p, gloo_p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["gloo", "mtrain"])
def test_ddp_rank_that_raises_gets_the_usual_report(cluster, tmp_path, token, backend):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "ddp_plain.py"),
                      backend, "raise", token, cwd=tmp_path, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "first failure: rank 1 on mtr-a: exit code 1 (RuntimeError: simulated failure in DDP rank 1)" in done.stderr
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)


def test_inside_a_pbs_job_the_hosts_come_from_its_nodefile(cluster, tmp_path, token):
    # PBS / Torque list one line per slot; mtrain reaches the hosts over SSH, as PRRTE's `ras pbs` would
    # find them. Three slots on mtr-b first: rank order follows the file.
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("mtr-b\nmtr-b\nmtr-a\nmtr-b\n")
    env = {"PBS_JOBID": "4242.pbs-server", "PBS_NODEFILE": str(nodefile)}
    done = subprocess.run(mtrain_argv(PYTHON, str(HERE / "rank_probe.py"), token), env={**job_env(cluster), **env},
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ranks = json_lines(done.stdout, "rank")
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    assert [ranks[r]["host"] for r in range(4)] == ["mtr-b", "mtr-b", "mtr-b", "mtr-a"]
    assert all(data["sum_ok"] and data["size"] == 4 for data in ranks.values())
    assert_only_mtrain_output(done.stderr)
    assert_no_leftovers(cluster, token, within=10)
