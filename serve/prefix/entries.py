"""One disk entry of the prefix store: its manifest (what `DiskEntry` holds), writing it (Orbax, then the
manifest last) and reading its arrays back, checked against the manifest."""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from serve.prefix import files
from serve.prefix.files import FORMAT, MANIFEST, MIN_FREE_BYTES, DiskFull
from serve.prefix.types import CheckpointKind
from sharding.multihost import Peers


@dataclasses.dataclass
class DiskEntry:
    """A checkpoint on disk: the states at `position`, the KV of its whole prefix, and where they are."""

    key: bytes
    path: Path
    position: int
    kind: CheckpointKind
    base: bytes  # chain hash of the last full block (the root for position < block_size)
    block_hashes: list[bytes]  # chain hashes of the full blocks 1..position // block_size
    tail: tuple[int, ...]  # tokens after the last full block
    nbytes: int  # array bytes
    disk_bytes: int  # bytes on disk (all files)
    arrays: dict[str, list]  # name -> [shape, dtype, crc32 or None (several processes)]
    used: float = 0.0  # last use (the manifest's mtime): LRU order across restarts
    holders: int = 0


def entry_meta(
    key: bytes,
    fingerprint: bytes,
    block_size: int,
    position: int,
    kind: CheckpointKind,
    chain: list[bytes],
    tail: tuple[int, ...],
) -> dict[str, Any]:
    """The manifest fields of a new entry: the checkpoint after `position` tokens whose full blocks hash to
    `chain` (root first) and whose partial block holds `tail`."""
    return {
        "key": key.hex(),
        "fingerprint": fingerprint.hex(),
        "block_size": block_size,
        "position": position,
        "kind": kind.value,
        "base": chain[-1].hex(),
        "block_hashes": [h.hex() for h in chain[1:]],
        "tail": [int(t) for t in tail],
        "created": time.time(),
    }


def read_entry(path: Path, fingerprint: bytes, block_size: int) -> DiskEntry | None:
    """The entry in `path` if its manifest is valid, belongs to this model and layout, and every file it
    lists exists with its recorded size; None when it is proven not to be one (no or a bad manifest, a
    missing or truncated file). Raises OSError when it cannot be read now (EIO, a permission, a manifest
    still being written): the entry may be fine, so the caller keeps it and tries again later."""
    name = path.name
    if len(name) != 64 or not path.is_dir():
        return None  # Orbax temporary directories end in '.orbax-checkpoint-tmp'
    if not (path / MANIFEST).exists() and (path / (MANIFEST + ".tmp")).exists():
        raise BlockingIOError(f"{path}: its manifest is still being written")
    try:
        key = bytes.fromhex(name)
        stat = (path / MANIFEST).stat()
        m = json.loads((path / MANIFEST).read_text())
        if m["format"] != FORMAT or m["fingerprint"] != fingerprint.hex() or m["key"] != name:
            return None
        if m["block_size"] != block_size:
            return None
        for rel, size in m["files"].items():
            if (path / rel).stat().st_size != size:
                return None
        entry = DiskEntry(
            key=key,
            path=path,
            position=int(m["position"]),
            kind=CheckpointKind(m["kind"]),
            base=bytes.fromhex(m["base"]),
            block_hashes=[bytes.fromhex(h) for h in m["block_hashes"]],
            tail=tuple(int(t) for t in m["tail"]),
            nbytes=int(m["nbytes"]),
            disk_bytes=sum(m["files"].values()) + stat.st_size,
            arrays={k: [list(shape), str(dtype), crc] for k, (shape, dtype, crc) in m["arrays"].items()},
            used=stat.st_mtime,
        )
    except OSError as exc:
        if is_transient(exc):
            raise
        return None  # a missing manifest or file
    except Exception:  # noqa: BLE001 - malformed: not a (complete) entry
        return None
    if len(entry.block_hashes) != entry.position // block_size or len(entry.tail) != (
        entry.position % block_size
    ):
        return None
    return entry


