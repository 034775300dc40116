"""horovodrun's flags and config file on `mtrain run`, and Horovod's variables in the runtime
(launcher/cli/tuning.py, launcher/cli/main.py, bindings/common/settings.py), without starting a job."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time

import pytest

import mtrain
from mtrain.launcher.cli import capabilities, tuning
from mtrain.launcher.cli.main import main
from mtrain.launcher.cli.config import MpiKind, MpiLauncher
from mtrain.launcher.job.environment import forwarded_names
from mtrain.launcher.job.hosts import HostSlots
from mtrain.launcher.job.mpirun import build_argv
from mtrain.launcher.supervise.output import OutputSink
from mtrain.ringreduce.transport import executor as collectives
from mtrain.ringreduce.core import log
from mtrain.common import settings
from mtrain.ringreduce.negotiation.cache import ResponseCache
from mtrain.ringreduce.negotiation.coordinator import Coordinator
from mtrain.common.settings import EngineConfig, LogLevel

pytestmark = pytest.mark.timeout(60)


def dry_run(capsys, *flags: str) -> "tuple[int, str, str]":
    status = main(["run", "--dry-run", "-np", "2", *flags, "python", "train.py"])
    out, err = capsys.readouterr()
    return status, out, err


def settings_shown(out: str) -> "dict[str, str]":
    """{variable: 'value (origin)'} from the dry run's `rank setting` lines."""
    return dict(re.findall(r"^rank setting (\w+)=(.*)$", out, re.MULTILINE))


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for name in list(__import__("os").environ):
        if name.startswith(("MTRAIN_", "HOROVOD_")) and name != "MTRAIN_MPIRUN":
            monkeypatch.delenv(name)


# -- the flags -----------------------------------------------------------------------------

def test_tuning_flags_reach_every_rank_as_mtrains_variables(capsys):
    status, out, err = dry_run(capsys, "--fusion-threshold-mb", "3", "--cycle-time-ms", "2.5",
                               "--cache-capacity", "0", "--hierarchical-allreduce", "--log-level", "info",
                               "--tcp")
    assert status == 0, err
    assert settings_shown(out) == {
        "MTRAIN_FUSION_THRESHOLD_BYTES": "3145728 (--fusion-threshold-mb)",
        "MTRAIN_CYCLE_TIME_MS": "2.5 (--cycle-time-ms)",
        "MTRAIN_CACHE_CAPACITY": "0 (--cache-capacity)",
        "MTRAIN_ALLREDUCE_ALGORITHM": "hierarchical (--hierarchical-allreduce)",
        "MTRAIN_LOG_LEVEL": "info (--log-level)",
        "NCCL_IB_DISABLE": "1 (--tcp)",
    }
    argv = out.strip().splitlines()[-1]
    for item in ("MTRAIN_FUSION_THRESHOLD_BYTES=3145728", "MTRAIN_CYCLE_TIME_MS=2.5", "MTRAIN_CACHE_CAPACITY=0",
                 "MTRAIN_ALLREDUCE_ALGORITHM=hierarchical", "MTRAIN_LOG_LEVEL=info", "NCCL_IB_DISABLE=1"):
        assert f"-x {item}" in argv, argv
    assert err == ""  # all of them are real: no notes


def test_no_hierarchical_allreduce_is_horovods_default_which_is_auto(capsys):
    status, out, err = dry_run(capsys, "--no-hierarchical-allreduce", "--no-hierarchical-allgather")
    assert status == 0, err
    assert settings_shown(out) == {"MTRAIN_ALLREDUCE_ALGORITHM": "auto (--no-hierarchical-allreduce)"}
    assert err == ""


