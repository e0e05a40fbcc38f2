"""Checkpoint I/O: load a Hugging Face Kimi Linear directory or our Orbax directory into a ready model.

    model = load_pretrained("path/to/Kimi-Linear-48B-A3B-Instruct", dtype=jnp.bfloat16, mesh=mesh)
    logits = model(input_ids)

The model is built abstractly (`nnx.eval_shape`, nothing allocated), split into graph and state, and each
state leaf is filled with a device array made from the tensor just read and placed on its sharding; the
host never holds a second full copy of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.weights.hf import MODEL_TYPE, CheckpointError, path_name, save_hf
from jaxhybrid.weights.orbax_io import is_orbax_dir, save_orbax

__all__ = [
    "CheckpointError",
    "checkpoint_format",
    "load_pretrained",
    "read_model_config",
    "save_hf",
    "save_orbax",
]


def read_model_config(directory: str | Path) -> Any:
    """The ModelConfig of a checkpoint directory; only `model_type: kimi_linear` is accepted."""
    from jaxhybrid.config import ConfigError, load_config

    directory = Path(directory)
    path = directory / "config.json"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    if not path.exists():
        raise CheckpointError(f"{directory}: no config.json (not a model directory)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type != MODEL_TYPE:
        what = "has no model_type" if model_type is None else f"has model_type {model_type!r}"
        raise ConfigError(f"{path} {what}: only '{MODEL_TYPE}' (Kimi Linear) checkpoints are supported")
    return load_config(directory)


def checkpoint_format(directory: str | Path) -> str:
    """'orbax' for our converted directories, 'hf' for safetensors ones."""
    directory = Path(directory)
    if is_orbax_dir(directory):
        return "orbax"
    if any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists():
        return "hf"
    raise CheckpointError(f"{directory}: neither safetensors files nor an Orbax checkpoint under params/")


def _shardings(abstract: Any, names: list[str], mesh: jax.sharding.Mesh | None) -> dict[str, Any]:
    if mesh is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return dict.fromkeys(names, device)
    from flax import nnx

    from sharding.rules import state_shardings  # built separately; imported only when a mesh is given

    out = {}
    for path, leaf in nnx.to_flat_state(state_shardings(abstract, mesh)):
        out[path_name(path)] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"state_shardings gave no sharding for '{missing[0]}'")
    return out


def load_pretrained(
    path: str | Path,
    dtype: Any = None,
    mesh: jax.sharding.Mesh | None = None,
    *,
    progress: bool | None = None,
) -> Any:
    """A ready HybridLM from a Hugging Face Kimi Linear directory or one written by `save_orbax`.

    `dtype`: the model dtype (None: the dtype the checkpoint stores its embedding in); parameters the model
    keeps in fp32 (A_log, dt_bias, the router) stay fp32. `mesh`: place each parameter on the sharding
    `sharding.rules.state_shardings` gives it (None: the default device). `progress`: show a progress bar
    (None: only on a terminal).
    """
    from flax import nnx

    from jaxhybrid.layers.basic import Buffer
    from jaxhybrid.model import HybridLM
    from jaxhybrid.weights import hf, orbax_io

    directory = Path(path)
    cfg = read_model_config(directory)
    fmt = checkpoint_format(directory)
    tensors = None
    if fmt == "hf":
        tensors = hf.scan_checkpoint(directory)
        stored = hf.checkpoint_dtype(tensors)
    else:
        arrays = orbax_io.stored_arrays(directory)
        if "model.embed_tokens.weight" not in arrays:
            raise CheckpointError(f"{directory}: array 'model.embed_tokens.weight' is missing")
        stored = arrays["model.embed_tokens.weight"][1]
    dtype = np.dtype(stored if dtype is None else jnp.dtype(dtype))

    abstract = nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), dtype=dtype))
    graphdef, state = nnx.split(abstract)
    variables = {}
    for p, var in nnx.to_flat_state(state):
        if not isinstance(var, (nnx.Param, Buffer)):
            raise TypeError(
                f"model variable '{path_name(p)}' is a {type(var).__name__}, not a Param or Buffer"
            )
        variables[path_name(p)] = var
    shardings = _shardings(abstract, list(variables), mesh)
    targets = {name: (var.get_value(), shardings[name]) for name, var in variables.items()}

    if fmt == "hf":
        for name, arr in hf.read_params(
            directory, targets, tied_embeddings=cfg.tie_word_embeddings, progress=progress, tensors=tensors
        ):
            variables[name].set_value(arr)
    else:
        for name, arr in orbax_io.restore(directory, targets).items():
            variables[name].set_value(arr)
    return nnx.merge(graphdef, state)
