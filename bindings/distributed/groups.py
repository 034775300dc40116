"""Making the mtrain backend's groups: the creator torch calls for ``init_process_group("mtrain")``
and ``new_group(backend="mtrain")``. A subgroup runs on a private process set of the runtime
(docs/ddp-backend.md)."""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

import mtrain.ringreduce as rr

from .process_group import ProcessGroupMtrain

__all__ = ["create_group"]


def create_group(options: Any, backend_options: Any = None) -> ProcessGroupMtrain:
    """The creator torch calls for ``init_process_group("mtrain")`` and ``new_group(backend="mtrain")``,
    on the group's members only (torch returns NON_GROUP_MEMBER on the others before it gets here)."""
    rank, size = options.group_rank, options.group_size
    members = [int(r) for r in (options.global_ranks_in_group or [])]
    if not rr.is_initialized():
        if members and len(members) < dist.get_world_size():
            # init() takes every rank of the job, and torch calls us on the members only.
            raise RuntimeError(f"an mtrain subgroup (ranks {members}) needs mtrain's runtime started on every "
                               "rank first: call mtrain.ringreduce.init() (or hvd.init()) on every rank before "
                               "new_group(backend='mtrain'), or make the default group mtrain")
        rr.init()
    process_set = rr.global_process_set
    if not members:  # the default group
        if (rank, size) != (rr.rank(), rr.size()):
            raise RuntimeError(f"torch.distributed says rank {rank} of {size}, but this process is mtrain rank "
                               f"{rr.rank()} of {rr.size()}: set RANK and WORLD_SIZE to the MPI rank and size "
                               "(or call mtrain.distributed.init_process_group(), which does)")
    else:
        if len(set(members)) != len(members) or any(not 0 <= r < rr.size() for r in members):
            raise RuntimeError(f"group {options.group_id!r} has ranks {members}; the mtrain job has distinct ranks "
                               f"0..{rr.size() - 1}")
        if len(members) != size or not 0 <= rank < size or members[rank] != rr.rank():
            raise RuntimeError(f"torch.distributed says this process is rank {rank} of group {options.group_id!r} "
                               f"(global ranks {members}), but it is mtrain rank {rr.rank()}: torch's global ranks "
                               "must be the MPI ranks (set RANK to the MPI rank)")
        if members != sorted(members):
            raise RuntimeError(f"group {options.group_id!r} lists its ranks out of order ({members}); the mtrain "
                               "backend orders a group's ranks as their global ranks (as new_group does)")
        if len(members) < rr.size():
            process_set = rr.private_process_set(members)
    return ProcessGroupMtrain(rank, size, str(options.group_id), process_set, members, options.store,
                              options.timeout)

