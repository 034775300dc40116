"""mtrain.elastic with PyTorch: commit/restore, resuming from the newest snapshot, host updates,
the reset exit status, and ElasticSampler.

All ranks of these jobs run on one machine, so each rank body points its own
environment at its own snapshot folder ("rank<r>/{host}") to play a host of its own.
"""
import io
import os
import shutil
import sys
import tempfile

import numpy as np

from tests.bindings.requires import require

require("torch", "pip install '.[torch]'")

import torch  # noqa: E402

from tests.mpi.harness import launch, mpi_test  # noqa: E402

ELASTIC_VARS = ("MTRAIN_ELASTIC", "MTRAIN_ELASTIC_STATE_DIR", "MTRAIN_ELASTIC_UPDATES", "MTRAIN_ELASTIC_VERSION",
                "MTRAIN_JOB_SECRET")
KEY = "0123456789abcdef" * 4  # the job's key, as the launcher would give every rank


def _model(seed: int):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()


def _flat(model) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def _step(model, optimizer, shift: float) -> None:
    x = torch.arange(15, dtype=torch.float64).reshape(3, 5) / 7 + shift
    optimizer.zero_grad()
    model(x).pow(2).sum().backward()
    optimizer.step()


def _identical(hvd, value, what: str) -> None:
    everyone = hvd.allgather_object(value)
    for r, other in enumerate(everyone):
        assert np.array_equal(np.asarray(other), np.asarray(value)), f"{what}: rank {r} differs from rank {hvd.rank()}"


def _shared_tmp(hvd) -> str:
    return hvd.broadcast_object(tempfile.mkdtemp(prefix="mtrain-elastic-") if hvd.rank() == 0 else None, 0)


def _elastic_env(base: str, rank: int, version: int = 0) -> None:
    os.environ.update({"MTRAIN_ELASTIC": "1",
                       "MTRAIN_ELASTIC_STATE_DIR": os.path.join(base, f"rank{rank}", "{host}"),
                       "MTRAIN_ELASTIC_UPDATES": os.path.join(base, f"updates-rank{rank}-{{host}}"),
                       "MTRAIN_ELASTIC_VERSION": str(version), "MTRAIN_JOB_SECRET": KEY})


def _plain_env() -> None:
    for name in ELASTIC_VARS:
        os.environ.pop(name, None)


@mpi_test(nps=(2, 3))
def test_commit_restore_round_trip_and_sync_outside_an_elastic_job():
    import mtrain.torch as hvd
    from mtrain.elastic import torch as elastic
    _plain_env()
    n, me = hvd.size(), hvd.rank()
    model = _model(seed=10 + me)  # different on every rank until the state syncs
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (me + 1))
    state = elastic.TorchState(model=model, optimizer=optimizer, epoch=me, batch=10 * me, history=[me])
    assert state.commit_number == -1

    @elastic.run
    def train(state, steps):
        _identical(hvd, _flat(state.model), "parameters after the run's sync")
        assert (state.epoch, state.batch, state.history) == (0, 0, [0]), "attributes are rank 0's"
        for step in range(steps):
            _step(state.model, state.optimizer, shift=me + step)  # distinct per rank
            state.batch = step * 100 + me
            state.history.append(step)
            state.commit()
            assert state.commit_number == step
        committed = (_flat(state.model), state.batch, list(state.history),
                     copy_state(state.optimizer.state_dict()))
        _step(state.model, state.optimizer, shift=50.0)
        state.batch, state.epoch = -1, 99
        state.history.append("lost")
        state.restore()
        assert np.array_equal(_flat(state.model), committed[0])
        assert (state.batch, state.history, state.epoch) == (committed[1], committed[2], 0)
        restored = state.optimizer.state_dict()["state"]
        for index, values in committed[3].items():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(restored[index][key], values[key]), f"optimizer {index}.{key}"
        state.check_host_updates()  # outside an elastic job: nothing happens, no collective
        return "done"

    assert train(state, 3) == "done"
    # ObjectState alone, with Horovod's leading arguments too.
    plain = elastic.ObjectState(hvd.broadcast_object, hvd.rank, values=[me, me + 1])
    plain.sync()
    assert plain.values == [0, 1]
    plain.values.append(7)
    plain.commit()
    plain.values.append(8)
    plain.restore()
    assert plain.values == [0, 1, 7]


def copy_state(state_dict):
    import copy
    return copy.deepcopy(state_dict["state"])


