"""Checkpoint I/O: load a Hugging Face Kimi Linear directory or our Orbax directory into a ready model.

    model = load_pretrained("path/to/Kimi-Linear-48B-A3B-Instruct", dtype=jnp.bfloat16)
    # on a mesh: sharding.placement.load_pretrained_on_mesh(path, mesh), which passes `shardings`
    logits = model(input_ids)

The model is built abstractly (`nnx.eval_shape`, nothing allocated), split into graph and state, and each
state leaf is filled with a device array read straight into its sharding: from safetensors each process
reads only the byte ranges of its own devices' shards; from Orbax each process reads the stored chunks its
devices' slices touch (`orbax_io.restore`; `save_orbax` stores routed experts one expert per chunk, while
directories written before that hold one chunk per array, read whole).

The released Kimi K3 layout loads too: `language_model.`-prefixed tensors, the vision tower skipped (and
reported), MXFP4 routed experts kept packed (or dequantized on request), config.json with the text model
under `text_config`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import abstract_model, path_name
from jaxhybrid.ops.mxfp4 import dequantize
from jaxhybrid.weights import hf, orbax_io
from jaxhybrid.weights.hf import MODEL_TYPE, save_hf
from jaxhybrid.weights.orbax_io import is_orbax_dir, save_orbax
from jaxhybrid.weights.progress import load_progress
from jaxhybrid.weights.safetensors import CheckpointError, scan_checkpoint
from jaxhybrid.weights.slices import SliceReader

log = logging.getLogger(__name__)

__all__ = [
    "CheckpointError",
    "checkpoint_format",
    "load_pretrained",
    "read_model_config",
    "save_hf",
    "save_orbax",
    "stored_dtype",
]


def read_raw_config(directory: str | Path) -> dict[str, Any]:
    """The config.json of a checkpoint directory as a dict."""
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
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return raw


def is_kimi_linear_family(raw: dict[str, Any]) -> bool:
    """`model_type: kimi_linear`, or a multimodal wrapper (Kimi K3, whatever its own model_type) whose
    `text_config` is a Kimi Linear family text model: model_type kimi_linear, or a `linear_attn_config`."""
    if raw.get("model_type") == MODEL_TYPE:
        return True
    text = raw.get("text_config")
    return isinstance(text, dict) and (text.get("model_type") == MODEL_TYPE or "linear_attn_config" in text)


def read_model_config(directory: str | Path) -> Any:
    """The ModelConfig of a checkpoint directory; only Kimi Linear family models are accepted
    (`is_kimi_linear_family`)."""
    directory = Path(directory)
    raw = read_raw_config(directory)
    if not is_kimi_linear_family(raw):
        model_type = raw.get("model_type")
        what = "has no model_type" if model_type is None else f"has model_type {model_type!r}"
        raise ConfigError(
            f"{directory / 'config.json'} {what}: only '{MODEL_TYPE}' (Kimi Linear) checkpoints and "
            "wrappers with a Kimi Linear family text_config (Kimi K3) are supported"
        )
    return load_config(directory)


def _with_stored_a_log_size(cfg: Any, tensors: dict[str, Any]) -> Any:
    """K3 stores `A_log` padded (128 entries for 96 heads) but its config.json does not say so: take the
    padded size from the checkpoint when the config leaves it unset."""
    sizes = {int(np.prod(t.shape)) for n, t in tensors.items() if n.endswith(".self_attn.A_log")}
    if cfg.kda_a_log_size is not None or not sizes:
        return cfg
    if len(sizes) > 1:
        raise CheckpointError(f"A_log tensors have different sizes across layers: {sorted(sizes)}")
    size = sizes.pop()
    return cfg if size == cfg.kda_num_heads else cfg.replace(kda_a_log_size=size)


def checkpoint_format(directory: str | Path) -> str:
    """'orbax' for our converted directories, 'hf' for safetensors ones."""
    directory = Path(directory)
    if is_orbax_dir(directory):
        return "orbax"
    if any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").exists():
        return "hf"
    raise CheckpointError(f"{directory}: neither safetensors files nor an Orbax checkpoint under params/")


def stored_dtype(directory: str | Path) -> np.dtype:
    """The dtype a checkpoint directory stores its embedding table in: the model dtype `load_pretrained`
    gives when none is asked for (headers / metadata only)."""
    directory = Path(directory)
    if checkpoint_format(directory) == "hf":
        return hf.checkpoint_dtype(hf.text_model_tensors(scan_checkpoint(directory))[0])
    arrays = orbax_io.stored_arrays(directory)
    if "model.embed_tokens.weight" not in arrays:
        raise CheckpointError(f"{directory}: array 'model.embed_tokens.weight' is missing")
    return arrays["model.embed_tokens.weight"][1]


def _shardings(abstract: Any, names: list[str], shardings: Any) -> dict[str, Any]:
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        return dict.fromkeys(names, device)
    from flax import nnx

    out = {}
    for path, leaf in nnx.to_flat_state(shardings(abstract)):
        out[path_name(path)] = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
    missing = sorted(set(names) - set(out))
    if missing:
        raise ValueError(f"`shardings` gave no sharding for '{missing[0]}'")
    return out


def _packed_targets(cfg: Any, dtype: Any, targets: dict[str, Any], shardings: Any) -> dict[str, Any]:
    """`targets` of a model with dequantized experts, its routed experts' `wK` replaced by the stored
    `wK_packed` / `wK_scale` arrays (shapes and shardings of the packed model): what to restore from an
    Orbax directory of packed experts before `_dequantized`."""
    from flax import nnx

    packed = abstract_model(cfg, dtype)
    names = [n for n in (path_name(p) for p, _ in nnx.to_flat_state(nnx.state(packed))) if n not in targets]
    placement = _shardings(packed, names, shardings)
    values = {path_name(p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(packed))}
    kept = {n: t for n, t in targets.items() if n + "_packed" not in values}
    return kept | {n: (values[n], placement[n]) for n in names}


def _dequantized(restored: dict[str, Any], targets: dict[str, Any]) -> dict[str, Any]:
    """`restored` with each `wK_packed` / `wK_scale` pair dequantized (`jaxhybrid.ops.mxfp4`, exact) into the
    target `wK`'s dtype and sharding, one array at a time."""
    out = {n: a for n, a in restored.items() if not n.endswith(("_packed", "_scale"))}
    for name in set(targets) - set(out):
        sds, sharding = targets[name]
        fn = jax.jit(lambda p, s, dt=sds.dtype: dequantize(p, s, dt), out_shardings=sharding)
        out[name] = fn(restored.pop(name + "_packed"), restored.pop(name + "_scale"))
    return out


