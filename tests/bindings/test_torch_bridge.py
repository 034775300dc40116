"""The one torch-NumPy bridge (mtrain.torch.bridge), which the Horovod API and the DDP backend
both cross: views share the tensor's memory, and every dtype comes back as it went in."""
import numpy as np

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


@mpi_test(nps=(1,))
def test_round_trips_and_shared_memory():
    from mtrain.distributed import process_group
    from mtrain.torch import bridge
    assert process_group.real_view is bridge.real_view and process_group.to_tensor is bridge.to_tensor
    tensor = torch.arange(6, dtype=torch.float32)
    view = bridge.numpy_view(tensor)
    view[0] = 42.0  # a view, not a copy: an in-place result lands in the tensor
    assert tensor[0].item() == 42.0
    grad = torch.ones(3, requires_grad=True)
    assert np.array_equal(bridge.numpy_view(grad), np.ones(3, dtype=np.float32))
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        pass
    else:
        bf = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
        array = bridge.host_array(bf)
        assert array.dtype.name == "bfloat16" and array.shape == (3,)
        back = bridge.from_numpy(array)
        assert back.dtype == torch.bfloat16 and torch.equal(back, bf)
    z = torch.tensor([1 + 2j, -3 + 0.5j], dtype=torch.complex64)
    pairs = bridge.real_view(z)
    assert pairs.dtype == np.float32 and pairs.shape == (2, 2)
    assert torch.equal(bridge.to_tensor(pairs.reshape(-1), z.dtype), z)
    frozen = np.arange(4.0)
    frozen.flags.writeable = False
    thawed = bridge.to_tensor(frozen)  # torch refuses read-only memory: a copy
    assert torch.equal(thawed, torch.arange(4.0, dtype=torch.float64))
