"""Horovod's build queries (``hvd.mpi_built()`` …): training scripts branch on them.

mtrain always talks MPI through mpi4py; it has no Gloo, NCCL, DDL, oneCCL, ROCm or
SYCL (Intel GPU) support of its own. Its CUDA support is CuPy: present when the install
has it (``pip install 'mtrain[cuda12]'``), absent otherwise.
"""
from mtrain.ringreduce.transport.cuda import cupy_installed


def mpi_built() -> bool: return True
def mpi_enabled() -> bool: return True
def gloo_built() -> bool: return False
def gloo_enabled() -> bool: return False
def nccl_built() -> bool: return False
def ddl_built() -> bool: return False
def ccl_built() -> bool: return False


def cuda_built() -> bool:
    """Whether this install can reduce GPU buffers (CuPy arrays; CUDA tensors in mtrain.torch)."""
    return cupy_installed()


def rocm_built() -> bool: return False
# Horovod's examples call it on their default (GPU) path to pick 'XPU' over 'GPU' devices.
def sycl_built() -> bool: return False
