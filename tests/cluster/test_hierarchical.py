"""The hierarchical all-reduce on two real hosts of two ranks each (the namespace cluster).

Each host reduces through its shared memory, one ring per local rank runs across
the hosts, and every rank must end with exactly the expected values (small
integers, so any order of reduction gives the same bits).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.cluster.conftest import PYTHON, run_mtrain

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]
HERE = Path(__file__).resolve().parent


def _ranks(stdout: str) -> "dict[int, dict]":
    out = {}
    for line in stdout.splitlines():
        _, _, rest = line.partition(">:")
        if rest.startswith("{"):
            data = json.loads(rest)
            out[data["rank"]] = data
    return out


@pytest.mark.parametrize("algorithm, transport, path", [("hierarchical", "cma", "hierarchical"),
                                                        ("auto", "auto", "hierarchical"), ("ring", "auto", "ring")])
def test_two_hosts_of_two(cluster, algorithm, transport, path):
    done = run_mtrain(cluster, "-np", "4", "-H", "mtr-a:2,mtr-b:2", "-x", f"MTRAIN_ALLREDUCE_ALGORITHM={algorithm}",
                      "-x", f"MTRAIN_SHM_TRANSPORT={transport}", PYTHON, str(HERE / "hierarchical_rank.py"),
                      timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = _ranks(done.stdout)
    assert sorted(ranks) == [0, 1, 2, 3], done.stdout[-4000:]
    for rank, data in ranks.items():
        assert data["host"] == ("mtr-a" if rank < 2 else "mtr-b"), data
        assert (data["local_size"], data["cross_size"]) == (2, 2), data
        assert data["algorithm"] == algorithm and data["path"] == path, data
        if path == "hierarchical" and (transport == "auto" or os.environ.get("CI")):
            # auto takes the segment; cma, asked for, works between the namespace hosts' ranks,
            # which share the pid namespace (root, CI; elsewhere it may fall back to the segment).
            assert data["transport"] == ("cma" if transport == "cma" else "segment"), data
        assert data["problems"] == [], f"rank {rank}: wrong results for {data['problems']}"


def test_uneven_hosts_take_the_ring(cluster):
    """Three ranks on two hosts (2 + 1): the chunks cannot line up across hosts, so the flat ring."""
    done = run_mtrain(cluster, "-np", "3", "-H", "mtr-a:2,mtr-b:1", "-x", "MTRAIN_ALLREDUCE_ALGORITHM=hierarchical",
                      PYTHON, str(HERE / "hierarchical_rank.py"), timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = _ranks(done.stdout)
    assert sorted(ranks) == [0, 1, 2], done.stdout[-4000:]
    for rank, data in ranks.items():
        assert data["path"] == "ring" and data["problems"] == [], data
