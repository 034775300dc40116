"""mtrain.ray's user-facing errors (importable without Ray)."""
from __future__ import annotations

INSTALL_HINT = "pip install 'mtrain[ray]'"


class RayNotAvailable(ImportError):
    """Ray is not installed in this environment."""


class RayClusterUnreachable(ConnectionError):
    """No Ray cluster answered at the address tried."""


def ray_not_available(error: BaseException) -> RayNotAvailable:
    return RayNotAvailable(f"mtrain.ray needs Ray, which cannot be imported here ({error}): {INSTALL_HINT}")
