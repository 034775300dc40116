"""The negotiation (ringreduce/negotiation/: the coordinator, the response cache, the stall
inspector, the vector and the steady batch) without MPI: the gathered reports every rank would
send are built by hand, as rank 0 receives them."""
import threading

import numpy as np
import pytest

from mtrain.ringreduce.core.errors import MismatchError, StallError, Verdict
from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.core.requests import AllreduceOp, RequestState
from mtrain.ringreduce.negotiation import cache as cache_module
from mtrain.ringreduce.negotiation.cache import ResponseCache
from mtrain.ringreduce.negotiation.coordinator import Coordinator
from mtrain.ringreduce.negotiation.messages import Response
from mtrain.ringreduce.negotiation.steady import SteadyBatch
from mtrain.ringreduce.negotiation.vector import Control, Negotiator, bits_of, set_bit


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
    assert cache.names_at([0]) == ["w"] and cache.next_bit == 1 and cache.words == 1


def test_each_new_name_gets_the_next_bit_and_every_rank_stays_identical():
    coordinator = Coordinator(2, 60, 0)
    caches = [ResponseCache(), ResponseCache()]
    names = [f"grad.{i}" for i in range(70)]  # more than one 64-bit word
    reports = [report(n, i) for i, n in enumerate(names)]
    responses = coordinator.decide(gathered(reports, reports[::-1]), caches[0], set(), 0.0)
    apply_all(responses, *caches)
    assert [r.bit for r in responses] == list(range(70))
    assert caches[0].names_at(range(70)) == caches[1].names_at(range(70)) == names
    assert [(c.bit_of(n), c.signature_of(n)) for n in names for c in caches] == [
        (i, i) for i in range(70) for _ in caches]
    assert caches[0].next_bit == caches[1].next_bit == 70 and caches[0].words == 2


def test_auto_named_ops_are_never_cached():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    responses = coordinator.decide(gathered([report("noname.4", 1)], [report("noname.4", 1)]), cache, set(), 0.0)
    assert responses == [Response(Verdict.READY, "noname.4", -1, 1)]
    apply_all(responses, cache)
    assert cache.next_bit == 0 and not cache.holds("noname.4") and cache.lookup("noname.4", 1) == -1


def test_cache_full_runs_the_op_without_a_bit(monkeypatch):
    monkeypatch.setattr(cache_module, "CACHE_CAPACITY", 2)
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
    assert cache.next_bit == 0, "a mismatch assigns no bit"
    assert coordinator.undecided() == [] and coordinator.stall.watched() == {}, "the name is forgotten"


def test_a_rank_with_new_metadata_for_a_cached_name_invalidates_it_everywhere():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    apply_all(coordinator.decide(gathered([report("w", "A")], [report("w", "A")]), cache, set(), 0.0), cache)
    # Rank 0 still holds "w" under its cached metadata (its bit is set); rank 1 reports "w" as B.
    responses = coordinator.decide(gathered([], [report("w", "B")]), cache, {"w"}, 1.0)
    assert responses == [Response(Verdict.INVALIDATE, "w")]
    apply_all(responses, cache)
    assert cache.lookup("w", "A") == -1 and not cache.holds("w") and cache.next_bit == 1, "a tombstone keeps later bits in place"
    # Rank 0 reports afresh; with B everywhere the name is ready again under a new bit.
    responses = coordinator.decide(gathered([report("w", "B")], []), cache, set(), 2.0)
    assert responses == [Response(Verdict.READY, "w", 1, "B")]
    apply_all(responses, cache)
    assert cache.lookup("w", "B") == 1 and cache.names_at([1]) == ["w"] and cache.next_bit == 2


def test_new_metadata_on_every_rank_at_once_keeps_the_bit():
    coordinator, cache = Coordinator(2, 60, 0), ResponseCache()
    apply_all(coordinator.decide(gathered([report("w", "A")], [report("w", "A")]), cache, set(), 0.0), cache)
    responses = coordinator.decide(gathered([report("w", "B")], [report("w", "B")]), cache, set(), 1.0)
    assert responses == [Response(Verdict.READY, "w", 0, "B")]
    apply_all(responses, cache)
    assert cache.lookup("w", "B") == 0 and cache.lookup("w", "A") == -1


def test_stall_past_the_limit_is_an_error_naming_the_missing_ranks(capsys):
    coordinator, cache = Coordinator(3, warn_seconds=60, shutdown_seconds=10), ResponseCache()
    assert not coordinator.after_round((), ["late"], now=100.0)
    assert not coordinator.after_round((), (), 105.0)
    assert coordinator.after_round((), (), 111.0)
    pending = [["late"], [], ["late"]]
    responses = coordinator.decide(gathered([], [], [], pending=pending), cache, set(), 111.0)
    assert len(responses) == 1 and responses[0].verdict is Verdict.STALLED
    message = responses[0].message
    assert "'late'" in message and "rank(s) [0, 2]" in message and "rank(s) [1]" in message
    assert type(responses[0].verdict.error(message)) is StallError
    assert not coordinator.after_round((), (), 200.0), "a stalled op is reported once"
    assert capsys.readouterr().err == ""


