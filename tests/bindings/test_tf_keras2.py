"""Keras 2 (tf_keras under ``TF_USE_LEGACY_KERAS=1``) through mtrain.tensorflow.keras and mtrain.keras,
in real ``mtrain run`` jobs at np 2 and 3: Horovod's Keras test patterns, one program (keras2_program.py)
checking them all, since TensorFlow's start-up dominates.

Each pattern follows Horovod 0.28's test/parallel/test_tensorflow2_keras.py (and test_tensorflow_keras.py)
and the code it exercises:

- DistributedOptimizer in compile/fit, new and legacy tf_keras optimizers, with BroadcastGlobalVariablesCallback
  and MetricAverageCallback: weights and averaged losses equal the NumPy rule (SGD on the ranks' mean
  gradient) — horovod/_keras/__init__.py create_distributed_optimizer, horovod/_keras/callbacks.py;
- from_config of the wrapped optimizer (test_from_config), also of a Keras 3 one; a legacy optimizer's get_gradients;
  the error for a TF1 optimizer;
- sparse_as_dense and sparse IndexedSlices gradients of an Embedding (test_sparse_as_dense);
- backward_passes_per_step with and without average_aggregated_gradients, with register_local_var, with an inf
  gradient in the first round (test_gradient_aggregation, ..._with_local_vars, test_grad_aggregation_with_inf_grad;
  horovod/tensorflow/gradient_aggregation_eager.py), and in fit;
- PartialDistributedOptimizer through mtrain.keras (test_partial_distributed_optimizer);
- BroadcastGlobalVariablesCallback with local variables (test_broadcast_global_variables_callback_with_local_vars),
  a local layer's optimizer slots staying local (legacy and new optimizers);
- LearningRateWarmupCallback and LearningRateScheduleCallback (test_train_model_lr_schedule), with Horovod's
  momentum correction (horovod/_keras/callbacks.py LearningRateScheduleCallbackImpl);
- load_model of models saved with a wrapped optimizer, custom_optimizers and custom_objects
  (horovod/tensorflow/keras/__init__.py load_model; test_tensorflow_keras.py test_load_model*).

Every rank's data differ, so an un-averaged gradient fails a check; each rank prints the checks it passed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bindings.requires import require
from tests.bindings.test_horovod_patterns import mtrain_run, rank_lines

require("tensorflow", "pip install '.[tensorflow]'")
require("tf_keras", "pip install '.[dev]' (tf-keras)")

PROGRAM = Path(__file__).resolve().parent / "keras2_program.py"


@pytest.mark.parametrize("np_", [2, 3], ids=lambda n: f"np{n}")
def test_horovod_keras2_patterns_under_tf_use_legacy_keras(np_: int) -> None:
    done = mtrain_run(["-np", str(np_), "-H", f"localhost:{np_}"], str(PROGRAM), [], timeout=240,
                      env_extra={"TF_USE_LEGACY_KERAS": "1", "OMPI_MCA_mpi_yield_when_idle": "1"})
    lines = rank_lines(done.stdout)
    reports, digests = [], []
    for rank in range(np_):
        found = [m for m in (re.fullmatch(r"rank \d+ checks (\d+) (.*)", line) for line in lines.get(rank, [])) if m]
        assert len(found) == 1, f"rank {rank} did not finish: {lines.get(rank)}\n{done.stderr[-3000:]}"
        reports.append((int(found[0].group(1)), found[0].group(2)))
        digests += [line for line in lines[rank] if line.startswith(f"rank {rank} digest ")]
    assert len(set(reports)) == 1, "the ranks ran different checks"
    names = set(reports[0][1].split(","))
    for pattern in ("fit.new.weights", "fit.legacy.metric_average", "from_config.legacy.reduces",
                    "get_gradients.legacy",
                    "from_config.keras3.reduces", "sparse_as_dense=False", "aggregation.inf", "aggregation.fit",
                    "partial.local2.var3", "broadcast.local.layer0", "broadcast.slots.new.local", "lr.schedule",
                    "lr.momentum_restored", "load_model.custom.reduces"):
        assert pattern in names, f"{pattern} was not checked: {sorted(names)}"
    assert len({d.split()[-1] for d in digests}) == 1 and len(digests) == np_, digests


_WITHOUT_TF_KERAS = """
import os, sys
sys.modules["tf_keras"] = None  # as if it were not installed
import keras
import mtrain.tensorflow.keras as hvd
assert hvd.callbacks.BroadcastGlobalVariablesCallback.__mro__[1] is keras.callbacks.Callback
hvd.DistributedOptimizer(keras.optimizers.SGD(0.1))
try:
    hvd.DistributedOptimizer(object())
except TypeError as error:
    print("error:", error)
print("legacy requested:", os.environ.get("TF_USE_LEGACY_KERAS"))
"""


@pytest.mark.parametrize("legacy", ["1", ""], ids=["TF_USE_LEGACY_KERAS=1", "unset"])
def test_without_tf_keras_keras3_alone_and_a_clear_error(legacy: str) -> None:
    """No tf_keras on the machine: importing works (also under TF_USE_LEGACY_KERAS=1, where the callbacks
    fall back to Keras 3's), Keras 3 optimizers wrap, anything else is one line saying tf_keras is missing."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    if legacy:
        env["TF_USE_LEGACY_KERAS"] = legacy
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TF_KERAS], capture_output=True, text=True, timeout=120,
                          env=env, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "got object; tf_keras is not installed, so only Keras 3 optimizers can be wrapped" in done.stdout, \
        done.stdout