def test_flags_without_machinery_in_mtrain_get_one_line_each_and_change_nothing(capsys):
    flags = ["--gloo", "--hierarchical-allgather", "--mpi-threads-disable", "--num-nccl-streams", "2",
             "--thread-affinity", "3", "--gloo-timeout-seconds", "45", "--disable-cache"]
    status, out, err = dry_run(capsys, *flags)
    assert status == 0, err
    lines = err.strip().splitlines()
    for flag in ("--gloo", "--hierarchical-allgather", "--mpi-threads-disable", "--num-nccl-streams",
                 "--thread-affinity", "--gloo-timeout-seconds", "--disable-cache"):
        assert len([line for line in lines if line.startswith(f"mtrain: {flag}: ")]) == 1, err
    assert len(lines) == 7, err
    assert settings_shown(out) == {}
    status, out, err = dry_run(capsys, "--jsrun")
    assert status == 0 and err.strip() == "mtrain: --jsrun: mtrain starts the ranks with mpirun (inside an LSF allocation too)"
    status, out, err = dry_run(capsys, "--mpi", "--log-without-timestamp")
    assert status == 0 and err == "" and settings_shown(out) == {}


def test_binding_args_replace_the_default_binding(capsys):
    status, out, err = dry_run(capsys, "--binding-args", "--map-by ppr:1:core --bind-to core")
    assert status == 0, err
    argv = out.strip().splitlines()[-1]
    assert "--map-by ppr:1:core --bind-to core" in argv and "--bind-to none" not in argv
    assert "--map-by slot" not in argv
    status, out, err = dry_run(capsys)
    assert "--map-by slot --bind-to none" in out.strip().splitlines()[-1]


def test_build_argv_binding_for_both_families():
    plan = [HostSlots("localhost", 2)]
    ompi = build_argv(MpiLauncher("mpirun", MpiKind.OPENMPI), plan, ["p"], rank_python="py", agent=None,
                      binding_args=["--rankfile", "ranks.txt"])
    assert ompi[:7] == ["mpirun", "-np", "2", "--host", "localhost:2", "--rankfile", "ranks.txt"]
    assert "--bind-to" not in ompi
    hydra = build_argv(MpiLauncher("mpiexec", MpiKind.MPICH), plan, ["p"], rank_python="py", agent=None,
                       binding_args=["-bind-to", "core"])
    assert hydra[5:7] == ["-bind-to", "core"] and hydra.count("-bind-to") == 1


def test_network_interfaces_plural_and_repeated_are_one_union(capsys):
    status, out, err = dry_run(capsys, "--network-interfaces", "eth0,ib0", "--network-interface", "eth1",
                               "--network-interface", "eth0")
    assert status == 0, err
    assert "--mca btl_tcp_if_include eth0,ib0,eth1" in out


def test_version_and_check_build_on_run(capsys, monkeypatch):
    assert main(["run", "-v"]) == 0
    assert capsys.readouterr().out.strip() == f"mtrain, version {mtrain.__version__}"
    monkeypatch.setattr(capabilities, "build_facts",
                        lambda: capabilities.BuildFacts(tensorflow=False, torch=True, mpi=True))
    assert main(["run", "-cb"]) == 0  # no -np, no command: Horovod's -cb needs neither
    out = capsys.readouterr().out
    assert out.startswith(f"mtrain v{mtrain.__version__}:")
    expected = ["[ ] TensorFlow", "[X] PyTorch", "[ ] MXNet", "Available Controllers:", "[X] MPI", "[ ] Gloo",
                "Available Tensor Operations:", "[ ] NCCL", "[ ] DDL", "[ ] CCL", "[X] MPI", "[ ] Gloo"]
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    assert lines[2:] == expected, out


