"""Elastic state: what a training loop commits, restores and syncs (Horovod's ``State`` API).

``commit()`` keeps a copy of the state in memory and, in an elastic job, writes it to
this host's snapshot (so the next generation, on a new host set, can resume from it),
then checks whether the driver has a new host set.  All ranks commit at the same
points, so the check is a collective and every rank raises ``HostsUpdatedInterrupt``
at the same commit.
"""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import numpy as np

import mtrain.ringreduce as rr
from mtrain.ringreduce import HorovodInternalError  # noqa: F401  (re-exported: Horovod's name)

from . import job, snapshot

_HOST_UPDATES_OP = "mtrain.elastic.host_updates"


class HostsUpdatedInterrupt(RuntimeError):
    """The host set changed: every rank stops at the same commit (as Horovod's).

    ``skip_sync``: Horovod skips the state sync when hosts were only removed.  mtrain
    starts a new process set for every host set, so its ranks always sync.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the elastic job's host set changed")
        self.skip_sync = skip_sync


class State:
    """The base of every elastic state.

    Subclasses implement ``save`` (copy the current values aside), ``restore`` (put
    the copies back), ``sync`` (make every rank's values rank 0's) and, to be
    snapshotted, ``committed_values()`` / ``load_committed(values)``.
    """

    def __init__(self, bcast_object: "Callable[..., Any] | None" = None,
                 get_rank: "Callable[[], int] | None" = None) -> None:
        self._bcast_object = bcast_object or rr.broadcast_object
        self._get_rank = get_rank or rr.rank
        self._reset_callbacks: "list[Callable[[], None]]" = []
        self._commit_number = -1  # the last commit's number (-1: none yet)

    # --- Horovod's API -----------------------------------------------------------------------
    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Functions to call after the host set changed and the state was synced."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: Any = None, update_res: Any = None) -> None:
        """Horovod's driver notification; mtrain's ranks read the host-set version instead."""

    def commit(self) -> None:
        """Keep the current state (in memory and, in an elastic job, in this host's snapshot),
        then check for a new host set.  Collective: every rank commits at the same points."""
        self._prepare_commit()
        self.save()
        self._commit_number += 1
        if job.is_elastic():
            self._write_snapshot()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank when any rank's host has news."""
        if not job.is_elastic():
            return  # no driver publishes host sets: nothing can change (and no rank communicates)
        mine = np.array([1 if job.hosts_updated_here() else 0], dtype=np.int32)
        agreed = rr.allreduce(mine, op=rr.Max, name=_HOST_UPDATES_OP)
        if int(agreed[0]):
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """Called by ``on_reset`` before the reset callbacks (nothing by default)."""

    # --- what a snapshot holds ----------------------------------------------------------------
    def _prepare_commit(self) -> None:
        """Collective work every rank does before ``save`` in a commit (nothing by default)."""

    def committed_values(self) -> Any:
        """The values ``save`` set aside, picklable (the snapshot's payload)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be snapshotted: implement committed_values()")

    def load_committed(self, values: Any) -> None:
        """Take `values` (another rank's ``committed_values()``) as the committed state and restore it."""
        raise NotImplementedError(f"{type(self).__name__} cannot be snapshotted: implement load_committed()")

    @property
    def commit_number(self) -> int:
        """How many commits this job made before the current one, counting all generations (-1: none)."""
        return self._commit_number

    @commit_number.setter
    def commit_number(self, number: int) -> None:
        """Set by a new generation's start: the number of the commit it resumed from."""
        self._commit_number = number

    def _write_snapshot(self) -> None:
        # Every rank holds the same committed state: one writer per host is enough.
        if rr.local_rank() != 0:
            return
        snapshot.write(job.state_folder(), snapshot.new_header(self._commit_number, rr.size()), self.committed_values(),
                       job.secret())


class ObjectState(State):
    """Plain Python attributes, synced by broadcasting the committed values from rank 0.

    ``ObjectState(epoch=0, batch=0)`` (Horovod's leading ``bcast_object, get_rank`` are
    optional here).
    """

    def __init__(self, bcast_object: "Callable[..., Any] | None" = None,
                 get_rank: "Callable[[], int] | None" = None, **kwargs: Any) -> None:
        self._saved_state = copy.deepcopy(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: copy.deepcopy(getattr(self, name)) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, copy.deepcopy(value))  # later changes never reach the commit

    def committed_values(self) -> Any:
        return {"objects": self._saved_state}

    def load_committed(self, values: Any) -> None:
        self._saved_state = dict(values["objects"])
        self.restore()
