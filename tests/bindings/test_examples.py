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