@pytest.mark.parametrize("flags, fragment", [
    (["--fusion-threshold-mb", "-1"], "-1 is not in the range x>=0"),
    (["--fusion-threshold-mb", "1.5"], "'1.5' is not a valid integer"),
    (["--cycle-time-ms", "soon"], "'soon' is not a valid float"),
    (["--cache-capacity", "-5"], "-5 is not in the range x>=0"),
    (["--log-level", "loud"], "'loud' is not one of"),
    (["--num-nccl-streams", "-2"], "-2 is not in the range"),
    (["--binding-args", "'--bind-to"], "--binding-args: No closing quotation"),
    (["--gloo", "--mpi"], "give one of --gloo, --mpi and --jsrun, not --gloo and --mpi"),
    (["--cycle-time-ms", "2", "-x", "MTRAIN_CYCLE_TIME_MS=4"], "--cycle-time-ms sets MTRAIN_CYCLE_TIME_MS"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, flags, fragment):
    status = main(["run", "-np", "2", *flags, "true"])
    err = capsys.readouterr().err
    assert status == 2
    assert len(err.strip().splitlines()) == 1 and fragment in err, err
    assert "Traceback" not in err


# -- the config file -----------------------------------------------------------------------

CONFIG = """\
controller: gloo
params:
  fusion_threshold_mb: 32
  cycle_time_ms: 6.5
  cache_capacity: 512
  hierarchical_allreduce: false
library_options:
  num_nccl_streams: 2
logging:
  level: debug
"""


def test_config_file_in_horovods_schema_sets_the_ranks_variables(capsys, tmp_path):
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    status, out, err = dry_run(capsys, "--config-file", str(path))
    assert status == 0, err
    assert settings_shown(out) == {
        "MTRAIN_FUSION_THRESHOLD_BYTES": "33554432 (--config-file params.fusion_threshold_mb)",
        "MTRAIN_CYCLE_TIME_MS": "6.5 (--config-file params.cycle_time_ms)",
        "MTRAIN_CACHE_CAPACITY": "512 (--config-file params.cache_capacity)",
        "MTRAIN_ALLREDUCE_ALGORITHM": "auto (--config-file params.hierarchical_allreduce)",
        "MTRAIN_LOG_LEVEL": "debug (--config-file logging.level)",
    }
    assert sorted(err.strip().splitlines()) == [
        "mtrain: --config-file controller: mtrain runs on MPI; --gloo is not needed",
        "mtrain: --config-file library_options.num_nccl_streams: mtrain's collectives do not use NCCL; "
        "the setting has no effect",
    ]


def test_flags_on_the_command_line_beat_the_file(capsys, tmp_path):
    path = tmp_path / "horovod.yaml"
    path.write_text(CONFIG)
    status, out, err = dry_run(capsys, "--cycle-time-ms", "0.25", "--config-file", str(path),
                               "--hierarchical-allreduce", "--mpi", "--log-level", "ERROR")
    assert status == 0, err
    shown = settings_shown(out)
    assert shown["MTRAIN_CYCLE_TIME_MS"] == "0.25 (--cycle-time-ms)"
    assert shown["MTRAIN_ALLREDUCE_ALGORITHM"] == "hierarchical (--hierarchical-allreduce)"
    assert shown["MTRAIN_LOG_LEVEL"] == "error (--log-level)"
    assert shown["MTRAIN_CACHE_CAPACITY"] == "512 (--config-file params.cache_capacity)"
    assert "--gloo" not in err  # the file's controller yields to --mpi, as in Horovod


@pytest.mark.parametrize("text, fragment", [
    ("params:\n  cache_capacity: -3\n", "params.cache_capacity: -3 is not in the range x>=0"),
    ("params:\n  cycle_time: 3\n", "unknown key params.cycle_time; params takes cache_capacity, cycle_time_ms"),
    ("parms:\n  cycle_time_ms: 3\n", "unknown section 'parms'"),
    ("controller: nccl\n", "controller: 'nccl': expected one of gloo, mpi"),
    ("params: [1,\n", "not valid YAML at line"),
    ("logging:\n  level: loud\n", "logging.level: 'loud' is not one of"),
])
def test_bad_config_files_are_one_line_naming_file_and_key(capsys, tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    status = main(["run", "-np", "2", "--config-file", str(path), "true"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--config-file {path}: " in err and fragment in err, err


def test_config_keys_of_flags_this_run_lacks_are_named_not_dropped(capsys, tmp_path):
    path = tmp_path / "horovod.yaml"
    path.write_text("library_options:\n  ccl_bgt_affinity: 1\nparams:\n  cycle_time_ms: 4\n")
    status, out, err = dry_run(capsys, "--config-file", str(path))
    assert status == 0, err
    assert "MTRAIN_CYCLE_TIME_MS" in settings_shown(out)
    assert ("mtrain: --config-file library_options.ccl_bgt_affinity: not applied; this mtrain run has no "
            "--ccl-bgt-affinity" in err.splitlines())


def test_timeline_and_stall_check_flags_and_their_config_keys(capsys, tmp_path):
    status, out, err = dry_run(capsys, "--timeline-filename", "tl.json", "--timeline-mark-cycles",
                               "--no-stall-check", "--stall-check-warning-time-seconds", "12.5",
                               "--stall-check-shutdown-time-seconds", "30")
    assert status == 0 and err == "", err
    assert settings_shown(out) == {
        "MTRAIN_TIMELINE": f"{os.path.abspath('tl.json')} (--timeline-filename)",
        "MTRAIN_TIMELINE_MARK_CYCLES": "1 (--timeline-mark-cycles)",
        "MTRAIN_STALL_CHECK_DISABLE": "1 (--no-stall-check)",
        "MTRAIN_STALL_WARNING_SECONDS": "12.5 (--stall-check-warning-time-seconds)",
        "MTRAIN_STALL_SHUTDOWN_SECONDS": "30 (--stall-check-shutdown-time-seconds)",
    }
    # Horovod's file says `stall_check: enabled:` where its command line says --no-stall-check.
    path = tmp_path / "horovod.yaml"
    path.write_text("timeline:\n  filename: /tmp/x.json\n  mark_cycles: false\n"
                    "stall_check:\n  enabled: false\n  warning_time_seconds: 5\n")
    status, out, err = dry_run(capsys, "--config-file", str(path))
    assert status == 0 and err == "", err
    assert settings_shown(out) == {
        "MTRAIN_TIMELINE": "/tmp/x.json (--config-file timeline.filename)",
        "MTRAIN_TIMELINE_MARK_CYCLES": "0 (--config-file timeline.mark_cycles)",
        "MTRAIN_STALL_CHECK_DISABLE": "1 (--config-file stall_check.enabled)",
        "MTRAIN_STALL_WARNING_SECONDS": "5 (--config-file stall_check.warning_time_seconds)",
    }
    path.write_text("stall_check:\n  enabled: true\n")
    status, out, err = dry_run(capsys, "--config-file", str(path))
    assert settings_shown(out) == {"MTRAIN_STALL_CHECK_DISABLE": "0 (--config-file stall_check.enabled)"}
    status = main(["run", "-np", "2", "--stall-check-warning-time-seconds", "-1", "true"])
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and "--stall-check-warning-time-seconds" in err


def test_dry_run_shows_the_horovod_and_mtrain_variables_the_ranks_inherit(capsys, monkeypatch):
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "17")
    monkeypatch.setenv("MTRAIN_SHM_TRANSPORT", "segment")
    monkeypatch.setenv("MTRAIN_JOB_SECRET", "do-not-show")  # of an enclosing job: replaced, never printed
    status, out, err = dry_run(capsys, "-x", "HOROVOD_TIMELINE=/tmp/t.json")
    assert status == 0, err
    assert settings_shown(out) == {"HOROVOD_STALL_CHECK_TIME_SECONDS": "17 (this environment)",
                                   "MTRAIN_SHM_TRANSPORT": "segment (this environment)",
                                   "HOROVOD_TIMELINE": "/tmp/t.json (-x HOROVOD_TIMELINE)"}
    assert "do-not-show" not in out


def test_horovod_variables_are_forwarded_to_every_host():
    env = {"HOROVOD_CACHE_CAPACITY": "0", "HOROVOD_LOG_LEVEL": "debug", "HOME": "/h"}
    assert forwarded_names(env) == ["HOROVOD_CACHE_CAPACITY", "HOROVOD_LOG_LEVEL"]


def test_every_variable_the_flags_set_is_one_the_runtime_reads():
    runtime_names = {s.ours for s in settings.SETTINGS} | {collectives.ALGORITHM_VARIABLE}
    flag_names = {name for flag in tuning.FLAGS
                  for name, _ in flag.effect("INFO" if flag.option == "log_level" else 1).variables}
    assert flag_names - runtime_names == {tuning.NCCL_IB_DISABLE}  # NCCL's own, for a program's NCCL
    assert len(flag_names) == 17


# -- output timestamps ---------------------------------------------------------------------

class _Stream:
    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    def flush(self) -> None:
        pass


def test_prefix_output_with_timestamp_stamps_rank_lines_like_horovod(tmp_path):
    stream = _Stream()
    sink = OutputSink(tmp_path, 1, False, timestamp=True)
    sink.write(b"[0]<stdout>:step 1\n", stream)
    sink.close()
    stamp, _, rest = stream.data.decode().partition("[0]")
    assert rest == "<stdout>:step 1\n"
    parsed = time.strptime(stamp, "%a %b %d %H:%M:%S %Y")  # time.asctime(), as Horovod writes it
    assert abs(time.mktime(parsed) - time.time()) < 120
    assert (tmp_path / "rank.0" / "stdout").read_bytes() == b"step 1\n"  # the files stay unstamped


# -- the runtime's variables ---------------------------------------------------------------

def test_horovod_variables_alone_set_the_engine():
    config = EngineConfig.from_environment({
        "HOROVOD_FUSION_THRESHOLD": "2097152", "HOROVOD_CYCLE_TIME": "3.5", "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "12", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "40",
        "HOROVOD_TIMELINE": "/tmp/tl.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_LOG_LEVEL": "Debug",
        "HOROVOD_HIERARCHICAL_ALLGATHER": "1"})
    assert config == EngineConfig(cycle_time_s=0.0035, fusion_threshold_bytes=2097152, cache_capacity=0,
                                  stall_warning_s=12.0, stall_shutdown_s=40.0, timeline_path="/tmp/tl.json",
                                  timeline_mark_cycles=True, log_level=LogLevel.DEBUG, hierarchical_allgather=True)


def test_ours_win_over_horovods():
    config = EngineConfig.from_environment({
        "HOROVOD_CYCLE_TIME": "3.5", "MTRAIN_CYCLE_TIME_MS": "0.5",
        "HOROVOD_CACHE_CAPACITY": "0", "MTRAIN_CACHE_CAPACITY": "64",
        "HOROVOD_LOG_LEVEL": "trace", "MTRAIN_LOG_LEVEL": "error",
        "HOROVOD_TIMELINE": "/tmp/h.json", "MTRAIN_TIMELINE": "/tmp/m.json",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "MTRAIN_STALL_CHECK_DISABLE": "0"})
    assert (config.cycle_time_s, config.cache_capacity, config.log_level, config.timeline_path) == (
        0.0005, 64, LogLevel.ERROR, "/tmp/m.json")
    assert config.stall_warning_s == settings.DEFAULT_STALL_WARNING_SECONDS


def test_defaults_and_horovods_special_values():
    assert EngineConfig.from_environment({}) == EngineConfig()
    assert EngineConfig().cache_capacity == 4096 and EngineConfig().log_level is LogLevel.WARNING
    off = EngineConfig.from_environment({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"})
    assert math.isinf(off.stall_warning_s) and off.stall_shutdown_s == 0.0  # no warning, no shutdown
    assert EngineConfig.from_environment({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline_path is None
    # Horovod's flags are numbers (strtol > 0): 2 is on, 0 off.
    assert EngineConfig.from_environment({"HOROVOD_TIMELINE_MARK_CYCLES": "2"}).timeline_mark_cycles is True
    assert EngineConfig.from_environment({"HOROVOD_TIMELINE_MARK_CYCLES": "0"}).timeline_mark_cycles is False


@pytest.mark.parametrize("name, value, fragment", [
    ("HOROVOD_CYCLE_TIME", "fast", "HOROVOD_CYCLE_TIME='fast' is not a number of milliseconds >= 0"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "HOROVOD_FUSION_THRESHOLD='-1' is not a whole number of bytes"),
    ("HOROVOD_CACHE_CAPACITY", "2.5", "HOROVOD_CACHE_CAPACITY='2.5' is not a whole number of op names"),
    ("MTRAIN_CACHE_CAPACITY", "lots", "MTRAIN_CACHE_CAPACITY='lots' is not a whole number"),
    # Horovod would read "true" as off without a word; here it is an error saying what is meant.
    ("HOROVOD_STALL_CHECK_DISABLE", "true", "HOROVOD_STALL_CHECK_DISABLE='true' is not an integer: 1 (on) or 0"),
    ("HOROVOD_LOG_LEVEL", "verbose", "HOROVOD_LOG_LEVEL='verbose' is not one of trace, debug, info, warning, "
                                     "error, fatal"),
    ("HOROVOD_DYNAMIC_PROCESS_SETS", "yes", "HOROVOD_DYNAMIC_PROCESS_SETS='yes' is not an integer"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "nan", "HOROVOD_STALL_CHECK_TIME_SECONDS='nan' is not a number"),
])
def test_bad_values_name_the_variable_and_what_it_takes(name, value, fragment):
    with pytest.raises(ValueError) as info:
        EngineConfig.from_environment({name: value})
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_horovods_hierarchical_allreduce_is_read_as_horovod_reads_flags():
    assert collectives.algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "2"}) == "hierarchical"
    assert collectives.algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "0"}) == "auto"
    assert collectives.algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
                                                   "MTRAIN_ALLREDUCE_ALGORITHM": "ring"}) == "ring"
    with pytest.raises(ValueError, match="HOROVOD_HIERARCHICAL_ALLREDUCE='on' is not an integer"):
        collectives.algorithm_from_environment({"HOROVOD_HIERARCHICAL_ALLREDUCE": "on"})


def test_cache_capacity_zero_caches_nothing_and_capacity_two_caches_two():
    for capacity, bits in ((0, [-1, -1, -1]), (2, [0, 1, -1])):
        coordinator, cache = Coordinator(1, 60, 0), ResponseCache(capacity)
        responses = coordinator.decide([([("a", 1, "a"), ("b", 2, "b"), ("c", 3, "c")], None)], cache, set(), 0.0)
        assert [r.bit for r in responses] == bits


def test_log_level_hides_the_stall_warning_below_it(capsys):
    def stall_round(level: LogLevel) -> str:
        log.start(EngineConfig(log_level=level), rank=1)
        coordinator, cache = Coordinator(2, 0.5, 0), ResponseCache()
        coordinator.decide([([("slow", 1, "slow")], ["slow"]), ([], [])], cache, set(), 0.0)
        coordinator.decide([([], ["slow"]), ([], [])], cache, set(), 2.0)
        return capsys.readouterr().err
    try:
        assert "mtrain: stall warning: op 'slow'" in stall_round(LogLevel.WARNING)
        assert stall_round(LogLevel.ERROR) == ""
    finally:
        log.start(EngineConfig(), rank=1)


def test_rank_zero_logs_its_settings_at_debug_and_says_there_is_no_hierarchical_allgather(capsys):
    try:
        log.start(EngineConfig(log_level=LogLevel.DEBUG, cache_capacity=0, hierarchical_allgather=True), rank=0)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2
        assert err[0].startswith("mtrain: engine settings: cycle_time_ms=1 ") and "cache_capacity=0" in err[0]
        assert err[1].startswith("mtrain: HOROVOD_HIERARCHICAL_ALLGATHER is set, but mtrain has no hierarchical")
        log.start(EngineConfig(hierarchical_allgather=True), rank=1)
        assert capsys.readouterr().err == ""  # rank 0 alone says it
    finally:
        log.start(EngineConfig(), rank=1)


def test_the_launcher_refuses_a_variable_the_ranks_would_refuse():
    from mtrain.launcher.cli import tuning
    refusal = tuning.refused_variable({"HOROVOD_CYCLE_TIME": "abc"})
    assert refusal is not None and refusal.startswith("HOROVOD_CYCLE_TIME='abc' is not a number")
    assert tuning.refused_variable({"HOROVOD_CACHE_CAPACITY": "-1"}).startswith("HOROVOD_CACHE_CAPACITY=")
    # Ours win, so the ranks never read Horovod's twin: nothing to refuse (as init() reads it).
    assert tuning.refused_variable({"MTRAIN_CYCLE_TIME_MS": "2", "HOROVOD_CYCLE_TIME": "abc"}) is None
    assert tuning.refused_variable({"HOROVOD_AUTOTUNE": "1", "HOROVOD_FUSION_THRESHOLD": "0"}) is None


def test_checking_variables_leaves_mpi_alone_in_the_launcher():
    code = ("import sys; from mtrain.launcher.cli import tuning; tuning.refused_variable({}); "
            "print(sorted(m for m in sys.modules if m.startswith(('mpi4py', 'mtrain.ringreduce'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


# Every flag of horovodrun 0.28 (horovod/runner/launch.py, parse_args; its hidden aliases too),
# with a value where it takes one. Elastic ones run in their own line (they need a discovery script).
HOROVODRUN_FLAGS = [
    ["-v"], ["--version"], ["-cb"], ["--check-build"], ["--disable-cache"], ["--start-timeout", "30"],
    ["--network-interface", "lo"], ["--network-interfaces", "lo"], ["--output-filename", "out"], ["--verbose"],
    ["--config-file", "CONFIG"], ["-p", "22"], ["--ssh-port", "22"], ["-i", "KEY"], ["--ssh-identity-file", "KEY"],
    ["--fusion-threshold-mb", "64"], ["--cycle-time-ms", "5"], ["--cache-capacity", "1024"],
    ["--hierarchical-allreduce"], ["--no-hierarchical-allreduce"], ["--hierarchical-allgather"],
    ["--no-hierarchical-allgather"], ["--autotune"], ["--no-autotune"], ["--autotune-log-file", "at.csv"],
    ["--autotune-warmup-samples", "3"], ["--autotune-steps-per-sample", "10"],
    ["--autotune-bayes-opt-max-samples", "20"], ["--autotune-gaussian-process-noise", "0.8"],
    ["--timeline-filename", "tl.json"], ["--timeline-mark-cycles"], ["--no-timeline-mark-cycles"],
    ["--no-stall-check"], ["--stall-check"], ["--stall-check-warning-time-seconds", "60"],
    ["--stall-check-shutdown-time-seconds", "0"], ["--mpi-threads-disable"], ["--no-mpi-threads-disable"],
    ["--mpi-args=--oversubscribe"], ["--tcp"], ["--binding-args=--bind-to none"], ["--num-nccl-streams", "1"],
    ["--thread-affinity", "0"], ["--gloo-timeout-seconds", "30"], ["--log-level", "WARNING"],
    ["--log-with-timestamp"], ["--log-without-timestamp"], ["-prefix-timestamp"], ["--prefix-output-with-timestamp"],
    ["--log-hide-timestamp"], ["--no-log-hide-timestamp"], ["-H", "localhost:2"], ["--hosts", "localhost:2"],
    ["-hostfile", "HOSTFILE"], ["--hostfile", "HOSTFILE"], ["--gloo"], ["--mpi"], ["--jsrun"],
]


@pytest.mark.parametrize("flag", HOROVODRUN_FLAGS, ids=lambda flag: flag[0])
def test_every_horovodrun_flag_is_accepted(capsys, tmp_path, flag):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    (tmp_path / "key").write_text("")
    (tmp_path / "horovod.yaml").write_text("params:\n  cycle_time_ms: 2\n")
    args = [{"CONFIG": str(tmp_path / "horovod.yaml"), "KEY": str(tmp_path / "key"),
             "HOSTFILE": str(tmp_path / "hosts")}.get(arg, arg) for arg in flag]
    status = main(["run", "-np", "2", *args, "--dry-run", "python", "train.py"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert len(err.strip().splitlines()) <= 1, err  # at most the one line of a flag mtrain has no use for
    if flag[0] in ("-v", "--version"):
        assert out.strip() == f"mtrain, version {mtrain.__version__}", out
    elif flag[0] in ("-cb", "--check-build"):
        assert "Available Frameworks:" in out, out
    else:  # the job's plan, not click's help (which a misread single-dash flag such as -hostfile gives)
        assert re.search(r"^host localhost: ranks 0-1 \(local\)$", out, re.MULTILINE), out


def test_horovodruns_elastic_flags_are_accepted(capsys, tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\n")
    script.chmod(0o755)
    status = main(["run", "-np", "2", "--min-np", "1", "--max-np", "2", "--slots-per-host", "2",
                   "--elastic-timeout", "60", "--reset-limit", "3", "--blacklist-cooldown-range", "1", "5",
                   "--host-discovery-script", str(script), "--dry-run", "python", "train.py"])
    assert status == 0, capsys.readouterr().err
