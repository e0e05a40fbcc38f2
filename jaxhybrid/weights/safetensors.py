"""The safetensors files of a checkpoint directory, beneath both the Hugging Face layout (`hf`) and the
sliced reader (`slices`): the files and their headers, the stored dtypes, page-aligned host buffers to read
into, writing tensors as one file or shards with an index, and which stored tensors each of our parameters
is made of (`TensorSpec`: one tensor, E per-expert tensors stacked, or MXFP4 packed codes + scales).

Reading a header reads no tensor data; every name, shape and dtype can be checked before a byte is read.
"""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jaxhybrid.weights.mxfp4 import SCALE_NAN, packed_shapes

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 16 << 20  # a dtype conversion reads pieces of at most this size

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


# --- the files and their headers -------------------------------------------------------------------------


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


# --- which stored tensors make each parameter ------------------------------------------------------------

_EXPERT_PARAM = re.compile(r"^(?P<prefix>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<w>w[123])$")
# MXFP4 experts kept packed: `experts.w1_packed` [E, out, in/2] stacks `experts.{e}.w1.weight_packed`
# (and `_scale` likewise), read as ordinary stacked uint8 tensors.
_PACKED_EXPERT_PARAM = re.compile(
    r"^(?P<prefix>model\.layers\.\d+\.block_sparse_moe\.experts)\.(?P<w>w[123])_(?P<part>packed|scale)$"
)


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
        return packed_shapes(self.shape[1:])[1] if self.quant else ()


def tensor_specs(shapes: Mapping[str, tuple[int, ...]], expert_quant: str | None = None) -> list[TensorSpec]:
    """The checkpoint tensors behind each of our parameters (`shapes`: our flat name -> shape).
    `expert_quant="mxfp4"`: the routed experts are stored as MXFP4 packed + scale tensors."""
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


# --- writing ---------------------------------------------------------------------------------------------


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
