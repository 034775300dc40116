"""The elastic driver's pure parts: discovery output, the blacklist and its cooldown, plans."""
import math

import pytest

from mtrain.launcher.elastic.driver import Blacklist, DiscoveryError, parse_discovery_output, plan_hosts
from mtrain.launcher.job.hosts import HostSlots


def test_discovery_lines_with_and_without_slots():
    assert parse_discovery_output("a:2\n\nb\n  c:1  \n", 4) == [HostSlots("a", 2), HostSlots("b", 4), HostSlots("c", 1)]
    assert parse_discovery_output("", None) == []


@pytest.mark.parametrize("text, fragment", [
    ("a:2\nthis is garbage\n", "line 2: 'this is garbage' is not `host` or `host:slots`"),
    ("a:x\n", "line 1"),
    ("a\n", "host a has no slot count; print `a:N` or give --slots-per-host"),
    ("a:0\n", "host a has 0 slots"),
    ("a:1\na:2\n", "host a is listed twice"),
    (":3\n", "line 1"),
])
def test_discovery_garbage_is_a_clear_error(text, fragment):
    with pytest.raises(DiscoveryError) as caught:
        parse_discovery_output(text, None)
    assert fragment in str(caught.value)


def test_blacklist_without_cooldown_is_forever_and_with_one_grows_to_its_cap():
    forever = Blacklist(None)
    forever.add("a", 10.0)
    assert not forever.allows("a", 1e9) and forever.allows("b", 10.0) and forever.until["a"] == math.inf
    cooling = Blacklist((10.0, 25.0))
    cooling.add("a", 0.0)
    assert not cooling.allows("a", 9.9) and cooling.allows("a", 10.0)
    cooling.add("a", 100.0)
    assert not cooling.allows("a", 119.0) and cooling.allows("a", 120.0)  # 2nd failure: 20 s
    cooling.add("a", 200.0)
    assert cooling.allows("a", 225.0) and cooling.listed(224.0) == ["a"]  # 3rd: capped at 25 s


def test_plan_skips_blacklisted_hosts_and_trims_to_the_limit():
    hosts = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 2)]
    blacklist = Blacklist(None)
    blacklist.add("b", 0.0)
    assert plan_hosts(hosts, blacklist, 1.0, None) == [HostSlots("a", 2), HostSlots("c", 2)]
    assert plan_hosts(hosts, Blacklist(None), 1.0, 4) == [HostSlots("a", 2), HostSlots("b", 2)]
    assert plan_hosts(hosts, Blacklist(None), 1.0, 2) == [HostSlots("a", 2)]


def test_the_hosts_whose_ranks_never_reported_an_end():
    # Ranks are placed in plan order: a:0-1, b:2-4, c:5. Open MPI's launcher exits 0 when b's
    # daemon dies with its ranks; their wrappers die too and write no record.
    from mtrain.launcher.elastic.driver import silent_hosts
    from mtrain.common.records.exit_record import ExitRecord
    plan = [HostSlots("a", 2), HostSlots("b", 3), HostSlots("c", 1)]
    records = [ExitRecord(rank, "x", 0, False, 1.0, ()) for rank in (0, 1, 5)]
    assert silent_hosts(plan, records) == ["b"]
    assert silent_hosts(plan, [ExitRecord(r, "x", 0, False, 1.0, ()) for r in range(6)]) == []
    assert silent_hosts(plan, records[:2]) == ["b", "c"]
    # One of b's ranks said how it ended: b's part of the job did not vanish whole.
    assert silent_hosts(plan, records + [ExitRecord(3, "b", -15, True, 1.0, ())]) == []
    # The other ranks stopped by the job's end (SIGTERM): b is still the host that went.
    stopped = [ExitRecord(rank, host, -15, True, 2.0, ()) for rank, host in ((0, "a"), (1, "a"), (5, "c"))]
    assert silent_hosts(plan, stopped) == ["b"]
    # A rank killed on its own (on c) is the cause; a's ranks' last words were lost as the job
    # was stopped (a record is a line of output, relayed by a daemon that is ending).
    killed = [ExitRecord(5, "c", -9, False, 1.0, ())]
    assert silent_hosts(plan, killed) == []
    assert silent_hosts(plan, killed + [ExitRecord(2, "b", -15, True, 2.0, ())]) == []


def test_a_reset_asked_for_by_a_rank_whose_peers_were_stopped_on_their_way_out():
    # Seen under Slurm: rank 3 exited with 75 first; Open MPI stopped the others, still leaving
    # MPI_Finalize, by SIGTERM. The generation asked for the next one all the same.
    from mtrain.launcher.elastic.driver import reset_asked
    from mtrain.common.records.elastic import RESET_EXIT_STATUS
    from mtrain.common.records.exit_record import ExitRecord
    asked = ExitRecord(3, "b", RESET_EXIT_STATUS, False, 1.0)
    stopped = [ExitRecord(rank, "a", -15, True, 1.1) for rank in (0, 1, 2)]
    assert reset_asked([asked] + stopped)
    assert reset_asked([ExitRecord(r, "a", RESET_EXIT_STATUS, False, 1.0) for r in range(4)])
    assert not reset_asked(stopped)                                        # nobody asked
    assert not reset_asked([asked, ExitRecord(0, "a", 1, False, 1.0)])     # a rank failed on its own
    assert not reset_asked([asked, ExitRecord(0, "a", -9, False, 1.0)])    # a rank killed on its own
    assert not reset_asked([])


def test_hosts_slow_to_answer_at_the_end_are_waited_for_once_in_all():
    """Snapshot cleanup at a job's end (on Ctrl-C too) waits for all hosts within one bound: it
    once waited the bound for each host in turn, so three hosts that never answered held the
    exit three times as long."""
    import threading
    import time
    from mtrain.launcher.elastic.driver import on_hosts_within
    answered, never = [], threading.Event()

    def action(host: str) -> None:
        if host == "fast":
            answered.append(host)
        else:
            never.wait()
    started = time.monotonic()
    try:
        left = on_hosts_within(["slow-1", "fast", "slow-2", "slow-3"], action, 0.5)
        took = time.monotonic() - started
    finally:
        never.set()
    assert left == ["slow-1", "slow-2", "slow-3"] and answered == ["fast"]
    assert took < 1.0, f"waited {took:.2f} s for a bound of 0.5 s"
