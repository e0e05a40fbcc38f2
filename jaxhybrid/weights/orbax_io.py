"""Our own checkpoint directory: `config.json` (HF style, `load_config` reads it), the tokenizer files, and
the parameters as an Orbax checkpoint under `params/`, keyed by our names (experts stacked).

Restoring goes straight into the target shardings, and the stored dtype is cast to the requested one on
the way: each process reads from Orbax's OCDBT store (with tensorstore, Orbax's storage library) the
chunks of its own devices' slices (`_sharded_reads`). Arrays are stored in chunks (`save_args`) so that
those are about its own bytes; directories written with one chunk per array restore the same way, each
array read whole.
"""

from __future__ import annotations

import functools
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import path_name
from jaxhybrid.weights.hf import copy_tokenizer_files, named_arrays, write_config
from jaxhybrid.weights.safetensors import CheckpointError, host_buffer

PARAMS_DIR = "params"
RESTORE_CONCURRENT_GB = 1
FORMAT = "orbax"
OCDBT_MANIFEST = "manifest.ocdbt"
CHUNK_BYTES = 4 << 20
EXPERTS_AXIS = "experts"  # the logical name of the stacked routed experts' axis (`sharding.rules`)


def is_orbax_dir(directory: str | Path) -> bool:
    params = Path(directory) / PARAMS_DIR
    return params.is_dir() and (params / "_CHECKPOINT_METADATA").exists()


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def checkpointer(
    restore_concurrent_gb: int | None = RESTORE_CONCURRENT_GB, processes: set[int] | None = None
) -> Any:
    """The Orbax checkpointer this project writes and reads with: a pytree of arrays, uncompressed
    (decoding zstd costs more CPU time than the smaller read saves on a local disk), and at most
    `restore_concurrent_gb` of arrays in flight while restoring. `processes`: the JAX processes that save
    together; naming them makes Orbax synchronise through the distributed runtime's barriers instead of a
    device collective, so saves may run on a background thread while the devices compute."""
    import orbax.checkpoint as ocp

    handler = ocp.PyTreeCheckpointHandler(use_compression=False, restore_concurrent_gb=restore_concurrent_gb)
    if processes is None:
        return ocp.Checkpointer(handler)
    options = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=set(processes))
    return ocp.Checkpointer(handler, multiprocessing_options=options)


