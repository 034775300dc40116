"""mtrain.ray's two setup mistakes, each one line: Ray not installed, no cluster at the address."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

PYTHON = sys.executable
# Python with `import ray` failing as it does where Ray is not installed.
HIDE_RAY = ("import sys\n"
            "class NoRay:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name == 'ray' or name.startswith('ray.'):\n"
            "            raise ModuleNotFoundError(\"No module named 'ray'\", name='ray')\n"
            "sys.meta_path.insert(0, NoRay())\n")


def _need_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        if os.environ.get("CI"):  # (CI installs the extra: these tests must run there)
            pytest.fail("needs Ray, which CI installs: pip install 'mtrain[ray]'")
        pytest.skip("needs Ray: pip install 'mtrain[ray]'")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def test_without_ray_the_error_names_the_extra_to_install():
    done = _python(HIDE_RAY + "import mtrain.ray\nfrom mtrain.ray import RayExecutor\n")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mtrain.ray.errors.RayNotAvailable: mtrain.ray needs Ray"), done.stderr
    assert "pip install 'mtrain[ray]'" in last


def test_the_rank_side_needs_no_ray():
    done = _python(HIDE_RAY + "from mtrain.ray import worker, RayNotAvailable\n"
                   "worker.create_executable(dict, [], {'a': 1})\nprint(worker.call_with_executable(len))\n")
    assert (done.returncode, done.stdout) == (0, "1\n"), done.stderr


def test_no_cluster_at_the_address_is_one_line_naming_it():
    _need_ray()
    with socket.socket() as sock:  # a port where nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = _python("from mtrain.ray import RayExecutor\n"
                   "RayExecutor(RayExecutor.create_settings(), num_workers=1).start()\n",
                   RAY_ADDRESS=f"127.0.0.1:{port}")
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"mtrain.ray.errors.RayClusterUnreachable: mtrain.ray: no Ray cluster reachable at "
                           f"127.0.0.1:{port} ("), done.stderr[-3000:]


def test_bad_worker_counts_are_refused_before_anything_starts():
    _need_ray()
    from mtrain.ray import RayExecutor
    with pytest.raises(ValueError, match="either num_workers or num_hosts"):
        RayExecutor(num_workers=2, num_hosts=2)
    with pytest.raises(ValueError, match="num_workers must be a positive integer"):
        RayExecutor(num_workers=0)
    with pytest.raises(ValueError, match="no elastic RayExecutor"):
        RayExecutor(min_workers=1, max_workers=2)
