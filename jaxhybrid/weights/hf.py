"""Hugging Face Kimi Linear checkpoints: the name mapping, reading one tensor at a time, writing.

Our parameter names are the checkpoint names (`model.layers.0.self_attn.q_proj.weight`, ...) with one
exception: the routed experts of a MoE layer are stacked into one parameter per projection,
`model.layers.L.block_sparse_moe.experts.w1` [E, out, in], which the checkpoint stores as E tensors
`model.layers.L.block_sparse_moe.experts.{e}.w1.weight` [out, in]. Everything else, including
`self_attn.A_log` ([1, 1, H, 1] on both sides; a flat [H] loads too) and the router's
`e_score_correction_bias` (a Buffer here), maps one to one with the same shape. A dense layer's MLP loads
from `mlp.*` (the published checkpoints) or `block_sparse_moe.*_proj` (transformers 5.x).

The released Kimi K3 layout (shared/K3.md) differs in three ways, all handled here:
- the text model's tensors are prefixed `language_model.` (`language_model.model.X`,
  `language_model.lm_head.weight`); everything outside that prefix (`vision_tower.*`, `mm_projector.*`)
  is not part of the text model and is skipped (`text_model_tensors`, reported by the loader);
- routed experts are MXFP4 (`experts.E.wK.weight_packed` uint8 [out, in/2] + `weight_scale` uint8
  [out, in/32]) when config.json's `quantization_config` says compressed-tensors `mxfp4-pack-quantized`
  (`ModelConfig.expert_quant == "mxfp4"`); a model that keeps them packed (the default) reads them as
  stacked uint8 arrays `experts.wK_packed` / `experts.wK_scale`; with `dequantize_experts` the loader
  dequantizes them exactly into the stacked expert arrays (`jaxhybrid.weights.mxfp4`);
- `config.json` keeps the text model under `text_config`.

Reading (`read_params`, through `jaxhybrid.weights.slices`) puts every parameter straight into its sharding:
a process reads only the byte ranges of the slices its own devices hold, into a page-aligned buffer of the
parameter's dtype that `jax.make_array_from_callback` places (on the CPU it adopts the buffer without a
copy); no whole tensor lands on one device or in host memory unless one device holds it whole. The files
themselves (headers, dtypes, which stored tensors make a parameter, shards) are
`jaxhybrid.weights.safetensors`, which both this module and `slices` read with.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import path_name  # noqa: F401 - re-exported: the checkpoint names
from jaxhybrid.weights.mxfp4 import quantize_mxfp4
from jaxhybrid.weights.progress import load_progress
from jaxhybrid.weights.safetensors import (
    CheckpointError,
    TensorInfo,
    TensorSpec,
    np_dtype,
    scan_checkpoint,
    tensor_specs,
    write_safetensors,
)
from jaxhybrid.weights.slices import SliceReader, read_sharded

# Tensors some exports carry that the model does not use; anything else unexpected is an error.
KNOWN_UNUSED: tuple[re.Pattern[str], ...] = (
    re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$"),
    # compressed-tensors may record each packed weight's logical shape; the config gives it already
    re.compile(r"^model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]\.weight_shape$"),
)

RELEASED_PREFIX = "language_model."  # the text model's tensors in the released (multimodal) K3 layout
RELEASED_MODEL_TYPE = "kimi_k3"  # the top-level model_type our released-layout writer labels config.json with
MXFP4_FORMAT = "mxfp4-pack-quantized"
QUANT_METHOD = "compressed-tensors"


# --- the name mapping ------------------------------------------------------------------------------------

# transformers 5.x `save_pretrained` writes a dense lead layer's MLP under `block_sparse_moe.` (its module
# name), the published Kimi-Linear checkpoints under `mlp.`; both spellings load.
_DENSE_MLP_ALT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj)\.weight$")


def text_model_tensors(tensors: Mapping[str, TensorInfo]) -> tuple[dict[str, TensorInfo], list[str]]:
    """(the text model's tensors under our names, the names skipped). In the released layout (any name
    starts with `language_model.`) that prefix is removed and every tensor outside it is skipped; other
    checkpoints pass through unchanged. A dense layer's MLP spelled `block_sparse_moe.{gate,up,down}_proj`
    (transformers 5.x) is renamed `mlp.*`; a checkpoint with both spellings is refused. Each TensorInfo
    keeps the name it has in its file."""
    skipped: list[str] = []
    if any(n.startswith(RELEASED_PREFIX) for n in tensors):
        skipped = sorted(n for n in tensors if not n.startswith(RELEASED_PREFIX))
        tensors = {
            n.removeprefix(RELEASED_PREFIX): t for n, t in tensors.items() if n.startswith(RELEASED_PREFIX)
        }
    text: dict[str, TensorInfo] = {}
    for name, info in tensors.items():
        m = _DENSE_MLP_ALT.match(name)
        ours = f"{m[1]}.mlp.{m[2]}.weight" if m else name
        if m and ours in tensors:
            raise CheckpointError(
                f"tensor '{ours}' is stored twice: as '{ours}' and as '{info.key or name}' (use one spelling)"
            )
        text[ours] = info
    return text, skipped


def _flat_a_log(name: str, got: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """K3's notes give 128 `A_log` entries per layer, not their layout: `[N]` loads as `[1, 1, N, 1]`."""
    return name.endswith(".self_attn.A_log") and len(got) == 1 and got[0] == int(np.prod(shape))


