"""Point-to-point transfers: one rank's array into another rank's array, matched in order.

    handle = send_async(array, dest, tag=0)     # on rank src
    handle = recv_async(array, source, tag=0)   # on rank dest: fills ``array``
    synchronize(handle)                         # (or poll(handle))

Ranks are global ranks (as ``root_rank`` is); with a ``process_set`` both ends must be in
it, and its transfers never meet another set's. The k-th send from ``src`` to ``dest``
with a tag matches the k-th recv on ``dest`` from ``src`` with that tag, as in MPI.

On the wire, on the set's own communicator (``Communicators.p2p``, nothing else), a transfer is

* a small one (payload up to ``MTRAIN_P2P_EAGER_BYTES``, 64 KiB): one message on MPI
  tag ``2*tag`` holding a header (dtype, element count) and the payload;
* a large one: the header alone on tag ``2*tag``, then the payload on tag ``2*tag+1`` in
  chunks of ``MTRAIN_P2P_CHUNK_BYTES`` (1 MiB), at most ``MTRAIN_P2P_WINDOW`` (2) in flight,
  sent straight from the caller's array and received straight into the receiver's.

The header is what lets a receiver refuse, with an error that says so, a send of another
dtype or size (MPI itself would truncate silently or fail without saying whose the data
was); a refused payload is still received, into scratch, so the sender never waits on it.
MPI's non-overtaking rule per (communicator, source, tag) keeps headers and payloads in
order; within one (communicator, peer, tag) queue only the first transfer posts chunks,
so chunks of consecutive transfers never interleave (each end keeps one FIFO per queue).

Which thread moves the bytes: never the engine thread. The caller posts the first
messages (the header, and a large send's first chunks; so transfers start in program
order, without a thread hop); after that, one daemon thread per process (``mtrain-p2p``),
and any thread waiting on a transfer's handle, drive MPI's progress for the transfers in
flight: they post further chunks and the payload receives as headers arrive, and complete
the handles. A blocking send/recv drives its own transfer and leaves the mover thread
asleep. The engine thread runs collectives on other communicators; since MPI's progress is
shared by every thread of a rank, the chunks are what lets its messages through while a
large transfer is in flight (``benchmarks/p2p.py`` measures an all-reduce beside one). The
mover thread polls with short, growing sleeps while transfers are in flight and sleeps on
a condition when none are.

CuPy arrays are staged through host memory, on the legacy default stream: a send copies its
array to the host before it returns; a recv lands in a host buffer, then on the device. A
transfer whose peer has left the job ends with the ``ShutdownError`` that names it (the set's
engine hears of the leaving rank within a cycle), never a hang; this rank's own ``shutdown()``
ends its transfers in flight likewise.
"""
from __future__ import annotations

import collections
import enum
import struct
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from mtrain.common import settings
from mtrain.ringreduce.core.errors import InvalidArgumentError, MismatchError, ShutdownError
from mtrain.ringreduce.transport import mpi
from mtrain.ringreduce.transport.backend import is_device_array

MPI = mpi.deferred(__name__)  # mpi4py's MPI from init() on (importing the runtime starts no MPI)

# dtype name (padded), element count, whether the payload follows in a message of its own.
_HEADER = struct.Struct("<16sqq")
EAGER_BYTES = 64 * 1024
# A large payload moves in chunks of this size, at most WINDOW of them in flight per transfer: a
# rank's other messages (the engine's collectives) get through between chunks.
CHUNK_BYTES = 1 << 20
WINDOW = 2
# After the set's engine says a peer left, transfers in flight still get this long to finish
# (their last messages may still be on the way), then fail.
_DEPARTED_GRACE_SECONDS = 1.0
# How long a thread waiting on a transfer polls MPI without sleeping.
_SPIN_SECONDS = 2e-4


def _eager_bytes() -> int:
    return int(settings.number_or(settings.P2P_EAGER_BYTES, EAGER_BYTES))


_names: Dict[np.dtype, bytes] = {}


def _header(buffer: np.ndarray, separate: bool) -> bytes:
    name = _names.get(buffer.dtype)
    if name is None:  # dtype.name is slow to build: once per dtype
        name = _names[buffer.dtype] = buffer.dtype.name.encode("ascii")[:16]
    return _HEADER.pack(name, buffer.size, separate)


