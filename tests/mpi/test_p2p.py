"""Point-to-point transfers in the runtime (send/recv and their async forms), in real mpirun jobs.

Every body runs on every rank; values differ per rank, per element and per message, so a
transfer that lands in the wrong recv, or a wrong part of one, shows.
"""
import os
import time

import numpy as np
import pytest

import mtrain.ringreduce as rr
from mtrain.ringreduce.core.errors import InvalidArgumentError, MismatchError, ShutdownError
from mtrain.ringreduce.transport.p2p import EAGER_BYTES
from tests.mpi.data import values
from tests.mpi.harness import mpi_test

# Around the size where a transfer's payload leaves the header's message (float32 elements).
EDGE = EAGER_BYTES // 4
SIZES = [0, 1, 7, EDGE - 8, EDGE, EDGE + 1, 1_000_003]
DTYPES = [np.float32, np.int64, np.float16, np.uint8, np.complex64, np.bool_]


def _message(source: int, number: int, shape, dtype) -> np.ndarray:
    """What ``source`` sends as its ``number``-th message: unique to both."""
    seed = source * 100 + number
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return values(seed, shape, np.int64) % 3 == 0
    if dtype.kind == "c":
        return values(seed, shape, np.float32) + 1j * values(seed + 1, shape, np.float32)
    return values(seed, shape, dtype)


@mpi_test(nps=(2, 3))
def test_ring_exchange_of_every_size_and_dtype():
    """Each rank sends to the next and receives from the one before, every size around the
    eager edge and every dtype, contiguous or not on either end."""
    rank, size = rr.rank(), rr.size()
    after, before = (rank + 1) % size, (rank - 1) % size
    number = 0
    for dtype in DTYPES:
        for count in SIZES if dtype == np.float32 else [0, 5, EDGE + 3]:
            number += 1
            sent = _message(rank, number, (count,), dtype)
            into = np.zeros(count, dtype)
            receiving = rr.recv_async(into, before, tag=number % 4)
            rr.synchronize(rr.send_async(sent, after, tag=number % 4))
            got = rr.synchronize(receiving)
            assert got is into, "recv returns the array it filled"
            want = _message(before, number, (count,), dtype)
            assert np.array_equal(into, want), f"{dtype.__name__}[{count}] from rank {before}"
    # Non-contiguous on both ends: every other element of a 2-D array, into a column view.
    for count in (9, EDGE + 5):
        number += 1
        base = _message(rank, number, (2 * count,), np.float64)
        target = np.zeros((count, 3))
        receiving = rr.recv_async(target[:, 1], before, tag=7)
        rr.send(base[::2], after, tag=7)
        rr.synchronize(receiving)
        want = _message(before, number, (2 * count,), np.float64)[::2]
        assert np.array_equal(target[:, 1], want), f"non-contiguous float64[{count}]"
        assert not target[:, 0].any() and not target[:, 2].any(), "a strided recv wrote outside its view"
    # A 0-d array and a multi-dimensional one of the same element count as the sender's.
    rr.synchronize(rr.send_async(np.float32(rank + 0.5), after, tag=1))
    scalar = rr.recv(np.zeros((), np.float32), before, tag=1)
    assert scalar == before + 0.5


@mpi_test(nps=(2, 3))
def test_transfers_match_in_order_per_source_and_tag():
    """The k-th send of a (source, dest, tag) meets the k-th recv, large (several chunks) and small
    mixed; other tags are their own queues, whatever order their recvs are posted in."""
    rank, size = rr.rank(), rr.size()
    # Each rank its own window (read when its first transfer starts): the wire order of chunks must
    # not depend on both ends posting alike.
    os.environ["MTRAIN_P2P_WINDOW"] = str(3 if rank == 0 else 1)
    if rank >= 2:  # rank 2 of 3 sits this one out (others' traffic must not reach it)
        rr.barrier()
        return
    peer = 1 - rank
    # Large ones of several chunks (1 MiB each), back to back on one tag: their
    # chunks must not interleave on the wire.
    counts = [3, EDGE + 11, 1_100_003, 300_001, 1, 0, 2 * EDGE, 5, 1_100_003, EDGE + 11, 4]
    if rank == 0:
        sends = [rr.send_async(_message(0, i, (n,), np.float32), peer, tag=5) for i, n in enumerate(counts)]
        sends += [rr.send_async(_message(0, 50 + t, (t + 2,), np.int32), peer, tag=t) for t in range(4)]
        for handle in sends:
            assert rr.synchronize(handle) is None
    else:
        # The other tags' recvs are posted first and in reverse; tag 5's in order.
        others = [(t, rr.recv_async(np.zeros(t + 2, np.int32), peer, tag=t)) for t in reversed(range(4))]
        mine = [rr.recv_async(np.zeros(n, np.float32), peer, tag=5) for n in counts]
        for i, (n, handle) in enumerate(reversed(list(zip(counts, mine)))):  # waited for last first
            k = len(counts) - 1 - i
            assert np.array_equal(rr.synchronize(handle), _message(0, k, (n,), np.float32)), f"message {k}"
        for t, handle in others:
            assert np.array_equal(rr.synchronize(handle), _message(0, 50 + t, (t + 2,), np.int32)), f"tag {t}"
    rr.barrier()


