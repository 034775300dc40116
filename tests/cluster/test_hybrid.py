"""examples/hybrid_parallel.py on two hosts: 2 pipeline stages (one per host) x 2 data-parallel
replicas, Horovod-style and as plain torch.distributed on backend "mtrain"; each ends equal to one
process training the whole model on the whole batch."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.bindings.requires import require
from tests.cluster.conftest import PYTHON, run_mtrain

require("torch", "pip install '.[torch]'")

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hybrid_parallel.py"


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
