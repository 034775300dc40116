#!/usr/bin/env bash
# GPU check of the CuPy path, on one machine with a GPU (made for one H200, torch,
# cupy-cuda13x and mpi4py preinstalled, no network). Usually under 5 minutes
# (the step bounds add up to 560 s, under a 10-minute device call):
#   1. environment: GPU, CuPy, torch, mpi4py, MPI library, CUDA-aware or not
#   2. the GPU tests (tests/gpu) and the staging tests (tests/mpi/test_staging.py)
#   3. busbw of CuPy buffers 4 KiB .. 1 GiB at np=2 on one GPU: staged, then
#      CUDA-aware when MPI is, each with the device-to-device copy as reference
# Everything goes to stdout and, when $OUT is set, to $OUT/gpu_check.log.
# Run from anywhere: bash benchmarks/gpu_check.sh
set -u -o pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO" || exit 1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
LOG=/dev/null
if [ -n "${OUT:-}" ]; then mkdir -p "$OUT" && LOG="$OUT/gpu_check.log"; fi
exec > >(tee -a "$LOG") 2>&1

FAILED=()
step() {  # step NAME SECONDS CMD...: run with a time bound, record failures, never stop the script
    local name=$1 limit=$2; shift 2
    echo; echo "=== $name (limit ${limit}s) ==="
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "--- $name: exit $rc after $((SECONDS - start))s"
    [ $rc -eq 0 ] || FAILED+=("$name (exit $rc)")
}

# mtrain as it is installed (pip install -e .): the repository root is not put on the
# path, where its folders would import as top-level packages (benchmarks/repo_helpers.py).
# Two ranks on one GPU; let them yield when idle (they share the host cores too).
export OMPI_MCA_mpi_yield_when_idle=1
MPIRUN="$(dirname "$PY")/mpirun"
[ -x "$MPIRUN" ] || MPIRUN="$(command -v mpirun || true)"
ROOT_FLAG=()
[ "$(id -u)" = 0 ] && ROOT_FLAG=(--allow-run-as-root)

step "environment" 60 "$PY" - <<'EOF'
import importlib.util, os, sys
print("python", sys.version.split()[0])
for mod in ("numpy", "cupy", "torch", "mpi4py", "pytest"):
    spec = importlib.util.find_spec(mod)
    version = "missing"
    if spec is not None:
        try:
            version = getattr(__import__(mod), "__version__", "?")
        except Exception as exc:
            version = f"import failed: {exc!r}"
    print(f"{mod:8} {version}")
from mtrain.ringreduce.transport import cuda
print("GPUs visible to CuPy:", cuda.gpu_count(), " CUDA_VISIBLE_DEVICES =", os.environ.get("CUDA_VISIBLE_DEVICES"))
if cuda.gpu_count():
    import cupy
    props = cupy.cuda.runtime.getDeviceProperties(0)
    print("GPU 0:", props["name"].decode() if isinstance(props["name"], bytes) else props["name"],
          f"{props['totalGlobalMem'] / 2**30:.0f} GiB")
from mpi4py import MPI
print("MPI:", MPI.Get_library_version().splitlines()[0])
print("MPIX_Query_cuda_support():", cuda.query_cuda_support())
EOF

GPUS=$("$PY" -c "from mtrain.ringreduce.transport import cuda; print(cuda.gpu_count())" 2>/dev/null || echo 0)
if [ "$GPUS" = 0 ]; then
    echo; echo "no GPU visible to CuPy: only the staging tests on host stand-ins run"
    step "staging tests on host stand-ins" 90 "$PY" -m pytest -q -x tests/mpi/test_staging.py
    FAILED+=("no GPU (nothing GPU-side was checked)")
elif [ -z "$MPIRUN" ]; then
    echo "no mpirun found: skipping the MPI tests and the bandwidth table"
    FAILED+=("mpirun missing")
else
    CUDA_AWARE=$("$PY" -c "from mtrain.ringreduce.transport import cuda; print(int(bool(cuda.query_cuda_support())))" 2>/dev/null || echo 0)
    if "$PY" -c "import pytest" 2>/dev/null; then
        step "GPU tests (tests/gpu)" 210 "$PY" -m pytest -q -rs tests/gpu
        step "staging tests on host stand-ins" 90 "$PY" -m pytest -q -x tests/mpi/test_staging.py
    else
        echo "pytest missing: skipping the tests"; FAILED+=("pytest missing")
    fi
    BENCH=("$MPIRUN" "${ROOT_FLAG[@]}" -np 2 --oversubscribe --bind-to none
           -x OMPI_MCA_mpi_yield_when_idle -x MTRAIN_CUDA_AWARE
           "$PY" benchmarks/allreduce.py --cupy --min-bytes 4K --max-bytes 1G --budget 0.15 --min-iters 5)
    export MTRAIN_CUDA_AWARE=0
    step "busbw, CuPy buffers, staged through pinned host memory" 100 "${BENCH[@]}"
    if [ "$CUDA_AWARE" = 1 ]; then
        export MTRAIN_CUDA_AWARE=1
        step "busbw, CuPy buffers, CUDA-aware MPI" 100 "${BENCH[@]}"
    else
        echo; echo "=== busbw, CUDA-aware: skipped, this MPI is not CUDA-aware (MPIX_Query_cuda_support() = 0) ==="
    fi
fi

echo
if [ ${#FAILED[@]} -eq 0 ]; then
    echo "gpu_check: all steps passed"
else
    echo "gpu_check: ${#FAILED[@]} step(s) failed:"; printf '  %s\n' "${FAILED[@]}"
    exit 1
fi