def is_transient(exc: BaseException) -> bool:
    """Whether a failure to read an entry may pass (an OSError other than a missing file, anywhere in its
    chain of causes), as opposed to proof that the entry is corrupt."""
    while exc is not None:
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError | NotADirectoryError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def write_entry(
    saver: Any, directory: Path, meta: dict[str, Any], arrays: dict[str, Any], peers: Peers
) -> tuple[DiskEntry | None, float]:
    """Save `arrays` as the entry `meta["key"]` with `saver` (Orbax), then its manifest (process 0; the
    others return None after writing their shards); (the entry, seconds)."""
    import orbax.checkpoint as ocp

    t0 = time.perf_counter()
    several = peers.several
    if not several:  # one process: numpy on the host, with checksums
        import jax

        arrays = {k: np.asarray(v) for k, v in jax.device_get(arrays).items()}
    final = directory / meta["key"]
    tmp = final.with_name(final.name + ".orbax-checkpoint-tmp")
    if peers.leader:  # the others wait at Orbax's first barrier until this is done
        files.remove(tmp)  # leftovers of an earlier crash, or an entry the index rejected
        files.remove(final)
    nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in arrays.values())
    if not several and shutil.disk_usage(directory).free < nbytes + MIN_FREE_BYTES:
        raise DiskFull(errno.ENOSPC, f"less than {nbytes + MIN_FREE_BYTES} bytes free", str(directory))
    try:
        saver.save(final, args=ocp.args.PyTreeSave(arrays))
    except BaseException:
        if peers.leader:
            files.remove(tmp)  # a failed save leaves nothing behind
            files.remove(final)
        raise
    if not peers.leader:
        return None, time.perf_counter() - t0
    manifest = dict(
        meta,
        format=FORMAT,
        nbytes=nbytes,
        arrays={
            k: [list(a.shape), np.dtype(a.dtype).name, None if several else files.crc(a)]
            for k, a in arrays.items()
        },
        files=files.files(final),
    )
    part = final / (MANIFEST + ".tmp")
    with open(part, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, final / MANIFEST)
    entry = read_entry(final, bytes.fromhex(meta["fingerprint"]), meta["block_size"])
    if entry is None:
        raise RuntimeError(f"{final}: the checkpoint just written does not read back")
    return entry, time.perf_counter() - t0


def read_arrays(
    loader: Any, entry: DiskEntry, block_size: int, peers: Peers, restore_shardings: Any
) -> tuple[list, Any, Any]:
    """(states [(conv, state) per KDA layer], kv [mla, n, block, latent] or None, tail or None) of an entry,
    checked against its manifest: numpy on one process, each process's shards with several."""
    import orbax.checkpoint as ocp

    if peers.several:  # every process reads its shards, into the states' shardings
        args = {
            k: ocp.ArrayRestoreArgs(sharding=restore_shardings(k, tuple(shape), dtype))
            for k, (shape, dtype, _) in entry.arrays.items()
        }
    else:
        args = {k: ocp.RestoreArgs(restore_type=np.ndarray) for k in entry.arrays}
    tree = loader.restore(entry.path, args=ocp.args.PyTreeRestore(restore_args=args))
    for name, (shape, dtype, crc) in entry.arrays.items():
        a = tree[name]
        if list(a.shape) != shape or np.dtype(a.dtype).name != dtype:
            raise ValueError(f"array '{name}' does not match its manifest")
        if crc is not None and files.crc(a) != crc:
            raise ValueError(f"array '{name}' does not match its checksum")
    states = [
        (tree[f"conv_{i}"], tree[f"state_{i}"]) for i in range(sum(1 for k in tree if k[:5] == "conv_"))
    ]
    if (entry.position // block_size) != (tree["kv"].shape[1] if "kv" in tree else 0):
        raise ValueError("the stored KV does not cover the prefix")
    if bool(entry.position % block_size) != ("tail" in tree):
        raise ValueError("the partial block's KV is missing or unexpected")
    return states, tree.get("kv"), tree.get("tail")
