"""The autotuner's pieces without MPI: the optimiser, the setting space, the sample counting and rank 0's decisions."""
from __future__ import annotations

import numpy as np
import pytest

from mtrain.ringreduce.observe import autotune
from mtrain.ringreduce.observe.autotune import Knobs, Space, Tuner
from mtrain.ringreduce.observe.optim import BayesianOptimizer
from mtrain.common.settings import AutotuneConfig, EngineConfig


def optimise(f, bounds, samples: int, seed: int) -> "tuple[np.ndarray, float, list]":
    optimizer = BayesianOptimizer(bounds, noise=0.01, seed=seed)
    for _ in range(samples):
        x = optimizer.next_sample()
        optimizer.add_sample(x, f(x))
    best, score = optimizer.best()
    return best, score, optimizer.xs


def test_finds_the_peak_of_a_1d_function_in_few_samples():
    best, _, _ = optimise(lambda x: -(x[0] - 0.3) ** 2, [(0.0, 1.0)], 10, seed=1)
    assert abs(best[0] - 0.3) < 0.05


def test_finds_the_peak_of_a_2d_function_in_few_samples():
    best, _, _ = optimise(lambda x: -((x[0] - 7) ** 2 + (x[1] + 2) ** 2), [(0.0, 10.0), (-5.0, 5.0)], 20, seed=2)
    assert abs(best[0] - 7) < 0.5 and abs(best[1] + 2) < 0.5


def test_same_seed_same_samples_other_seed_other_samples():
    f = lambda x: -np.sin(3 * x[0]) - x[0] ** 2  # noqa: E731
    _, _, a = optimise(f, [(-1.0, 2.0)], 6, seed=5)
    _, _, b = optimise(f, [(-1.0, 2.0)], 6, seed=5)
    _, _, c = optimise(f, [(-1.0, 2.0)], 6, seed=6)
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
    assert [x.tolist() for x in a] != [x.tolist() for x in c]


def test_samples_stay_in_the_box():
    _, _, xs = optimise(lambda x: x[0] + x[1], [(2.0, 3.0), (-1.0, 0.0)], 8, seed=0)
    assert all(2.0 <= x[0] <= 3.0 and -1.0 <= x[1] <= 0.0 for x in xs)


START = Knobs(8 << 20, 1.0, 512 << 10, 2 << 20, "auto", "segment", True)


def test_space_has_only_the_knobs_this_job_can_turn():
    ring_only = Space(["ring"], [], stripes=False)
    assert [d.field for d in ring_only.dimensions] == ["fusion_threshold_bytes", "cycle_time_ms", "segment_bytes"]
    assert ring_only.categorical == (("cache_enabled", (True, False)),)
    full = Space(["auto", "ring", "shm"], ["segment", "cma"], stripes=True)
    assert [d.field for d in full.dimensions][-1] == "stripe_bytes"
    assert [field for field, _ in full.categorical] == ["algorithm", "transport", "cache_enabled"]


def test_space_maps_knobs_to_the_box_and_back():
    space = Space(["auto", "ring", "shm"], ["segment"], stripes=True)
    assert space.vector(START) == pytest.approx([8.0, 1.0, 19.0, 21.0])
    assert space.knobs(space.vector(START), START) == START
    # A start outside the box (1 KiB threshold is inside; 0 ms cycle and a 128 MB threshold are not) is clipped.
    odd = START._replace(fusion_threshold_bytes=128 << 20, cycle_time_ms=0.0)
    assert space.vector(odd)[:2] == [64.0, 0.1]
    assert space.knobs([100.0, 50.0, 30.0, 1.0], START)[:4] == (64 << 20, 10.0, 4 << 20, 256 << 10)


def tuner(tmp_path, **config) -> Tuner:
    settings = dict(enabled=True, log_path=str(tmp_path / "log.csv"), warmup_samples=1, steps_per_sample=2,
                    bayes_opt_max_samples=3, gaussian_process_noise=0.8)
    settings.update(config)
    return Tuner(AutotuneConfig(**settings), Space(["auto", "ring"], [], stripes=False), START, rank=0, hosts=1)