def test_stall_warning_is_printed_once_per_op(capsys):
    coordinator, cache = Coordinator(2, warn_seconds=5, shutdown_seconds=0), ResponseCache()
    coordinator.after_round((), ["slow.0"], now=0.0)
    coordinator.after_round((), ["slow.1"], now=3.0)
    coordinator.after_round((), ["slow.0", "slow.1"], now=4.0)  # already seen: each keeps its first time
    assert not coordinator.after_round((), (), 5.0)
    assert coordinator.after_round((), (), 6.0)
    pending = [["slow.0", "slow.1"], []]
    assert coordinator.decide(gathered([], [], pending=pending), cache, set(), 6.0) == []
    err = capsys.readouterr().err
    assert "stall warning" in err and "'slow.0'" in err and "rank(s) [1]" in err and "slow.1" not in err
    assert not coordinator.after_round((), (), 7.0), "slow.0 was warned about; slow.1 is not due yet"
    assert coordinator.after_round((), (), 8.5), "slow.1 is due now"
    assert coordinator.stall.warned() == {"slow.0"}
    coordinator.after_round(["slow.0"], (), 8.6)  # slow.0 ran at last
    assert coordinator.stall.watched() == {"slow.1": 3.0} and coordinator.stall.warned() == set()


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
    assert (cache.bit_of("w5"), cache.signature_of("w5")) == (65, "again") and cache.words == 2


