"""The README's first command: examples/train_torch.py at np=2 learns the digits."""
import re
import sys

from tests.bindings.requires import require
from tests.mpi.harness import launch

require("torch", "pip install '.[torch]'")
require("sklearn", "pip install '.[examples]'")


def test_train_torch_example_reaches_90_percent_at_np2():
    result = launch(2, [sys.executable, "examples/train_torch.py", "--epochs", "5"], timeout=180)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    found = re.findall(r"final test accuracy: ([0-9.]+)", result.stdout)
    assert len(found) == 1, f"rank 0 alone prints the final accuracy once:\n{result.stdout[-3000:]}"
    assert float(found[0]) >= 0.9, result.stdout[-3000:]
    # Rank 0's line per epoch: the averaged loss and the job's throughput.
    rates = re.findall(r"^epoch +\d+: train loss [0-9.]+ .* (\d+) samples/s$", result.stdout, re.MULTILINE)
    assert len(rates) == 5 and all(int(rate) > 0 for rate in rates), result.stdout[-3000:]


def test_horovod_features_example_at_np3():
    """Process sets, join with uneven shards, sparse embeddings, SyncBatchNorm, a grouped
    all-reduce and a gradient through an all-reduce, in one Horovod program."""
    result = launch(3, [sys.executable, "examples/horovod_features.py"], timeout=240)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    # Rank r holds a shard proportional to r + 1: rank 2 trains longest and joins last.
    for rank in range(3):
        assert re.search(rf"rank {rank}: \d+ batches .* the last rank to join was 2", result.stdout), result.stdout
    batches = [int(n) for n in re.findall(r"rank \d: (\d+) batches", result.stdout)]
    assert len(set(batches)) == 3, f"the shards are uneven, so are the batch counts: {batches}"
    found = re.findall(r"evaluated by ranks \[0, 2\]: .* final test accuracy: ([0-9.]+)", result.stdout)
    assert len(found) == 1, f"the even ranks' set reports once:\n{result.stdout[-3000:]}"
    assert float(found[0]) >= 0.75, result.stdout[-3000:]
    epochs = re.findall(r"^epoch (\d+): rank 0 loss [0-9.]+, (\d+) samples/s on rank 0$", result.stdout, re.MULTILINE)
    assert [int(e) for e, _ in epochs] == [1, 2, 3, 4] and all(int(r) > 0 for _, r in epochs), result.stdout[-3000:]
