"""Whether the per-tensor submit pays: one all-reduce per tensor through the runtime's two submits.

Run as ``mpirun -np 2 python benchmarks/submit_path.py`` (or ``mtrain run -np 2 …``).
A step of N small in-place all-reduces (default 1,000 × 1 KiB, as a model with many
small gradients submits them), each variant taking turns in the same run:

* one object: ``rr.allreduce_async_`` → ``submit.submit_allreduce``, which makes one
  ``AllreduceOp`` (request and handle in one) and queues it through ``SubmitQueue.submit_one``;
* request + handle: what every other op takes, a ``Handle`` and a ``Request`` per tensor
  (``requests.make_request``), queued by ``Engine.submit`` through the same queue core;
* MPI_Allreduce per tensor (mpi4py, in place), for scale.

Both mtrain variants give the same results (checked); time per step is the median over
rounds of the slowest rank's step.
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mtrain.ringreduce as rr
from mtrain.ringreduce import runtime
from mtrain.ringreduce.core.ops import Kind
from mtrain.ringreduce.core.requests import Handle, make_request

from allreduce import timed_side_by_side  # a sibling benchmark (repo_helpers.py says why so)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tensors", type=int, default=1000)
    parser.add_argument("--elements", type=int, default=256, help="float32 elements per tensor")
    parser.add_argument("--budget", type=float, default=3.0, help="seconds of timing (approx.)")
    parser.add_argument("--min-iters", type=int, default=20)
    args = parser.parse_args()
    rr.init()
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    engine = runtime.current().sets[0].engine  # benchmark only: the general submit, driven directly
    arrays = {key: [np.zeros(args.elements, np.float32) for _ in range(args.tensors)] for key in "abm"}
    names = {key: [f"{key}.{i}" for i in range(args.tensors)] for key in "ab"}

    def one_object() -> None:
        handles = [rr.allreduce_async_(a, op=rr.Sum, name=name) for a, name in zip(arrays["a"], names["a"])]
        for handle in handles:
            rr.synchronize(handle)

    def request_and_handle() -> None:
        handles = []
        for a, name in zip(arrays["b"], names["b"]):
            handle = Handle(1, False, engine.done_cv)
            engine.submit([make_request(Kind.ALLREDUCE, a, name, handle, op=rr.Sum, in_place=True)])
            handles.append(handle)
        for handle in handles:
            rr.synchronize(handle)

    def mpi_per_tensor() -> None:
        for a in arrays["m"]:
            comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)

    # Same inputs, same results: distinct per rank and element, then one step each.
    for key in "ab":
        for i, a in enumerate(arrays[key]):
            a[:] = np.arange(args.elements, dtype=np.float32) + me + i
    one_object()
    request_and_handle()
    for a, b in zip(arrays["a"], arrays["b"]):
        assert np.array_equal(a, b), "the two submits disagree"
    for key in "ab":
        for a in arrays[key]:
            a[:] = 0  # sums of zeros stay zero: every step does the same work
    nbytes = args.tensors * args.elements * 4
    medians = timed_side_by_side(comm, {"one object (submit_allreduce)": one_object,
                                        "request + handle (Engine.submit)": request_and_handle,
                                        "MPI_Allreduce per tensor": mpi_per_tensor},
                                 nbytes, args.budget, args.min_iters)
    if me == 0:
        base = medians["MPI_Allreduce per tensor"]
        print(f"# {args.tensors} x {args.elements * 4} B in-place all-reduces per step, {n} ranks")
        print(f"{'variant':40s} {'ms/step':>9s} {'us/tensor':>10s} {'vs MPI':>7s}")
        for label, seconds in medians.items():
            print(f"{label:40s} {seconds * 1e3:9.2f} {seconds * 1e6 / args.tensors:10.2f} {seconds / base:7.2f}")
    rr.shutdown()


if __name__ == "__main__":
    main()
