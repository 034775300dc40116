"""mtrain.torch against Horovod 0.28's behaviour: error classes, integer scaling, differentiable
collectives, grouped gather/scatter, sparse gradients, timeline and the module's surface.

Every rank body builds the single-process reference from every rank's data itself
(the data is a function of the rank), so one job checks both sides.
"""
import json
import os
import tempfile
import types
import warnings

import numpy as np
import pytest

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import mpi_test  # noqa: E402


def rank_data(r: int, shape, dtype=torch.float64) -> torch.Tensor:
    """Distinct per rank and per element."""
    count = int(np.prod(shape)) if len(shape) else 1
    values = torch.arange(count, dtype=torch.float64) * 0.37 - 1.1 * r + 0.01 * r * r + 0.5
    return values.reshape(shape).to(dtype)


# -- 1. errors ---------------------------------------------------------------------------------

@mpi_test(nps=(2, 3))
def test_every_collective_error_is_a_runtime_error_on_every_rank():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    last = me == n - 1
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert issubclass(hvd.MismatchError, hvd.HorovodInternalError) and issubclass(hvd.MismatchError, ValueError)
    f32, f64 = torch.float32, torch.float64

    def fails(call, *fragments, kind=RuntimeError):
        try:
            call()
        except kind as error:
            for fragment in fragments:
                assert fragment in str(error), f"{fragment!r} not in {error}"
            return error
        raise AssertionError(f"rank {me}: no {kind.__name__} from {call}")

    shape_of = (3, 2 + last)
    cases = {
        "allreduce shape": lambda: hvd.allreduce(torch.zeros(shape_of), name="e.ar.shape"),
        "allreduce dtype": lambda: hvd.allreduce(torch.zeros(3, dtype=f64 if last else f32), name="e.ar.dtype"),
        "allreduce op": lambda: hvd.allreduce(torch.zeros(3), op=hvd.Max if last else hvd.Sum, name="e.ar.op"),
        "allreduce scale": lambda: hvd.allreduce(torch.zeros(3), prescale_factor=2.0 if last else 1.0, name="e.ar.pre"),
        "grouped_allreduce shape": lambda: hvd.grouped_allreduce([torch.zeros(2), torch.zeros(shape_of)], name="e.gar"),
        "allgather shape": lambda: hvd.allgather(torch.zeros(shape_of), name="e.ag.shape"),
        "allgather dtype": lambda: hvd.allgather(torch.zeros(2, dtype=f64 if last else f32), name="e.ag.dtype"),
        "grouped_allgather shape": lambda: hvd.grouped_allgather([torch.zeros(1), torch.zeros(shape_of)], name="e.gag"),
        "broadcast shape": lambda: hvd.broadcast(torch.zeros(shape_of), 0, name="e.bc.shape"),
        "broadcast dtype": lambda: hvd.broadcast(torch.zeros(3, dtype=f64 if last else f32), 0, name="e.bc.dtype"),
        "broadcast root": lambda: hvd.broadcast(torch.zeros(3), root_rank=1 if last else 0, name="e.bc.root"),
        "broadcast_ root": lambda: hvd.broadcast_(torch.zeros(3), root_rank=1 if last else 0, name="e.bc_.root"),
        "alltoall shape": lambda: hvd.alltoall(torch.zeros((n, 1 + last)), name="e.a2a.shape"),
        "alltoall dtype": lambda: hvd.alltoall(torch.zeros(n, dtype=f64 if last else f32), name="e.a2a.dtype"),
        "reducescatter shape": lambda: hvd.reducescatter(torch.zeros((n, 1 + last)), name="e.rs.shape"),
        "reducescatter dtype": lambda: hvd.reducescatter(torch.zeros(n, dtype=f64 if last else f32), name="e.rs.dtype"),
        "reducescatter op": lambda: hvd.reducescatter(torch.zeros(n), op=hvd.Max if last else hvd.Sum, name="e.rs.op"),
        "grouped_reducescatter shape": lambda: hvd.grouped_reducescatter([torch.zeros((n, 1 + last))], name="e.grs"),
        "collective kind": lambda: (hvd.allreduce(torch.zeros(3), name="e.kind") if last
                                    else hvd.broadcast(torch.zeros(3), 0, name="e.kind")),
    }
    for what, call in cases.items():
        error = fails(call)
        assert isinstance(error, hvd.MismatchError) and isinstance(error, hvd.HorovodInternalError), what
    # Also through the async API: synchronize raises it.
    handle = hvd.allreduce_async(torch.zeros(2 + last), name="e.async")
    fails(lambda: hvd.synchronize(handle), "e.async")
    # A name already in flight on this rank: refused at once, as a RuntimeError (and still a ValueError).
    # In round k only rank k holds the op (the others submit it once rank k says it is done checking).
    for k in range(n):
        name = f"e.dup.{k}"
        if me == k:
            first = hvd.allreduce_async(torch.ones(2), name=name, op=hvd.Sum)
            fails(lambda: hvd.allreduce_async(torch.ones(2), name=name), f"'{name}' is already in flight")
            fails(lambda: hvd.allgather_async(torch.ones(2), name=name), "already in flight", kind=ValueError)
            hvd.broadcast_object("checked", root_rank=k, name=f"e.dup.ready.{k}")
        else:
            hvd.broadcast_object(None, root_rank=k, name=f"e.dup.ready.{k}")
            first = hvd.allreduce_async(torch.ones(2), name=name, op=hvd.Sum)
        assert hvd.synchronize(first).tolist() == [float(n)] * 2
    # A root rank that does not exist.
    fails(lambda: hvd.broadcast(torch.zeros(2), root_rank=n), "root_rank must be")
    fails(lambda: hvd.broadcast_(torch.zeros(2), root_rank=-1), "root_rank must be", kind=ValueError)
    # A scalar to reducescatter.
    fails(lambda: hvd.reducescatter(torch.tensor(1.5 + me)), "at least one dimension")
    fails(lambda: hvd.grouped_reducescatter([torch.ones(n), torch.tensor(2.0)]), "arrays[1]")
    # alltoall splits that are not integers, decided by the dtype (integral values too).
    for splits in (torch.tensor([1.0] * n), torch.tensor([1.0] * n, dtype=torch.float64), [1.0] * n):
        fails(lambda: hvd.alltoall(torch.zeros(n), splits=splits), "integer", kind=ValueError)
    # The runtime still works afterwards.
    assert hvd.allreduce(torch.full((2,), me + 1.0), op=hvd.Sum).tolist() == [n * (n + 1) / 2] * 2