def skipped_summary(names: Iterable[str]) -> dict[str, int]:
    """Skipped tensor count per top-level name (`vision_tower`: 412, `mm_projector`: 4, ...)."""
    out: dict[str, int] = {}
    for n in names:
        top = n.split(".", 1)[0]
        out[top] = out.get(top, 0) + 1
    return out


def known_unused(name: str, tied_embeddings: bool = False) -> bool:
    if tied_embeddings and name == "lm_head.weight":
        return True
    return any(p.match(name) for p in KNOWN_UNUSED)


# --- reading ---------------------------------------------------------------------------------------------


def check_against(
    specs: list[TensorSpec], tensors: Mapping[str, TensorInfo], *, tied_embeddings: bool, where: str
) -> None:
    """Raise CheckpointError naming the first missing, mis-shaped or unexpected tensor."""
    expected: set[str] = set()
    for spec in specs:
        parts = [(spec.hf_names, spec.hf_shape), (spec.scale_names, spec.scale_shape)]
        for names, shape in parts:
            for hf in names:
                expected.add(hf)
                if hf not in tensors:
                    hint = ""
                    if f"{hf}_packed" in tensors:
                        hint = (
                            f"; the checkpoint has '{hf}_packed', but MXFP4 tensors need a "
                            f"compressed-tensors '{MXFP4_FORMAT}' quantization_config in config.json"
                        )
                    raise CheckpointError(
                        f"{where}: tensor '{hf}' is missing (the config needs it, shape {list(shape)}){hint}"
                    )
                got = tensors[hf].shape
                if got != shape and not _flat_a_log(hf, got, shape):
                    raise CheckpointError(
                        f"{where}: tensor '{hf}' has shape {list(got)} in {tensors[hf].file.name}, "
                        f"the config needs {list(shape)}"
                    )
                np_dtype(tensors[hf].dtype)  # unsupported dtypes fail here, before anything is read
                if (spec.quant or spec.packed_part) and tensors[hf].dtype != "U8":
                    raise CheckpointError(
                        f"{where}: MXFP4 tensor '{hf}' has dtype {tensors[hf].dtype}, expected U8"
                    )
    extra = sorted(n for n in tensors if n not in expected and not known_unused(n, tied_embeddings))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        hint = ""
        if extra[0].endswith(("weight_packed", "weight_scale")):
            hint = f" (MXFP4 tensors need a compressed-tensors '{MXFP4_FORMAT}' quantization_config)"
        raise CheckpointError(
            f"{where}: unexpected tensor '{extra[0]}'{more}: not part of this config's model "
            f"and not a known-unused tensor{hint}"
        )