class Direction(str, enum.Enum):
    """Which way a transfer moves an array (its text is the API's verb)."""

    SEND = "send"
    RECV = "recv"


class Phase(enum.Enum):
    """Where a transfer is (``Transfer._phase``)."""

    HEADER = "header"
    PAYLOAD = "payload"
    DONE = "done"


class Transfer:
    """One send or recv in flight: its handle too (``poll``/``synchronize`` take it)."""

    __slots__ = ("kind", "state", "peer", "tag", "array", "_buffer", "_land", "_first", "_scratch", "_payload",
                 "_posted", "_inflight", "_phase", "_error", "_channel", "_mover", "_callbacks", "__weakref__")
    # ``array``: the caller's array (NumPy, or CuPy: then ``_buffer`` is its host copy, and a recv
    # lands there first, ``_land``)

    def __init__(self, kind: Direction, state: Any, peer: int, tag: int, array: np.ndarray, mover: "_Mover") -> None:
        self.kind, self.state, self.peer, self.tag, self.array = kind, state, peer, tag, array
        self._buffer: np.ndarray = array
        self._land = False          # a recv into a non-contiguous array copies back at the end
        self._first: Optional[MPI.Request] = None   # the header's (or small transfer's) message
        self._scratch: Optional[np.ndarray] = None  # that message's bytes
        self._payload: Optional[np.ndarray] = None  # a large transfer's payload bytes (uint8)
        self._posted = 0                            # of which this many are posted, in chunks
        self._inflight: Deque[MPI.Request] = collections.deque()
        # send: PAYLOAD (until every message is out) -> DONE
        # recv: HEADER -> PAYLOAD (large only) -> DONE
        self._phase = Phase.HEADER if kind is Direction.RECV else Phase.PAYLOAD
        self._error: Optional[BaseException] = None
        self._channel: Optional[Deque["Transfer"]] = None
        self._mover = mover
        self._callbacks: Optional[List[Callable[["Transfer"], None]]] = None

    def __repr__(self) -> str:
        return f"<mtrain {self.describe()}: {self._phase.value}>"

    def describe(self) -> str:
        way = "to" if self.kind is Direction.SEND else "from"
        what = f"{self.array.dtype.name}{list(self.array.shape)}"
        return f"{self.kind.value} of {what} {way} rank {self.peer} (tag {self.tag})"

    # -- what poll / synchronize call ----------------------------------------------
    def done(self) -> bool:
        """Whether the transfer has ended (driving its progress once, if nobody else is)."""
        if self._phase is not Phase.DONE:
            self._mover.poll()
        return self._phase is Phase.DONE

    def wait(self) -> Any:
        if self._phase is not Phase.DONE:
            self._mover.wait_for(self)
        if self._error is not None:
            raise self._error
        return self.array if self.kind is Direction.RECV else None

    def error(self) -> Optional[BaseException]:
        """The transfer's error once it is done (None: it succeeded, or is not done)."""
        return self._error

    def add_done_callback(self, callback: Callable[["Transfer"], None]) -> None:
        """Call ``callback(transfer)`` once it is done (now, if it is), outside the mover's lock,
        on whichever thread finished it: keep it short (completing a future, say)."""
        self._mover.add_callback(self, callback)

    # -- driven under the mover's lock ---------------------------------------------
    def _finish(self, error: Optional[BaseException] = None) -> None:
        if error is not None and self._error is None:
            self._error = error
        if self._land and self._error is None:
            try:
                if isinstance(self.array, np.ndarray):
                    self.array[...] = self._buffer.reshape(self.array.shape)
                else:
                    _host_to_device(self.array, self._buffer)
            except Exception as failure:  # a device copy that failed: the transfer's error
                self._error = failure
        self._phase = Phase.DONE
        self._first, self._scratch, self._payload = None, None, None
        if self._callbacks:
            self._mover.ready.append(self)

    def _advance(self, head: bool, chunk: int, window: int) -> bool:
        """Move on as far as MPI allows; True when anything changed. ``head``: this transfer is the
        first of its channel, the one whose payload chunks may be posted now."""
        changed = False
        if self._first is not None and (self._phase is not Phase.HEADER or head):
            if self._first.Test():
                self._first = None
                changed = True
                if self._phase is Phase.HEADER:
                    self._read_header()
                    if self._phase is Phase.DONE:
                        return True
            elif self._phase is Phase.HEADER:
                return False
        if self._phase is not Phase.PAYLOAD:
            return changed
        while self._inflight and self._inflight[0].Test():  # chunks complete in the order posted
            self._inflight.popleft()
            changed = True
        payload = self._payload
        if payload is not None and head and self._posted < payload.nbytes:
            comm, peer = self.state.comms.p2p, self.state.set_rank_of(self.peer)
            post = comm.Isend if self.kind is Direction.SEND else comm.Irecv
            while self._posted < payload.nbytes and len(self._inflight) < window:
                piece = payload[self._posted:self._posted + chunk]
                self._inflight.append(post([piece, MPI.BYTE], peer, 2 * self.tag + 1))
                self._posted += piece.nbytes
            changed = True
        if self._first is None and not self._inflight and (payload is None or self._posted >= payload.nbytes):
            self._finish()
            return True
        return changed

    def _read_header(self) -> None:
        """A recv's first message has come: check it against this buffer; a small transfer is complete."""
        assert self._scratch is not None
        name, count, separate = _HEADER.unpack_from(self._scratch)
        sent_dtype = name.rstrip(b"\0").decode("ascii", "replace")
        problem = None
        if sent_dtype != self._buffer.dtype.name or count != self._buffer.size:
            problem = MismatchError(
                f"{self.describe()}: rank {self.peer} sent {sent_dtype}[{count}], but this buffer holds "
                f"{self._buffer.dtype.name}[{self._buffer.size}]; a send and its recv must have the same dtype and "
                "number of elements")
        if not separate:
            if problem is None:
                payload = self._scratch[_HEADER.size:_HEADER.size + self._buffer.nbytes]
                self._buffer.reshape(-1).view(np.uint8)[...] = payload
            self._finish(problem)
            return
        self._phase = Phase.PAYLOAD
        if problem is None:
            self._payload = _bytes_of(self._buffer)
        else:  # drained into scratch, so that the sender's transfer ends too
            self._error = problem
            self._payload = np.empty(_sent_nbytes(sent_dtype, count), np.uint8)
        self._scratch = None

    def _out_of_channel(self) -> bool:
        """Whether this transfer no longer holds up the next one of its channel."""
        if self._phase is Phase.DONE:
            return True
        if self._phase is Phase.HEADER:
            return False
        return self._payload is None or self._posted >= self._payload.nbytes