@mpi_test(nps=(3,))
def test_a_process_set_has_its_own_transfers():
    """The same tag between the same two ranks, in a process set and in the job, never mix."""
    pair = rr.add_process_set([0, 2])
    rank = rr.rank()
    if rank == 0:
        rr.send(np.full(6, 1.0), 2, tag=0, process_set=pair)
        rr.send(np.full(6, 2.0), 2, tag=0)
    elif rank == 2:
        in_job = rr.recv_async(np.zeros(6), 0, tag=0)  # posted first, but for the job's send
        in_pair = rr.recv(np.zeros(6), 0, tag=0, process_set=pair)
        assert (in_pair == 1.0).all() and (rr.synchronize(in_job) == 2.0).all()
    else:
        with pytest.raises(InvalidArgumentError, match="not part of process set"):
            rr.send(np.zeros(1), 0, process_set=pair)
    if rank in (0, 2):
        with pytest.raises(InvalidArgumentError, match="is not a rank of process set"):
            rr.send(np.zeros(1), 1, process_set=pair)
    rr.barrier()
    rr.remove_process_set(pair)


@mpi_test(nps=(2,))
def test_bad_transfers_say_what_is_wrong_and_the_sender_still_finishes():
    rank = rr.rank()
    peer = 1 - rank
    for bad, match in [(lambda: rr.send(np.zeros(2), rank), "is this rank"),
                       (lambda: rr.recv(np.zeros(2), rank), "is this rank"),
                       (lambda: rr.send(np.zeros(2), 5), "is not a rank of the job"),
                       (lambda: rr.send(np.zeros(2), -1), "is not a rank of the job"),
                       (lambda: rr.send(np.zeros(2), 1.0), "must be an integer"),
                       (lambda: rr.send(np.zeros(2), peer, tag=-1), "out of range"),
                       (lambda: rr.recv(np.zeros(2)[:], peer, tag=2 ** 40), "out of range")]:
        with pytest.raises(InvalidArgumentError, match=match):
            bad()
    read_only = np.zeros(3)
    read_only.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        rr.recv(read_only, peer)
    with pytest.raises(TypeError, match="numpy.ndarray"):
        rr.send([1, 2], peer)
    # Mismatches are the receiver's error; the sender's transfer ends normally, small or large.
    cases = [(np.zeros(8, np.float32), np.zeros(5, np.float32), "sent float32\\[8\\], but this buffer holds float32\\[5\\]"),
             (np.zeros(EDGE + 9, np.float32), np.zeros(EDGE, np.float32), "sent float32\\[16393\\]"),
             (np.zeros(4, np.float64), np.zeros(4, np.float32), "sent float64\\[4\\], but this buffer holds float32"),
             (np.zeros(EDGE + 1, np.int64), np.zeros(EDGE + 1, np.int32), "sent int64")]
    for i, (sent, buffer, match) in enumerate(cases):
        if rank == 0:
            rr.send(sent, 1, tag=i)
        else:
            with pytest.raises(MismatchError, match=match):
                rr.recv(buffer, 0, tag=i)
    # Both ends still talk after the errors.
    if rank == 0:
        rr.send(np.arange(3.0), 1, tag=9)
    else:
        assert list(rr.recv(np.zeros(3), 0, tag=9)) == [0.0, 1.0, 2.0]


@mpi_test(nps=(2,))
def test_a_large_transfer_does_not_hold_up_collectives():
    """Rank 0 sends 64 MiB that rank 1 receives only after 20 all-reduces: they finish meanwhile."""
    rank = rr.rank()
    big = np.arange(16 << 20, dtype=np.float32) if rank == 0 else np.zeros(16 << 20, np.float32)
    pending = rr.send_async(big, 1) if rank == 0 else None
    for i in range(20):
        got = rr.allreduce(np.full(5, float(rank + i)), op=rr.Sum, name=f"during.{i}")
        assert (got == 2 * i + 1).all()
    if rank == 0:
        assert not rr.poll(pending), "the send finished before rank 1 posted its recv (64 MiB should not)"
        rr.synchronize(pending)
    else:
        rr.recv(big, 0)
        assert big[-1] == (16 << 20) - 1 and big[12345] == 12345.0


@mpi_test(nps=(2, 3))
def test_a_transfer_with_a_rank_that_left_fails_naming_it():
    """Rank 1 shuts down (as a rank does when its program ends); transfers from and to it end
    with the ShutdownError that names it, promptly, small or large."""
    rank = rr.rank()
    if rank == 1:
        rr.shutdown()
        return
    started = time.monotonic()
    for make in (lambda: rr.recv_async(np.zeros(5), 1),
                 lambda: rr.recv_async(np.zeros(EDGE * 4, np.float32), 1, tag=3),
                 lambda: rr.send_async(np.zeros(EDGE * 4, np.float32), 1, tag=4)):
        handle = make()
        with pytest.raises(ShutdownError, match=r"rank 1 .*rank\(s\) \[1\] left the job") as failure:
            rr.synchronize(handle)
        assert failure.value.peers == [1]
    assert time.monotonic() - started < 30, "the transfers took too long to fail"
