"""Elastic training: what the launcher's elastic driver (launcher/elastic/driver.py) and the ranks'
``hvd.elastic`` (bindings/elastic/) share.

An MPI world cannot shrink or grow, so an elastic job runs as generations: the driver starts one
mpirun per host set.  Ranks keep every `state.commit()` in memory and in a snapshot on their
host; a new generation restores the newest commit any rank holds.

    record          written by                              read by
    HostUpdates     the launcher (through the SSH agents)   hvd.elastic in the ranks (host-set version)
    ElasticResume   rank 0 of an elastic generation         the supervisor (the reset's log line)
"""
import os

from mtrain.common.private import PrivatePathError, read_private, write_private
from mtrain.common.records.base import Record
from mtrain.common.records.marker import MarkerRecord

ENV_ELASTIC = "MTRAIN_ELASTIC"                      # "1" in the ranks of an elastic job
ENV_ELASTIC_STATE_DIR = "MTRAIN_ELASTIC_STATE_DIR"  # template, "{host}": this host's snapshot folder
ENV_ELASTIC_UPDATES = "MTRAIN_ELASTIC_UPDATES"      # template, "{host}": file with the host-set version
ENV_ELASTIC_VERSION = "MTRAIN_ELASTIC_VERSION"      # the host-set version this generation started with
RESET_EXIT_STATUS = 75   # every rank exits with it to ask the driver for the next generation
# A random key per job that signs the snapshots (bindings/elastic/snapshot.py), so that a new
# generation loads only what this job wrote.  It reaches the ranks in their environment (mpirun
# forwards it by name from its own, which only this user can read): never on a command line.
ENV_JOB_SECRET = "MTRAIN_JOB_SECRET"
RESUME_MARKER = b"@@mtrain-elastic-resumed@@ "


def new_job_secret() -> str:
    return os.urandom(32).hex()


def updates_file(job_file: str) -> str:
    """The host-update file template that goes with a job-file template."""
    return job_file[:-len(".json")] + ".updates" if job_file.endswith(".json") else job_file + ".updates"


def host_path(template: str, host: "str | None" = None) -> str:
    """A per-host path from one of the templates above ("{host}": this host's name)."""
    import socket
    return template.format(host=host or socket.gethostname())


class HostUpdates(Record):
    """The host-set version, kept in a file on each host (written by the launcher's side)."""

    version: int

    def write(self, path: str) -> None:
        # The bare number, not JSON: hvd.elastic polls it every step.
        write_private(path, str(self.version).encode())

    @staticmethod
    def read(path: str) -> int:
        """The version in `path` (0 when there is none yet); PrivatePathError when it is not ours."""
        try:
            return int(read_private(path).decode().strip() or 0)
        except PrivatePathError:
            raise
        except (OSError, ValueError):
            return 0


class ElasticResume(MarkerRecord):
    """Rank 0 of a new generation says, on stderr, from which commit training resumed."""

    marker = RESUME_MARKER

    commit: int   # the commit number restored (-1: none, training starts afresh)
    size: int     # how many ranks this generation has
