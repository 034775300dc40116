"""`mtrain check`: what this install can do (MPI, CUDA-awareness, frameworks, GPUs)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from typing import NamedTuple

FRAMEWORKS = ("numpy", "cupy", "torch", "tensorflow")
_IMPORT_PROBE = "import importlib,sys; m=importlib.import_module(sys.argv[1]); print(getattr(m,'__version__','?'))"


def _run(argv: list[str], timeout: float = 60.0) -> tuple[int, str]:
    """(status, stdout) of a command; on failure the text says why (its stderr, or the error)."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 1, str(error)
    # Only stdout carries the answer: libraries log to stderr (TensorFlow's oneDNN notice, say).
    return done.returncode, (done.stdout if done.returncode == 0 else done.stderr or done.stdout).strip()


def mpi_description() -> tuple[str, str]:
    """(launcher line, library line) for the MPI mtrain would use."""
    from mtrain.launcher.job.mpirun import MpiNotFound, find_mpirun
    try:
        mpi = find_mpirun()
        status, text = _run([mpi.path, "--version"], 20)
        launcher_line = f"{mpi.kind.value} launcher {mpi.path}: {text.splitlines()[0] if text else '?'}"
    except MpiNotFound as error:
        launcher_line = f"no MPI launcher: {error}"
    library = mpi_library()
    return launcher_line, (f"mpi4py uses: {library}" if library is not None else "mpi4py: not importable")


def mpi_library() -> str | None:
    """The first line of mpi4py's MPI library version, or None when mpi4py cannot load it."""
    # Read without initialising MPI (a probe must not start a job).
    status, text = _run([sys.executable, "-c",
                         "import mpi4py; mpi4py.rc.initialize=False; from mpi4py import MPI; "
                         "print(MPI.Get_library_version().splitlines()[0])"], 30)
    return text if status == 0 else None


def framework_versions(names: tuple[str, ...] = FRAMEWORKS) -> dict[str, str | None]:
    """{name: version, or None when it cannot be imported}, probed in parallel."""
    results: dict[str, str | None] = {}

    def probe(name: str) -> None:
        # A separate interpreter per framework: a broken install cannot take mtrain down.
        status, text = _run([sys.executable, "-c", _IMPORT_PROBE, name], 120)
        lines = text.splitlines()
        results[name] = lines[-1] if status == 0 and lines else None

    threads = [threading.Thread(target=probe, args=(name,), daemon=True) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(130)
    return results


def cuda_aware() -> str:
    """'yes' / 'no' / 'unknown' for Open MPI's CUDA support."""
    info = shutil.which("ompi_info") or shutil.which("ompi_info", path=sys.prefix + "/bin")
    if not info:
        return "unknown (no ompi_info)"
    status, text = _run([info, "--parsable", "--all"], 30)
    for line in text.splitlines():
        if "mpi_built_with_cuda_support:value" in line:
            return "yes" if line.rstrip().endswith("true") else "no"
    return "unknown"


def gpu_count() -> int:
    """NVIDIA GPUs on this host, by `nvidia-smi -L` (no CUDA library is loaded); 0 without the tool.

    The launcher's one GPU counter: `mtrain check` and the preflight probe on every host use it.
    Inside a rank the runtime asks CUDA itself (ringreduce.cuda), which honours CUDA_VISIBLE_DEVICES.
    """
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    status, text = _run([smi, "-L"], 20)
    return sum(1 for line in text.splitlines() if line.startswith("GPU")) if status == 0 else 0


def report() -> int:
    """Print the capability report; 0 when an MPI launcher is usable."""
    results: dict[str, str | None] = {}
    frameworks = threading.Thread(target=lambda: results.update(framework_versions()), daemon=True)
    frameworks.start()  # the imports take longest: they run while MPI is looked at
    launcher_line, library_line = mpi_description()
    print(launcher_line)
    print(library_line)
    print(f"CUDA-aware MPI: {cuda_aware()}")
    frameworks.join(135)
    for name in FRAMEWORKS:
        print(f"{name}: {results[name] or 'not importable'}" if name in results else f"{name}: timed out")
    print(f"GPUs: {gpu_count()}")
    return 0 if not launcher_line.startswith("no MPI") else 1


class BuildFacts(NamedTuple):
    """What `mtrain run --check-build` marks: Horovod's table, filled in from this install."""

    tensorflow: bool   # importable: mtrain.tensorflow (and .keras) can run
    torch: bool        # importable: mtrain.torch can run
    mpi: bool          # an MPI launcher and an mpi4py that loads its library


def build_facts() -> BuildFacts:
    from mtrain.launcher.job.mpirun import MpiNotFound, find_mpirun
    versions = framework_versions(("tensorflow", "torch"))
    try:
        find_mpirun()
        launcher = True
    except MpiNotFound:
        launcher = False
    return BuildFacts(tensorflow=versions.get("tensorflow") is not None, torch=versions.get("torch") is not None,
                      mpi=launcher and mpi_library() is not None)


def check_build(facts: BuildFacts | None = None) -> str:
    """Horovod's `--check-build` table for this install.  mtrain has no MXNet adapter and
    runs on MPI alone: its collectives are its own over MPI, with no Gloo, NCCL, DDL or
    oneCCL inside (a torch.distributed program may still use NCCL itself)."""
    import mtrain
    facts = build_facts() if facts is None else facts

    def mark(present: bool) -> str:
        return "[X]" if present else "[ ]"

    return "\n".join([
        f"mtrain v{mtrain.__version__}:",
        "",
        "Available Frameworks:",
        f"    {mark(facts.tensorflow)} TensorFlow",
        f"    {mark(facts.torch)} PyTorch",
        f"    {mark(False)} MXNet",
        "",
        "Available Controllers:",
        f"    {mark(facts.mpi)} MPI",
        f"    {mark(False)} Gloo",
        "",
        "Available Tensor Operations:",
        f"    {mark(False)} NCCL",
        f"    {mark(False)} DDL",
        f"    {mark(False)} CCL",
        f"    {mark(facts.mpi)} MPI",
        f"    {mark(False)} Gloo",
    ])
