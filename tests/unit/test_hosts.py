"""Host parsing and slot assignment (pure functions)."""
import pytest

from mtrain.launcher.job.hosts import (
    HostSlots,
    HostSpecError,
    assign_slots,
    expand_slurm_counts,
    expand_slurm_nodelist,
    is_local,
    parse_host_list,
    parse_hostfile_text,
    rank_hosts,
    read_hostfile,
    slurm_hosts,
)


def test_host_list_in_order_with_default_slot():
    assert parse_host_list("b:4,a:2,c") == [HostSlots("b", 4), HostSlots("a", 2), HostSlots("c", 1)]


def test_host_list_ipv6_and_addresses():
    assert parse_host_list("[fe80::1]:3,10.0.0.2:2") == [HostSlots("[fe80::1]", 3), HostSlots("10.0.0.2", 2)]


@pytest.mark.parametrize("text, fragment", [
    ("h1:", "missing slot count"),
    ("h1:0", "at least 1"),
    ("h1:x", "not a whole number"),
    ("h1:-2", "not a whole number"),
    (":4", "missing host name"),
    ("h1:2,h1:2", "listed twice"),
    ("h1:2,,h2:2", "empty entry"),
    ("", "empty host list"),
    ("h;rm:2", "not a valid host name"),
    ("h 1:2", "not a valid host name"),
])
def test_host_list_errors_name_the_problem(text, fragment):
    with pytest.raises(HostSpecError, match=fragment):
        parse_host_list(text)


def test_hostfile_comments_blank_lines_and_default_slots():
    text = "# cluster\n\nnode1 slots=4  # big one\nnode2\n  node3 slots=2 max_slots=8\n"
    assert parse_hostfile_text(text) == [HostSlots("node1", 4), HostSlots("node2", 1), HostSlots("node3", 2)]


@pytest.mark.parametrize("text, fragment", [
    ("node1 slots=x\n", "hostfile:1: slot count"),
    ("node1\nnode2 slots=0\n", "hostfile:2: slot count must be at least 1"),
    ("node1 cpus=4\n", "hostfile:1: cannot read 'cpus=4'"),
    ("node1:4\n", "write `node1 slots=N`"),
    ("node1\nnode1 slots=2\n", "listed twice"),
    ("# nothing\n\n", "no hosts"),
])
def test_hostfile_errors_give_line_numbers(text, fragment):
    with pytest.raises(HostSpecError, match=fragment):
        parse_hostfile_text(text)


def test_missing_hostfile_is_a_spec_error(tmp_path):
    with pytest.raises(HostSpecError, match="cannot read it"):
        read_hostfile(str(tmp_path / "absent"))


def test_assign_slots_fills_host_by_host():
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 4)]
    plan = assign_slots(hosts, 4)
    assert plan == [HostSlots("a", 2), HostSlots("b", 2)]
    assert rank_hosts(plan) == ["a", "a", "b", "b"]
    assert assign_slots(hosts, 9) == hosts


@pytest.mark.parametrize("num_proc, fragment", [(0, "at least one"), (-1, "at least one"),
                                                (10, "more than the 9 slots")])
def test_assign_slots_rejects_bad_counts(num_proc, fragment):
    with pytest.raises(HostSpecError, match=fragment):
        assign_slots([HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 4)], num_proc)


def test_slurm_nodelist_expansion_keeps_zero_padding():
    assert expand_slurm_nodelist("gpu[08-11,20],login1,x[1-2]y") == [
        "gpu08", "gpu09", "gpu10", "gpu11", "gpu20", "login1", "x1y", "x2y"]
    assert expand_slurm_counts("4(x2),2") == [4, 4, 2]


def test_slurm_hosts_from_environment():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_TASKS_PER_NODE": "2(x2),1"}
    assert slurm_hosts(env) == [HostSlots("n1", 2), HostSlots("n2", 2), HostSlots("n3", 1)]
    assert slurm_hosts({}) is None
    with pytest.raises(HostSpecError, match="3 nodes but 2 task counts"):
        slurm_hosts(dict(env, SLURM_TASKS_PER_NODE="2,2"))


def test_local_names():
    names = frozenset({"localhost", "127.0.0.1", "me"})
    assert is_local("me", names) and is_local("localhost", names) and not is_local("other", names)
