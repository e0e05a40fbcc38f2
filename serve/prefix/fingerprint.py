"""The model fingerprint that keys the prefix store: cached states are valid only for the exact weights,
config and cache format that computed them.

Every weight byte counts: each parameter is reduced to two 32-bit words (a sum of its 32-bit words, each
times an odd multiplier derived from its position, modulo 2^32, in two independent lanes). A large or
sharded parameter is reduced on the device by one jitted pass, and only those words reach the host; a small
one on one device (at most `HOST_DIGEST_BYTES`) is copied and reduced with NumPy to the same words, since a
program per shape would cost a compile for a few microseconds of work. Changing any word changes its lane-1
term (odd multipliers are invertible modulo 2^32), so a fine-tune that edits one middle row gets another
fingerprint; several changes cancel in both lanes with probability about 2^-64. On a mesh the pass runs
sharded on the devices that hold the weights, on every process alike. The fingerprint also covers the
config, every parameter's name, shape and dtype, and FORMAT (bumped when the cached data's meaning
changes).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

FORMAT = "jaxhybrid-prefix-v2"
HOST_DIGEST_BYTES = 4 << 20


def _mix(i: Any, a: int, b: int) -> Any:
    """A per-position odd 32-bit multiplier (an integer hash of the index), of a uint32 jax or NumPy array
    (uint32 arithmetic wraps modulo 2^32 in both)."""
    x = i * np.uint32(a) + np.uint32(b)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    return x | np.uint32(1)


def _lanes(w: Any, xp: Any) -> tuple[Any, Any]:
    """The two lanes of flat uint32 words `w`, with `xp` (jax.numpy on the device, numpy on the host)."""
    i = xp.arange(w.shape[0], dtype=xp.uint32)
    lane1 = xp.sum(w * _mix(i, 0x9E3779B1, 0x85EBCA77), dtype=xp.uint32)
    lane2 = xp.sum((w ^ np.uint32(0xA5A5A5A5)) * _mix(i, 0xC2B2AE3D, 0x27D4EB2F), dtype=xp.uint32)
    return lane1, lane2


def _words(x: jax.Array) -> jax.Array:
    """The array's bits as flat uint32 words (narrower types widened, one element per word)."""
    if x.dtype == jnp.bool_:
        return x.reshape(-1).astype(jnp.uint32)
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, bits).reshape(-1).astype(jnp.uint32)


@jax.jit
def _leaf_digest(x: jax.Array) -> jax.Array:
    """[2] uint32: the two lanes of one parameter (one program per shape and dtype)."""
    return jnp.stack(_lanes(_words(x), jnp))


def _host_leaf_digest(x: np.ndarray) -> np.ndarray:
    """`_leaf_digest` of a host array, bit for bit."""
    x = np.ascontiguousarray(x).reshape(-1)
    if x.dtype == np.bool_:
        w = x.astype(np.uint32)
    else:
        w = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.uint32)
    with np.errstate(over="ignore"):
        return np.array(_lanes(w, np), np.uint32)


def _digest(x: jax.Array) -> np.ndarray:
    """[2] uint32 of one parameter: on the host when it is small and on this process's one device."""
    if x.nbytes <= HOST_DIGEST_BYTES and len(x.sharding.device_set) == 1 and x.is_fully_addressable:
        return _host_leaf_digest(np.asarray(x))
    return np.asarray(jax.block_until_ready(_leaf_digest(x)))


def weights_digest(model: nnx.Module) -> tuple[list[str], np.ndarray]:
    """(parameter names with shape and dtype, their [n, 2] uint32 device digests) of every weight."""
    flat = nnx.to_flat_state(nnx.state(model))
    names, leaves = [], []
    for path, var in flat:
        value = var.get_value() if isinstance(var, nnx.Variable) else var
        if not isinstance(value, jax.Array):
            continue
        names.append(f"{'.'.join(map(str, path))}:{list(value.shape)}:{value.dtype.name}")
        leaves.append(value)
    # One leaf at a time, each finished before the next: with several processes independent programs in
    # flight could run their cross-process reductions in different orders on different processes.
    digests = [_digest(x) for x in leaves]
    return names, np.stack(digests) if digests else np.zeros((0, 2), np.uint32)


def model_fingerprint(model: nnx.Module) -> bytes:
    """sha256 over FORMAT, the config and the weights' digests (see the module doc)."""
    cfg = getattr(model, "config", None)
    fields = dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else {}
    config_json = json.dumps(fields, sort_keys=True, default=str)
    names, digests = weights_digest(model)
    h = hashlib.sha256(FORMAT.encode() + b"\0" + config_json.encode() + b"\0")
    h.update("\n".join(names).encode())
    h.update(digests.astype("<u4").tobytes())
    return h.digest()
