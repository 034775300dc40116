"""RayExecutor: Horovod's Ray API (horovod/ray/runner.py) on mtrain's MPI ranks.

    driver process                                     each Ray node (one SlotActor per bundle)
    RayExecutor.start()
      ├─ placement group + actors (placement.py) ─────▶ first actor on the node: TaskService
      ├─ CallServer (launcher/tasks/call_service.py)
      └─ job process: mpirun ── task agent ═══════════▶ remote guard ─ prted ─ ranks (call_worker)
                                                                    each rank ══▶ CallServer
    run / execute / execute_single  ── calls through the CallServer, results in rank order
    shutdown()  ── ranks told to stop, job ends, services stopped, actors killed, group removed

The ranks live as long as the executor: start() launches them once (launcher/tasks/launch.py,
in a process of its own so the job is supervised exactly as `mtrain run` supervises one, and
can be stopped with a signal), and every call runs in the same processes, so a model or an
MPI world made in one call is there in the next.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import subprocess
import sys
import threading
from typing import Any, Callable, Dict, List, Optional

from mtrain.ray.errors import RayClusterUnreachable, RayNotAvailable, ray_not_available

try:
    import ray
except ImportError as _error:  # (the one line the user reads; not a traceback of ours)
    raise ray_not_available(_error) from None

__all__ = ["RayExecutor", "RaySettings", "RayNotAvailable", "RayClusterUnreachable"]

PROBE_SECONDS = 10.0  # connecting to the cluster's address before ray.init()
STOP_SECONDS = 30.0   # shutdown(): ranks leaving their loop, then the job's end, within this


@dataclasses.dataclass
class RaySettings:
    """What RayExecutor.create_settings gives (Horovod's MiniSettings, without its SSH fields)."""

    timeout_s: float = 30.0                  # ranks connecting back to the driver after start()
    placement_group_timeout_s: float = 100.0  # the cluster reserving the placement group
    nics: Optional[set] = None               # interfaces (or subnets) for MPI, like --network-interface
    verbose: int = 1                         # 2: mpirun's command line and its own lines too


def connect(address: Optional[str] = None) -> None:
    """ray.init() to the running cluster at `address` (default $RAY_ADDRESS, else "auto"), unless
    this process is connected already; RayClusterUnreachable (one line, naming the address) if none answers."""
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    # Ray retries an address where nothing answers for minutes, saying so only in its log lines:
    # a plain TCP connect first turns that into one line at once.
    probe = _tcp_address(target)
    if probe is not None:
        try:
            socket.create_connection(probe, timeout=PROBE_SECONDS).close()
        except OSError as error:
            raise RayClusterUnreachable(f"mtrain.ray: no Ray cluster reachable at {target} "
                                        f"({error.strerror or error}); start one with `ray start --head`, or "
                                        "give its address in RAY_ADDRESS") from None
    try:
        ray.init(address=target, logging_level="ERROR", log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError, TimeoutError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RayClusterUnreachable(f"mtrain.ray: no Ray cluster reachable at {target} ({first}); start one with "
                                    "`ray start --head`, or give its address in RAY_ADDRESS") from None


def _tcp_address(target: str) -> "tuple[str, int] | None":
    """(host, port) of a "host:port" Ray address; None for "auto", "local" or a ray:// client address."""
    host, colon, port = target.rpartition(":")
    if not colon or "//" in target or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


class RayExecutor:
    """Horovod's RayExecutor: `num_workers` ranks (or `num_hosts` × `num_workers_per_host`) on the
    Ray cluster this process is connected to (ray.init() first, or $RAY_ADDRESS / a local one)."""

    @classmethod
    def create_settings(cls, timeout_s: float = 30, placement_group_timeout_s: float = 100,
                        nics: Optional[set] = None, verbose: int = 1) -> RaySettings:
        """Settings for the executor (Horovod's create_settings; there is no SSH, so no SSH fields)."""
        return RaySettings(timeout_s=timeout_s, placement_group_timeout_s=placement_group_timeout_s, nics=nics,
                           verbose=verbose)

    def __init__(self, settings: Optional[RaySettings] = None, num_workers: Optional[int] = None,
                 num_hosts: Optional[int] = None, num_workers_per_host: int = 1, cpus_per_worker: float = 1,
                 use_gpu: bool = False, gpus_per_worker: Optional[float] = None,
                 min_workers: Optional[int] = None, max_workers: Optional[int] = None) -> None:
        if min_workers is not None or max_workers is not None:
            raise ValueError("mtrain.ray has no elastic RayExecutor (min_workers/max_workers); give num_workers "
                             "or num_hosts, or run elastic jobs with `mtrain run --min-np` (docs/elastic.md)")
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give either num_workers or num_hosts (with num_workers_per_host)")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"RayExecutor: {name} must be a positive integer, not {value!r}")
        self.settings = settings or RaySettings()
        self.num_workers, self.num_hosts, self.num_workers_per_host = num_workers, num_hosts, num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.placement = None
        self.server = None
        self.job: Optional[subprocess.Popen] = None
        self._watcher: Optional[threading.Thread] = None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._box = None
        self._calls = 0

    # ---- start and stop --------------------------------------------------------------------

    def start(self, executable_cls: Optional[type] = None, executable_args: Optional[List] = None,
              executable_kwargs: Optional[Dict] = None, extra_env_vars: Optional[Dict] = None) -> None:
        """Reserve the workers' resources, start the ranks, make `executable_cls` in each."""
        from mtrain.launcher.tasks.call_service import CallServer, new_key
        from mtrain.launcher.tasks.launch import start_through_tasks
        from mtrain.ray import placement as placing
        from mtrain.ray.worker import create_executable
        if self.job is not None:
            raise RuntimeError("RayExecutor.start(): already started; shutdown() first")
        connect()
        bundles, strategy, per_bundle = placing.bundles_for(
            self.num_workers, self.num_hosts, self.num_workers_per_host, self.cpus_per_worker, self.gpus_per_worker)
        self.placement = placing.place(bundles, strategy, per_bundle, self.settings.placement_group_timeout_s,
                                       ray.get_runtime_context().get_node_id())
        try:
            key = new_key()
            nodes = self.placement.nodes
            services = ray.get([node.service_actor.start_service.remote(key) for node in nodes], timeout=60)
            for node, service in zip(nodes, services):
                node.service = (service[0], int(service[1]))
            self.server = CallServer(key, self.placement.size, advertise=ray.util.get_node_ip_address())
            self.server.start()
            env = {**{str(k): str(v) for k, v in (extra_env_vars or {}).items()}, **self.server.env()}
            options = {"network_interfaces": tuple(sorted(self.settings.nics))} if self.settings.nics else {}
            self.job = start_through_tasks([sys.executable, "-m", "mtrain.launcher.tasks.call_worker"],
                                           {node.hostname: node.service for node in nodes},
                                           {node.hostname: node.slots for node in nodes}, key, env,
                                           self.settings.timeout_s, self.settings.verbose, **options)
            self._watcher = threading.Thread(target=self._watch_job, args=(self.job, self.server), daemon=True)
            self._watcher.start()
            self.server.wait_for_ranks(self.settings.timeout_s)
            self.server.call_all(create_executable, (executable_cls, list(executable_args or []),
                                                     dict(executable_kwargs or {})))
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _watch_job(job: subprocess.Popen, server) -> None:
        """The job ended (a rank died, or shutdown): calls still waiting fail, naming why."""
        status = job.wait()
        server.fail(f"mtrain.ray: the job's ranks ended (status {status}); the failing rank is named above, "
                    "on the driver's stderr")

    def shutdown(self) -> None:
        """Stop the ranks, then the services, actors and placement group; nothing is left on any node."""
        import signal

        from mtrain.launcher.process_tools import signal_process
        server, job, placement = self.server, self.job, self.placement
        self.server = self.job = self.placement = None
        if server is not None:
            server.stop()  # the ranks leave their loops and exit 0: the job ends by itself
        if job is not None:
            try:
                job.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                signal_process(job.pid, signal.SIGTERM)  # the supervisor ends the job everywhere
                try:
                    job.wait(timeout=STOP_SECONDS)
                except subprocess.TimeoutExpired:
                    job.kill()
                    job.wait()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._box is not None:
            ray.kill(self._box, no_restart=True)
            self._box = None
        if placement is not None:
            placement.release()

    # ---- calls ---------------------------------------------------------------------------

    def _server(self):
        if self.server is None:
            raise RuntimeError("RayExecutor: not started; call start() first")
        return self.server

    def run(self, fn: Callable[..., Any], args: Optional[List] = None, kwargs: Optional[Dict] = None) -> List[Any]:
        """fn(*args, **kwargs) in every rank; the results in rank order (RankFailed names a rank that raised)."""
        return self._server().call_all(fn, tuple(args or ()), dict(kwargs or {}))

    def execute(self, fn: Callable[[Any], Any]) -> List[Any]:
        """fn(executable) in every rank, with the executable_cls instance start() made there."""
        from mtrain.ray.worker import call_with_executable
        return self._server().call_all(call_with_executable, (fn,))

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """fn(executable) in rank 0 alone; its result."""
        from mtrain.ray.worker import call_with_executable
        return self._server().call_one(0, call_with_executable, (fn,))

    def run_remote(self, fn: Callable[..., Any], args: Optional[List] = None,
                   kwargs: Optional[Dict] = None) -> list:
        """Like run(), without waiting: one Ray ObjectRef per rank, in rank order (ray.get takes
        them).  The call runs on the driver's CallServer; a small actor hands its results to Ray."""
        from mtrain.ray.results import ResultBox, portable
        server = self._server()
        if self._box is None:
            self._box = ray.remote(ResultBox).options(num_cpus=0).remote()
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtrain-ray")
        self._calls += 1
        call, box = self._calls, self._box
        refs = [box.get.remote(call, rank) for rank in range(server.size)]

        def finish() -> None:
            try:
                outcome = (True, server.call_all(fn, tuple(args or ()), dict(kwargs or {})))
            except BaseException as error:  # handed to whoever ray.get()s the refs
                outcome = (False, portable(error))
            try:
                ray.get(box.put.remote(call, outcome))
            except Exception as error:  # (results that do not pickle): the refs must not wait forever
                ray.get(box.put.remote(call, (False, RuntimeError(f"run_remote: cannot hand the results "
                                                                  f"to Ray: {type(error).__name__}: {error}"))))

        self._pool.submit(finish)
        return refs
