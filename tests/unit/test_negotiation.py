"""Coordinator and ResponseCache (ringreduce/negotiation/coordinator.py) without MPI: the gathered
reports every rank would send are built by hand, as rank 0 receives them."""
import numpy as np
import pytest

from mtrain.ringreduce.negotiation import coordinator as negotiation
from mtrain.ringreduce.core.errors import MismatchError, StallError, Verdict
from mtrain.ringreduce.negotiation.coordinator import Coordinator, Response, ResponseCache, bits_of, set_bit


def report(name, meta, description=None):
    return (name, meta, description or f"allreduce {meta}")


def gathered(*per_rank, pending=None):
    """One coordinator round: each rank's reports (and pending names, for a stall check)."""
    return [(list(reports), None if pending is None else pending[r]) for r, reports in enumerate(per_rank)]


def apply_all(responses, *caches):
    for cache in caches:
        for response in responses:
            cache.apply(response)


def test_op_reported_by_every_rank_with_equal_metadata_is_ready_and_cached():
    coordinator, cache = Coordinator(3, 60, 0), ResponseCache()
    first = coordinator.decide(gathered([report("w", "f4[3]")], [], [report("w", "f4[3]")]), cache, set(), 0.0)
    assert first == [], "rank 1 has not reported yet"
    second = coordinator.decide(gathered([], [report("w", "f4[3]")], []), cache, set(), 1.0)
    assert second == [Response(Verdict.READY, "w", 0, "f4[3]")]
    apply_all(second, cache)
    assert cache.lookup("w", "f4[3]") == 0 and cache.lookup("w", "f4[4]") == -1
    assert cache.names == ["w"] and cache.words == 1


def test_each_new_name_gets_the_next_bit_and_every_rank_stays_identical():
    coordinator = Coordinator(2, 60, 0)
    caches = [ResponseCache(), ResponseCache()]
    names = [f"grad.{i}" for i in range(70)]  # more than one 64-bit word
    reports = [report(n, i) for i, n in enumerate(names)]
    responses = coordinator.decide(gathered(reports, reports[::-1]), caches[0], set(), 0.0)
    apply_all(responses, *caches)
    assert [r.bit for r in responses] == list(range(70))
    assert caches[0].names == caches[1].names == names
    assert caches[0].entries == caches[1].entries and caches[0].words == 2


def test_auto_named_ops_are_never_cached():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    responses = coordinator.decide(gathered([report("noname.4", 1)], [report("noname.4", 1)]), cache, set(), 0.0)
    assert responses == [Response(Verdict.READY, "noname.4", -1, 1)]
    apply_all(responses, cache)
    assert cache.names == [] and cache.lookup("noname.4", 1) == -1


def test_cache_full_runs_the_op_without_a_bit(monkeypatch):
    monkeypatch.setattr(negotiation, "CACHE_CAPACITY", 2)
    coordinator, cache = Coordinator(1, 60, 0), ResponseCache()
    responses = coordinator.decide(gathered([report("a", 1), report("b", 2), report("c", 3)]), cache, set(), 0.0)
    assert [(r.name, r.bit) for r in responses] == [("a", 0), ("b", 1), ("c", -1)]


def test_different_metadata_is_a_mismatch_naming_every_rank():
    coordinator, cache = Coordinator(3, 60, 0), ResponseCache()
    responses = coordinator.decide(gathered([report("w", "A", "allreduce float32[10]")],
                                            [report("w", "B", "allreduce float32[11]")],
                                            [report("w", "A", "allreduce float32[10]")]), cache, set(), 0.0)
    assert len(responses) == 1 and responses[0].verdict is Verdict.MISMATCH
    message = responses[0].message
    for fragment in ("'w'", "rank 0: allreduce float32[10]", "rank 1: allreduce float32[11]",
                     "rank 2: allreduce float32[10]"):
        assert fragment in message
    error = responses[0].verdict.error(message)
    assert type(error) is MismatchError and str(error) == message
    apply_all(responses, cache)
    assert cache.names == [], "a mismatch assigns no bit"
    assert coordinator.reported == {} and coordinator.first_seen == {}, "the name is forgotten"


