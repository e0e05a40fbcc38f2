"""Compiled programs kept on disk as serialized executables, so that a later start skips tracing too.

JAX's persistent compilation cache saves XLA's compile but not the Python trace and lowering that come
before its lookup: a cached model program still costs a second or more per start. `ExecutableCache` keeps each
compiled program itself (`jax.experimental.serialize_executable`) in `executables/` under JAX's cache
directory (`jax_compilation_cache_dir`, which `--compile-cache` sets; off with that cache), and loads
it without tracing. An entry's key covers everything that changes the program but not the values of its
arguments (the weights are arguments, so one executable serves any weights of that structure): the model's
structure as its static graph, the shapes, dtypes and shardings of every input and the tree they form, the
program's name, the source of the packages that trace it, the jax and jaxlib versions and the devices.
Anything that fails on reading is logged and the program compiles as without the cache; entries are
written to a temporary file and renamed, so processes may share the directory. Like JAX's own cache, the
directory must be the user's own: an entry is a pickle of machine code, loaded as it is.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

log = logging.getLogger("jaxhybrid.compile")

FORMAT = "jaxhybrid-executables-v1"
_PACKAGES = ("jaxhybrid", "serve/engine", "sharding")  # the code a program's trace runs


@functools.cache
def code_fingerprint() -> str:
    """A digest of the source of the packages whose code the engine's programs trace."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def _platform() -> str:
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    return f"{jax.__version__}/{jaxlib.__version__}/{jax.default_backend()}/{len(devices)}x{kinds}"


def input_spec(args: tuple[Any, ...]) -> str:
    """The program's inputs as a compiled program sees them: their tree, and each leaf's shape, dtype and
    placement (`None` for an uncommitted array: it goes where the program puts it)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    parts = [str(tree)]
    for x in leaves:
        sharding = getattr(x, "sharding", None) if getattr(x, "committed", True) else None
        parts.append(f"{x.shape}:{x.dtype}:{getattr(x, 'weak_type', False)}:{sharding}")
    return "\n".join(parts)


def _device_ids(compiled: Any) -> list[int]:
    """The ids of the devices `compiled` runs on, in its device assignment's order (what loading it needs:
    by default it would be loaded for every device of the backend)."""
    sharding = jax.tree_util.tree_leaves(compiled.input_shardings)[0]
    return [d.id for d in sharding._device_assignment]


def fresh_compile() -> contextlib.AbstractContextManager:
    """Compile in this thread without JAX's persistent cache: on XLA:CPU an executable that cache gave back
    serializes without its kernels' code (`serialize_executable` of it loads, then fails at its first run with
    NOT_FOUND: Function ... not found), so a program to be kept must be compiled, not read."""
    from jax._src import config as jax_config  # the option's thread-local switch, which jax.config lacks

    return jax_config.enable_compilation_cache(False)


class ExecutableCache:
    """Serialized compiled programs in `directory` (None: nothing is kept)."""

    def __init__(self, directory: Path | None):
        self.directory = directory
        self._warned = False

    @classmethod
    def from_jax_config(cls) -> ExecutableCache:
        """In `executables/` under JAX's compilation cache directory, when that cache is on and this is one
        process (the executables of a multi-process mesh are not kept)."""
        directory = jax.config.jax_compilation_cache_dir
        if not (jax.config.jax_enable_compilation_cache and directory) or jax.process_count() > 1:
            return cls(None)
        return cls(Path(directory) / "executables")

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def key(self, name: str, structure: str, args: tuple[Any, ...]) -> str:
        """The entry of program `name` of a model of static `structure` (its graph) called with `args`."""
        h = hashlib.sha256()
        for part in (FORMAT, _platform(), code_fingerprint(), name, structure, input_spec(args)):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def load(self, key: str) -> tuple[Any, ...] | None:
        """The entry's compiled programs (as `save` got them), or None when absent or unreadable."""
        if self.directory is None:
            return None
        path = self.directory / f"{key}.pkl"
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            by_id = {d.id: d for d in jax.devices()}
            return tuple(
                serialize_executable.deserialize_and_load(
                    payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids]
                )
                for payload, in_tree, out_tree, device_ids in entry
            )
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn, corrupt or foreign entry: compile as if it were absent
            self._note(f"cannot load the compiled program {path.name} ({type(e).__name__}: {e}); compiling")
            return None

    def save(self, key: str, compiled: tuple[Any, ...]) -> None:
        """Keep `compiled` (jax.stages.Compiled programs) under `key`; failures are logged."""
        if self.directory is None:
            return
        try:
            entry = tuple((*serialize_executable.serialize(c), _device_ids(c)) for c in compiled)
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, self.directory / f"{key}.pkl")
            except BaseException:
                os.unlink(tmp)
                raise
        except Exception as e:
            self._note(f"could not keep a compiled program in {self.directory} ({type(e).__name__}: {e})")

    def _note(self, message: str) -> None:
        """The first failure at info, later ones at debug: serving goes on either way."""
        log.log(logging.DEBUG if self._warned else logging.INFO, message)
        self._warned = True


