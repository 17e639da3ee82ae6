"""Several processes, one program: JAX's multi-controller runtime (`jax.distributed.initialize`).

Every process runs the same `train.py` command; process 0 also runs the coordinator at
`distributed.coordinator_address` (host:port). The processes together see all devices
(`jax.devices()`), the mesh spans them, each feeds its own rows of every batch, and orbax checkpoints
are written and read by all of them. Under SLURM (an `srun` job step, or `hydra/launcher=slurm`)
the values left null come from SLURM's environment, as JAX itself reads it (coordinator: the first
node of the step, on a port derived from the job id; process id: SLURM_PROCID; count: SLURM_NTASKS;
one device per task: SLURM_LOCALID).

JAX aborts the whole process (a C++ fatal error and a stack trace) when the coordinator cannot be
reached or the processes never all join. So before handing over, `initialize` checks what it can
and gives one line instead: process 0 checks that the address is this machine's and the port is
free; the others wait, up to `distributed.timeout_s`, for the coordinator's port to accept a
connection; and a watchdog ends the process with one line when the join has not finished by then.
"""

import dataclasses
import os
import socket
import sys
import threading
import time
from typing import Optional

from zoo._compat import backends_are_initialized, cluster_env
from zoo.train.command_line import slurm_number
from zoo.train.run_config import ConfigError, DistributedConfig

EXIT_BAD_INPUT = 2
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclasses.dataclass(frozen=True)
class Cluster:
    """What this process joins: resolved from the config, then the cluster's environment."""

    coordinator_address: Optional[str]
    num_processes: int
    process_id: int
    local_device_ids: Optional[list[int]]
    source: str  # "config" or "slurm"


# The cluster this process joined (None: single process, or not initialized by zoo).
_JOINED: Optional[Cluster] = None


def slurm_present() -> bool:
    """A SLURM job step with the variables JAX's SLURM detection reads."""
    return all(v in os.environ for v in _SLURM_VARS)


def _jax_cluster_defaults(c: DistributedConfig, local_device_ids):
    """Fill the unset values from the cluster environment the way jax.distributed.initialize does."""
    ClusterEnv = cluster_env()  # JAX's own detection (SLURM, Open MPI, ...)
    if ClusterEnv is None:  # pragma: no cover - JAX moved it: fall back to SLURM's variables
        return (
            c.coordinator_address,
            c.num_processes if c.num_processes is not None else slurm_number("SLURM_NTASKS", None),
            c.process_id if c.process_id is not None else slurm_number("SLURM_PROCID", None),
            local_device_ids,
        )
    return ClusterEnv.auto_detect_unset_distributed_params(
        c.coordinator_address, c.num_processes, c.process_id, local_device_ids, None, c.timeout_s
    )