def test_a_rank_with_new_metadata_for_a_cached_name_invalidates_it_everywhere():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    apply_all(coordinator.decide(gathered([report("w", "A")], [report("w", "A")]), cache, set(), 0.0), cache)
    # Rank 0 still holds "w" under its cached metadata (its bit is set); rank 1 reports "w" as B.
    responses = coordinator.decide(gathered([], [report("w", "B")]), cache, {"w"}, 1.0)
    assert responses == [Response(Verdict.INVALIDATE, "w")]
    apply_all(responses, cache)
    assert cache.lookup("w", "A") == -1 and cache.names == [None], "a tombstone keeps later bits in place"
    # Rank 0 reports afresh; with B everywhere the name is ready again under a new bit.
    responses = coordinator.decide(gathered([report("w", "B")], []), cache, set(), 2.0)
    assert responses == [Response(Verdict.READY, "w", 1, "B")]
    apply_all(responses, cache)
    assert cache.lookup("w", "B") == 1 and cache.names == [None, "w"]


def test_new_metadata_on_every_rank_at_once_keeps_the_bit():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    apply_all(coordinator.decide(gathered([report("w", "A")], [report("w", "A")]), cache, set(), 0.0), cache)
    responses = coordinator.decide(gathered([report("w", "B")], [report("w", "B")]), cache, set(), 1.0)
    assert responses == [Response(Verdict.READY, "w", 0, "B")]
    apply_all(responses, cache)
    assert cache.lookup("w", "B") == 0 and cache.lookup("w", "A") == -1


def test_stall_past_the_limit_is_an_error_naming_the_missing_ranks(capsys):
    coordinator, cache = Coordinator(3, warn_seconds=60, shutdown_seconds=10), ResponseCache()
    coordinator.note_partial(["late"], now=100.0)
    assert not coordinator.stall_check_due(105.0)
    assert coordinator.stall_check_due(111.0)
    pending = [["late"], [], ["late"]]
    responses = coordinator.decide(gathered([], [], [], pending=pending), cache, set(), 111.0)
    assert len(responses) == 1 and responses[0].verdict is Verdict.STALLED
    message = responses[0].message
    assert "'late'" in message and "rank(s) [0, 2]" in message and "rank(s) [1]" in message
    assert type(responses[0].verdict.error(message)) is StallError
    assert not coordinator.stall_check_due(200.0), "a stalled op is reported once"
    assert capsys.readouterr().err == ""


def test_stall_warning_is_printed_once_per_op(capsys):
    coordinator, cache = Coordinator(2, warn_seconds=5, shutdown_seconds=0), ResponseCache()
    coordinator.note_partial(["slow.0"], now=0.0)
    coordinator.note_partial(["slow.1"], now=3.0)
    coordinator.note_partial(["slow.0", "slow.1"], now=4.0)  # already seen: each keeps its first time
    assert not coordinator.stall_check_due(5.0)
    assert coordinator.stall_check_due(6.0)
    pending = [["slow.0", "slow.1"], []]
    assert coordinator.decide(gathered([], [], pending=pending), cache, set(), 6.0) == []
    err = capsys.readouterr().err
    assert "stall warning" in err and "'slow.0'" in err and "rank(s) [1]" in err and "slow.1" not in err
    assert not coordinator.stall_check_due(7.0), "slow.0 was warned about; slow.1 is not due yet"
    assert coordinator.stall_check_due(8.5), "slow.1 is due now"
    coordinator.forget("slow.0")
    assert coordinator.first_seen == {"slow.1": 3.0} and coordinator.warned == set()


@pytest.mark.parametrize("bits", [[], [0], [5, 63], [0, 64, 65, 127, 128]])
def test_set_bit_and_bits_of_round_trip(bits):
    words = np.zeros(3, dtype=np.uint64)
    for bit in bits:
        set_bit(words, bit)
    assert bits_of(words) == bits
    assert sum(bin(int(w)).count("1") for w in words) == len(bits)


def test_cache_version_moves_only_when_a_cached_names_bit_or_the_vector_length_moves():
    cache = ResponseCache()
    versions = [cache.version]

    def apply(*responses):
        for response in responses:
            cache.apply(response)
        versions.append(cache.version)
    apply(*[Response(Verdict.READY, f"w{i}", i, "m") for i in range(63)])  # the first word (from none)
    apply(Response(Verdict.READY, "noname.1", -1, "m"))  # not cached
    apply(Response(Verdict.READY, "w63", 63, "m"))  # still one word: nothing moved
    apply(Response(Verdict.READY, "w64", 64, "m"))  # a second word: the vector grows
    apply(Response(Verdict.INVALIDATE, "w5"))  # a bit leaves
    apply(Response(Verdict.READY, "w5", 5, "other"))  # the name comes back (its tombstone bit)
    apply(Response(Verdict.READY, "w5", 65, "again"))  # an existing name moves to another bit
    assert versions == [0, 1, 1, 1, 2, 3, 3, 4], versions
    assert cache.entries["w5"] == (65, "again") and cache.words == 2