class ModelExecutables:
    """A runner's model programs, compiled once per `ProgramShape`: the model program (`run` or its
    scanned form) and the write of its rows' states (`write_rows`), read from `cache` when it holds them,
    else compiled (and kept there). `structure`: the model's static graph, in words (part of the key)."""

    def __init__(self, write_rows: Any, structure: Callable[[], str], cache: ExecutableCache):
        self.write_rows, self.cache = write_rows, cache
        self._structure, self._structure_text = structure, ""
        self._compiled: dict[Any, tuple[Any, Any]] = {}

    def shapes(self) -> frozenset:
        """The program shapes compiled or loaded so far."""
        return frozenset(self._compiled)

    def get(self, program: Any, name: str, run: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(model program, rows' write) for `program`'s shape: `run` (a jitted function named `name`) is
        traced only when neither this runner nor the cache has it. `args`: `run`'s arguments (params, KDA
        pools, MLA pools, tokens, slot ids, block tables, start, valid), only looked at for their shapes."""
        if program in self._compiled:
            return self._compiled[program]
        key, loaded = "", None
        if self.cache.enabled:
            self._structure_text = self._structure_text or self._structure()
            key = self.cache.key(name, self._structure_text, args)
            loaded = _LOADED.get(key) or self.cache.load(key)
        if loaded is not None and len(loaded) == 2:
            log.debug("compiled program %s read from %s", program, self.cache.directory)
            self._compiled[program] = _remember(key, (loaded[0], loaded[1]))
            return self._compiled[program]
        with fresh_compile() if self.cache.enabled else contextlib.nullcontext():
            compiled_run = run.lower(*args).compile()
            _, rows, _ = compiled_run.out_info
            compiled_write = self.write_rows.lower(args[1], args[4], rows).compile()
        self._compiled[program] = (compiled_run, compiled_write)
        if self.cache.enabled:
            self.cache.save(key, _remember(key, self._compiled[program]))
        return self._compiled[program]


# The programs this process read or kept, by key: another runner of the same model and shape (engines
# built one after another) takes them from here, as jit's own caches would give it, not from the disk.
_LOADED: collections.OrderedDict[str, tuple[Any, Any]] = collections.OrderedDict()
_LOADED_MAX = 64


def _remember(key: str, programs: tuple[Any, Any]) -> tuple[Any, Any]:
    _LOADED[key] = programs
    _LOADED.move_to_end(key)
    while len(_LOADED) > _LOADED_MAX:
        _LOADED.popitem(last=False)
    return programs


def forget_loaded() -> None:
    """Drop the programs kept in this process (with `jax.clear_caches`, to free their memory)."""
    _LOADED.clear()