def resolve(c: DistributedConfig) -> Optional[Cluster]:
    """The cluster to join, or None for a single process. Incomplete settings: ConfigError (one line)."""
    explicit = [k for k in ("coordinator_address", "num_processes", "process_id") if getattr(c, k) is not None]
    slurm = c.auto_detect and slurm_present()
    if not explicit and not slurm:
        return None
    if slurm:  # JAX's detection reads them too, and a number that is not one ended it in a traceback
        for name in ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"):
            slurm_number(name, 0)
    if slurm and not explicit and slurm_number("SLURM_NTASKS", 1) == 1:
        return None  # a one-task SLURM job: nothing to join
    if c.num_processes == 1 and (c.process_id in (None, 0)) and not slurm:
        return None
    source = "config"
    address, count, pid, local = c.coordinator_address, c.num_processes, c.process_id, c.local_device_ids
    if slurm:
        address, count, pid, local = _jax_cluster_defaults(c, local)
        source = "slurm"
    missing = [
        k for k, v in (("coordinator_address", address), ("num_processes", count), ("process_id", pid)) if v is None
    ]
    if missing:
        given = ", ".join(f"distributed.{k}={getattr(c, k)}" for k in explicit)
        raise ConfigError(
            f"distributed.{missing[0]}: not set ({given} given, no SLURM job step found); "
            "set distributed.coordinator_address, distributed.num_processes and distributed.process_id together"
        )
    if not 0 <= pid < count:
        raise ConfigError(
            f"distributed.process_id: {pid} is not in 0..{count - 1} (num_processes={count}); fix the process id"
        )
    return Cluster(address, int(count), int(pid), list(local) if local is not None else None, source)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_coordinator_host(address: str) -> None:
    """Process 0 serves the coordinator: its host must be this machine and its port free."""
    host, port = _split(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ConfigError(
            f"distributed.coordinator_address={address}: cannot resolve host {host!r} ({e.strerror}); check the host "
            "name"
        ) from None
    local_ok, port_free = False, False
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind((sockaddr[0], 0))  # binds only to an address of this machine; sends nothing
            except OSError:
                continue
            local_ok = True
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((sockaddr[0], port))
                port_free = True
            except OSError:
                pass
        break
    if not local_ok:
        raise ConfigError(
            f"distributed.coordinator_address={address}: {host} is not an address of this machine, and process 0 runs "
            "the "
            "coordinator; start process 0 on that host or give this host's address"
        )
    if not port_free:
        raise ConfigError(
            f"distributed.coordinator_address={address}: port {port} is already in use here; choose a free port"
        )


def _wait_for_coordinator(address: str, deadline: float, timeout_s: int) -> None:
    host, port = _split(address)
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
        except OSError:
            pass
        if time.monotonic() >= deadline:
            raise ConfigError(
                f"distributed.coordinator_address={address}: could not reach it within {timeout_s}s; "
                "check host/port and that process 0 is running"
            )
        time.sleep(0.2)


def _watchdog(cluster: Cluster, deadline: float, timeout_s: int) -> threading.Timer:
    """JAX aborts with a stack trace when the join times out; say it in one line first, and exit 2."""

    def fire():
        print(
            f"error: distributed.num_processes={cluster.num_processes}: not every process joined the coordinator at "
            f"{cluster.coordinator_address} within {timeout_s}s (this is process {cluster.process_id}); start all "
            f"{cluster.num_processes} processes with the same coordinator_address and num_processes",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_BAD_INPUT)

    t = threading.Timer(max(0.0, deadline - time.monotonic()), fire)
    t.daemon = True
    t.start()
    return t


def initialize(c: DistributedConfig) -> Optional[Cluster]:
    """Join the cluster (before JAX starts its backends); None for a single process. Bad settings,
    an unreachable coordinator or a join that times out: one line, nothing started."""
    global _JOINED
    cluster = resolve(c)
    import jax

    if cluster is None:
        if _JOINED is not None:
            raise ConfigError(
                "distributed: this process already joined a cluster for an earlier job; run this job in its own process"
            )
        return None
    if _JOINED is not None:
        if _JOINED != cluster:
            raise ConfigError(
                "distributed: this process already joined another cluster for an earlier job; run this job in its own "
                "process"
            )
        return cluster
    if backends_are_initialized():
        raise ConfigError(
            "distributed: JAX already started in this process as a single process; run this job in its own process"
        )

    deadline = time.monotonic() + c.timeout_s
    if cluster.process_id == 0:
        _check_coordinator_host(cluster.coordinator_address)
    else:
        _wait_for_coordinator(cluster.coordinator_address, deadline, c.timeout_s)
    # CPU devices of different processes talk through gloo (XLA:CPU has no other cross-process
    # collectives); GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = _watchdog(cluster, deadline, c.timeout_s)
    try:
        jax.distributed.initialize(
            coordinator_address=cluster.coordinator_address,
            num_processes=cluster.num_processes,
            process_id=cluster.process_id,
            local_device_ids=cluster.local_device_ids,
            # JAX's own deadline comes after the watchdog's, so the one-line message wins.
            initialization_timeout=c.timeout_s + 30,
            cluster_detection_method="deactivate",
        )
    finally:
        watchdog.cancel()
    _JOINED = cluster
    return cluster


def is_main_process() -> bool:
    """False only in a process other than 0 of a cluster `initialize` joined: process 0 (or the only
    one) writes the files. Reads the join, not JAX, so asking starts no backend (train.py asks after a
    failure, which may come before JAX started)."""
    return _JOINED is None or _JOINED.process_id == 0
