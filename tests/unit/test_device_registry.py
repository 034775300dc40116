"""How device arrays and frameworks plug into the runtime, without a GPU: the backend
registry (ringreduce/transport/backend.py) and the device-bound hooks (ringreduce/transport/cuda.py)."""
import sys
import types

import numpy as np
import pytest

from mtrain.ringreduce.transport import backend, cuda


def test_cupy_arrays_are_registered_by_the_cuda_module():
    assert backend.DEVICE_BACKENDS["cupy"] is cuda.backend


def test_backend_for_dispatches_on_the_arrays_package(monkeypatch):
    fake_array_type = type("ndarray", (), {"__module__": "fakedev._core"})
    seen = []
    monkeypatch.setitem(backend.DEVICE_BACKENDS, "fakedev", lambda array: seen.append(array) or "fake-backend")
    array = fake_array_type()
    assert backend.is_device_array(array) and not backend.is_device_array(np.zeros(2))
    assert backend.backend_for(array) == "fake-backend" and seen == [array]
    assert backend.backend_for(np.zeros(2)).name == "numpy"
    with pytest.raises(TypeError, match="numpy.asarray"):
        backend.backend_for([1.0, 2.0])


def test_device_hooks_follow_the_gpu_init_binds(monkeypatch):
    used = []
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda device_id: types.SimpleNamespace(use=lambda: used.append(device_id)),
        driver=types.SimpleNamespace(ctxGetCurrent=lambda: 0)))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(cuda, "gpu_count", lambda: 4)
    monkeypatch.setattr(cuda, "_device_hooks", [])
    monkeypatch.setattr(cuda, "_bound_device", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    early = []
    cuda.on_device_bound(early.append)
    assert early == [], "nothing is bound before init()"
    assert cuda.bind_device(local_rank=6) == 2
    assert used == [2] and early == [2]
    late = []
    cuda.on_device_bound(late.append)  # a binding imported after init() learns the GPU at once
    assert late == [2]


def test_no_gpu_means_no_binding_and_no_hook_call(monkeypatch):
    monkeypatch.setattr(cuda, "gpu_count", lambda: 0)
    monkeypatch.setattr(cuda, "_device_hooks", [])
    monkeypatch.setattr(cuda, "_bound_device", None)
    calls = []
    cuda.on_device_bound(calls.append)
    assert cuda.bind_device(local_rank=1) is None and calls == []


@pytest.mark.parametrize("installed", [True, False])
def test_cuda_built_says_whether_the_install_has_the_gpu_path(monkeypatch, installed):
    import importlib.util

    from mtrain import build_info
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: (object() if installed else None) if name == "cupy" else real_find_spec(name, *a))
    assert build_info.cuda_built() is installed
    assert cuda.cupy_installed() is installed
    if not installed:
        assert cuda.gpu_count() == 0