@mpi_test(nps=(2, 3))
def test_a_generation_resumes_from_the_newest_commit_any_host_holds():
    import mtrain.torch as hvd
    from mtrain.elastic import snapshot
    from mtrain.elastic import torch as elastic
    from mtrain.common.records.elastic import ElasticResume, RESUME_MARKER
    n, me = hvd.size(), hvd.rank()
    dataset = list(range(40))
    # Each round: commit held by each rank's "host" (-1: none, a new host).
    rounds = {
        "newest on the last rank": [3 + r for r in range(n)],
        "newest on rank 0": [9] + [-1] * (n - 1),
        "a tie: the lowest rank is the source": [-1] + [5] * (n - 1),
        "nobody has a snapshot": [-1] * n,
    }
    for what, commits in rounds.items():
        base = _shared_tmp(hvd)
        _elastic_env(base, me)
        # What this rank's host committed: values distinct per rank and element.
        old_model = _model(seed=200 + me)
        old_opt = torch.optim.SGD(old_model.parameters(), lr=0.1, momentum=0.9)
        _step(old_model, old_opt, shift=me)
        old_sampler = elastic.ElasticSampler(dataset, seed=3)
        old_sampler.record_indices(range(10 * me, 10 * me + 4))
        old = elastic.TorchState(model=old_model, optimizer=old_opt, sampler=old_sampler, epoch=100 + me,
                                 batch=7 * me)
        old.save()  # collective: the sampler's record becomes every rank's
        if commits[me] >= 0:
            snapshot.write(os.path.join(base, f"rank{me}", os.uname().nodename),
                           snapshot.new_header(commits[me], 7), old.committed_values(), KEY.encode())
        newest = max(commits)
        source = commits.index(newest)
        want_flat = hvd.broadcast_object(_flat(old_model), source)
        # The new generation starts from fresh objects (different on every rank).
        model = _model(seed=300 + me)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = elastic.ElasticSampler(dataset, seed=3)
        state = elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
        resets = []
        state.register_reset_callbacks([lambda: resets.append(hvd.size())])
        captured = io.BytesIO()
        real_stderr = sys.stderr
        wrapper = io.TextIOWrapper(captured, write_through=True)  # kept: collecting it closes `captured`
        if me == 0:
            sys.stderr = wrapper

        @elastic.run
        def train(state):
            return state.commit_number

        try:
            got = train(state)
        finally:
            sys.stderr = real_stderr
        written = captured.getvalue()
        assert got == newest, f"{what}: resumed from {got}, want {newest}"
        assert resets == ([n] if newest >= 0 else []), f"{what}: reset callbacks {resets}"
        if newest >= 0:
            assert np.array_equal(_flat(state.model), want_flat), f"{what}: parameters are not the source's"
            assert (state.epoch, state.batch) == (100 + source, 7 * source), what
            momentum = [s["momentum_buffer"].numpy() for s in state.optimizer.state_dict()["state"].values()]
            assert len(momentum) == 4, f"{what}: optimizer state missing"
            processed = set().union(*(range(10 * r, 10 * r + 4) for r in range(n)))
            assert state.sampler.processed_indices == processed, what
        else:
            assert np.array_equal(_flat(state.model), hvd.broadcast_object(_flat(model), 0)), what
            processed = set()
        _identical(hvd, _flat(state.model), what)
        # The sampler repartitions what is left of the epoch among this generation's ranks.
        shares = hvd.allgather_object(list(state.sampler))
        left = set(dataset) - processed
        assert set().union(*map(set, shares)) == left, what
        assert sum(map(len, shares)) == n * -(-len(left) // n), what
        if me == 0:
            lines = [line for line in written.splitlines() if line.startswith(RESUME_MARKER)]
            assert [ElasticResume.decode(line[len(RESUME_MARKER):]) for line in lines] == \
                [ElasticResume(newest, n)], f"{what}: {written!r}"
        # The next commit continues the count and lands in this host's snapshot (local rank 0 writes).
        state.commit()
        assert state.commit_number == newest + 1
        if hvd.local_rank() == 0:
            header = snapshot.read_header(os.path.join(base, f"rank{me}", os.uname().nodename), KEY.encode())
            assert header is not None and header.commit == newest + 1 and header.size == n, (what, header)
        hvd.barrier()
        if me == 0:
            shutil.rmtree(base)
    _plain_env()


@mpi_test(nps=(2, 3))
def test_host_updates_interrupt_every_rank_at_the_same_commit():
    import mtrain.torch as hvd
    from mtrain.elastic import torch as elastic
    from mtrain.common.records.elastic import HostUpdates
    n, me = hvd.size(), hvd.rank()
    base = _shared_tmp(hvd)
    _elastic_env(base, me, version=4)
    state = elastic.ObjectState(step=0)
    seen_at = None
    for step in range(8):
        state.step = step
        if me == n - 1 and step == 2:
            # Only this rank's host hears of a new host set (an older version first: no news).
            HostUpdates(3).write(os.environ["MTRAIN_ELASTIC_UPDATES"].format(host=os.uname().nodename))
        if me == n - 1 and step == 3:
            HostUpdates(5).write(os.environ["MTRAIN_ELASTIC_UPDATES"].format(host=os.uname().nodename))
        try:
            state.commit()
        except elastic.HostsUpdatedInterrupt as interrupt:
            assert interrupt.skip_sync is False
            seen_at = step
            break
    assert hvd.allgather_object(seen_at) == [3] * n
    assert state.commit_number == 3
    hvd.barrier()
    if me == 0:
        shutil.rmtree(base)
    _plain_env()


@mpi_test(nps=(2, 3))
def test_elastic_sampler_partitions_and_resumes_after_recorded_batches():
    import mtrain.torch as hvd
    from mtrain.elastic import torch as elastic
    _plain_env()
    n, me = hvd.size(), hvd.rank()
    for length in (24, 23, 2):
        for shuffle in (True, False):
            what = f"length {length} shuffle {shuffle}"
            sampler = elastic.ElasticSampler(list(range(length)), shuffle=shuffle, seed=11)
            shares = hvd.allgather_object(list(sampler))
            assert all(len(share) == len(sampler) == -(-length // n) for share in shares), what
            flat = [i for share in shares for i in share]
            assert set(flat) == set(range(length)), f"{what}: an index is lost"
            assert len(flat) - len(set(flat)) == n * len(sampler) - length, f"{what}: repeats beyond padding"
            if shuffle and length > 10:
                assert flat != sorted(flat), what
            state = elastic.TorchState(sampler=sampler, epoch=0)
            if length < 2 * n:
                continue
            sampler.record_batch(0, 2)  # each rank processed its first batch of 2
            state.commit()  # gathers every rank's record
            processed = {i for share in shares for i in share[:2]}
            assert sampler.processed_indices == processed, what
            # A new generation (simulated: a fresh sampler loads the commit) partitions the rest.
            resumed = elastic.ElasticSampler(list(range(length)), shuffle=shuffle, seed=11)
            resumed.load_state_dict(state.committed_values()["handlers"]["sampler"])
            rest = hvd.allgather_object(list(resumed))
            assert set().union(*map(set, rest)) == set(range(length)) - processed, what
            assert not set().union(*map(set, rest)) & processed, f"{what}: a processed index repeats"
            # set_epoch clears the record and reorders.
            sampler.set_epoch(1)
            assert sampler.processed_indices == set() and len(sampler) == -(-length // n), what
            if shuffle:
                assert hvd.allgather_object(list(sampler)) != shares, what


def _reset_exit_body():
    import mtrain.torch as hvd
    from mtrain.elastic import torch as elastic
    from mtrain.common.records.elastic import HostUpdates
    me = hvd.rank()
    model = _model(seed=me)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model=model, optimizer=optimizer, batch=0)

    @elastic.run
    def train(state):
        for state.batch in range(state.batch, 100):
            _step(state.model, state.optimizer, shift=me)
            if state.batch == 4 and me == 0:
                HostUpdates(2).write(os.environ["MTRAIN_ELASTIC_UPDATES"].format(host=os.uname().nodename))
            print(f"rank {me} commits batch {state.batch}", flush=True)
            state.commit()
        print(f"rank {me} finished without an interrupt", flush=True)

    train(state)
    print(f"rank {me} returned from run", flush=True)


class _Body:
    rank_body = staticmethod(_reset_exit_body)


reset_exit_body = _Body()


def test_run_exits_every_rank_with_the_reset_status_and_the_next_generation_resumes(tmp_path):
    from mtrain.elastic import snapshot
    from mtrain.common.records.elastic import RESET_EXIT_STATUS, RESUME_MARKER, ElasticResume
    env = {"MTRAIN_ELASTIC": "1", "MTRAIN_ELASTIC_STATE_DIR": str(tmp_path / "state-{host}"),
           "MTRAIN_ELASTIC_UPDATES": str(tmp_path / "updates-{host}"), "MTRAIN_ELASTIC_VERSION": "1",
           "MTRAIN_JOB_SECRET": KEY}
    argv = [sys.executable, "-m", "tests.mpi.harness", __name__, "reset_exit_body"]
    first = launch(2, argv, timeout=120, env=env)
    assert first.returncode == RESET_EXIT_STATUS, first.stdout[-3000:] + first.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} commits batch 4" in first.stdout
        assert f"rank {rank} commits batch 5" not in first.stdout, "a rank went past the interrupted commit"
        assert f"rank {rank} returned from run" not in first.stdout
    resumed = [ElasticResume.decode(line[len(RESUME_MARKER):].encode())
               for line in first.stderr.splitlines() if line.startswith(RESUME_MARKER.decode())]
    assert resumed == [ElasticResume(-1, 2)]
    header = snapshot.read_header(str(tmp_path / f"state-{os.uname().nodename}"), KEY.encode())
    assert header is not None and header.commit == 4, header
    # The next generation (version 2, three ranks) resumes from that commit and runs to the end.
    second = launch(3, argv, timeout=180, env=dict(env, MTRAIN_ELASTIC_VERSION="2"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    lines = second.stdout.splitlines()
    assert "rank 2 commits batch 4" in lines and "rank 2 commits batch 3" not in lines
    assert all(f"rank {r} finished without an interrupt" in second.stdout for r in range(3))
    resumed = [ElasticResume.decode(line[len(RESUME_MARKER):].encode())
               for line in second.stderr.splitlines() if line.startswith(RESUME_MARKER.decode())]
    assert resumed == [ElasticResume(4, 3)]
