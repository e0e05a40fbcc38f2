"""Where an op's arrays live decides how it runs: the CPU's kernels and formulations only in a program that
runs on CPUs, the accelerators' forms everywhere else, whatever the host process's default backend is.

A program compiled for a TPU on a CPU host (ahead-of-time, for a topology; or a server's programs on a
mesh of accelerator devices) is traced on that host, so `jax.default_backend()` says "cpu" there and cannot
choose. What can:

- a concrete array's devices;
- a traced array's sharding: an input placed on a mesh carries the mesh's abstract device (its platform)
  through every value computed from it, so a program over a mesh knows its platform while it is traced;
- the mesh in context (`jax.set_mesh`), likewise;
- failing all of these (a program over single-device arrays, or one traced from shapes alone), the
  platform the program is lowered for: :func:`by_platform` then traces both forms and lets
  `jax.lax.platform_dependent` keep the one for that platform (only its branch is lowered, so a TPU
  program holds no CPU custom call, and XLA inlines the branch it keeps).

The choice is part of what jit keys a trace on (the arrays' shardings, the context mesh, the lowering
platform), so a cached trace is never reused for another platform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax

__all__ = ["CPU", "by_platform", "platform_of"]

CPU = "cpu"
T = TypeVar("T")


def platform_of(*trees: Any) -> str | None:
    """The platform (``"cpu"``, ``"tpu"``, ``"gpu"``, ...) of the devices the arrays in `trees` live on, or
    of the context mesh; None where neither says (traced values of single-device inputs). The first array
    that says decides: one program's arrays share a platform."""
    for leaf in jax.tree.leaves(trees):
        found = _leaf_platform(leaf)
        if found is not None:
            return found
    return _mesh_platform(jax.sharding.get_abstract_mesh())


def by_platform(among: Any, *, cpu: Callable[[], T], default: Callable[[], T]) -> T:
    """``cpu()`` where the arrays `among` live on CPUs, else ``default()``. Both return the same structure of
    the same shapes and dtypes (they are the same op). Where the platform is known while tracing only that
    form is traced; otherwise the platform the program is lowered for chooses (module docstring)."""
    known = platform_of(among)
    if known is not None:
        return cpu() if known == CPU else default()
    return jax.lax.platform_dependent(cpu=cpu, default=default)


def _leaf_platform(leaf: Any) -> str | None:
    if isinstance(leaf, jax.core.Tracer):
        sharding = getattr(jax.typeof(leaf), "sharding", None)  # abstract: its mesh, if it has one
        return _mesh_platform(getattr(sharding, "mesh", None))
    if isinstance(leaf, jax.Array):
        return next(iter(leaf.devices())).platform
    sharding = getattr(leaf, "sharding", None)  # a ShapeDtypeStruct's, if it was given one
    if isinstance(sharding, jax.sharding.Sharding):
        return next(iter(sharding.device_set)).platform
    return None


def _mesh_platform(mesh: Any) -> str | None:
    if mesh is None or getattr(mesh, "empty", True):
        return None
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None)