def stored_arrays(directory: str | Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Our name -> (shape, dtype) of every array in an Orbax checkpoint directory (metadata only). A load
    asks for it more than once (the dtype to serve in, then the arrays to read): read once per version of
    the metadata file."""
    params = (Path(directory) / PARAMS_DIR).resolve()  # Orbax finds no metadata under a relative path
    try:
        stat = (params / "_METADATA").stat()
        version = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
    except OSError:  # no metadata file (yet): read, and let Orbax say what is wrong
        return _stored_arrays.__wrapped__(params, None)
    return dict(_stored_arrays(params, version))


@functools.lru_cache(maxsize=8)
def _stored_arrays(params: Path, version: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    ck = checkpointer()
    try:
        meta = ck.metadata(params)
    except Exception as exc:  # orbax raises various types for unreadable metadata
        raise CheckpointError(f"{params}: cannot read the Orbax checkpoint metadata: {exc}") from exc
    finally:
        ck.close()
    if meta is None:
        raise CheckpointError(f"{params}: the Orbax checkpoint has no metadata")
    tree = meta.item_metadata.tree if hasattr(meta, "item_metadata") else meta
    return {name: (tuple(m.shape), np.dtype(m.dtype)) for name, m in _flatten(tree).items()}


def save_args(model: Any, chunk_bytes: int = CHUNK_BYTES) -> dict[str, Any]:
    """Our name -> the Orbax `SaveArgs` that chunk each array on disk, from its logical axes.

    A sharded restore reads every chunk its shard touches, whole, so the chunks must split where shards
    do. Routed experts are the bytes that matter (K3: 2.72T of 2.78T parameters) and expert parallelism is
    the axis that spans processes, so a stacked experts array is chunked one expert at a time (Orbax's
    `shard_axes` on the expert axis: every expert-parallel degree splits on expert boundaries, so each
    process reads exactly its experts). Any chunk still over `chunk_bytes` (an expert matrix of a large
    model; every other array over it) is split further by `chunk_byte_size`, Orbax's largest-axes-first
    split; arrays under `chunk_bytes` stay one chunk. Orbax's options cannot ask for a partial split of a
    chosen axis (`shard_axes` cuts it to width 1), so a tensor-parallel axis is split only where it is
    among an array's largest: a tensor shard narrower than a chunk reads the whole chunk. That costs
    little where tensor parallelism stays inside a host, whose process needs every tensor rank's part of
    its arrays anyway. 4 MiB: above the 1 MiB under which Orbax warns of slow I/O, small against a layer
    of any model worth sharding."""
    import orbax.checkpoint as ocp
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))):
        axes = var.get_metadata("out_sharding", None) or ()
        experts = tuple(i for i, name in enumerate(axes) if name == EXPERTS_AXIS)
        out[path_name(path)] = ocp.SaveArgs(chunk_byte_size=chunk_bytes, shard_axes=experts)
    return out


def save_orbax(
    model: Any,
    directory: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    overwrite: bool = False,
    chunk_bytes: int = CHUNK_BYTES,
) -> Path:
    """Write `model` to `directory` (config.json, tokenizer files copied from `tokenizer_dir`, params/),
    each array in chunks of at most `chunk_bytes`, routed experts one expert per chunk (`save_args`)."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        if not overwrite:
            raise FileExistsError(f"{directory} exists and is not empty (pass overwrite=True to replace it)")
        if (directory / PARAMS_DIR).exists():
            shutil.rmtree(directory / PARAMS_DIR)
    directory.mkdir(parents=True, exist_ok=True)
    import orbax.checkpoint as ocp

    arrays = named_arrays(model)
    ck = checkpointer()
    try:
        ck.save(
            (directory / PARAMS_DIR).resolve(),
            args=ocp.args.PyTreeSave(_nest(arrays), save_args=_nest(save_args(model, chunk_bytes))),
        )
    finally:
        ck.close()
    dtype = np.dtype(arrays["model.embed_tokens.weight"].dtype).name
    write_config(model.config, directory, jaxhybrid_format=FORMAT, dtype=dtype)
    copy_tokenizer_files(None if tokenizer_dir is None else Path(tokenizer_dir), directory)
    return directory


def check_stored(
    stored: Mapping[str, tuple[tuple[int, ...], np.dtype]],
    expected: Mapping[str, tuple[int, ...]],
    where: str,
) -> None:
    for name, shape in expected.items():
        if name not in stored:
            raise CheckpointError(
                f"{where}: array '{name}' is missing (the config needs shape {list(shape)})"
            )
        if tuple(stored[name][0]) != tuple(shape):
            raise CheckpointError(
                f"{where}: array '{name}' has shape {list(stored[name][0])}, the config needs {list(shape)}"
            )
    extra = sorted(set(stored) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: unexpected array '{extra[0]}': not part of this config's model")


def restore(
    directory: str | Path, targets: Mapping[str, tuple[jax.ShapeDtypeStruct, jax.sharding.Sharding]]
) -> dict[str, jax.Array]:
    """Our name -> array restored onto its sharding in the target dtype, after checking names and shapes:
    read by `_sharded_reads` from the OCDBT store Orbax writes (every directory `save_orbax` writes), by
    Orbax's restore otherwise."""
    params = (Path(directory) / PARAMS_DIR).resolve()
    check_stored(stored_arrays(directory), {n: sds.shape for n, (sds, _) in targets.items()}, str(params))
    if not (params / OCDBT_MANIFEST).exists():
        return restore_with_orbax(params, targets)
    try:
        return _sharded_reads(params, targets)
    except ValueError as exc:  # tensorstore's errors (a missing array, an unreadable chunk)
        raise CheckpointError(f"{params}: reading the Orbax checkpoint failed: {exc}") from exc


def restore_with_orbax(
    params: Path, targets: Mapping[str, tuple[jax.ShapeDtypeStruct, jax.sharding.Sharding]]
) -> dict[str, jax.Array]:
    """Orbax's own restore of `params` onto the targets (directories without an OCDBT store; the oracle
    of `_sharded_reads`)."""
    import orbax.checkpoint as ocp

    abstract = {
        name: jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sharding)
        for name, (sds, sharding) in targets.items()
    }
    tree = _nest(abstract)
    ck = checkpointer()
    try:
        restore_args = ocp.checkpoint_utils.construct_restore_args(tree)
        restored = ck.restore(params, args=ocp.args.PyTreeRestore(item=tree, restore_args=restore_args))
    except Exception as exc:
        raise CheckpointError(f"{params}: restoring the Orbax checkpoint failed: {exc}") from exc
    finally:
        ck.close()
    return _flatten(restored)


def _sharded_reads(
    params: Path, targets: Mapping[str, tuple[jax.ShapeDtypeStruct, jax.sharding.Sharding]]
) -> dict[str, jax.Array]:
    """Our name -> array on its sharding, each process reading from the OCDBT store only the chunks of its
    own devices' slices, each distinct slice once, straight into a page-aligned buffer of the target dtype
    (tensorstore casts on the way) that `jax.make_array_from_callback` places: on the CPU its local devices'
    replicas adopt that one buffer (`safetensors.host_buffer`), as the safetensors loader's do. Orbax's
    restore reads a slice once too but copies it to each device from an unaligned buffer, and keeps up to
    `restore_concurrent_gb` of such buffers in flight. No chunk cache: in a directory of one chunk per
    array each distinct slice reads its array's whole chunk."""
    import tensorstore as ts

    context = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
    kvstore = {"driver": "ocdbt", "base": f"file://{params}"}
    out = {}
    for name, (sds, sharding) in targets.items():
        spec = {"driver": "zarr", "kvstore": kvstore, "path": name}
        store = ts.open(spec, open=True, read=True, context=context).result()
        dtype = np.dtype(sds.dtype)
        source = store if store.dtype.numpy_dtype == dtype else ts.cast(store, ts.dtype(dtype.name))
        out[name] = jax.make_array_from_callback(
            tuple(sds.shape), sharding, _slice_reader(source, tuple(sds.shape), dtype), dtype=dtype
        )
    return out


def _slice_reader(source: Any, shape: tuple[int, ...], dtype: np.dtype) -> Any:
    """The callback of `jax.make_array_from_callback`: index -> the slice of `source`, read once."""
    import tensorstore as ts

    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def fetch(index: tuple[slice, ...]) -> np.ndarray:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        if bounds not in seen:
            buf = host_buffer(tuple(b - a for a, b in bounds), dtype)
            if not bounds:
                buf[()] = source.read().result()
            else:
                part = source[tuple(slice(a, b) for a, b in bounds)]
                ts.array(buf)[ts.d[:].translate_to[[a for a, _ in bounds]]].write(part).result()
            seen[bounds] = buf
        return seen[bounds]

    return fetch
