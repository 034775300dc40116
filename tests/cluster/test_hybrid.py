"""Model and hybrid parallelism on two hosts: examples/hybrid_parallel.py (2 pipeline stages, one
per host, x 2 data-parallel replicas; Horovod-style and as plain torch.distributed on backend
"mtrain"), and torch's own pipelining schedules on backend mtrain, each equal to one process
training the whole model (and to gloo)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bindings.requires import require
from tests.cluster.conftest import PYTHON, run_mtrain
from tests.cluster.test_launch_styles import json_lines

require("torch", "pip install '.[torch]'")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "hybrid_parallel.py"


@pytest.mark.parametrize("api", [["--api", "hvd"], ["--api", "torch"], ["--api", "torch", "--schedule", "1f1b"]],
                         ids=["hvd", "torch-gpipe", "torch-1f1b"])
def test_hybrid_example_on_two_hosts_equals_one_process(cluster, tmp_path, api):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(EXAMPLE), *api,
                      cwd=tmp_path, timeout=200)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    verdicts = re.findall(r"\[(\d)\]<stdout>:rank (\d) \(stage (\d), replica (\d)\): parameters equal one process",
                          done.stdout)
    assert sorted((int(p), int(r), int(s), int(d)) for p, r, s, d in verdicts) == \
        [(0, 0, 0, 0), (1, 1, 0, 1), (2, 2, 1, 0), (3, 3, 1, 1)], done.stdout
    steps = re.findall(r"step (\d): loss ([0-9.]+), \d+ samples/s", done.stdout)
    assert [int(s) for s, _ in steps] == list(range(5)), done.stdout
    assert float(steps[-1][1]) < float(steps[0][1]), "the loss goes down"


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_torch_pipelining_on_two_hosts_equals_gloo_and_one_process(cluster, tmp_path, schedule):
    """A PipelineStage per rank (4 stages, 2 per host), unchanged torch code, on backend mtrain."""
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "pipeline_plain.py"), schedule,
                      cwd=tmp_path, timeout=200)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    ranks = json_lines(done.stdout, "rank")
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout
    for rank, data in ranks.items():
        assert data["host"] == ("mtr-a" if rank < 2 else "mtr-b")
        assert data["losses"] == (8 if rank == 3 else 0), data  # 2 steps x 4 microbatches, on the last stage
        assert data["vs_gloo"] <= 1e-6 and data["vs_one_process"] <= 1e-5, data


def test_a_stage_whose_input_does_not_fit_fails_naming_the_stage_and_the_shapes(cluster, tmp_path):
    """The last stage expects 7 features where the stage before it sends 6: torch's pipelining checks
    the shapes it learns over our send/recv, and the job's report names the rank, the shapes and the line."""
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", PYTHON, str(HERE / "pipeline_plain.py"), "gpipe",
                      "mismatch", cwd=tmp_path, timeout=200)
    assert done.returncode != 0, done.stdout
    report = [line for line in done.stderr.splitlines() if line.startswith("mtrain: job failed; first failure:")]
    assert len(report) == 1, done.stderr[-3000:]
    assert re.search(r"rank 3 on mtr-b: exit code 1 \(PipeliningMetadataError: Stage 3 input\[0\]: shape mismatch: "
                     r"torch.Size\(\[2, 7\]\) vs torch.Size\(\[2, 6\]\).*\) at .*pipeline_plain.py:\d+ in run",
                     report[0]), report[0]
