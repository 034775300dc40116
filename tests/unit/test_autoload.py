"""torch's autoload of the "mtrain" backend (bindings/autoload.py) and what a rank's layout tells
Lightning (bindings/common/records/job_layout.py): registered inside an mtrain job only, never starting
MPI at ``import torch``; the PL_TRAINER_* defaults only where Lightning's arithmetic holds."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from mtrain import autoload
from mtrain.common.records.job_layout import ENV_JOB_FILE, JobLayout

REPO = Path(__file__).resolve().parents[2]
_PROBE = ("import json, sys, torch, torch.distributed as dist; "
          "print(json.dumps({'registered': 'mtrain' in dist.Backend.backend_list, "
          "'mpi': 'mpi4py.MPI' in sys.modules, 'runtime': 'mtrain.ringreduce' in sys.modules}))")


def _import_torch(**env: str) -> dict:
    pytest.importorskip("torch")
    clean = {k: v for k, v in os.environ.items() if k not in (ENV_JOB_FILE, "TORCH_DEVICE_BACKEND_AUTOLOAD")}
    done = subprocess.run([sys.executable, "-c", _PROBE], env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_names_agree_with_their_owners():
    assert autoload.JOB_VARIABLE == ENV_JOB_FILE
    # mtrain.distributed.BACKEND, read from its source: importing it would start the runtime.
    tree = ast.parse((REPO / "bindings" / "distributed" / "process_group.py").read_text())
    [value] = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and any(getattr(target, "id", "") == "BACKEND" for target in node.targets)]
    assert autoload.BACKEND == value


def test_the_entry_point_is_declared():
    found = [ep for ep in entry_points(group="torch.backends") if ep.name == "mtrain"]
    assert [ep.value for ep in found] == ["mtrain.autoload:register_torch_backend"], \
        "reinstall mtrain (pip install -e .) so its entry points are current"


def test_import_torch_registers_the_backend_inside_a_job_without_starting_mpi():
    assert _import_torch(**{ENV_JOB_FILE: "/nonexistent/{host}.json"}) == {
        "registered": True, "mpi": False, "runtime": False}


def test_import_torch_outside_a_job_or_with_autoload_off_leaves_torch_alone():
    assert _import_torch() == {"registered": False, "mpi": False, "runtime": False}
    assert _import_torch(**{ENV_JOB_FILE: "/nonexistent/{host}.json", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}) == {
        "registered": False, "mpi": False, "runtime": False}


def _layout(slots, gpus=()) -> JobLayout:
    workers = tuple(f"w{r}:1" for r in range(sum(slots)))
    return JobLayout(tuple(slots), "10.1.0.5", 4001, workers, tuple(gpus), ())


def test_lightning_defaults_come_with_equal_hosts_only():
    env = [_layout((2, 2)).rank_environment(rank) for rank in range(4)]
    assert {(e["PL_TRAINER_DEVICES"], e["PL_TRAINER_NUM_NODES"]) for e in env} == {("2", "2")}
    assert {e["TORCHELASTIC_RUN_ID"] for e in env} == {"mtrain-10.1.0.5-4001"}
    # Unequal hosts: Lightning's devices x num_nodes cannot be the world size; its own check says so.
    unequal = [_layout((2, 1)).rank_environment(rank) for rank in range(3)]
    assert not any("PL_TRAINER_DEVICES" in e or "PL_TRAINER_NUM_NODES" in e for e in unequal)
    assert all("TORCHELASTIC_RUN_ID" in e for e in unequal)
    # GPUs shared out one per rank: each rank sees one device, so a count per host would be wrong.
    pinned = [_layout((2, 2), (2, 2)).rank_environment(rank) for rank in range(4)]
    assert not any("PL_TRAINER_DEVICES" in e for e in pinned)