def _Op(name, signature):
    """A real request (an all-reduce submitted on its own) under ``signature``, as the cache and the
    steady batch see it: its state moves only through its own methods."""
    return AllreduceOp(threading.Condition(), name, np.zeros(3, np.float32), ReduceOp.Sum, False, 1.0, 1.0,
                       signature=signature)


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
    assert [op.state for op in ops] == [RequestState.CACHED] * 2 + [RequestState.UNREPORTED] * 2
    assert [op.bit for op in ops] == [2, 0, -1, -1]
    ops[3].report()  # sent to the coordinator: neither a bit nor news
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
    ranks = [Negotiator(None, r, size) for r in range(size)]
    layout = ranks[0].layout(2)  # 128 cache bits
    assert ranks[0].layout(2) is layout and layout.length == 3 + 3 * ((size + 63) // 64)
    held = {r: [1, 64 + r % 3, 127] for r in range(size)}
    vectors = [n.vector(layout, held[n.rank], Control.UNREPORTED if n.rank == size - 1 else 0,
                        leaving=n.rank == 0, busy=True, joined=False) for n in ranks]
    agreement = Negotiator.decode(layout, *_exchange(*vectors))
    common = sorted(set.intersection(*(set(b) for b in held.values())))
    assert agreement.ready == common
    assert agreement.partial == sorted(set().union(*held.values()) - set(common))
    assert agreement.control == Control.UNREPORTED
    assert agreement.leaving == [0] and agreement.busy == list(range(size)) and agreement.joined == []


def test_a_joined_rank_agrees_to_every_op_but_holds_none():
    ranks = [Negotiator(None, r, 3) for r in range(3)]
    layout = ranks[0].layout(1)
    vectors = [ranks[0].vector(layout, [4, 9], 0, leaving=False, busy=True, joined=False),
               ranks[1].vector(layout, [], 0, leaving=False, busy=False, joined=True),
               ranks[2].vector(layout, [4], 0, leaving=False, busy=True, joined=False)]
    agreement = Negotiator.decode(layout, *_exchange(*vectors))
    assert agreement.ready == [4] and agreement.partial == [9]
    assert agreement.joined == [1] and agreement.busy == [0, 2]


def test_a_steady_batch_runs_only_when_every_rank_sent_exactly_it():
    cache = _cached([("a", "A"), ("b", "B"), ("c", "C")])
    ranks = [Negotiator(None, r, 2) for r in range(2)]
    layout = ranks[0].layout(cache.words)
    batches = []
    for negotiator in ranks:
        ops = [_Op("c", "C"), _Op("a", "A")]  # submitted in this order
        assert cache.mark(ops) == ([2, 0], False)
        batches.append(SteadyBatch.learn(ops, cache.version, negotiator, layout))
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
    news = ranks[1].vector(layout, [2, 0], Control.UNREPORTED, leaving=False, busy=True, joined=False)
    leaving = ranks[1].vector(layout, [2, 0], Control.SHUTDOWN, leaving=True, busy=True, joined=False)
    joined = ranks[1].vector(layout, [], 0, leaving=False, busy=False, joined=True)
    for other in (fewer, news, leaving, joined):
        assert not steady.agreed(*_exchange_packed((steady.vector, steady.vector), other))
    assert SteadyBatch.learn([_Op("noname.3", "N")], cache.version, ranks[0], layout) is None


def test_a_steady_batch_of_one_op_matches_by_name_and_signature():
    meta = ("B", 4)
    cache = _cached([("a", ("A", 1)), ("b", meta)])
    negotiator = Negotiator(None, 0, 2)
    layout = negotiator.layout(cache.words)
    ops = [_Op("b", meta)]
    cache.mark(ops)
    steady = SteadyBatch.learn(ops, cache.version, negotiator, layout)
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
    """A request of a two-rank exchange whose peer sent ``peer``: it reduces with the op it was
    made with (only BAND gives the negotiation's answer), and completes when tested, unless the
    comm is told to interrupt the next test (a Ctrl-C inside the exchange)."""

    def __init__(self, comm, send, recv, op):
        self.comm, self.send, self.recv, self.op = comm, send, recv, op
        self.active = self.freed = False

    def Start(self):
        assert not self.freed, "a freed request was started"
        self.comm.started += 1
        self.active = True

    def Test(self):
        if self.comm.interrupt:
            self.comm.interrupt = False
            raise KeyboardInterrupt
        if self.active:
            peer = self.comm.peer(self.send.size)
            self.recv[...] = self.op.Reduce_local_result(self.send, peer)
            self.active = False
        return True

    def Free(self):
        assert not self.active, "an active request was freed (erroneous in MPI)"
        self.freed = True


class _MpiOp:
    """An MPI reduction operator as the stand-in applies it."""

    def __init__(self, mpi_op):
        self.mpi_op = mpi_op

    def Reduce_local_result(self, mine, peer):
        from mpi4py import MPI
        if self.mpi_op == MPI.BAND:
            return np.bitwise_and(mine, peer)
        if self.mpi_op == MPI.BOR:
            return np.bitwise_or(mine, peer)
        raise AssertionError(f"the exchange reduced with {self.mpi_op}")


class _Comm:
    """The control communicator of rank 0 in a job of two, whose rank 1 holds ``peer_bits``
    (busy, no news): exchanges of any length reduce with the op they name."""

    def __init__(self, persistent, peer_bits):
        self.started = self.posted = 0
        self.interrupt = False
        self.persistent = [] if persistent else None
        self.peer_bits = peer_bits

    def peer(self, length):
        words = length // 2 - 1 - 3  # the cache words of a two-rank layout (control + 3 rank words)
        layout = Negotiator(None, 1, 2).layout(words)
        vector = Negotiator(None, 1, 2).vector(layout, self.peer_bits, 0, leaving=False, busy=True, joined=False)[1]
        return Negotiator.packed(vector)

    def __getattr__(self, name):
        if name == "Allreduce_init" and self.persistent is not None:
            def make(send, recv, op):
                self.persistent.append(_Started(self, send, recv, _MpiOp(op)))
                return self.persistent[-1]
            return make
        raise AttributeError(name)  # an MPI before 4.0: no persistent collectives

    def Iallreduce(self, send, recv, op):
        self.posted += 1
        request = _Started(self, send, recv, _MpiOp(op))
        request.Start()
        self.started -= 1  # (posted, not started)
        return request


@pytest.mark.parametrize("persistent", [True, False])
def test_the_exchange_reuses_one_persistent_request_per_length(persistent):
    peer_bits = [3, 5, 70]
    comm = _Comm(persistent, peer_bits)
    negotiator = Negotiator(comm, 0, 2)
    rounds = 0
    for words, bits in ((1, [3]), (1, [3, 5]), (2, [7, 70]), (1, [5])):
        layout = negotiator.layout(words)
        mine = negotiator.vector(layout, bits, 0, leaving=False, busy=True, joined=False)
        everywhere, anywhere = negotiator.exchange(*mine)
        agreement = Negotiator.decode(layout, everywhere, anywhere)
        held = [b for b in peer_bits if b < 64 * words]
        assert agreement.ready == sorted(set(bits) & set(held)), (words, bits)
        assert agreement.partial == sorted(set(bits) ^ set(held)), (words, bits)
        assert agreement.busy == [0, 1]
        everywhere, not_anywhere = negotiator.exchange_packed(negotiator.packed(mine[1]))
        assert Negotiator.decode(layout, everywhere, negotiator.anywhere(not_anywhere)) == agreement
        rounds += 2
    if persistent:
        assert len(comm.persistent) == 2 and comm.started == rounds and comm.posted == 0, "one request per length"
        # An exchange that an interrupt left unfinished leaves its request active: close() frees
        # the others and leaves that one alone (freeing an active request is erroneous).
        comm.interrupt = True
        with pytest.raises(KeyboardInterrupt):
            negotiator.exchange(*negotiator.vector(negotiator.layout(2), [7], 0, leaving=False, busy=True,
                                                   joined=False))
        active = [request for request in comm.persistent if request.active]
        assert len(active) == 1
        negotiator.close()
        assert [request.freed for request in comm.persistent] == [not request.active for request in comm.persistent]
    else:
        assert comm.posted == rounds and comm.started == 0
        negotiator.close()  # nothing to free
