"""Skip a test module whose framework is not installed, except in CI (CI=true), where that is a failure."""
import importlib.util
import os

import pytest


def require(module: str, install: str) -> None:
    """Call at module level: skip (or, under CI, fail) when ``module`` cannot be imported."""
    if importlib.util.find_spec(module) is not None:
        return
    message = f"{module} is not installed: {install}"
    if os.environ.get("CI", "").lower() in ("true", "1"):
        pytest.fail(f"{message} (CI must run these tests)", pytrace=False)
    pytest.skip(message, allow_module_level=True)