# -- 2. semantics ---------------------------------------------------------------------------------

@mpi_test(nps=(1, 2, 3))
def test_integer_scaling_truncates_toward_zero_as_horovod():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    every = [torch.tensor([-37, 37, -3, 5, -1, 0, 9 + r], dtype=torch.int32) - 2 * r for r in range(n)]
    for dtype in (torch.int32, torch.int64, torch.int16):
        mine = every[me].to(dtype)
        pre = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5)
        want = sum(torch.trunc(e.double() * 0.5).long() for e in every)
        assert pre.dtype == dtype and pre.tolist() == want.tolist(), (dtype, pre, want)
        post = hvd.allreduce(mine, op=hvd.Sum, postscale_factor=0.25)
        want = torch.trunc(sum(e.long() for e in every).double() * 0.25).long()
        assert post.tolist() == want.tolist(), (dtype, post, want)
        # In place and fused with others (fusion buffer path).
        a, b = mine.clone(), (mine * 3).clone()
        hvd.grouped_allreduce_([a, b], op=hvd.Sum, prescale_factor=0.5)
        assert b.tolist() == sum(torch.trunc(e.double() * 1.5).long() for e in every).tolist()
        # Average is a sum scaled once by postscale / size, truncated (not floor-divided, then scaled).
        for post in (1.0, 3.0):
            got = hvd.allreduce(mine, op=hvd.Average, postscale_factor=post)
            want = torch.trunc(sum(e.long() for e in every).double() * (post / n)).long()
            assert got.tolist() == want.tolist(), (dtype, post, got, want)
    # The Horovod example itself, on one element.
    single = hvd.allreduce(torch.tensor([-37]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.0 / n)
    assert single.tolist() == [int(np.trunc(n * -18 / n))]
    # reducescatter scales the same way (rows 2 * n + 1: uneven split).
    rows = [torch.arange(-(2 * n + 1), 2 * n + 1, 2, dtype=torch.int64) * (r + 1) - r for r in range(n)]
    got = hvd.reducescatter(rows[me], op=hvd.Sum, prescale_factor=0.5, postscale_factor=0.5)
    full = torch.trunc(sum(torch.trunc(x.double() * 0.5) for x in rows) * 0.5).long()
    lo = sum(len(rows[0]) // n + (1 if r < len(rows[0]) % n else 0) for r in range(me))
    assert got.tolist() == full[lo:lo + got.shape[0]].tolist()


@mpi_test(nps=(2, 3))
def test_optimizer_state_broadcast_with_missing_gradients_and_step_after_synchronize_warns():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    makers = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
        "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        "adam": lambda p: torch.optim.Adam(p, lr=0.1),
        "adamw-amsgrad": lambda p: torch.optim.AdamW(p, lr=0.1, amsgrad=True),
    }
    for label, make in makers.items():
        for stepped in ([0], [1], list(range(n)), []):
            torch.manual_seed(me)
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).double()
            opt = make(model.parameters())
            if me in stepped:  # only the first layer gets gradients: the second has no state
                model[0](torch.ones(1, 3, dtype=torch.float64) * (me + 1)).sum().backward()
                opt.step()
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            state = opt.state_dict()["state"]
            gathered = hvd.allgather_object(sorted(state))
            assert all(keys == gathered[0] for keys in gathered), (label, stepped, gathered)
            for index, entry in state.items():
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor):
                        values = hvd.allgather_object(value.tolist())
                        assert all(v == values[0] for v in values), (label, stepped, index, key)
    # step() after an explicit synchronize(), outside skip_synchronize(): Horovod's warning, no second average.
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), named_parameters=[("p", p)])
    (p * (me + 1.0)).sum().backward()
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), -(n + 1) / 2, dtype=torch.float64))
    opt.zero_grad()
    (p * (me + 1.0)).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), -(n + 1.0), dtype=torch.float64))


