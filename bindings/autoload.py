"""torch's out-of-tree backend autoload: inside an `mtrain run` job, ``import torch`` registers the
``torch.distributed`` backend "mtrain", so ``init_process_group("mtrain")`` and Lightning's
``DDPStrategy(process_group_backend="mtrain")`` work without ``import mtrain.distributed``.

torch calls every entry point of the group "torch.backends" at the end of ``import torch``
(unless TORCH_DEVICE_BACKEND_AUTOLOAD=0); pyproject.toml declares ours. It runs in every Python
that imports torch in this environment, so it must cost nothing outside a job: it reads one
environment variable and returns. Inside a job it only names the backend: the creator imports
``mtrain.distributed`` (and so the runtime, which starts MPI) when torch first makes an "mtrain"
group, not at ``import torch``.
"""
from __future__ import annotations

import os
from typing import Any

# mtrain.common.records.job_layout.ENV_JOB_FILE, which `mtrain run` sets for every rank; spelled
# out because importing the launcher's records would cost every `import torch` milliseconds
# (tests/unit/test_autoload.py keeps the two equal).
JOB_VARIABLE = "MTRAIN_JOB_FILE"
BACKEND = "mtrain"  # mtrain.distributed.BACKEND, kept equal by the same test


def in_mtrain_job() -> bool:
    """True in a rank that `mtrain run` started."""
    return bool(os.environ.get(JOB_VARIABLE))


def create_group(options: Any, backend_options: Any = None) -> Any:
    """torch's creator for "mtrain" groups, which imports the backend on first use."""
    from mtrain.distributed.groups import create_group as create

    return create(options, backend_options)


def register_torch_backend() -> None:
    """The "torch.backends" entry point: register "mtrain" with torch.distributed in an mtrain job."""
    if not in_mtrain_job():
        return
    import torch.distributed as dist

    if not dist.is_available() or hasattr(dist.Backend, BACKEND.upper()):  # registered already
        return
    dist.Backend.register_backend(BACKEND, create_group, extended_api=True, devices=["cpu"])