def read_params(
    directory: Path,
    targets: Mapping[str, tuple[jax.ShapeDtypeStruct, jax.sharding.Sharding]],
    *,
    tied_embeddings: bool = False,
    progress: bool | None = None,
    tensors: Mapping[str, TensorInfo] | None = None,
    expert_quant: str | None = None,
    reader: Any = None,
) -> Iterator[tuple[str, jax.Array]]:
    """Yield (our name, device array) for every target (name -> (abstract leaf, sharding)).

    All names, shapes and dtypes are checked before any data is read. Each array is read straight into its
    sharding (`jaxhybrid.weights.slices.read_sharded`: this process reads only its own devices' slices,
    cast to the target dtype) before the next is read. `tensors`: the checkpoint's tensors under our names
    (default: scanned, released-layout prefix removed and the rest skipped); `expert_quant="mxfp4"`: routed
    experts are read as MXFP4 and dequantized exactly. `reader`: a `slices.SliceReader` to read with (its
    `bytes_read` counts what this process read per tensor; default: a fresh one).
    """
    directory = Path(directory)
    tensors = text_model_tensors(scan_checkpoint(directory))[0] if tensors is None else tensors
    specs = tensor_specs({name: sds.shape for name, (sds, _) in targets.items()}, expert_quant)
    check_against(specs, tensors, tied_embeddings=tied_embeddings, where=str(directory))
    # Read in file order so each shard is streamed front to back.
    specs.sort(key=lambda s: (str(tensors[s.hf_names[0]].file), tensors[s.hf_names[0]].offset))
    total = sum(tensors[hf].nbytes for s in specs for hf in (*s.hf_names, *s.scale_names))
    # The bar walks the checkpoint's bytes; its postfix says what this process really read (its own slices).
    bar = load_progress(total, f"loading {directory.name}", progress)
    own = reader is None
    reader = SliceReader() if own else reader
    try:
        with bar:
            for spec in specs:
                sds, sharding = targets[spec.name]
                arr = read_sharded(reader, spec, tensors, sds, sharding, where=str(directory))
                arr.block_until_ready()
                if spec.packed_part == "scale":  # this process's slices of the scales: no NaN scale
                    for shard in arr.addressable_shards:
                        spec.check_data(
                            np.asarray(shard.data), str(directory), first=shard.index[0].start or 0
                        )
                bar.update(sum(tensors[hf].nbytes for hf in (*spec.hf_names, *spec.scale_names)))
                bar.set_postfix_str(f"{reader.total / 2**20:,.0f} MiB read", refresh=False)
                yield spec.name, arr
    finally:
        if own:
            reader.close()


def checkpoint_dtype(tensors: Mapping[str, TensorInfo]) -> np.dtype:
    """The dtype the checkpoint stores its embedding table in (the model dtype when none is asked for)."""
    info = tensors.get("model.embed_tokens.weight")
    if info is None:
        raise CheckpointError("tensor 'model.embed_tokens.weight' is missing")
    return np_dtype(info.dtype)


# --- writing ---------------------------------------------------------------------------------------------


def _quantized_pair(
    quantize: Callable[[], tuple[np.ndarray, np.ndarray]],
) -> tuple[Callable[[], np.ndarray], Callable[[], np.ndarray]]:
    """Thunks of (packed, scale) that quantize one expert once, not once per tensor: the result is kept
    from the first call until both thunks have run."""
    memo: dict[int, np.ndarray] = {}

    def part(i: int) -> Callable[[], np.ndarray]:
        def thunk() -> np.ndarray:
            if i not in memo:
                memo.update(enumerate(quantize()))
            return memo.pop(i)

        return thunk

    return part(0), part(1)


def hf_tensors(
    params: Mapping[str, Any], *, prefix: str = "", expert_quant: str | None = None
) -> Iterator[tuple[str, Callable[[], np.ndarray], tuple[int, ...], np.dtype]]:
    """(checkpoint name, thunk giving the tensor, shape, dtype) for our named params, experts unstacked;
    names prefixed with `prefix`; `expert_quant="mxfp4"`: experts quantized to packed + scale tensors
    (each thunk quantizes its expert: exact for values that MXFP4 represents)."""
    u8 = np.dtype(np.uint8)
    for spec in tensor_specs({n: tuple(a.shape) for n, a in params.items()}, expert_quant):
        arr = params[spec.name]
        dtype = np.dtype(arr.dtype)
        if spec.quant:
            for e, (p_name, s_name) in enumerate(zip(spec.hf_names, spec.scale_names, strict=True)):
                packed, scale = _quantized_pair(lambda a=arr, e=e: quantize_mxfp4(np.asarray(a[e])))
                yield prefix + p_name, packed, spec.hf_shape, u8
                yield prefix + s_name, scale, spec.scale_shape, u8
        elif len(spec.hf_names) == 1 and not spec.stacked:
            yield prefix + spec.hf_names[0], (lambda a=arr: np.asarray(a)), spec.hf_shape, dtype
        else:
            for e, hf in enumerate(spec.hf_names):
                yield prefix + hf, (lambda a=arr, e=e: np.asarray(a[e])), spec.hf_shape, dtype


# --- directories -----------------------------------------------------------------------------------------

