"""JobLayout: what every rank is told about the job, so that plain torch.distributed and
tf.distribute programs find each other.

Written by the launcher once the preflight knows addresses and free ports (launcher/job/layout.py),
handed to each host through the gate or the environment, and read on each host by the rank
wrapper from a file (launcher/job/job_files.py).
"""
import json

from mtrain.common.private import PrivatePathError, read_private, write_private
from mtrain.common.records.base import Record

ENV_JOB_FILE = "MTRAIN_JOB_FILE"  # a path template: "{host}" stands for the host's name (launcher/job/job_files.py)
# A job started through Slurm: its layout (JobLayout.encode()), which the daemon's guard on each node
# writes at $MTRAIN_JOB_FILE there (launcher/job/slurm.py); srun passes mpirun's environment on.
ENV_JOB_LAYOUT = "MTRAIN_JOB_LAYOUT"


class JobLayout(Record):
    json_optional = ("gpu_per_rank", "interfaces")

    slots: tuple[int, ...]            # ranks per host, hosts in rank order
    master_addr: str                  # rank 0's address on the job's network
    master_port: int                  # free on rank 0's host (torch's env:// rendezvous)
    workers: tuple[str, ...]          # "address:port" per rank, ports free on each host (TF_CONFIG)
    gpu_per_rank: tuple[int, ...] = ()  # per host: GPUs to share one per local rank (empty: leave GPUs alone)
    interfaces: tuple[str, ...] = ()    # per host: its interface on the job's network ("" unknown)

    def write(self, path: str) -> None:
        # In the job's folder in /tmp (see bindings/common/private.py): mode 0600, never through a planted path.
        write_private(path, self.encode().encode())

    @staticmethod
    def read(path: str) -> "JobLayout | None":
        """The layout in `path`, None when there is none; PrivatePathError when it is not ours."""
        try:
            return JobLayout.decode(read_private(path).decode("utf-8"))
        except PrivatePathError:
            raise
        except (OSError, UnicodeDecodeError):
            return None

    def rank_environment(self, rank: int) -> "dict[str, str]":
        """The variables torchrun gives a rank, plus TF_CONFIG for tf.distribute."""
        host, first = 0, 0
        while rank >= first + self.slots[host]:
            first += self.slots[host]
            host += 1
        local_rank, world = rank - first, sum(self.slots)
        env = {"RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(self.slots[host]),
               "GROUP_RANK": str(host), "GROUP_WORLD_SIZE": str(len(self.slots)),
               "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world),
               "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port),
               # torchrun's run id: torch.distributed.is_torchelastic_launched() reads it, and so Lightning
               # picks its TorchElasticEnvironment, which takes ranks and MASTER_ADDR from the variables above.
               "TORCHELASTIC_RUN_ID": f"mtrain-{self.master_addr}-{self.master_port}",
               "TF_CONFIG": json.dumps({"cluster": {"worker": list(self.workers)},
                                        "task": {"type": "worker", "index": rank}})}
        if self.interfaces and self.interfaces[host]:
            env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = self.interfaces[host]
        if self.gpu_per_rank and self.gpu_per_rank[host] > 0:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank % self.gpu_per_rank[host])
        if len(set(self.slots)) == 1 and not any(self.gpu_per_rank):
            # Lightning's Trainer reads its defaults from PL_TRAINER_*: its devices="auto" counts one CPU
            # and num_nodes defaults to 1, where the job has slots-per-host ranks on each host. Lightning's
            # DDP needs the same number of ranks on every host (docs/trainers.md).
            env["PL_TRAINER_DEVICES"], env["PL_TRAINER_NUM_NODES"] = str(self.slots[0]), str(len(self.slots))
        return env