def _sent_nbytes(dtype_name: str, count: int) -> int:
    try:
        itemsize = np.dtype(dtype_name).itemsize
    except TypeError:
        itemsize = _named_itemsize(dtype_name)
    return int(itemsize * count)


def _named_itemsize(dtype_name: str) -> int:
    """Item size of a dtype NumPy knows only through a plug-in (bfloat16: ml_dtypes)."""
    try:
        import ml_dtypes
        return np.dtype(getattr(ml_dtypes, dtype_name)).itemsize
    except (ImportError, AttributeError, TypeError):
        digits = "".join(c for c in dtype_name if c.isdigit())
        return max(1, int(digits) // 8) if digits else 1


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """A contiguous array's bytes as a flat uint8 view (MPI moves bytes; the header says what they are)."""
    return array.reshape(-1).view(np.uint8) if array.size else np.empty(0, np.uint8)


class _Mover:
    """The transfers in flight in this process and the thread that drives them."""

    def __init__(self) -> None:
        # One lock; two conditions on it, so that a completion wakes only the threads that sleep
        # on a transfer, and a submission only the mover thread, and each only when it sleeps.
        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._work_cv = threading.Condition(self._lock)
        self._active: List[Transfer] = []
        # Transfers whose payloads share a (communicator, direction, peer, tag) queue: only the first
        # posts its chunks, so that chunks of consecutive transfers never interleave on the wire.
        self._channels: Dict[Tuple[int, str, int, int], Deque[Transfer]] = {}
        self._departed_since: Dict[int, float] = {}
        self._closing = False
        self._waiters = 0           # threads in wait_for: they drive progress, the mover stands aside
        self._sleepers = 0          # of those, the ones asleep on _done_cv
        self._mover_idle = False    # the mover thread sleeps on _work_cv
        self.eager = _eager_bytes()
        self.chunk = max(4096, int(settings.number_or(settings.P2P_CHUNK_BYTES, CHUNK_BYTES)))
        self.window = max(1, int(settings.number_or(settings.P2P_WINDOW, WINDOW)))
        self.ready: List[Transfer] = []  # done transfers whose callbacks are due (run outside the lock)
        self._thread = threading.Thread(target=self._run, name="mtrain-p2p", daemon=True)
        self._thread.start()

    # -- submitting (caller's thread) ---------------------------------------------
    def start(self, transfer: Transfer, wake: bool) -> Transfer:
        """Post ``transfer``'s first message. ``wake``: the mover thread takes it on (an async
        transfer); the caller of a blocking send or recv drives it itself."""
        state, comm = transfer.state, transfer.state.comms.p2p
        peer = state.set_rank_of(transfer.peer)
        buffer, eager = transfer._buffer, self.eager
        large = transfer.kind is Direction.SEND and buffer.nbytes > eager
        if transfer.kind is Direction.SEND:
            header = np.frombuffer(_header(buffer, large), np.uint8)
            if large:
                transfer._scratch = header
                transfer._payload = _bytes_of(buffer)
            else:
                transfer._scratch = np.empty(_HEADER.size + buffer.nbytes, np.uint8)
                transfer._scratch[:_HEADER.size] = header
                transfer._scratch[_HEADER.size:] = _bytes_of(buffer)
        else:
            transfer._scratch = np.empty(_HEADER.size + eager, np.uint8)
        with self._lock:
            if self._closing:
                raise ShutdownError("mtrain was shut down; call init() again before sending")
            post = comm.Isend if transfer.kind is Direction.SEND else comm.Irecv
            transfer._first = post([transfer._scratch, MPI.BYTE], peer, 2 * transfer.tag)
            if transfer.kind is Direction.RECV or large:
                key = (id(comm), transfer.kind, peer, transfer.tag)
                channel = self._channels.get(key)
                if channel is None:
                    channel = self._channels[key] = collections.deque()
                channel.append(transfer)
                transfer._channel = channel
                if large and channel[0] is transfer:  # its first chunks go now, with the header
                    transfer._advance(True, self.chunk, self.window)
            self._active.append(transfer)
            if wake and self._mover_idle:
                self._work_cv.notify()
        return transfer

    def add_callback(self, transfer: Transfer, callback: Callable[[Transfer], None]) -> None:
        with self._lock:
            if transfer._phase is not Phase.DONE:
                transfer._callbacks = (transfer._callbacks or []) + [callback]
                return
        callback(transfer)

    def _run_callbacks(self) -> None:
        if not self.ready:
            return
        with self._lock:
            due, self.ready = self.ready, []
        for transfer in due:
            for callback in transfer._callbacks or ():
                callback(transfer)
            transfer._callbacks = None

    # -- progress (under the lock) --------------------------------------------------
    def _progress(self) -> bool:
        changed = False
        now = None
        chunk, window = self.chunk, self.window
        for transfer in list(self._active):
            channel = transfer._channel
            head = channel is None or channel[0] is transfer
            if transfer._advance(head, chunk, window):
                changed = True
            if head and channel is not None and transfer._out_of_channel():
                channel.popleft()
                transfer._channel = None
            if transfer._phase is Phase.DONE:
                self._active.remove(transfer)
                continue
            engine = transfer.state.engine
            departed = ShutdownError("this rank's process set was removed") if engine is None else engine.departed()
            if departed is not None:
                now = time.monotonic() if now is None else now
                since = self._departed_since.setdefault(id(transfer.state), now)
                if now - since >= _DEPARTED_GRACE_SECONDS:
                    self._fail(transfer, departed)
                    changed = True
        if changed and self._sleepers:
            self._done_cv.notify_all()
        return changed

    def _fail(self, transfer: Transfer, why: BaseException) -> None:
        peers = getattr(why, "peers", [])
        error = ShutdownError(f"{transfer.describe()} cannot finish: {why}", peers=peers)
        if transfer.kind is Direction.RECV:  # a send cannot be taken back; its requests are let go
            for request in [transfer._first, *transfer._inflight]:
                if request is not None:
                    try:
                        request.Cancel()
                    except MPI.Exception:
                        pass
        transfer._inflight.clear()
        transfer._finish(error)
        if transfer in self._active:
            self._active.remove(transfer)
        channel = transfer._channel
        if channel is not None and transfer in channel:
            channel.remove(transfer)
        transfer._channel = None

    def poll(self) -> None:
        """One round of progress, unless another thread is making it right now."""
        if self._lock.acquire(blocking=False):
            try:
                self._progress()
            finally:
                self._lock.release()
            self._run_callbacks()

    def wait_for(self, transfer: Transfer) -> None:
        """Drive progress until ``transfer`` is done: spinning for a moment (a reply usually comes
        within microseconds), then on growing sleeps that the mover's completions cut short."""
        spin_end, delay = None, 0.0
        with self._lock:
            self._waiters += 1
        try:
            while True:
                with self._lock:
                    if transfer._phase is Phase.DONE:
                        return
                    if self._progress():
                        spin_end, delay = None, 0.0
                        continue
                    now = time.perf_counter()
                    if spin_end is None:
                        spin_end = now + _SPIN_SECONDS
                    if now < spin_end:
                        continue  # the lock is let go between tries: other threads submit meanwhile
                    self._sleepers += 1
                    self._done_cv.wait(delay)
                    self._sleepers -= 1
                    delay = min(max(delay * 2, 5e-5), 1e-3)
        finally:
            with self._lock:
                self._waiters -= 1
                if not self._waiters and self._active and self._mover_idle:
                    self._work_cv.notify()  # transfers still in flight: the mover takes them on
            self._run_callbacks()

    def _run(self) -> None:
        delay = 0.0
        while True:
            with self._lock:
                while (not self._active or self._waiters) and not self._closing:
                    self._mover_idle = True
                    self._work_cv.wait()
                self._mover_idle = False
                if self._closing:
                    return
                moved = self._progress()
            self._run_callbacks()
            if moved:
                delay = 0.0
                time.sleep(0)
            else:
                delay = min(max(delay * 2, 2e-5), 1e-3)
                time.sleep(delay)

    # -- ending -------------------------------------------------------------------------
    def close_set(self, state: Any, why: BaseException) -> None:
        """Fail the transfers of ``state``'s set (it is being stopped)."""
        with self._lock:
            for transfer in [t for t in self._active if t.state is state]:
                self._fail(transfer, why)
            self._departed_since.pop(id(state), None)
            self._done_cv.notify_all()
        self._run_callbacks()

    def stop(self) -> None:
        with self._lock:
            self._closing = True
            self._work_cv.notify()
        self._thread.join(timeout=5.0)


_mover: Optional[_Mover] = None
_mover_lock = threading.Lock()


def _get_mover() -> _Mover:
    global _mover
    if _mover is None and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        raise InvalidArgumentError("point-to-point transfers need MPI initialized with MPI_THREAD_MULTIPLE (they "
                                   "run beside the engine thread); leave mpi4py.rc.thread_level at its default")
    with _mover_lock:
        if _mover is None:
            _mover = _Mover()
        return _mover


def close_set(state: Any) -> None:
    """The set's engine is stopping on this rank: its transfers in flight end."""
    mover = _mover
    if mover is not None:
        mover.close_set(state, ShutdownError("mtrain shut down on this rank while this transfer was in flight"))


def stop() -> None:
    """Every set is stopping (``shutdown()``): end the mover thread, before MPI goes."""
    global _mover
    with _mover_lock:
        mover, _mover = _mover, None
    if mover is not None:
        mover.stop()


# -- checks and entry points ---------------------------------------------------------

def check_peer(state: Any, peer: Any, what: str, this_rank: int) -> int:
    """``peer`` (a global rank) as an int, refused with a clear error when it cannot be one."""
    if isinstance(peer, bool) or not isinstance(peer, (int, np.integer)):
        raise InvalidArgumentError(f"{what} must be an integer rank, got {peer!r}")
    peer = int(peer)
    if peer == this_rank:
        raise InvalidArgumentError(f"{what} {peer} is this rank: a rank cannot send to or receive from itself")
    if peer not in state.ranks:
        where = "the job" if state.id == 0 else f"process set {state.id}"
        raise InvalidArgumentError(f"{what} {peer} is not a rank of {where} (ranks {_ranks_text(state.ranks)}); "
                                   "give a global rank of the set")
    return peer


def _ranks_text(ranks: "list[int]") -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 3:
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


_tag_ub: Optional[int] = None


def _tag_upper_bound() -> int:
    """MPI's largest tag (an attribute of COMM_WORLD alone; communicators split from it lack it)."""
    global _tag_ub
    if _tag_ub is None:
        _tag_ub = int(MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767)
    return _tag_ub


def check_tag(tag: Any) -> int:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise InvalidArgumentError(f"tag must be an integer, got {tag!r}")
    upper = _tag_upper_bound()
    if not 0 <= int(tag) <= (upper - 1) // 2:
        raise InvalidArgumentError(f"tag {int(tag)} is out of range: tags go from 0 to {(upper - 1) // 2}")
    return int(tag)


def _checked_array(array: Any, what: Direction) -> Any:
    """``array`` if a transfer takes it: a NumPy array, or a CuPy one (staged through the host)."""
    if is_device_array(array):
        return array
    if isinstance(array, np.generic):
        array = np.asarray(array)
    if not isinstance(array, np.ndarray):
        raise TypeError(f"{what.value} takes a numpy.ndarray (or a cupy.ndarray), got {type(array).__name__}")
    if array.dtype.hasobject:
        raise TypeError(f"{what} cannot move an array of Python objects; use broadcast_object/allgather_object")
    return array


def _device_to_host(array: Any) -> np.ndarray:
    """A device array's values in host memory, once the work queued before on the legacy default
    stream (where the runtime's device work goes, and the framework bridges order theirs) is done."""
    import cupy
    with cupy.cuda.Device(array.device.id):
        return array.get(stream=cupy.cuda.Stream.null)


def _host_to_device(array: Any, host: np.ndarray) -> None:
    """``host``'s values into a device array, on the legacy default stream (blocking: done when it returns)."""
    import cupy
    with cupy.cuda.Device(array.device.id):
        null = cupy.cuda.Stream.null
        if array.flags.c_contiguous:
            array.set(host.reshape(array.shape), stream=null)
        else:
            with null:
                array[...] = cupy.asarray(host.reshape(array.shape))
        null.synchronize()


def start_send(state: Any, array: Any, dest: Any, tag: Any = 0, wake: bool = True) -> Transfer:
    """Start sending ``array`` to global rank ``dest`` of the set whose state is ``state``. A CuPy
    array is copied to the host first (here, before this returns: it may be changed at once)."""
    array = _checked_array(array, Direction.SEND)
    dest = check_peer(state, dest, "send: dest", state.global_rank)
    tag = check_tag(tag)
    transfer = Transfer(Direction.SEND, state, dest, tag, array, _get_mover())
    # A copy only when it is not contiguous host memory already.
    transfer._buffer = np.ascontiguousarray(array) if isinstance(array, np.ndarray) else _device_to_host(array)
    return transfer._mover.start(transfer, wake)


def start_recv(state: Any, array: Any, source: Any, tag: Any = 0, wake: bool = True) -> Transfer:
    """Start receiving into ``array`` from global rank ``source`` (a CuPy array through a host buffer)."""
    array = _checked_array(array, Direction.RECV)
    if isinstance(array, np.ndarray) and not array.flags.writeable:
        raise InvalidArgumentError("recv writes into its array, which is read-only; pass a writable array")
    source = check_peer(state, source, "recv: source", state.global_rank)
    tag = check_tag(tag)
    transfer = Transfer(Direction.RECV, state, source, tag, array, _get_mover())
    if not (isinstance(array, np.ndarray) and array.flags.c_contiguous):
        transfer._buffer = np.empty(array.shape, array.dtype)
        transfer._land = True
    return transfer._mover.start(transfer, wake)