class _Op:
    """What ``ResponseCache.mark`` and ``SteadyBatch`` read of a request."""

    def __init__(self, name, signature):
        self.name, self.signature = name, signature
        self.state, self.bit = negotiation.RequestState.UNREPORTED, -1


def _cached(names_and_metas):
    cache = ResponseCache()
    for bit, (name, meta) in enumerate(names_and_metas):
        cache.apply(Response(Verdict.READY, name, bit, meta))
    return cache


def test_mark_places_cached_ops_and_reports_the_rest():
    cache = _cached([("a", "A"), ("b", "B"), ("c", "C")])
    ops = [_Op("c", "C"), _Op("a", "A"), _Op("b", "other metadata"), _Op("new", "N")]
    bits, unreported = cache.mark(ops)
    assert bits == [2, 0] and unreported
    assert [op.state for op in ops] == [negotiation.RequestState.CACHED] * 2 + [negotiation.RequestState.UNREPORTED] * 2
    assert [op.bit for op in ops] == [2, 0, -1, -1]
    ops[3].state = negotiation.RequestState.REPORTED  # sent to the coordinator: neither a bit nor news
    assert cache.mark(ops) == ([2, 0], True)  # "b" is still unreported
    assert cache.mark(ops[:2] + ops[3:]) == ([2, 0], False)


def _exchange(*vectors):
    """What every rank gets from ``Negotiator.exchange``: AND of the AND halves, OR of the OR halves."""
    everywhere = np.bitwise_and.reduce([v[0] for v in vectors])
    anywhere = np.bitwise_or.reduce([v[1] for v in vectors])
    return everywhere, anywhere


def _exchange_packed(*vectors):
    """What ``Negotiator.exchange_packed`` returns: the AND, and the OR's complement as exchanged."""
    everywhere, anywhere = _exchange(*vectors)
    return everywhere, ~anywhere


