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
copy); no whole tensor lands on one device or in host memory unless one device holds it whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.model import path_name  # noqa: F401 - re-exported: the checkpoint names

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 16 << 20  # a dtype conversion reads pieces of at most this size

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

_EXPERT_PARAM = re.compile(r"^(?P<prefix>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
# MXFP4 experts kept packed: `experts.w1_packed` [E, out, in/2] stacks `experts.{e}.w1.weight_packed`
# (and `_scale` likewise), read as ordinary stacked uint8 tensors.
_PACKED_EXPERT_PARAM = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<w>w[123])_(?P<part>packed|scale)$"
)

# safetensors dtype names -> numpy dtypes (bfloat16 and the fp8 types through ml_dtypes).
_ST_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class CheckpointError(ValueError):
    """A checkpoint that does not match the config (missing / unexpected / mis-shaped tensor) or is broken."""


def np_dtype(name: str) -> np.dtype:
    import ml_dtypes  # noqa: F401  (registers bfloat16 / fp8 with numpy)

    if name not in _ST_DTYPES:
        raise CheckpointError(f"unsupported safetensors dtype {name!r}")
    return np.dtype(_ST_DTYPES[name])


# --- the name mapping ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One parameter of ours and the checkpoint tensor(s) it is made of."""

    name: str  # our flat name
    hf_names: tuple[str, ...]  # one name, or the E per-expert names (in expert order) of a stacked param
    hf_shape: tuple[int, ...]  # shape of each checkpoint tensor (MXFP4: of each weight_packed)
    shape: tuple[int, ...]  # our shape
    quant: str | None = None  # "mxfp4": hf_names are `weight_packed` tensors, each with a `weight_scale`

    @property
    def stacked(self) -> bool:
        return len(self.hf_names) > 1 or bool(_EXPERT_PARAM.match(self.name) or self.packed_part)

    @property
    def packed_part(self) -> str | None:
        """ "packed" / "scale" for the stacked uint8 arrays of experts kept packed, else None."""
        m = _PACKED_EXPERT_PARAM.match(self.name)
        return m["part"] if m else None

    def check_data(self, host: np.ndarray, where: str, first: int = 0) -> None:
        """Refuse what was read but must not load: an E8M0 NaN scale (255) among packed experts' scales
        (`host` holds experts `first`, `first + 1`, ...)."""
        from jaxhybrid.weights.mxfp4 import SCALE_NAN

        if self.packed_part == "scale":
            bad = np.flatnonzero(np.any(host.reshape(host.shape[0], -1) == SCALE_NAN, axis=1))
            if bad.size:
                raise CheckpointError(
                    f"{where}: tensor '{self.hf_names[first + bad[0]]}' holds the E8M0 NaN scale 255"
                )

    @property
    def scale_names(self) -> tuple[str, ...]:
        """The `weight_scale` tensor beside each `weight_packed` one (MXFP4 only)."""
        return tuple(n.removesuffix("_packed") + "_scale" for n in self.hf_names) if self.quant else ()

    @property
    def scale_shape(self) -> tuple[int, ...]:
        from jaxhybrid.weights.mxfp4 import packed_shapes

        return packed_shapes(self.shape[1:])[1] if self.quant else ()