# -- 3. differentiable collectives -------------------------------------------------------------------

def rows_of(total: int, n: int, r: int) -> "tuple[int, int]":
    lo = sum(total // n + (1 if k < total % n else 0) for k in range(r))
    return lo, lo + total // n + (1 if r < total % n else 0)


def _weights(shape, r: int) -> torch.Tensor:
    return torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape) * 0.11 + r * 0.7 - 0.3


@mpi_test(nps=(2, 3))
def test_collectives_are_differentiable_with_horovods_gradients():
    """Each rank's gradient equals d(sum over ranks of each rank's loss)/d(its input), built in one
    process from every rank's data, times the factor by which Horovod's backward functions
    (horovod/torch/mpi_ops.py) depart from it: 1/size for allgather and broadcast (an Average
    all-reduce of the gradient), size for reducescatter (an allgather times size for Sum).
    tests/bindings/test_torch_horovod_rules.py checks those rules op by op."""
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()

    def check(label, distributed, reference, shapes, grad_scale=1.0):
        """distributed(tensors) -> outputs on this rank; reference(per-rank tensors, r) -> rank r's outputs;
        grad_scale: Horovod's gradient over the textbook one."""
        mine = [rank_data(me, s(me)).requires_grad_() for s in shapes]
        outs = distributed(mine)
        outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
        assert all(o.grad_fn is not None for o in outs), f"{label}: no grad_fn"
        sum((o * _weights(o.shape, me)).sum() for o in outs).backward()
        every = [[rank_data(r, s(r)).requires_grad_() for s in shapes] for r in range(n)]
        total = 0
        for r in range(n):
            ref = reference(every, r)
            ref = list(ref) if isinstance(ref, (list, tuple)) else [ref]
            if r == me:
                for o, w in zip(outs, ref):
                    assert o.shape == w.shape and torch.allclose(o.detach(), w.detach(), atol=1e-12), label
            total = total + sum((o * _weights(o.shape, r)).sum() for o in ref)
        total.backward()
        for got, want in zip(mine, every[me]):
            want = torch.zeros_like(want) if want.grad is None else want.grad * grad_scale  # unused input: zeros
            assert got.grad is not None and torch.allclose(got.grad, want, atol=1e-12), f"{label}: rank {me} grad {got.grad} != {want}"

    same = lambda r: (3, 5)  # noqa: E731
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0), (hvd.Average, 2.0, 0.25)):
        scale = pre * post / (n if op == hvd.Average else 1)
        check(f"allreduce {op} {pre} {post}",
              lambda ts: hvd.allreduce(ts[0] * 1.0, op=op, prescale_factor=pre, postscale_factor=post),
              lambda ev, r: sum(e[0] for e in ev) * scale, [same])
        check(f"grouped_allreduce {op}",
              lambda ts: hvd.grouped_allreduce([ts[0], ts[1] * 2], op=op, prescale_factor=pre, postscale_factor=post),
              lambda ev, r: [sum(e[0] for e in ev) * scale, sum(e[1] * 2 for e in ev) * scale],
              [same, lambda r: (7,)])
    ragged = lambda r: (r + 1, 3)  # noqa: E731  first dimension differs per rank
    check("allgather", lambda ts: hvd.allgather(ts[0]), lambda ev, r: torch.cat([e[0] for e in ev]), [ragged],
          1 / n)
    check("allgather scalar", lambda ts: hvd.allgather(ts[0]), lambda ev, r: torch.stack([e[0] for e in ev]),
          [lambda r: ()], 1 / n)
    check("grouped_allgather", lambda ts: hvd.grouped_allgather([ts[0], ts[1]]),
          lambda ev, r: [torch.cat([e[0] for e in ev]), torch.cat([e[1] for e in ev])],
          [ragged, lambda r: (2 * r + 1,)], 1 / n)
    for root in range(n):
        check(f"broadcast root {root}", lambda ts: hvd.broadcast(ts[0], root),
              lambda ev, r: ev[root][0] * 1.0, [same], 1 / n)
    # alltoall: rank r sends splits[r][d] rows to rank d.
    splits = [[(r + d) % 3 for d in range(n)] for r in range(n)]

    def a2a_ref(ev, r):
        parts = []
        for src in range(n):
            lo = sum(splits[src][:r])
            parts.append(ev[src][0][lo:lo + splits[src][r]])
        return torch.cat(parts)
    check("alltoall splits", lambda ts: hvd.alltoall(ts[0], splits=torch.tensor(splits[me]))[0], a2a_ref,
          [lambda r: (sum(splits[r]), 2)])
    check("alltoall even", lambda ts: hvd.alltoall(ts[0]),
          lambda ev, r: torch.cat([e[0][2 * r:2 * r + 2] for e in ev]), [lambda r: (2 * n, 3)])
    total_rows = 2 * n + 1
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Average, 0.5, 3.0)):
        scale = pre * post / (n if op == hvd.Average else 1)
        check(f"reducescatter {op} {pre} {post}",
              lambda ts: hvd.reducescatter(ts[0], op=op, prescale_factor=pre, postscale_factor=post),
              lambda ev, r: (sum(e[0] for e in ev) * scale)[slice(*rows_of(total_rows, n, r))],
              [lambda r: (total_rows, 2)], n)
        check(f"grouped_reducescatter {op}",
              lambda ts: hvd.grouped_reducescatter([ts[0], ts[1]], op=op, prescale_factor=pre, postscale_factor=post),
              lambda ev, r: [(sum(e[0] for e in ev) * scale)[slice(*rows_of(total_rows, n, r))],
                             (sum(e[1] for e in ev) * scale)[slice(*rows_of(n + 2, n, r))]],
              [lambda r: (total_rows, 2), lambda r: (n + 2,)], n)
    # Without requires_grad: plain tensors, no graph.
    assert hvd.allgather(rank_data(me, (2,))).grad_fn is None
    with torch.no_grad():
        assert hvd.broadcast(rank_data(me, (2,)).requires_grad_(), 0).grad_fn is None


