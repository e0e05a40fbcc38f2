"""Multi-host initialisation: `jax.distributed.initialize` from flags or the environment.

Every process runs the same program; after `initialize`, `jax.devices()` lists the devices of all
processes and a mesh from `sharding.mesh.make_mesh` spans them. On CPU (several processes on one
machine, or CPU hosts) the cross-process collectives use gloo, which must be selected before the CPU
backend starts (`jax_cpu_collectives_implementation`), so call `initialize` before any JAX computation.

Sources, first found wins, per value:
  coordinator    `MultihostSettings` (`--coordinator`), or $JAX_COORDINATOR_ADDRESS ("host:port")
  num_processes  `MultihostSettings` (`--num-processes`), or $JAX_NUM_PROCESSES
  process_id     `MultihostSettings` (`--process-id`), or $JAX_PROCESS_ID
With no coordinator and at most one process, nothing is initialised (single-process run).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

import jax

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


class MultiHostError(ValueError):
    """Inconsistent multi-host settings; the message names the value."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise MultiHostError(f"${name} must be an integer, got {raw!r}") from None


def set_cpu_device_count(count: int) -> None:
    """Ask for `count` CPU devices in this process (XLA_FLAGS); only effective before JAX starts its
    backends. Used to fake several devices per process on one machine."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


@dataclasses.dataclass(frozen=True)
class MultihostSettings:
    """Where this process joins a process group (`--coordinator`, `--num-processes`, `--process-id`); a value
    left None is read from the environment."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> MultihostSettings:
        """The settings of a command's parsed flags (`vars(args)`, read at the CLI's edge; `add_arguments`
        defines them); a command without them runs as one process unless the environment says otherwise."""
        return cls(flags.get("coordinator"), flags.get("num_processes"), flags.get("process_id"))


def initialize(
    settings: MultihostSettings = MultihostSettings(),
    *,
    cpu_collectives: str = "gloo",
    initialization_timeout: int = 300,
) -> bool:
    """Join the process group; returns True if `jax.distributed.initialize` ran, False for one process."""
    coordinator = settings.coordinator or os.environ.get(ENV_COORDINATOR) or None
    num_processes = settings.num_processes
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = settings.process_id if settings.process_id is not None else _env_int(ENV_PROCESS_ID)
    if coordinator is None:
        if num_processes not in (None, 1):
            raise MultiHostError(
                f"{num_processes} processes requested but no coordinator address "
                f"(--coordinator or ${ENV_COORDINATOR})"
            )
        return False
    if num_processes is None or process_id is None:
        raise MultiHostError(
            f"coordinator {coordinator} given: also set the number of processes and this process's id "
            f"(--num-processes/--process-id or ${ENV_NUM_PROCESSES}/${ENV_PROCESS_ID})"
        )
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise MultiHostError(f"process id {process_id} is outside 0..{num_processes - 1}")
    if ":" not in coordinator:
        raise MultiHostError(f"coordinator address must be host:port, got {coordinator!r}")
    if cpu_collectives:
        # Only the CPU backend reads this; accelerators keep their own collectives (NCCL, ICI).
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout,
    )
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--coordinator`, `--num-processes`, `--process-id` (defaults from the environment)."""
    group = parser.add_argument_group("multi-host")
    group.add_argument("--coordinator", default=None, help=f"host:port of process 0 (or ${ENV_COORDINATOR})")
    group.add_argument(
        "--num-processes", type=int, default=None, help=f"process count (or ${ENV_NUM_PROCESSES})"
    )
    group.add_argument(
        "--process-id", type=int, default=None, help=f"this process's id (or ${ENV_PROCESS_ID})"
    )


def shutdown(timeout: float | None = None) -> bool:
    """Leave the process group (no-op when `initialize` did not run). JAX's shutdown waits for every peer
    at a barrier, so with a dead peer it would hang until the heartbeat timeout and then abort the process:
    with `timeout`, give up after that many seconds and return False (the caller then exits anyway)."""
    if jax.process_count() <= 1:
        return True
    if timeout is None:
        jax.distributed.shutdown()
        return True
    return run_bounded(jax.distributed.shutdown, timeout)


def run_bounded(fn, timeout: float) -> bool:
    """Run fn() on a daemon thread; True if it returned (or raised) within `timeout` seconds."""
    import threading

    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a broken process group: the caller exits either way
            pass
        finally:
            done.set()

    threading.Thread(target=target, name="bounded-shutdown", daemon=True).start()
    return done.wait(timeout)


class Peers:
    """This process's place in the process group (one process: index 0 of 1), and the one collective the
    serving stack's host logic needs: process 0's JSON-able value on every process."""

    def __init__(self, index: int | None = None, count: int | None = None):
        self.index = jax.process_index() if index is None else index
        self.count = jax.process_count() if count is None else count

    @property
    def leader(self) -> bool:
        return self.index == 0

    @property
    def several(self) -> bool:
        return self.count > 1

    def broadcast(self, value: object) -> object:
        """Process 0's `value` (JSON-able) on every process; every process must call it, in the same order.
        Sent as uint8: the length first, then (unless `value` is None: one collective only) the payload
        padded to a power of two, so few shapes compile."""
        if self.count == 1:
            return value
        import json

        import numpy as np
        from jax.experimental import multihost_utils

        payload = json.dumps(value).encode() if self.leader and value is not None else b""
        header = np.frombuffer(np.int64(len(payload)).tobytes(), np.uint8)
        n = int(np.asarray(multihost_utils.broadcast_one_to_all(header)).view(np.int64)[0])
        if n == 0:
            return None
        buf = np.zeros(max(256, 1 << (max(n, 1) - 1).bit_length()), np.uint8)
        if self.leader:
            buf[:n] = np.frombuffer(payload, np.uint8)
        data = np.asarray(multihost_utils.broadcast_one_to_all(buf))[:n].tobytes()
        return json.loads(data)