def run_steps(t: Tuner, steps: int) -> int:
    """Steps of two names until a scored sample ends; returns the steps taken."""
    for step in range(1, steps + 1):
        t.note(["a", "b"], 1000)
        if t.due:
            return step
    return -1


def test_a_sample_is_five_subsamples_of_steps_and_warmups_are_not_scored(tmp_path):
    t = tuner(tmp_path)
    # Warm-up (5 x 2 steps, plus the step that closes the last sub-sample), then the first scored sample.
    assert run_steps(t, 100) == 2 * (2 * autotune.SUBSAMPLES + 1)
    assert t.warmups_left == 0 and t.score() > 0


def test_rank_0_tries_bayes_samples_then_each_categorical_value_then_keeps_the_best(tmp_path):
    t = tuner(tmp_path)
    tried = []
    scores = iter([10.0, 30.0, 20.0, 5.0, 1.0, 2.0])
    decision = None
    for score in scores:
        tried.append(t.current)
        decision = t.decide([score, score + 1])
        t.follow(decision)
        if not decision.active:
            break
    assert not decision.active
    assert len(tried) == 5  # 3 Bayesian samples, then ring and cache off from the best
    assert tried[0] == START and len({k[:2] for k in tried[:3]}) == 3
    assert tried[3] == tried[1]._replace(algorithm="ring") and tried[4] == tried[1]._replace(cache_enabled=False)
    assert decision.knobs == tried[1]  # scored 30, the best
    lines = (tmp_path / "log.csv").read_text().splitlines()
    assert lines[0] == autotune.LOG_HEADER
    assert [float(line.split(",")[-1]) for line in lines[1:]] == [10.0, 30.0, 20.0, 5.0, 1.0, 30.0]
    assert lines[1] == "0,0,0, 1,1,8,10"  # Horovod's columns and its ", " after torus_allreduce


def test_a_failed_log_file_is_a_warning_and_tuning_goes_on(tmp_path, capsys):
    from mtrain.ringreduce.core import log
    from mtrain.common.settings import LogLevel
    log.set_level(LogLevel.WARNING)
    t = tuner(tmp_path, log_path=str(tmp_path / "missing" / "log.csv"))
    assert "cannot write the log file" in capsys.readouterr().err
    assert t.decide([1.0]).active


def test_autotune_variables_horovods_and_ours():
    config = EngineConfig.from_environment({
        "HOROVOD_AUTOTUNE": "1", "HOROVOD_AUTOTUNE_LOG": "/tmp/h.csv", "MTRAIN_AUTOTUNE_LOG": "/tmp/m.csv",
        "HOROVOD_AUTOTUNE_WARMUP_SAMPLES": "0", "HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE": "4",
        "HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES": "7", "MTRAIN_AUTOTUNE_GAUSSIAN_PROCESS_NOISE": "0.25"}).autotune
    assert config == AutotuneConfig(True, "/tmp/m.csv", 0, 4, 7, 0.25)
    assert EngineConfig.from_environment({}).autotune == AutotuneConfig(False, None, 3, 10, 20, 0.8)


@pytest.mark.parametrize("name, value, fragment", [
    ("HOROVOD_AUTOTUNE_WARMUP_SAMPLES", "abc", "is not a whole number of samples >= 0"),
    ("HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE", "0", "is not a whole number of steps >= 1"),
    ("MTRAIN_AUTOTUNE_BAYES_OPT_MAX_SAMPLES", "2.5", "is not a whole number of samples >= 1"),
    ("HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE", "0", "is not a number > 0"),
    ("HOROVOD_AUTOTUNE", "yes", "is not an integer: 1 (on) or 0 (off)"),
])
def test_bad_autotune_values_name_the_variable(name, value, fragment):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_environment({name: value})
    assert str(info.value).startswith(f"{name}={value!r} {fragment}") and "\n" not in str(info.value)