# -- 4. grouped gather / scatter -------------------------------------------------------------------

@mpi_test(nps=(1, 2, 3))
def test_grouped_allgather_and_reducescatter():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    shapes = [(me + 1, 3), (2 * me + 1,), (1, 2, 2)]
    mine = [rank_data(me, s) + k for k, s in enumerate(shapes)]
    every = [[rank_data(r, s) + k for k, s in enumerate([(r + 1, 3), (2 * r + 1,), (1, 2, 2)])] for r in range(n)]
    gathered = hvd.grouped_allgather(mine, name="g.ag")
    for k, got in enumerate(gathered):
        assert torch.equal(got, torch.cat([e[k] for e in every])), k
    handle = hvd.grouped_allgather_async([m.float() for m in mine])
    assert [torch.equal(g, torch.cat([e[k].float() for e in every])) for k, g in enumerate(hvd.synchronize(handle))] \
        == [True] * 3
    rs_shapes = [(2 * n + 1, 2), (n,), (n + 2, 1, 3)]
    rs_mine = [rank_data(me, s) * (k + 1) for k, s in enumerate(rs_shapes)]
    rs_every = [[rank_data(r, s) * (k + 1) for k, s in enumerate(rs_shapes)] for r in range(n)]
    for op, pre, post in ((hvd.Sum, 1.0, 1.0), (hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 3.0)):
        scale = pre * post / (n if op == hvd.Average else 1)
        results = [hvd.grouped_reducescatter(rs_mine, op=op, prescale_factor=pre, postscale_factor=post),
                   hvd.synchronize(hvd.grouped_reducescatter_async(rs_mine, op=op, prescale_factor=pre,
                                                                   postscale_factor=post))]
        for got in results:
            for k, part in enumerate(got):
                full = sum(e[k] for e in rs_every) * scale
                assert torch.allclose(part, full[slice(*rows_of(rs_shapes[k][0], n, me))], atol=1e-12), (op, k)


