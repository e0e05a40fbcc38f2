"""Our own checkpoint directory: `config.json` (HF style, `load_config` reads it), the tokenizer files, and
the parameters as an Orbax checkpoint under `params/`, keyed by our names (experts stacked).

Restoring goes straight into the target shardings (Orbax reads each array into its device buffers), and
the stored dtype is cast to the requested one on the way.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.weights.hf import CheckpointError, copy_tokenizer_files, named_arrays, write_config

PARAMS_DIR = "params"
RESTORE_CONCURRENT_GB = 1
FORMAT = "orbax"


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
    """Our name -> (shape, dtype) of every array in an Orbax checkpoint directory (metadata only)."""
    params = (Path(directory) / PARAMS_DIR).resolve()  # Orbax finds no metadata under a relative path
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


def save_orbax(
    model: Any, directory: str | Path, *, tokenizer_dir: str | Path | None = None, overwrite: bool = False
) -> Path:
    """Write `model` to `directory` (config.json, tokenizer files copied from `tokenizer_dir`, params/)."""
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
        ck.save((directory / PARAMS_DIR).resolve(), args=ocp.args.PyTreeSave(_nest(arrays)))
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
    """Our name -> array restored onto its sharding in the target dtype, after checking names and shapes."""
    import orbax.checkpoint as ocp

    params = (Path(directory) / PARAMS_DIR).resolve()
    check_stored(stored_arrays(directory), {n: sds.shape for n, (sds, _) in targets.items()}, str(params))
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