MODEL_TYPE = "kimi_linear"
TOKENIZER_FILES = (
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def write_config(cfg: Any, directory: Path, **extra: Any) -> None:
    """`config.json` for `cfg` (a ModelConfig) that `load_config` reads back, with the HF model type."""
    out = {"model_type": MODEL_TYPE, "architectures": ["KimiLinearForCausalLM"], **cfg.to_hf_dict(), **extra}
    (Path(directory) / "config.json").write_text(json.dumps(out, indent=2) + "\n")


def mxfp4_quantization_config() -> dict[str, Any]:
    """A compressed-tensors quantization_config for MXFP4 routed experts (format under a config group)."""
    weights = {"num_bits": 4, "type": "float", "group_size": 32, "strategy": "group", "symmetric": True}
    return {
        "quant_method": QUANT_METHOD,
        "format": MXFP4_FORMAT,
        "config_groups": {"group_0": {"format": MXFP4_FORMAT, "targets": ["Linear"], "weights": weights}},
    }


def write_released_config(cfg: Any, directory: Path, expert_quant: str | None) -> None:
    """`config.json` in the released K3 shape: the text model under `text_config`, the quantization config
    at the top level (K3.md allows either place; the reader accepts both)."""
    text = {"model_type": MODEL_TYPE, **cfg.to_hf_dict()}
    out: dict[str, Any] = {"model_type": RELEASED_MODEL_TYPE, "text_config": text}
    if expert_quant == "mxfp4":
        out["quantization_config"] = mxfp4_quantization_config()
    (Path(directory) / "config.json").write_text(json.dumps(out, indent=2) + "\n")


def copy_tokenizer_files(src: Path | None, dst: Path) -> list[str]:
    """Copy the tokenizer / chat template / generation files that exist in `src` to `dst`."""
    import shutil

    copied = []
    if src is None:
        return copied
    for fname in TOKENIZER_FILES:
        if (Path(src) / fname).exists() and Path(src).resolve() != Path(dst).resolve():
            shutil.copyfile(Path(src) / fname, Path(dst) / fname)
            copied.append(fname)
    return copied


def named_arrays(model: Any) -> dict[str, jax.Array]:
    """Our flat name -> array for every parameter and buffer of a model (the checkpoint's contents)."""
    from flax import nnx

    state = nnx.state(model, nnx.Any(nnx.Param, Buffer))
    return {path_name(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def save_hf(
    model: Any,
    directory: str | Path,
    *,
    max_shard_bytes: int | None = None,
    tokenizer_dir: str | Path | None = None,
    layout: str = "kimi-linear",
    expert_quant: str | None = None,
    extra_tensors: Mapping[str, np.ndarray] | None = None,
) -> list[Path]:
    """Write `model` as a Hugging Face checkpoint directory (config.json + safetensors in the published
    names and shapes, experts unstacked); returns the safetensors files written.

    `layout="kimi-linear"`: Kimi Linear's names. `layout="k3-released"`: the released K3 layout, tensors
    under `language_model.` and config.json with `text_config` (+ `quantization_config`).
    `expert_quant="mxfp4"`: routed experts as MXFP4 packed + scale tensors (always so for a model that keeps
    them packed: its bytes are written as they are). `extra_tensors`: written as given (e.g. vision-tower
    tensors, which the loader skips).
    """
    if layout not in ("kimi-linear", "k3-released"):
        raise ValueError(f"unknown checkpoint layout {layout!r} (kimi-linear or k3-released)")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    released = layout == "k3-released"
    cfg = model.config
    if getattr(model, "packed_experts", False):  # experts held as MXFP4 are written as MXFP4
        expert_quant = "mxfp4"
    if hasattr(cfg, "expert_quant"):  # the config says how the experts are stored: as written here
        cfg = cfg.replace(expert_quant=expert_quant)
    if released:
        write_released_config(cfg, directory, expert_quant)
    elif expert_quant is not None:
        write_config(cfg, directory, quantization_config=mxfp4_quantization_config())
    else:
        write_config(cfg, directory)
    items = list(
        hf_tensors(named_arrays(model), prefix=RELEASED_PREFIX if released else "", expert_quant=expert_quant)
    )
    for name, arr in (extra_tensors or {}).items():
        arr = np.asarray(arr)
        items.append((name, (lambda a=arr: a), tuple(arr.shape), arr.dtype))
    paths = write_safetensors(items, directory, max_shard_bytes)
    copy_tokenizer_files(None if tokenizer_dir is None else Path(tokenizer_dir), directory)
    return paths
