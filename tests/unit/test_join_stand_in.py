"""What a joined rank stands in with (ringreduce/engine/join.py), without MPI."""
from __future__ import annotations

import threading
import time

import numpy as np

from mtrain.ringreduce.engine.join import stand_in  # (the package exports join(), the function)
from mtrain.ringreduce.core.ops import ReduceOp
from mtrain.ringreduce.core.requests import host_allreduce_signature


def test_a_stand_in_is_submitted_when_it_is_made():
    # Its submit time starts the timeline's NEGOTIATE span and the step meter's wait: left at 0,
    # both were as long as the machine's uptime on the joined rank.
    signature = host_allreduce_signature(np.zeros((3, 5), np.float32), ReduceOp.Sum, 1.0, 1.0)
    before = time.monotonic()
    request = stand_in("grad.3", signature, threading.Condition())
    assert before <= request.submitted <= time.monotonic()
    assert request.array.shape == (3, 5) and not request.array.any()
