"""What an elastic rank learns from its environment (the driver's side is mtrain.common.records.elastic).

Every value is read when it is needed, not at import: a rank's environment is the
source of truth, and tests point each rank at its own folders.
"""
from __future__ import annotations

import os

from mtrain.common.private import private_folder
from mtrain.common.records import elastic as records


def is_elastic() -> bool:
    """Whether this rank belongs to a generation of an elastic job ($MTRAIN_ELASTIC)."""
    return os.environ.get(records.ENV_ELASTIC, "") not in ("", "0")


def state_folder() -> str:
    """This host's snapshot folder (created if needed)."""
    template = os.environ.get(records.ENV_ELASTIC_STATE_DIR)
    if not template:
        raise RuntimeError(f"{records.ENV_ELASTIC} is set but {records.ENV_ELASTIC_STATE_DIR} is not: "
                           "elastic ranks need a snapshot folder; start the job with `mtrain run --min-np ...`")
    folder = records.host_path(template)
    # /dev/shm/mtrain-elastic-<job>/<host>: both made 0700 by us, or refused (see bindings/common/private.py).
    return private_folder(folder, parents=1)


def secret() -> bytes:
    """The job's key that signs its snapshots (the launcher's, in this rank's environment only)."""
    value = os.environ.get(records.ENV_JOB_SECRET, "")
    if not value:
        raise RuntimeError(f"{records.ENV_ELASTIC} is set but {records.ENV_JOB_SECRET} is not: elastic ranks need "
                           "the job's key to sign their snapshots; start the job with `mtrain run --min-np ...`")
    return value.encode()


def started_version() -> int:
    """The host-set version this generation started with."""
    try:
        return int(os.environ.get(records.ENV_ELASTIC_VERSION, "0") or 0)
    except ValueError:
        return 0


def current_version() -> int:
    """The host-set version the driver has published on this host (the start version when none)."""
    template = os.environ.get(records.ENV_ELASTIC_UPDATES)
    if not template:
        return started_version()
    return records.HostUpdates.read(records.host_path(template))


def hosts_updated_here() -> bool:
    """Whether the driver has a newer host set than the one this generation runs on."""
    return current_version() > started_version()
