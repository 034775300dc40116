"""``torch.distributed`` backend "mtrain": torch collectives and DDP on mtrain's engine and ring.
``import mtrain.distributed`` registers it. What it supports and how it is built: docs/ddp-backend.md.
"""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

import mtrain.ringreduce as rr

from .errors import ArgumentError
from .groups import create_group
from .process_group import BACKEND, ProcessGroupMtrain, monitored_barrier

__all__ = ["BACKEND", "ArgumentError", "ProcessGroupMtrain", "init_process_group", "monitored_barrier", "register"]


def register() -> None:
    """Register the "mtrain" backend with torch.distributed (done on ``import mtrain.distributed``)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, create_group, extended_api=True, devices=["cpu"])


def init_process_group(timeout: Optional[timedelta] = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group("mtrain")`` for ranks started by mpirun / mtrain run.

    Rank and world size come from the runtime. The rendezvous address is
    ``MASTER_ADDR``/``MASTER_PORT`` when both are set; otherwise rank 0 picks a
    free port and sends its address to every rank.
    """
    if not rr.is_initialized():
        rr.init()
    if "init_method" not in kwargs and "store" not in kwargs:
        if not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
            address = None
            if rr.rank() == 0:
                host = "127.0.0.1" if rr.cross_size() == 1 else socket.gethostname()
                with socket.socket() as s:
                    s.bind(("", 0))
                    address = f"tcp://{host}:{s.getsockname()[1]}"
            kwargs["init_method"] = rr.broadcast_object(address, 0, name="mtrain.distributed.rendezvous")
    if timeout is not None:
        kwargs["timeout"] = timeout
    hook = sys.excepthook
    dist.init_process_group(BACKEND, rank=rr.rank(), world_size=rr.size(), **kwargs)
    # torch wraps the excepthook and points sys.stderr at a buffer while the previous hook runs;
    # mtrain's hook aborts the job from inside, so the traceback would never be printed.
    sys.excepthook = hook


register()
