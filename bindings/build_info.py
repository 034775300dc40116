"""Horovod's build queries (``hvd.mpi_built()`` …): training scripts branch on them.

mtrain always talks MPI through mpi4py; it has no Gloo, NCCL, DDL, oneCCL or
ROCm controller of its own.
"""


def mpi_built() -> bool: return True
def mpi_enabled() -> bool: return True
def gloo_built() -> bool: return False
def gloo_enabled() -> bool: return False
def nccl_built() -> bool: return False
def ddl_built() -> bool: return False
def ccl_built() -> bool: return False
def cuda_built() -> bool: return False
def rocm_built() -> bool: return False
