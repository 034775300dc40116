"""`mtrain check`: what this install can do (MPI, CUDA-awareness, frameworks, GPUs)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading

FRAMEWORKS = ("numpy", "cupy", "torch", "tensorflow")
_IMPORT_PROBE = "import importlib,sys; m=importlib.import_module(sys.argv[1]); print(getattr(m,'__version__','?'))"


def _run(argv: list[str], timeout: float = 60.0) -> tuple[int, str]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        return 1, str(error)
    return done.returncode, (done.stdout + done.stderr).strip()


def mpi_description() -> tuple[str, str]:
    """(launcher line, library line) for the MPI mtrain would use."""
    from mtrain.launcher.mpirun import MpiNotFound, find_mpirun
    try:
        mpi = find_mpirun()
        status, text = _run([mpi.path, "--version"], 20)
        launcher_line = f"{mpi.kind} launcher {mpi.path}: {text.splitlines()[0] if text else '?'}"
    except MpiNotFound as error:
        launcher_line = f"no MPI launcher: {error}"
    # mpi4py's library, read without initialising MPI (a probe must not start a job).
    status, text = _run([sys.executable, "-c",
                         "import mpi4py; mpi4py.rc.initialize=False; from mpi4py import MPI; "
                         "print(MPI.Get_library_version().splitlines()[0])"], 30)
    return launcher_line, (f"mpi4py uses: {text}" if status == 0 else "mpi4py: not importable")


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
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    status, text = _run([smi, "-L"], 20)
    return sum(1 for line in text.splitlines() if line.startswith("GPU")) if status == 0 else 0


def report() -> int:
    """Print the capability report; 0 when an MPI launcher is usable."""
    results: dict[str, str] = {}

    def probe(name: str) -> None:
        # A separate interpreter per framework: a broken install cannot take mtrain down.
        status, text = _run([sys.executable, "-c", _IMPORT_PROBE, name], 120)
        results[name] = text.splitlines()[-1] if status == 0 else "not importable"

    threads = [threading.Thread(target=probe, args=(name,), daemon=True) for name in FRAMEWORKS]
    for thread in threads:
        thread.start()
    launcher_line, library_line = mpi_description()
    print(launcher_line)
    print(library_line)
    print(f"CUDA-aware MPI: {cuda_aware()}")
    for thread in threads:
        thread.join(130)
    for name in FRAMEWORKS:
        print(f"{name}: {results.get(name, 'timed out')}")
    print(f"GPUs: {gpu_count()}")
    return 0 if not launcher_line.startswith("no MPI") else 1