def load_pretrained(
    path: str | Path,
    dtype: Any = None,
    shardings: Any = None,
    *,
    progress: bool | None = None,
    report: dict[str, Any] | None = None,
    dequantize_experts: bool = False,
) -> Any:
    """A ready HybridLM from a Hugging Face Kimi Linear / released K3 directory or one from `save_orbax`.

    `dtype`: the model dtype (None: the dtype the checkpoint stores its embedding in); parameters the model
    keeps in fp32 (A_log, dt_bias, the router) stay fp32, and so does every tensor the checkpoint stores in
    fp32 while its embedding is in a narrower type (K3: conv weights, A_log, dt_bias, o_norm).
    `shardings`: a function from the abstract model to the nnx.State of each parameter's sharding (e.g.
    `lambda m: sharding.rules.state_shardings(m, mesh)`); each parameter is read straight into it (None:
    the default device). `progress`: a bar (True), nothing (False), or (None) a bar on a terminal and log
    lines otherwise (`jaxhybrid.weights.progress`), shown once the load takes a few seconds. `report`: a dict
    filled with `format`, `layout`, `expert_quant`, `skipped` (count), `skipped_summary` ({top-level name:
    count}), `skipped_names` (the first 20), `kept_fp32` (names kept fp32 by the rule above),
    `packed_experts` and, for safetensors, `read_bytes` / `read_bytes_by_tensor` (what this process read:
    its own shards only). MXFP4 routed experts load packed (uint8 codes + scales, `HybridLM` docs) unless
    `dequantize_experts` (dequantized exactly at load: 3.6x the bytes, the oracle). An Orbax directory
    restores its experts as it stored them (packed, or dense from a dequantized model); packed ones with
    `dequantize_experts` are restored packed and then dequantized, one array at a time.
    """
    from flax import nnx

    directory = Path(path)
    cfg = read_model_config(directory)
    fmt = checkpoint_format(directory)
    tensors = None
    unpack = False
    skipped: list[str] = []
    expert_quant = getattr(cfg, "expert_quant", None)  # from config.json's quantization_config
    if fmt == "hf":
        all_tensors = scan_checkpoint(directory)
        tensors, skipped = hf.text_model_tensors(all_tensors)
        stored = hf.checkpoint_dtype(tensors)
        stored_dtypes = {n: np.dtype(np.float32) for n, t in tensors.items() if t.dtype == "F32"}
        released = any(n.startswith(hf.RELEASED_PREFIX) for n in all_tensors)
        cfg = _with_stored_a_log_size(cfg, tensors)
    else:
        arrays = orbax_io.stored_arrays(directory)
        if "model.embed_tokens.weight" not in arrays:
            raise CheckpointError(f"{directory}: array 'model.embed_tokens.weight' is missing")
        stored = arrays["model.embed_tokens.weight"][1]
        stored_dtypes = {n: np.dtype(d) for n, (_, d) in arrays.items()}
        released = False
        stored_packed = any(n.endswith(".experts.w1_packed") for n in arrays)
        unpack = stored_packed and dequantize_experts  # restore packed, then dequantize
        dequantize_experts = not stored_packed or dequantize_experts
    dtype = np.dtype(stored if dtype is None else jnp.dtype(dtype))
    if skipped:
        summary = hf.skipped_summary(skipped)
        log.info(
            "%s: skipped %d tensors outside the text model (%s)",
            directory,
            len(skipped),
            ", ".join(f"{k}: {v}" for k, v in summary.items()),
        )

    abstract = abstract_model(cfg, dtype, dequantize_experts=dequantize_experts)
    graphdef, state = nnx.split(abstract)
    variables = {}
    for p, var in nnx.to_flat_state(state):
        if not isinstance(var, (nnx.Param, Buffer)):
            raise TypeError(
                f"model variable '{path_name(p)}' is a {type(var).__name__}, not a Param or Buffer"
            )
        variables[path_name(p)] = var
    placement = _shardings(abstract, list(variables), shardings)
    targets = {name: (var.get_value(), placement[name]) for name, var in variables.items()}
    kept_fp32 = []
    if np.dtype(stored) != np.float32:
        for name, (sds, sharding) in targets.items():
            narrow = jnp.issubdtype(sds.dtype, jnp.floating) and np.dtype(sds.dtype).itemsize < 4
            if narrow and stored_dtypes.get(name) == np.float32:
                targets[name] = (jax.ShapeDtypeStruct(sds.shape, jnp.float32), sharding)
                kept_fp32.append(name)
    if report is not None:
        report.update(
            format=fmt,
            layout="k3-released" if released else "kimi-linear" if fmt == "hf" else "orbax",
            expert_quant=expert_quant if fmt == "hf" else None,
            skipped=len(skipped),
            skipped_summary=hf.skipped_summary(skipped),
            skipped_names=skipped[:20],
            kept_fp32=kept_fp32,
            packed_experts=abstract.packed_experts,
        )

    if fmt == "hf":
        with SliceReader() as reader:
            for name, arr in hf.read_params(
                directory,
                targets,
                tied_embeddings=cfg.tie_word_embeddings,
                progress=progress,
                tensors=tensors,
                expert_quant=expert_quant,
                reader=reader,
            ):
                variables[name].set_value(arr)
        if report is not None:
            report.update(read_bytes=reader.total, read_bytes_by_tensor=dict(reader.bytes_read))
    else:
        total = sum(int(np.prod(sds.shape)) * np.dtype(sds.dtype).itemsize for sds, _ in targets.values())
        with load_progress(total, f"loading {directory.name}", progress, stepwise=False) as bar:
            restored = orbax_io.restore(
                directory, _packed_targets(cfg, dtype, targets, shardings) if unpack else targets
            )
            bar.update(total)
        if unpack:
            restored = _dequantized(restored, targets)
        for name, arr in restored.items():
            variables[name].set_value(arr)
    return nnx.merge(graphdef, state)
