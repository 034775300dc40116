"""The per-gradient handle: mtrain.torch's in-place all-reduce of a contiguous CPU tensor returns
the runtime's op itself (one object per tensor). It must still behave as every handle does:
poll, synchronize (more than once), the op's error, the argument checks and their order."""
import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


@mpi_test(nps=(1, 2))
def test_one_object_handle_behaves_as_a_handle():
    import mtrain.ringreduce as rr
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    tensor = torch.arange(6, dtype=torch.float32) + 10 * me
    expected = sum(torch.arange(6, dtype=torch.float32) + 10 * r for r in range(n))
    handle = hvd.allreduce_async_(tensor, name="one", op=1)  # an int op: Sum, as Horovod takes it
    assert isinstance(handle, rr.Handle)
    while not hvd.poll(handle):
        pass
    assert hvd.synchronize(handle) is tensor
    assert hvd.synchronize(handle) is tensor  # a second wait returns the same result
    assert torch.equal(tensor, expected)
    with pytest.raises(TypeError, match="handle"):
        hvd.synchronize(object())
    with pytest.raises(ValueError, match="unsupported reduction op 42"):
        hvd.allreduce_async_(tensor, name="op42", op=42)
    with pytest.raises(TypeError, match="bool"):
        hvd.allreduce_async_(torch.ones(3, dtype=torch.bool), name="flags", op=hvd.Sum)
    # The same name twice in flight: the second submit fails, the first op is unharmed. Rank 0's
    # op is certainly still in flight: the others submit theirs only after its check (a plain MPI
    # message, apart from the runtime's communicators). Alone, a rank's op may already be done.
    if n > 1:
        from mpi4py import MPI
        if me == 0:
            first = hvd.allreduce_async_(tensor, name="twice", op=hvd.Sum)
            with pytest.raises(rr.InvalidArgumentError, match="twice"):
                hvd.allreduce_async_(torch.zeros(6), name="twice", op=hvd.Sum)
            for peer in range(1, n):
                MPI.COMM_WORLD.send("go", dest=peer, tag=7)
        else:
            assert MPI.COMM_WORLD.recv(source=0, tag=7) == "go"
            first = hvd.allreduce_async_(tensor, name="twice", op=hvd.Sum)
        assert torch.equal(hvd.synchronize(first), expected * n)
    # The runtime's own handle for a NumPy array: its result is the array.
    array = np.full(4, me + 1.0)
    assert rr.synchronize(rr.allreduce_async_(array, op=rr.Sum, name="numpy")) is array
    assert np.array_equal(array, np.full(4, n * (n + 1) / 2))
