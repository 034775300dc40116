"""Horovod's variables alone, under plain mpirun, set the runtime (ours win where both are set)."""
import numpy as np

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from tests.mpi.harness import mpi_test

HOROVOD_ONLY = {"HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_FUSION_THRESHOLD": "2097152",
                "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "45",
                "HOROVOD_CYCLE_TIME": "2.5", "MTRAIN_CYCLE_TIME_MS": "4"}


@mpi_test(nps=(2,), env=HOROVOD_ONLY)
def test_horovod_variables_set_the_engine_and_a_cache_of_zero_caches_nothing():
    engine = runtime.current().engine
    config = engine.config
    assert (config.fusion_threshold_bytes, config.cache_capacity, config.stall_shutdown_s) == (2097152, 0, 45.0)
    assert config.cycle_time_s == 0.004  # MTRAIN_CYCLE_TIME_MS wins over HOROVOD_CYCLE_TIME
    assert engine.timelines.mark_cycles is True
    n = rr.size()
    for step in range(3):  # the same name every step: with a cache it would get a bit after the first
        got = rr.allreduce(np.arange(5, dtype=np.float64) + rr.rank() + step, op=rr.Sum, name="grad.layer1")
        assert got.tolist() == (np.arange(5) * n + n * (n - 1) / 2 + n * step).tolist()
    assert engine.cache.next_bit == 0 and not engine.cache.holds("grad.layer1")
