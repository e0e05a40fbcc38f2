"""Device mesh construction: axes `data`, `expert`, `tensor` over all devices of all processes.

A mesh is described by a spec string such as ``"data=1,expert=4,tensor=2"`` (the `--mesh` CLI flag) or a
dict ``{"expert": 4, "tensor": 2}``. Axes left out have size 1; one axis may be ``-1`` (or ``*``) to take
whatever the device count leaves. The product of the sizes must equal the number of devices.

Axis order is fixed, ``(data, expert, tensor)``: `tensor` varies fastest over the device list, so tensor
groups are neighbouring devices (the same host, and on GPUs the same NVLink island) and `data` replicas
are the farthest apart; on several hosts, `jax.devices()` lists each process's devices together, so a
`data` axis that is a multiple of the process count puts whole replicas on one host.

Axis types: the mesh uses ``AxisType.Auto`` on every axis. In this JAX (0.10), ``jax.make_mesh`` makes
Explicit axes by default, and Explicit axes require every input of a ``shard_map`` or jitted function to
carry its sharding in its type already; with Auto axes, jit accepts arrays in any layout (it reshards to
the in_shardings), the compiler propagates shardings from the parameters through the model, and
``shard_map`` (expert parallelism) reshards its inputs to its ``in_specs`` as needed. Parameters and
caches are still placed explicitly (`sharding.rules`), so nothing runs unsharded by accident.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES: tuple[str, ...] = ("data", "expert", "tensor")


class MeshSpecError(ValueError):
    """A mesh spec that cannot be parsed or does not fit the devices; the message says why."""


def parse_mesh_spec(spec: str | Mapping[str, int] | None) -> dict[str, int]:
    """``"data=1,expert=4,tensor=2"`` (or a dict, or None/"" for all ones) -> ``{axis: size}``, every axis
    present. A size may be -1 or ``*`` (at most one axis): resolved later against the device count."""
    if spec is None:
        items: list[tuple[str, object]] = []
    elif isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",")):
            if not part:
                continue
            if "=" not in part:
                raise MeshSpecError(
                    f"mesh spec '{spec}': '{part}' is not AXIS=SIZE (e.g. 'data=1,expert=4,tensor=2')"
                )
            name, _, value = part.partition("=")
            items.append((name.strip(), value.strip()))
    else:
        raise MeshSpecError(f"mesh spec must be a string or a mapping, got {type(spec).__name__}")
    sizes = dict.fromkeys(AXES, 1)
    seen: set[str] = set()
    for name, value in items:
        if name not in AXES:
            raise MeshSpecError(f"mesh spec: unknown axis '{name}' (axes are {', '.join(AXES)})")
        if name in seen:
            raise MeshSpecError(f"mesh spec: axis '{name}' is given twice")
        seen.add(name)
        if value in ("*", "-1", -1):
            sizes[name] = -1
            continue
        try:
            size = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise MeshSpecError(
                f"mesh spec: size of '{name}' must be a positive integer, got {value!r}"
            ) from None
        if isinstance(value, bool) or size < 1 or str(size) != str(value).strip():
            raise MeshSpecError(f"mesh spec: size of '{name}' must be a positive integer, got {value!r}")
        sizes[name] = size
    if sum(1 for v in sizes.values() if v == -1) > 1:
        raise MeshSpecError("mesh spec: at most one axis may be -1 / '*'")
    return sizes


def resolve_mesh_shape(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """Sizes for every axis whose product is `num_devices` (fills a -1 axis); MeshSpecError otherwise."""
    sizes = parse_mesh_spec(spec)
    known = int(np.prod([v for v in sizes.values() if v != -1]))
    wild = [k for k, v in sizes.items() if v == -1]
    if wild:
        if num_devices % known:
            raise MeshSpecError(
                f"mesh spec {format_mesh_shape(sizes)}: the fixed axes ({known} devices) do not divide the "
                f"{num_devices} devices"
            )
        sizes[wild[0]] = num_devices // known
    total = int(np.prod(list(sizes.values())))
    if total != num_devices:
        raise MeshSpecError(
            f"mesh spec {format_mesh_shape(sizes)} needs {total} devices but there are {num_devices} "
            f"({jax.process_count()} process(es), {jax.local_device_count()} local device(s) each); "
            f"the product of the axis sizes must equal the device count"
        )
    return sizes


def format_mesh_shape(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{k}={sizes[k]}" for k in AXES if k in sizes)


def make_mesh(
    spec: str | Mapping[str, int] | None = None, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A mesh with axes (data, expert, tensor), Auto axis types, over `devices` (default: all devices of
    all processes, `jax.devices()`)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(spec, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    if devices == list(jax.devices()):
        # jax.make_mesh orders devices for the physical topology (TPU/GPU) when it can.
        return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
    return Mesh(
        np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES)
    )


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """{axis: size} of a mesh."""
    return dict(mesh.shape)


def describe(mesh: Mesh) -> str:
    """One line: ``data=1,expert=4,tensor=2 over 8 devices (2 processes, cpu)``."""
    devs = mesh.devices.reshape(-1)
    procs = len({d.process_index for d in devs})
    return (
        f"{format_mesh_shape(mesh_shape(mesh))} over {devs.size} devices "
        f"({procs} process{'es' if procs != 1 else ''}, {devs[0].platform})"
    )


def add_mesh_argument(parser: argparse.ArgumentParser) -> None:
    """The `--mesh` flag: ``--mesh data=1,expert=4,tensor=2`` (unset: no mesh, one device)."""
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="AXIS=N,...",
        help="device mesh over all devices of all processes, axes data/expert/tensor, e.g. "
        "'data=1,expert=4,tensor=2' (missing axes are 1; one axis may be '*'). Default: one device.",
    )


def mesh_from_flag(value: str | None) -> Mesh | None:
    """`make_mesh` for a `--mesh` value; None when the flag is unset."""
    return None if value is None or not value.strip() else make_mesh(value)