# -- 5. sparse --------------------------------------------------------------------------------------

def _embedding_model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.ModuleDict({"emb": torch.nn.Embedding(13, 4, sparse=True),
                                "out": torch.nn.Linear(4, 2)}).double()


def _embedding_loss(model, ids, target):
    return torch.nn.functional.mse_loss(model["out"](model["emb"](ids).sum(1)), target)


@mpi_test(nps=(2, 3))
def test_sparse_allreduce_and_sparse_embedding_training_equal_one_process():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    # sparse_allreduce_async: duplicate indices within and across ranks are summed; Average divides.
    def sparse_of(r):
        idx = torch.tensor([[r % 4, 5, r % 4, 6 + r], [0, 1, 0, 2]])
        return torch.sparse_coo_tensor(idx, torch.arange(4, dtype=torch.float64) + 10 * r + 1, (9, 3))
    dense = sum(sparse_of(r).to_dense() for r in range(n))
    for op, want in ((hvd.Sum, dense), (hvd.Average, dense / n)):
        handle = hvd.sparse_allreduce_async(sparse_of(me), name=f"sp.{op}", op=op)
        got = hvd.synchronize(handle)
        assert got.is_sparse and got.is_coalesced() and torch.allclose(got.to_dense(), want), op
        assert handle() is got  # Horovod's sparse handle is callable
    # A model with a sparse embedding: np ranks on their slices == one process on the whole batch.
    steps, b = 3, 3
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 13, (n * b, 5), generator=g), torch.randn(n * b, 2, generator=g, dtype=torch.float64))
               for _ in range(steps)]
    for sparse_as_dense in (False, True):
        reference, model = _embedding_model(0), _embedding_model(0)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5),
                                       named_parameters=model.named_parameters(), sparse_as_dense=sparse_as_dense)
        for ids, target in batches:
            ref_opt.zero_grad()
            _embedding_loss(reference, ids, target).backward()
            assert reference["emb"].weight.grad.is_sparse
            ref_opt.step()
            opt.zero_grad()
            part = slice(me * b, (me + 1) * b)
            _embedding_loss(model, ids[part], target[part]).backward()
            opt.step()
            # Sparse either way: sparse_as_dense reduces a dense copy and makes the result sparse
            # again before the update (Horovod's synchronize, horovod/torch/optimizer.py).
            assert model["emb"].weight.grad.is_sparse
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(p, q, atol=1e-12), f"sparse_as_dense={sparse_as_dense}: {name} differs"


# -- 6. timeline, homogeneity, build queries, the module's surface -------------------------------------