@pytest.mark.parametrize("size", [1, 2, 3, 65])
def test_vectors_decode_to_the_same_agreement_for_every_rank(size):
    ranks = [negotiation.Negotiator(None, r, size) for r in range(size)]
    layout = ranks[0].layout(2)  # 128 cache bits
    assert ranks[0].layout(2) is layout and layout.length == 3 + 3 * ((size + 63) // 64)
    held = {r: [1, 64 + r % 3, 127] for r in range(size)}
    vectors = [n.vector(layout, held[n.rank], negotiation.Control.UNREPORTED if n.rank == size - 1 else 0,
                        leaving=n.rank == 0, busy=True, joined=False) for n in ranks]
    agreement = negotiation.Negotiator.decode(layout, *_exchange(*vectors))
    common = sorted(set.intersection(*(set(b) for b in held.values())))
    assert agreement.ready == common
    assert agreement.partial == sorted(set().union(*held.values()) - set(common))
    assert agreement.control == negotiation.Control.UNREPORTED
    assert agreement.leaving == [0] and agreement.busy == list(range(size)) and agreement.joined == []


def test_a_joined_rank_agrees_to_every_op_but_holds_none():
    ranks = [negotiation.Negotiator(None, r, 3) for r in range(3)]
    layout = ranks[0].layout(1)
    vectors = [ranks[0].vector(layout, [4, 9], 0, leaving=False, busy=True, joined=False),
               ranks[1].vector(layout, [], 0, leaving=False, busy=False, joined=True),
               ranks[2].vector(layout, [4], 0, leaving=False, busy=True, joined=False)]
    agreement = negotiation.Negotiator.decode(layout, *_exchange(*vectors))
    assert agreement.ready == [4] and agreement.partial == [9]
    assert agreement.joined == [1] and agreement.busy == [0, 2]


def test_a_steady_batch_runs_only_when_every_rank_sent_exactly_it():
    cache = _cached([("a", "A"), ("b", "B"), ("c", "C")])
    ranks = [negotiation.Negotiator(None, r, 2) for r in range(2)]
    layout = ranks[0].layout(cache.words)
    batches = []
    for negotiator in ranks:
        ops = [_Op("c", "C"), _Op("a", "A")]  # submitted in this order
        assert cache.mark(ops) == ([2, 0], False)
        batches.append(negotiation.SteadyBatch.learn(ops, cache.version, negotiator, layout))
    steady = batches[0]
    assert steady.order == [1, 0] and steady.ready_names == ["a", "c"], "the agreed order is the cache's"
    # The kept vector is the one an ordinary cycle builds for the same ops.
    assert np.array_equal(steady.vector, ranks[0].vector(layout, [2, 0], 0, leaving=False, busy=True,
                                                         joined=False)[1])
    assert steady.agreed(*_exchange_packed((steady.vector, steady.vector), (batches[1].vector, batches[1].vector)))
    assert steady.matches([_Op("c", "C"), _Op("a", "A")], cache.version)
    assert not steady.matches([_Op("a", "A"), _Op("c", "C")], cache.version), "another order"
    assert not steady.matches([_Op("c", "C"), _Op("a", "A")], cache.version + 1), "the cache moved"
    # The other rank brings one op less, news, a join or a departure: not agreed.
    fewer = ranks[1].vector(layout, [2], 0, leaving=False, busy=True, joined=False)
    news = ranks[1].vector(layout, [2, 0], negotiation.Control.UNREPORTED, leaving=False, busy=True, joined=False)
    leaving = ranks[1].vector(layout, [2, 0], negotiation.Control.SHUTDOWN, leaving=True, busy=True, joined=False)
    joined = ranks[1].vector(layout, [], 0, leaving=False, busy=False, joined=True)
    for other in (fewer, news, leaving, joined):
        assert not steady.agreed(*_exchange_packed((steady.vector, steady.vector), other))
    assert negotiation.SteadyBatch.learn([_Op("noname.3", "N")], cache.version, ranks[0], layout) is None


def test_a_steady_batch_of_one_op_matches_by_name_and_signature():
    meta = ("B", 4)
    cache = _cached([("a", ("A", 1)), ("b", meta)])
    negotiator = negotiation.Negotiator(None, 0, 2)
    layout = negotiator.layout(cache.words)
    ops = [_Op("b", meta)]
    cache.mark(ops)
    steady = negotiation.SteadyBatch.learn(ops, cache.version, negotiator, layout)
    assert steady.matches([_Op("b", meta)], cache.version)
    equal = tuple(["B", 4])
    assert equal is not meta and steady.matches([_Op("b", equal)], cache.version), "equal, not the same object"
    assert not steady.matches([_Op("a", ("A", 1))], cache.version), "another name"
    assert not steady.matches([_Op("b", ("B", 5))], cache.version), "other arguments"
    assert not steady.matches([_Op("b", meta)], cache.version + 1), "the cache moved"
    assert not steady.matches([_Op("b", meta), _Op("a", ("A", 1))], cache.version), "more ops"
    alone = steady.vector
    assert steady.agreed(*_exchange_packed((alone, alone), (alone, alone)))
    other = negotiator.vector(layout, [0, 1], 0, leaving=False, busy=True, joined=False)
    assert not steady.agreed(*_exchange_packed((alone, alone), other)), "another rank holds one op more"


class _Started:
    """A request that completes when tested: what a peerless all-reduce does."""

    def __init__(self, comm, send, recv):
        self.comm, self.send, self.recv, self.freed = comm, send, recv, False

    def Start(self):
        self.comm.started += 1

    def Test(self):
        self.recv[...] = self.send  # one rank: the reduction of one vector is that vector
        return True

    def Free(self):
        self.freed = True


class _Comm:
    def __init__(self, persistent):
        self.started = self.posted = 0
        self.persistent = [] if persistent else None

    def __getattr__(self, name):
        if name == "Allreduce_init" and self.persistent is not None:
            def make(send, recv, op):
                self.persistent.append(_Started(self, send, recv))
                return self.persistent[-1]
            return make
        raise AttributeError(name)  # an MPI before 4.0: no persistent collectives

    def Iallreduce(self, send, recv, op):
        self.posted += 1
        return _Started(self, send, recv)


@pytest.mark.parametrize("persistent", [True, False])
def test_the_exchange_reuses_one_persistent_request_per_length(persistent):
    comm = _Comm(persistent)
    negotiator = negotiation.Negotiator(comm, 0, 1)
    layout = negotiator.layout(1)
    for bits in ([3], [3, 5], [7]):
        mine = negotiator.vector(layout, bits, 0, leaving=False, busy=True, joined=False)
        everywhere, anywhere = negotiator.exchange(*mine)
        assert negotiation.Negotiator.decode(layout, everywhere, anywhere).ready == bits
        everywhere, not_anywhere = negotiator.exchange_packed(negotiator.packed(mine[1]))
        assert negotiation.Negotiator.decode(layout, everywhere, negotiator.anywhere(not_anywhere)).ready == bits
    if persistent:
        assert len(comm.persistent) == 1 and comm.started == 6 and comm.posted == 0
        negotiator.close()
        assert comm.persistent[0].freed
    else:
        assert comm.posted == 6
        negotiator.close()  # nothing to free
