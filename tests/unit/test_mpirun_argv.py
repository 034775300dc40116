"""The launcher argv builder: Open MPI 5 and MPICH hydra (pure)."""
import pytest

from mtrain.launcher.cli.config import MpiKind, MpiLauncher
from mtrain.launcher.job.environment import forwarded_names, rank_environment
from mtrain.launcher.job.hosts import HostSlots
from mtrain.launcher.job.mpirun import MpiNotFound, build_argv, kind_from_version_text

OMPI = MpiLauncher("/opt/ompi/bin/mpirun", MpiKind.OPENMPI)
HYDRA = MpiLauncher("/opt/mpich/bin/mpiexec", MpiKind.MPICH)
PLAN = [HostSlots("h1", 2), HostSlots("h2", 1)]
COMMAND = ["python", "train.py", "--name", "a b", "$HOME", "*", ";", "'q'"]


def _after(argv, flag):
    return [argv[i + 1] for i, word in enumerate(argv) if word == flag]


def test_openmpi_multi_host():
    argv = build_argv(OMPI, PLAN, COMMAND, rank_python="/env/bin/python", agent=["/env/bin/python", "-m", "mtrain.launcher.ssh.agent"],
                      env_names=["PATH"], env_values={"SEED": "1 2"}, network_interfaces=["10.0.0.0/24"],
                      as_root=True)
    assert argv[:3] == ["/opt/ompi/bin/mpirun", "-np", "3"]
    assert _after(argv, "--host") == ["h1:2,h2:1"]
    assert _after(argv, "--bind-to") == ["none"]
    assert "--allow-run-as-root" in argv
    prte = _after(argv, "--prtemca")
    assert prte == ["plm_ssh_agent", "plm_ssh_no_tree_spawn", "oob_tcp_if_include"]
    assert argv[argv.index("plm_ssh_agent") + 1] == "/env/bin/python -m mtrain.launcher.ssh.agent"
    assert argv[argv.index("btl_tcp_if_include") + 1] == "10.0.0.0/24"
    assert _after(argv, "-x") == ["PATH", "SEED=1 2"]
    # The user's words are the tail, untouched, after the rank wrapper.
    assert argv[-len(COMMAND) - 4:] == ["/env/bin/python", "-m", "mtrain.launcher.rank", "--", *COMMAND]


def test_openmpi_local_job_has_no_agent_and_no_root_flag():
    argv = build_argv(OMPI, [HostSlots("localhost", 4)], ["true"], rank_python="py", agent=None)
    assert "--prtemca" not in argv and "--allow-run-as-root" not in argv
    assert _after(argv, "--host") == ["localhost:4"]
    assert "mpi_yield_when_idle" not in argv


def test_openmpi_default_excludes_loopback_and_docker_between_hosts():
    argv = build_argv(OMPI, PLAN, ["true"], rank_python="py", agent=["agent"])
    excluded = argv[argv.index("btl_tcp_if_exclude") + 1].split(",")
    assert "lo" in excluded and "docker0" in excluded


def test_openmpi_rejects_agent_words_with_spaces():
    with pytest.raises(ValueError, match="spaces"):
        build_argv(OMPI, PLAN, ["true"], rank_python="py", agent=["/my env/python", "-m", "x"])


def test_hydra_multi_host():
    argv = build_argv(HYDRA, PLAN, COMMAND, rank_python="py", agent=["/tmp/shim"],
                      env_names=["PATH", "OMP_NUM_THREADS"], env_values={"A": "x y"},
                      network_interfaces=["ib0"], extra_args=["-verbose"])
    assert argv[:5] == ["/opt/mpich/bin/mpiexec", "-np", "3", "-hosts", "h1:2,h1:1".replace("h1:1", "h2:1")]
    assert _after(argv, "-launcher") == ["ssh"] and _after(argv, "-launcher-exec") == ["/tmp/shim"]
    assert _after(argv, "-genvlist") == ["PATH,OMP_NUM_THREADS"]
    assert argv[argv.index("-genv"):argv.index("-genv") + 3] == ["-genv", "A", "x y"]
    assert _after(argv, "-iface") == ["ib0"] and _after(argv, "-bind-to") == ["none"]
    assert argv.index("-verbose") < argv.index("mtrain.launcher.rank")
    assert argv[-len(COMMAND):] == COMMAND


def test_hydra_needs_a_single_program_agent():
    with pytest.raises(ValueError, match="one executable"):
        build_argv(HYDRA, PLAN, ["true"], rank_python="py", agent=["py", "-m", "mtrain.launcher.ssh.agent"])


def test_empty_command_or_plan_rejected():
    with pytest.raises(ValueError):
        build_argv(OMPI, PLAN, [], rank_python="py", agent=None)
    with pytest.raises(ValueError):
        build_argv(OMPI, [], ["true"], rank_python="py", agent=None)


@pytest.mark.parametrize("text, kind", [
    ("mpirun (Open MPI) 5.0.11\n", MpiKind.OPENMPI),
    ("prterun (PRRTE) 3.0.6\n", MpiKind.OPENMPI),
    ("HYDRA build details:\n    Version: 4.2.0\n", MpiKind.MPICH),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10", MpiKind.MPICH),
])
def test_kind_from_version_text(text, kind):
    assert kind_from_version_text(text) == kind


def test_unknown_mpi_refused():
    with pytest.raises(MpiNotFound, match="not Open MPI or MPICH"):
        kind_from_version_text("some other launcher 1.0")


def test_forwarded_environment():
    env = {"PATH": "/bin", "HOME": "/root", "NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0",
           "OMP_NUM_THREADS": "2", "MTRAIN_X": "1", "SECRET": "s"}
    assert forwarded_names(env) == ["CUDA_VISIBLE_DEVICES", "MTRAIN_X", "NCCL_DEBUG", "OMP_NUM_THREADS", "PATH"]
    names, values = rank_environment(env, ["SECRET", "PATH=/opt/bin", "UNSET_VAR", "NEW=a=b"])
    assert "SECRET" in names and "PATH" not in names and "UNSET_VAR" not in names
    assert values == {"PATH": "/opt/bin", "NEW": "a=b"}
