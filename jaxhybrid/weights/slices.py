"""Reading a parameter straight into its sharding: each process reads only the byte ranges of the slices its
own devices hold, from the safetensors files, with one `os.preadv` per contiguous range.

`slice_ranges` is the pure part: the contiguous (offset, length) ranges of a C-order array that a slice
covers (a row range of a tensor is one range; a column slice is one range per row). `SliceReader` reads
them into a page-aligned buffer of the target dtype (converting from the stored dtype in bounded pieces)
and counts the bytes it read per checkpoint tensor. `read_sharded` builds the `jax.Array` with
`jax.make_array_from_callback`, reading each distinct slice once per process even when several local
devices hold it (replication). Routed experts stacked from per-expert tensors read only the experts of
the slice; MXFP4 experts read the slice's packed codes and scales (columns widened to whole groups of 32) and
dequantize them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxhybrid.weights.mxfp4 import GROUP, SCALE_NAN, dequantize_mxfp4
from jaxhybrid.weights.safetensors import (
    CHUNK_BYTES,
    CheckpointError,
    TensorInfo,
    TensorSpec,
    host_buffer,
    np_dtype,
)

Index = tuple[slice, ...]


def normalize_index(index: Index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(start, stop) per dimension of a basic-slice index (missing trailing dims: whole)."""
    out = []
    for d, size in enumerate(shape):
        s = index[d] if d < len(index) else slice(None)
        start, stop, step = s.indices(size)
        if step != 1:
            raise ValueError(f"slice {s} of dimension {d}: only unit steps are read")
        out.append((start, max(start, stop)))
    return tuple(out)


def slice_ranges(
    shape: tuple[int, ...], bounds: tuple[tuple[int, int], ...], itemsize: int
) -> tuple[np.ndarray, int]:
    """(byte offsets, bytes per range) of the contiguous ranges that `bounds` ((start, stop) per dimension)
    covers in a C-order array of `shape`, in the order of the slice's own C-order elements."""
    shape = tuple(shape)
    sizes = [b - a for a, b in bounds]
    if not shape:
        return np.zeros(1, np.int64), itemsize
    if any(n == 0 for n in sizes):
        return np.zeros(0, np.int64), 0
    # the last dimension taken in part: every dimension after it is whole
    k = max((d for d, (a, b) in enumerate(bounds) if (a, b) != (0, shape[d])), default=0)
    inner = int(np.prod(shape[k + 1 :], dtype=np.int64))
    length = sizes[k] * inner * itemsize
    strides = np.array([int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(k + 1)], np.int64)
    grids = np.meshgrid(*[np.arange(a, b, dtype=np.int64) for a, b in bounds[:k]], indexing="ij")
    offsets = np.full(int(np.prod(sizes[:k], dtype=np.int64)), bounds[k][0] * strides[k], np.int64)
    for d, g in enumerate(grids):
        offsets += g.reshape(-1) * strides[d]
    return offsets * itemsize, length


