"""mtrain.ray: Horovod's RayExecutor on a Ray cluster, with ranks that MPI starts through one
actor per node (no SSH between nodes).  See docs/ray.md.

    from mtrain.ray import RayExecutor
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=60), num_workers=4)
    executor.start()
    results = executor.run(train, args=[config])   # one result per rank, in rank order
    executor.shutdown()

Importing this package does not import Ray (the ranks import mtrain.ray.worker); the names
below do, and say `pip install 'mtrain[ray]'` when Ray is missing.
"""
from __future__ import annotations

from mtrain.launcher.tasks.call_service import RankFailed
from mtrain.ray.errors import RayClusterUnreachable, RayNotAvailable

__all__ = ["RayExecutor", "RaySettings", "RankFailed", "RayNotAvailable", "RayClusterUnreachable"]


def __getattr__(name: str):
    if name in ("RayExecutor", "RaySettings"):
        from mtrain.ray import runner  # imports Ray (RayNotAvailable, one line, when it cannot)
        return getattr(runner, name)
    raise AttributeError(f"module 'mtrain.ray' has no attribute {name!r}")