@mpi_test(nps=(1, 2))
def test_timeline_homogeneous_build_queries_and_public_names():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    folder = hvd.broadcast_object(tempfile.mkdtemp() if me == 0 else None, root_rank=0)
    path = os.path.join(folder, "timeline.json")
    hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(5) * me, name="tl.allreduce")
    hvd.allgather(torch.ones(2), name="tl.allgather")
    hvd.stop_timeline()
    hvd.allreduce(torch.ones(5), name="tl.after")
    hvd.barrier()
    if me == 0:
        with open(path) as f:
            events = json.load(f)
        rows = {e["args"].get("name") for e in events if e.get("name") == "process_name"}
        assert {"tl.allreduce", "tl.allgather"} <= rows and "tl.after" not in rows, rows
        assert any(e.get("name") == "CYCLE_START" for e in events)
        assert any(e.get("name") == "ALLREDUCE" for e in events)
        hvd.start_timeline(path + ".2")  # restartable, without cycle marks
        hvd.stop_timeline()
        hvd.stop_timeline()  # stopping twice is harmless
        assert json.load(open(path + ".2"))[-1]["name"] == "end"
    hvd.barrier()
    assert hvd.is_homogeneous() is True  # every rank on this one host
    for query, value in (("mpi_built", True), ("mpi_enabled", True), ("gloo_built", False), ("gloo_enabled", False),
                         ("nccl_built", False), ("ddl_built", False), ("ccl_built", False), ("rocm_built", False),
                         ("sycl_built", False)):
        assert getattr(hvd, query)() is value, query
    assert isinstance(hvd.cuda_built(), bool)
    names = dir(hvd)
    assert not [x for x in names if x.startswith("_")], names
    for leaked in ("np", "torch", "Any", "rr", "contextlib", "warnings", "Handle", "Optional"):
        assert leaked not in names, leaked
    for wanted in ("allreduce", "HorovodInternalError", "start_timeline", "is_homogeneous", "grouped_allgather",
                   "sparse_allreduce_async", "nccl_built", "DistributedOptimizer", "Compression"):
        assert wanted in names, wanted
    assert "elastic" in names  # Horovod's hvd.elastic
    namespace: dict = {}
    exec("from mtrain.torch import *", namespace)
    imported = set(namespace) - {"__builtins__"}
    assert imported == set(hvd.__all__) and all(hasattr(hvd, x) for x in imported)
    assert not [x for x in imported if isinstance(namespace[x], types.ModuleType)]


# -- 7. SyncBatchNorm ----------------------------------------------------------------------------

@mpi_test(nps=(2, 3))
def test_sync_batch_norm_equals_batch_norm_on_the_concatenated_batch():
    import mtrain.torch as hvd
    n, me = hvd.size(), hvd.rank()
    for shape, momentum, affine in (((4, 3), 0.1, True), ((3, 2, 5, 2), None, True), ((2, 4, 3), 0.3, False)):
        b, channels = shape[0], shape[1]
        whole = torch.cat([rank_data(r, shape) * (1 + 0.2 * r) + torch.arange(channels, dtype=torch.float64)
                           .reshape([1, channels] + [1] * (len(shape) - 2)) * r for r in range(n)])
        reference = torch.nn.BatchNorm1d(channels, momentum=momentum, affine=affine).double() if len(shape) < 4 \
            else torch.nn.BatchNorm2d(channels, momentum=momentum, affine=affine).double()
        sync = hvd.SyncBatchNorm(channels, momentum=momentum, affine=affine).double()
        if affine:
            with torch.no_grad():
                for module in (reference, sync):
                    module.weight.copy_(torch.arange(channels, dtype=torch.float64) * 0.5 + 0.7)
                    module.bias.copy_(torch.arange(channels, dtype=torch.float64) * -0.2)
        for step in range(2):
            x_all = (whole + step).requires_grad_()
            out_all = reference(x_all)
            weights = torch.cat([_weights((b,) + shape[1:], r) for r in range(n)])
            (out_all * weights).sum().backward()
            x = (whole[me * b:(me + 1) * b] + step).requires_grad_()
            out = sync(x)
            assert out.grad_fn is not None
            (out * _weights(out.shape, me)).sum().backward()
            assert torch.allclose(out, out_all[me * b:(me + 1) * b], atol=1e-10), (shape, step)
            assert torch.allclose(x.grad, x_all.grad[me * b:(me + 1) * b], atol=1e-10), (shape, step)
            if affine:  # parameter gradients: this rank's share; summed over ranks, the whole batch's
                for p, q in ((sync.weight, reference.weight), (sync.bias, reference.bias)):
                    assert torch.allclose(hvd.allreduce(p.grad, op=hvd.Sum), q.grad, atol=1e-10), shape
                    p.grad = q.grad = None
            assert torch.allclose(sync.running_mean, reference.running_mean, atol=1e-12)
            assert torch.allclose(sync.running_var, reference.running_var, atol=1e-12)
        assert int(sync.num_batches_tracked) == 2
        sync.eval()
        reference.eval()
        x = whole[me * b:(me + 1) * b]
        assert torch.allclose(sync(x), reference(whole)[me * b:(me + 1) * b], atol=1e-12)
    with pytest.raises(ValueError, match="2D"):
        hvd.SyncBatchNorm(3)(torch.zeros(3))