class SliceReader:
    """Reads slices of checkpoint tensors by byte ranges; `bytes_read[name]` counts what it read per tensor.

    One file descriptor per safetensors file, opened on first use; reads go through `os.preadv` into the
    destination's memory (no memory mapping, so nothing of the file stays in the resident set)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.bytes_read: dict[str, int] = {}
        self._fds: dict[Path, int] = {}
        self._data_start: dict[Path, int] = {}

    def _fd(self, file: Path) -> int:
        if file not in self._fds:
            try:
                self._fds[file] = os.open(file, os.O_RDONLY)
                with open(file, "rb") as f:
                    self._data_start[file] = 8 + int.from_bytes(f.read(8), "little")
            except OSError as exc:
                raise CheckpointError(f"{file}: cannot open safetensors file: {exc}") from None
        return self._fds[file]

    def _pread(self, name: str, info: TensorInfo, offset: int, out: memoryview) -> None:
        fd = self._fd(info.file)
        start = self._data_start[info.file] + info.offset + offset
        done = 0
        while done < len(out):
            n = os.preadv(fd, [out[done:]], start + done)
            if n <= 0:
                raise CheckpointError(f"tensor '{name}' in {info.file}: the file ends inside its data")
            done += n
        self.bytes_read[name] = self.bytes_read.get(name, 0) + done

    def read(self, name: str, info: TensorInfo, shape: tuple[int, ...], bounds: Any, out: np.ndarray) -> None:
        """Read the slice `bounds` ((start, stop) per dimension) of tensor `name`, seen with our `shape` (a
        flat A_log as [1, 1, H, 1]: the same bytes), into `out` (C-contiguous, the slice's shape; its dtype
        converted from the stored one)."""
        stored = np_dtype(info.dtype)
        offsets, length = slice_ranges(shape, bounds, stored.itemsize)
        flat = out.reshape(-1)
        if stored == out.dtype:
            dst = memoryview(flat.view(np.uint8))
            for i, off in enumerate(offsets.tolist()):
                self._pread(name, info, off, dst[i * length : (i + 1) * length])
            return
        # another dtype: read bounded pieces of whole elements into a bounce buffer and convert
        piece = max(stored.itemsize, self.chunk_bytes - self.chunk_bytes % stored.itemsize)
        bounce = np.empty(min(piece, max(length, stored.itemsize)) // stored.itemsize, stored)
        raw = memoryview(bounce.view(np.uint8))
        pos = 0
        for off in offsets.tolist():
            for a in range(0, length, piece):
                n = min(piece, length - a)
                self._pread(name, info, off + a, raw[:n])
                count = n // stored.itemsize
                flat[pos : pos + count] = bounce[:count]
                pos += count

    @property
    def total(self) -> int:
        return sum(self.bytes_read.values())

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_slice(
    reader: SliceReader,
    spec: TensorSpec,
    tensors: Mapping[str, TensorInfo],
    dtype: Any,
    index: Index,
    where: str,
) -> np.ndarray:
    """The slice `index` of our parameter `spec` in `dtype`, read from its checkpoint tensor(s) only."""
    bounds = normalize_index(index, spec.shape)
    out = host_buffer(tuple(b - a for a, b in bounds), dtype)
    if spec.quant:
        return _read_mxfp4_slice(reader, spec, tensors, bounds, out, where)
    if not spec.stacked:
        hf = spec.hf_names[0]
        reader.read(hf, tensors[hf], spec.shape, bounds, out)
        return out
    (a, b), rest = bounds[0], bounds[1:]
    for e in range(a, b):  # only the experts of this slice
        hf = spec.hf_names[e]
        reader.read(hf, tensors[hf], spec.hf_shape, rest, out[e - a])
    return out


def _read_mxfp4_slice(
    reader: SliceReader,
    spec: TensorSpec,
    tensors: Mapping[str, TensorInfo],
    bounds: Any,
    out: np.ndarray,
    where: str,
) -> np.ndarray:
    """MXFP4 experts of the slice, dequantized exactly (the dequantize-at-load path, the oracle of packed
    serving): per expert, the slice's rows of `weight_packed` and `weight_scale`, their columns widened to
    whole scale groups of 32 (two codes a byte, one scale a group), then cut to the slice's columns."""
    (a, b), rows, (c, d) = bounds
    c0, d0 = c - c % GROUP, -(-d // GROUP) * GROUP
    packed = np.empty((rows[1] - rows[0], (d0 - c0) // 2), np.uint8)
    scale = np.empty((rows[1] - rows[0], (d0 - c0) // GROUP), np.uint8)
    for e in range(a, b):
        p_name, s_name = spec.hf_names[e], spec.scale_names[e]
        reader.read(p_name, tensors[p_name], spec.hf_shape, (rows, (c0 // 2, d0 // 2)), packed)
        reader.read(s_name, tensors[s_name], spec.scale_shape, (rows, (c0 // GROUP, d0 // GROUP)), scale)
        if np.any(scale == SCALE_NAN):
            raise CheckpointError(f"{where}: tensor '{s_name}' holds the E8M0 NaN scale 255")
        out[e - a] = dequantize_mxfp4(packed, scale, out.dtype)[:, c - c0 : d - c0]
    return out


def read_sharded(
    reader: SliceReader,
    spec: TensorSpec,
    tensors: Mapping[str, TensorInfo],
    target: jax.ShapeDtypeStruct,
    sharding: jax.sharding.Sharding,
    where: str,
) -> jax.Array:
    """Our parameter `spec` as a jax.Array on `sharding`, this process reading only the slices of its own
    (addressable) devices, each distinct slice once."""
    seen: dict[tuple[tuple[int, int], ...], np.ndarray] = {}

    def fetch(index: Index) -> np.ndarray:
        key = normalize_index(index, spec.shape)
        if key not in seen:
            seen[key] = read_slice(reader, spec, tensors, target.dtype, index, where)
        return seen[key]

    return jax.make_array_from_callback(tuple(spec.shape), sharding, fetch, dtype=target.dtype)
