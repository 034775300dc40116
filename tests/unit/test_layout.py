"""The job layout (torchrun's variables, TF_CONFIG) from what the preflight learned (pure)."""
import json

import pytest

from mtrain.launcher.job.hosts import HostSlots
from mtrain.launcher.job.layout import HostFacts, job_layout, ports_needed
from mtrain.launcher.job.netif import choose_interface
from mtrain.common.records.job_layout import JobLayout

PLAN = [HostSlots("a", 2), HostSlots("b", 3)]
FACTS = {
    "a": HostFacts({"lo": "127.0.0.1/8", "eth0": "10.1.0.5/16", "ib0": "192.168.7.5/24"}, (4001, 4002, 4003), 2, "a.example"),
    "b": HostFacts({"lo": "127.0.0.1/8", "ens3": "10.1.0.9/16", "ib0": "192.168.7.9/24"}, (5001, 5002, 5003), 0, "b.example"),
}


def test_ports_needed_one_per_rank_plus_rank_zeros_master_port():
    assert ports_needed(PLAN, None) == {"a": 3, "b": 3}
    assert ports_needed(PLAN, 29500) == {"a": 2, "b": 3}


def test_interface_chosen_by_subnet_or_by_name_in_order():
    assert choose_interface(FACTS["a"].addresses, ["10.1.0.0/16"]) == ("eth0", "10.1.0.5")
    assert choose_interface(FACTS["b"].addresses, ["10.1.0.0/16"]) == ("ens3", "10.1.0.9")
    assert choose_interface(FACTS["a"].addresses, ["ib9", "ib0", "eth0"]) == ("ib0", "192.168.7.5")
    assert choose_interface(FACTS["a"].addresses, ["172.16.0.0/12", "bad/subnet"]) is None


def test_layout_on_the_jobs_network_with_ports_from_each_host():
    layout = job_layout(PLAN, FACTS, ["10.1.0.0/16"])
    assert (layout.master_addr, layout.master_port) == ("10.1.0.5", 4001)
    assert layout.workers == ("10.1.0.5:4002", "10.1.0.5:4003", "10.1.0.9:5001", "10.1.0.9:5002", "10.1.0.9:5003")
    assert layout.interfaces == ("eth0", "ens3") and layout.gpu_per_rank == ()
    pinned = job_layout(PLAN, FACTS, ["ib0"], master_port=29500, one_gpu_per_rank=True)
    assert (pinned.master_addr, pinned.master_port) == ("192.168.7.5", 29500)
    assert pinned.workers[:2] == ("192.168.7.5:4001", "192.168.7.5:4002") and pinned.gpu_per_rank == (2, 0)
    fallback = job_layout(PLAN, FACTS, [])
    assert fallback.master_addr == "a.example" and fallback.interfaces == ("", "")


def test_layout_refuses_hosts_without_enough_ports():
    short = dict(FACTS, b=HostFacts({}, (5001,), 0, "b.example"))
    with pytest.raises(ValueError, match="host b: found 1 free ports for 3 ranks"):
        job_layout(PLAN, short, [])


def test_rank_environment_matches_torchrun_and_tf_config():
    layout = JobLayout((2, 3), "10.1.0.5", 4001, ("w0:1", "w1:2", "w2:3", "w3:4", "w4:5"), (2, 0), ("eth0", ""))
    assert JobLayout.decode(layout.encode()) == layout
    env = [layout.rank_environment(rank) for rank in range(5)]
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in env] == [
        ("0", "0", "2", "0"), ("1", "1", "2", "0"), ("2", "0", "3", "1"), ("3", "1", "3", "1"), ("4", "2", "3", "1")]
    assert {(e["WORLD_SIZE"], e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in env} == {
        ("5", "2", "10.1.0.5", "4001")}
    config = json.loads(env[3]["TF_CONFIG"])
    assert config == {"cluster": {"worker": ["w0:1", "w1:2", "w2:3", "w3:4", "w4:5"]}, "task": {"type": "worker", "index": 3}}
    assert [e.get("CUDA_VISIBLE_DEVICES") for e in env] == ["0", "1", None, None, None]
    assert [e.get("GLOO_SOCKET_IFNAME") for e in env] == ["eth0", "eth0", None, None, None]