def tensor_specs(shapes: Mapping[str, tuple[int, ...]], expert_quant: str | None = None) -> list[TensorSpec]:
    """The checkpoint tensors behind each of our parameters (`shapes`: our flat name -> shape).
    `expert_quant="mxfp4"`: the routed experts are stored as MXFP4 packed + scale tensors."""
    from jaxhybrid.weights.mxfp4 import packed_shapes

    if expert_quant not in (None, "mxfp4"):
        raise CheckpointError(f"unsupported expert quantization {expert_quant!r} (only 'mxfp4')")
    specs = []
    for name, shape in shapes.items():
        shape = tuple(shape)
        m = _EXPERT_PARAM.match(name)
        packed = _PACKED_EXPERT_PARAM.match(name)
        if packed:
            p = packed
            hf = tuple(f"{p['prefix']}.{e}.{p['w']}.weight_{p['part']}" for e in range(shape[0]))
            specs.append(TensorSpec(name, hf, shape[1:], shape))
        elif m and expert_quant == "mxfp4":
            hf = tuple(f"{m['prefix']}.{e}.{m['w']}.weight_packed" for e in range(shape[0]))
            specs.append(TensorSpec(name, hf, packed_shapes(shape[1:])[0], shape, quant="mxfp4"))
        elif m:
            hf = tuple(f"{m['prefix']}.{e}.{m['w']}.weight" for e in range(shape[0]))
            specs.append(TensorSpec(name, hf, shape[1:], shape))
        else:
            specs.append(TensorSpec(name, (name,), shape, shape))
    return specs


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


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # start of the data inside the file's data section
    nbytes: int
    key: str = ""  # the tensor's name inside the file (it differs from ours in the released layout)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor name -> info from a safetensors header; checks that the file holds all the data it declares."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise CheckpointError(
                f"{path}: truncated safetensors file: the header needs {8 + header_len} bytes, "
                f"the file has {size}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path}: corrupt safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    out: dict[str, TensorInfo] = {}
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = (int(x) for x in meta["data_offsets"])
            info = TensorInfo(
                path, str(meta["dtype"]), tuple(int(s) for s in meta["shape"]), start, stop - start, name
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: corrupt header entry for tensor '{name}': {exc!r}") from None
        out[name] = info
        end = max(end, stop)
    if 8 + header_len + end > size:
        raise CheckpointError(
            f"{path}: truncated safetensors file: its header declares {8 + header_len + end} bytes, "
            f"the file has {size}"
        )
    return out


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory: those named by the index, else every `*.safetensors`."""
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid safetensors index: {exc!r}") from None
        files = [directory / f for f in sorted(set(weight_map.values()))]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{directory}: shard file(s) named in {INDEX_FILE} are missing: {missing}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files and no {INDEX_FILE}")
    return files


def scan_checkpoint(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of an HF checkpoint directory, from the headers only (no tensor data is read)."""
    directory = Path(directory)
    tensors: dict[str, TensorInfo] = {}
    for path in checkpoint_files(directory):
        for name, info in read_header(path).items():
            if name in tensors:
                raise CheckpointError(
                    f"tensor '{name}' appears in both {tensors[name].file.name} and {path.name}"
                )
            tensors[name] = info
    index = directory / INDEX_FILE
    if index.exists():
        for name, fname in json.loads(index.read_text())["weight_map"].items():
            if name not in tensors or tensors[name].file.name != fname:
                raise CheckpointError(
                    f"tensor '{name}' is listed in {INDEX_FILE} under {fname} but is not there"
                )
    return tensors


def host_buffer(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised array in its own anonymous memory mapping: page-aligned, so on the CPU
    `jax.device_put` adopts it without a copy (the host buffer *is* the device array); returned to the
    OS as soon as it is dropped; and not backed by transparent huge pages, whose first-touch compaction
    made filling fresh numpy arrays several times slower on a busy machine."""
    import mmap

    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    mapping = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return np.frombuffer(mapping, dtype, count=count).reshape(shape)


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
    from jaxhybrid.weights.progress import load_progress
    from jaxhybrid.weights.slices import SliceReader, read_sharded

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
    from jaxhybrid.weights.mxfp4 import quantize_mxfp4

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


def write_safetensors(
    tensors: Iterable[tuple[str, Callable[[], np.ndarray], tuple[int, ...], np.dtype]],
    directory: Path,
    max_shard_bytes: int | None = None,
) -> list[Path]:
    """Write tensors in the HF layout: one `model.safetensors`, or shards + `model.safetensors.index.json`.

    Only one shard's tensors are materialised on the host at a time.
    """
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    items = list(tensors)
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, _, shape, dtype) in enumerate(items):
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map: dict[str, str] = {}
    total = 0
    paths = []
    for fname, shard in zip(names, shards, strict=True):
        data = {}
        for i in shard:
            name, thunk, _, _ = items[i]
            data[name] = np.ascontiguousarray(thunk())
            weight_map[name] = fname
            total += data[name].nbytes
        save_file(data, str(directory / fname), metadata={"format": "pt"})
        del data
        paths.append(directory / fname)
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths


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

    from jaxhybrid.layers.basic import Buffer

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
