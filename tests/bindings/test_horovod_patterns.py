"""Horovod's own example programs' patterns under a real ``mtrain run -np 2`` (CPU, tiny models).

Each program in ``horovod_patterns/`` is written the way Horovod's example of the same name
is (its flags and defaults, its API calls and arguments, the import line changed), with a tiny
model in place of ResNet-50 and small step counts here. Each test checks the example's output
(rank 0's img/sec lines) and that training made the replicas agree: every rank's parameters
(or, with Keras, its averaged losses) are the same at the end, although every rank trained on
its own random batch.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.bindings.requires import require
from tests.jobs import run_job

REPO = Path(__file__).resolve().parents[2]
PATTERNS = Path(__file__).resolve().parent / "horovod_patterns"
SMALL = ["--batch-size", "4", "--image-size", "32", "--num-batches-per-iter", "2", "--num-iters", "2"]
_LINE = re.compile(r"^\[(\d+)\]<stdout>:(.*)$")


def mtrain_run(flags: "list[str]", program: str, args: "list[str]", timeout: float,
               env_extra: "dict[str, str] | None" = None) -> subprocess.CompletedProcess:
    """``mtrain run FLAGS python PROGRAM ARGS`` from the repository root (PROGRAM relative to
    ``horovod_patterns/``, or absolute), ``env_extra`` added to the job's environment; the whole
    job is killed if it outlives ``timeout``."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # Two ranks share two cores: one compute thread each; and TensorFlow's start-up chatter off.
    env.update(OMP_NUM_THREADS="1", TF_NUM_INTRAOP_THREADS="1", TF_NUM_INTEROP_THREADS="2",
               TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1")
    env.update(env_extra or {})
    argv = [sys.executable, "-m", "mtrain.launcher.cli.main", "run", *flags, sys.executable, str(PATTERNS / program),
            *args]
    done = run_job(argv, timeout, program, env=env, cwd=REPO)
    assert done.returncode == 0, f"{program}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def rank_lines(stdout: str) -> "dict[int, list[str]]":
    """Each rank's stdout lines, without mtrain's ``[r]<stdout>:`` prefix."""
    lines: "dict[int, list[str]]" = {}
    for line in stdout.splitlines():
        found = _LINE.match(line)
        if found:
            lines.setdefault(int(found.group(1)), []).append(found.group(2))
    return lines


def assert_benchmark_output(lines: "dict[int, list[str]]", device: str, iters: int) -> None:
    """Rank 0 alone prints the benchmark's lines: one img/sec line per iteration, then the totals."""
    rank0 = lines.get(0, [])
    assert f"Number of {device}s: 2" in rank0, rank0
    rates = [float(m.group(2)) for m in (re.fullmatch(rf"Iter #(\d+): ([0-9.]+) img/sec per {device}", line)
                                          for line in rank0) if m]
    assert len(rates) == iters and all(rate > 0 for rate in rates), rank0
    assert [line for line in rank0 if line.startswith(f"Img/sec per {device}: ")], rank0
    assert [line for line in rank0 if re.match(rf"Total img/sec on 2 {device}\(s\): [0-9.]+ \+-", line)], rank0
    assert not [line for line in lines.get(1, []) if "img/sec" in line.lower()], "only rank 0 logs"


def final_reports(lines: "dict[int, list[str]]", pattern: str) -> "list[re.Match]":
    """Each rank's closing line (rank order), matched against ``pattern``."""
    found = []
    for rank in (0, 1):
        matches = [m for m in (re.fullmatch(pattern, line) for line in lines.get(rank, [])) if m]
        assert len(matches) == 1, f"rank {rank} did not report once: {lines.get(rank)}"
        found.append(matches[0])
    return found


def test_pytorch_synthetic_benchmark_with_sync_batch_norm_and_fp16_compression():
    """pytorch_synthetic_benchmark.py: SyncBatchNorm as norm_layer, Compression.fp16,
    DistributedOptimizer(op=Average), broadcast_parameters / broadcast_optimizer_state."""
    require("torch", "pip install '.[torch]'")
    done = mtrain_run(["-np", "2", "-H", "localhost:2"], "torch_synthetic_benchmark.py",
                      SMALL + ["--num-warmup-batches", "1", "--fp16-allreduce"], timeout=180)
    lines = rank_lines(done.stdout)
    assert_benchmark_output(lines, "CPU", iters=2)
    digests = [m.group(1) for m in final_reports(lines, r"rank \d state digest ([0-9a-f]{64})")]
    # Weights and SyncBatchNorm's running statistics: equal, as every rank saw the same averages.
    assert digests[0] == digests[1], "the ranks' models differ after training"


def test_pytorch_elastic_synthetic_benchmark_under_horovods_elastic_flags(tmp_path):
    """pytorch_synthetic_benchmark_elastic.py under --min-np/--max-np/--host-discovery-script:
    TorchState(model, optimizer, **attributes), register_reset_callbacks, @hvd.elastic.run and
    a commit after every batch (--num-batches-per-commit 1, the default)."""
    require("torch", "pip install '.[torch]'")
    script = tmp_path / "discover_hosts.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    iters = 2
    done = mtrain_run(["-np", "2", "--min-np", "2", "--max-np", "2", "--host-discovery-script", str(script)],
                      "torch_synthetic_benchmark_elastic.py", SMALL + ["--num-warmup-batches", "2"], timeout=180)
    lines = rank_lines(done.stdout)
    assert_benchmark_output(lines, "CPU", iters=iters)
    reports = final_reports(lines, r"rank \d parameter digest ([0-9a-f]{64}) state (.*)")
    assert reports[0].group(1) == reports[1].group(1), "the ranks' parameters differ after training"
    # The plain attributes as the example leaves them: warm, at the last iteration, a rate per iteration.
    assert [m.group(2) for m in reports] == [f"warm=True iter={iters - 1} batch=0 rates={iters}"] * 2
    assert "elastic reset" not in done.stderr, done.stderr[-3000:]


def test_tensorflow2_synthetic_benchmark_tape_in_tf_function_with_fp16_on_cpu():
    """tensorflow2_synthetic_benchmark.py with --no-cuda --fp16-allreduce: DistributedGradientTape
    in a tf.function, then broadcast_variables of the model's and the optimizer's variables."""
    require("tensorflow", "pip install '.[tensorflow]'")
    warmup = 1
    done = mtrain_run(["-np", "2", "-H", "localhost:2"], "tensorflow2_synthetic_benchmark.py",
                      SMALL + ["--num-warmup-batches", str(warmup), "--no-cuda", "--fp16-allreduce"], timeout=240)
    lines = rank_lines(done.stdout)
    assert_benchmark_output(lines, "CPU", iters=2)
    reports = final_reports(lines, r"rank \d trainable digest ([0-9a-f]{64}) after (\d+) steps")
    assert reports[0].group(1) == reports[1].group(1), "the ranks' weights differ after training"
    assert [int(m.group(2)) for m in reports] == [1 + warmup + 2 * 2] * 2


def test_tensorflow2_keras_synthetic_benchmark_fit_with_horovod_callbacks_default_flags():
    """tensorflow2_keras_synthetic_benchmark.py with its default flags (the GPU path: sycl_built()
    and device pinning find no accelerator on a CPU host): DistributedOptimizer in model.fit,
    BroadcastGlobalVariablesCallback(0) and MetricAverageCallback()."""
    require("tensorflow", "pip install '.[tensorflow]'")
    done = mtrain_run(["-np", "2", "-H", "localhost:2"], "tensorflow2_keras_synthetic_benchmark.py", SMALL,
                      timeout=240)
    lines = rank_lines(done.stdout)
    assert_benchmark_output(lines, "GPU", iters=2)  # the example labels its default path GPU
    reports = final_reports(lines, r"rank \d losses ([0-9. ]+) trainable digest ([0-9a-f]{64})")
    losses = [m.group(1).split() for m in reports]
    assert len(losses[0]) == 2 and losses[0] == losses[1], f"MetricAverageCallback: {losses}"
    assert reports[0].group(2) == reports[1].group(2), "the ranks' weights differ after training"
