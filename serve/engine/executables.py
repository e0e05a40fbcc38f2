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

What is kept is only ever what XLA compiled in this process. On XLA:CPU an executable that JAX's persistent
cache gave back serializes without its kernels' code: it loads, then fails at its first run ("Function
select_bitcast_fusion not found"), which killed the next command to read it. JAX decides once per process
whether it reads its cache, so no switch around one compile keeps it out. Instead a program to be kept is
compiled under keys of its own (`KEPT_OPTIONS`) that JAX's cache never writes (nor would it need to: the
program is kept here); a compile that JAX's cache served anyway is not kept; and a CPU program whose bytes
hold no object code is neither written nor loaded (`_require_code`). An entry carries a digest of its bytes,
checked at load; the native kernels' FFI handlers are registered before anything is loaded (a program calls
them by name).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import dataclasses
import enum
import functools
import hashlib
import logging
import os
import pickle
import queue
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from jaxhybrid.ops import placement, registry
from jaxhybrid.ops.native import cpu_flags, register_all

log = logging.getLogger("jaxhybrid.compile")

FORMAT = "jaxhybrid-executables-v2"
_PACKAGES = ("jaxhybrid", "serve/engine", "sharding")  # the code a program's trace runs


@functools.cache
def code_fingerprint() -> str:
    """A digest of the source of the packages whose code the engine's programs trace or call (the native
    kernels' C++ too: a program calls them by name)."""
    return source_digest(Path(__file__).resolve().parents[2])


def source_digest(root: Path) -> str:
    """A digest of the Python and C++ files (sources and headers) of `_PACKAGES` under `root`."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted(p for pattern in ("*.py", "*.cc", "*.h") for p in (root / package).rglob(pattern)):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def _platform() -> str:
    """The versions and devices a program is compiled for; on the CPU also its instruction set (XLA:CPU
    compiles for the host's: a cache directory shared by two machines must not give one the other's code)."""
    devices = jax.devices()
    kinds = sorted({d.device_kind for d in devices})
    isa = ""
    if jax.default_backend() == "cpu":
        isa = "/" + hashlib.sha256(cpu_flags().encode()).hexdigest()[:16]
    return f"{jax.__version__}/{jaxlib.__version__}/{jax.default_backend()}/{len(devices)}x{kinds}{isa}"


def input_spec(args: tuple[Any, ...]) -> str:
    """The program's inputs as a compiled program sees them: their tree, and each leaf's shape, dtype and
    placement (`None` for an uncommitted array: it goes where the program puts it)."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    parts = [str(tree)]
    for x in leaves:
        parts.append(f"{x.shape}:{x.dtype}:{getattr(x, 'weak_type', False)}:{_placement(x)}")
    return "\n".join(parts)


def _placement(x: Any) -> Any:
    """Where a compiled program takes argument `x` from: its sharding (None for an uncommitted array)."""
    return getattr(x, "sharding", None) if getattr(x, "committed", True) else None


def _devices(compiled: Any) -> list[Any]:
    """The devices `compiled` runs on, in its device assignment's order (what loading it needs: by default
    it would be loaded for every device of the backend)."""
    return list(jax.tree_util.tree_leaves(compiled.input_shardings)[0]._device_assignment)


def _device_ids(compiled: Any) -> list[int]:
    return [d.id for d in _devices(compiled)]


_JAX_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_served = threading.local()  # how many compiles of this thread JAX's persistent cache served


def _count_jax_cache_hit(event: str, **_: Any) -> None:
    if event == _JAX_CACHE_HIT:  # recorded on the thread that asked for the compile
        _served.hits = getattr(_served, "hits", 0) + 1


jax.monitoring.register_event_listener(_count_jax_cache_hit)


@dataclasses.dataclass
class Compiled:
    """Whether the compiles inside `compiled_here()` were all XLA's own in this process (none served by
    JAX's persistent cache): only such an executable serializes whole on XLA:CPU."""

    here: bool = True


# The compile options of a program this layer keeps: an option that only decides what an XLA dump holds (no
# code changes) and that JAX's cache key counts, so that a kept program has keys of its own in JAX's cache,
# which `compiled_here(keep=True)` never writes: XLA compiles it, whatever JAX's cache holds.
KEPT_OPTIONS = {"xla_dump_large_constants": False}


@contextlib.contextmanager
def compiled_here(keep: bool) -> Any:
    """Compile in this thread; the `Compiled` yielded says afterwards whether JAX's persistent cache served
    any of it. With `keep` (the program will be kept by this layer) JAX's cache does not write it."""
    from jax._src import config as jax_config  # the option's thread-local form, which jax.config lacks

    before = getattr(_served, "hits", 0)
    result = Compiled()
    limit = jax_config.persistent_cache_min_compile_time_secs
    with limit(float("inf")) if keep else contextlib.nullcontext():
        yield result
    result.here = getattr(_served, "hits", 0) == before


def _on_cpu(compiled: Any) -> bool:
    """Whether `compiled` runs on CPU devices (where it lives, not the process's default backend)."""
    return all(d.platform == "cpu" for d in _devices(compiled))


ELF = b"\x7fELF"  # XLA:CPU serializes a program's kernels as ELF objects inside its bytes


def _require_code(serialized: bytes) -> None:
    """Raise unless a CPU program's serialized bytes hold its kernels' object code. An executable that JAX's
    persistent cache gave back serializes without it (its bytes name kernels they do not hold), and the
    program loaded from them fails at its first call ("Function ... not found"); `compiled_here` keeps the
    engine from saving one, and this catches one that got by, at save and at load, for the cost of a scan
    of the bytes."""
    if ELF not in serialized:
        raise ValueError("its bytes hold no object code (an executable JAX's cache gave back?)")


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
        # JAX's default precision of a product is traced into the program ($JAX_DEFAULT_MATMUL_PRECISION),
        # and $XLA_FLAGS decide how XLA compiles it
        precision = f"precision={jax.config.jax_default_matmul_precision}"
        flags = f"xla_flags={os.environ.get('XLA_FLAGS', '')}"
        # whether the native kernels are on, and the target they are built for, decide which custom calls a
        # program makes and what it returns
        env = os.environ.get
        native = f"native={env('JAXHYBRID_NATIVE', '1')}/{env('JAXHYBRID_NATIVE_MARCH', 'native')}"
        # and the kernels mode decides which implementation of each op the program holds
        kernels = f"kernels={registry.mode().value}"
        parts = (FORMAT, _platform(), code_fingerprint(), precision, flags, native, kernels, name, structure)
        parts += (input_spec(args),)
        for part in parts:
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()

    def load(self, key: str) -> tuple[Any, ...] | None:
        """The entry's compiled programs (as `save` got them), or None when absent or unreadable (torn,
        corrupt, another format)."""
        if self.directory is None:
            return None
        path = self.directory / f"{key}.pkl"
        try:
            with open(path, "rb") as f:
                entry = pickle.load(f)
            if not (isinstance(entry, dict) and entry.get("format") == FORMAT):
                raise ValueError(f"not a {FORMAT} entry")
            if hashlib.sha256(entry["payload"]).hexdigest() != entry["digest"]:
                raise ValueError("its bytes do not match their digest")
            parts = pickle.loads(entry["payload"])
            by_id = {d.id: d for d in jax.devices()}
            on_cpu = [p is not None and any(by_id[i].platform == "cpu" for i in p[3]) for p in parts]
            if any(on_cpu):
                register_all()  # the handlers of the kernels a CPU program calls, before it is loaded
            for part, cpu in zip(parts, on_cpu, strict=True):
                if cpu:
                    _require_code(part[0])
            return tuple(
                None
                if part is None
                else serialize_executable.deserialize_and_load(
                    part[0], part[1], part[2], execution_devices=[by_id[i] for i in part[3]]
                )
                for part in parts
            )
        except FileNotFoundError:
            return None
        except Exception as e:  # a torn, corrupt or foreign entry: compile as if it were absent
            self._note(f"cannot load the compiled program {path.name} ({type(e).__name__}: {e}); compiling")
            return None

    def save(self, key: str, compiled: tuple[Any, ...]) -> bool:
        """Keep `compiled` (jax.stages.Compiled programs, or None, each compiled by XLA in this process)
        under `key`; whether it was kept (failures are logged). A CPU program whose bytes lack its code
        (`_require_code`) is not written: it would fail at its first call in the next process."""
        if self.directory is None:
            return False
        try:
            parts = []
            for c in compiled:
                if c is None:
                    parts.append(None)
                    continue
                part = (*serialize_executable.serialize(c), _device_ids(c))
                if _on_cpu(c):
                    _require_code(part[0])
                parts.append(part)
            payload = pickle.dumps(tuple(parts), protocol=pickle.HIGHEST_PROTOCOL)
            entry = {"format": FORMAT, "digest": hashlib.sha256(payload).hexdigest(), "payload": payload}
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
                os.replace(tmp, self.directory / f"{key}.pkl")
            except BaseException:
                os.unlink(tmp)
                raise
            return True
        except Exception as e:
            self._note(f"could not keep a compiled program in {self.directory} ({type(e).__name__}: {e})")
            return False

    def _note(self, message: str) -> None:
        """The first failure at info, later ones at debug: serving goes on either way."""
        log.log(logging.DEBUG if self._warned else logging.INFO, message)
        self._warned = True


WAIT_LOGGED_S = 0.5  # a step that waits this long for its program says so at info

QUICK_OPTIONS = {"xla_backend_optimization_level": 0}
QUICK_CPU_OPTIONS = {"xla_cpu_use_fusion_emitters": False}  # XLA:CPU's elemental emitters: quicker to compile


class Tier(enum.Enum):
    """How hard XLA optimizes a program. QUICK compiles a model program in about half the time (XLA:CPU at
    level 0, elemental emitters) and runs it slower: what a request waits for while no optimized program
    exists yet; the optimized one is compiled in the background and replaces it."""

    QUICK = "quick"
    OPTIMIZED = "optimized"


# A one-row decode step's products and reductions are one row each, and XLA:CPU's XNNPACK ("ynn") fusions
# of them cost more to call than they compute. From two rows on they pay: without them XLA:CPU multiplies a
# few rows by a weight stored [out, in] in a loop without vectors. Every other program keeps them. (The
# measurements: `git show 9bb8ba5:BENCHMARKS.md`, "XNNPACK fusions in the decode step".)
DECODE_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": ""}


def program_options(program: Any, tier: Tier, platform: str | None) -> dict[str, Any] | None:
    """XLA's compile options for `program` (a `ProgramShape`) at `tier` on `platform` (where its arguments
    live, `placement.platform_of`): None for XLA's defaults."""
    cpu = platform == placement.CPU
    options = {}
    if tier is Tier.QUICK:
        options |= QUICK_OPTIONS | (QUICK_CPU_OPTIONS if cpu else {})
    if getattr(program, "is_decode", False) and program.rows == 1 and cpu:
        options |= DECODE_OPTIONS
    return options or None


@dataclasses.dataclass(eq=False)
class _Slot:
    """One program (model program + rows' write) of one key, shared by the runners of this process: its key
    (in the cache too), the best compiled so far (None: none yet), whether that is the quick tier, and the
    lock held while compiling (a second caller waits for the compile in progress instead of repeating it)."""

    key: str
    program: Any = None  # its `ProgramShape` (which compile options it takes)
    best: tuple[Any, Any] | None = None
    quick: bool = False
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


class ModelExecutables:
    """A runner's model programs, compiled once per `ProgramShape`: the model program (`run` or its
    scanned form) and the write of its rows' states (`write_rows`). Shared by key with every runner of this
    process (engines built one after another), read from `cache`
    when it holds them, else compiled (and kept there). `structure`: the model's static graph, in words
    (part of the key). With `tiered`, a program that is missing when a step needs it is compiled at the
    quick tier and its optimized form in the background (`background`), which replaces it when done."""

    def __init__(
        self,
        write_rows: Any,
        structure: Callable[[], str],
        cache: ExecutableCache,
        tiered: bool = False,
    ):
        self.write_rows, self.cache, self.tiered = write_rows, cache, tiered
        self._structure, self._structure_text = structure, ""
        self._slots: dict[Any, _Slot] = {}

    def shapes(self) -> frozenset:
        """The program shapes compiled or loaded so far (at either tier)."""
        return frozenset(p for p, slot in self._slots.items() if slot.best is not None)

    def optimized(self, program: Any) -> bool:
        """Whether `program`'s optimized form is ready."""
        slot = self._slots.get(program)
        return slot is not None and slot.best is not None and not slot.quick

    def ready(self, program: Any) -> bool:
        """Whether a step can run `program` without waiting for a compile."""
        slot = self._slots.get(program)
        return slot is not None and slot.best is not None

    def get(self, program: Any, name: str, run: Any, args: tuple[Any, ...]) -> tuple[Any, Any]:
        """(model program, rows' write) for `program`'s shape, at whatever tier is ready: `run` (a jitted
        function named `name`) is traced only when neither this process nor the cache has it. `args`: `run`'s
        arguments (params, KDA pools, MLA pools, tokens, slot ids, block tables, start, valid), only looked
        at for their shapes. A compile in progress on another thread is waited for. A step that waits for
        its program (read, compiled here, or compiling elsewhere) says so, and for how long, in one log line
        (at info from `WAIT_LOGGED_S` on)."""
        slot = self._slots.get(program)
        if slot is not None and slot.best is not None:
            return slot.best
        start = time.monotonic()
        slot = self._slot(program, name, args)
        how = ""
        if not slot.lock.acquire(blocking=False):
            how = "compiling on another thread"
            slot.lock.acquire()
        try:
            if slot.best is None and self._load(slot):
                how = "read from the compile cache"
            elif slot.best is None:
                lowered = self._lower(run, args)
                tier = Tier.QUICK if self.tiered else Tier.OPTIMIZED
                self._install(slot, lowered, tier)
                how = f"compiled at the {tier.value} tier"
                if slot.quick:  # the optimized form from the same trace, in the background
                    self._submit(slot, lowered, Tier.OPTIMIZED)
            elif not how:
                how = "compiled by another runner of this process"
        finally:
            slot.lock.release()
        waited = time.monotonic() - start
        log.log(
            logging.INFO if waited >= WAIT_LOGGED_S else logging.DEBUG,
            "a step waited %.1f s for its program %s (%s)",
            waited,
            program,
            how,
        )
        return slot.best

    def compile(
        self, program: Any, name: str, run: Any, args: tuple[Any, ...], tier: Tier, background: bool = False
    ) -> bool | concurrent.futures.Future:
        """Make `program` ready at `tier` or better; False if it already was (nothing compiled). With
        `background` the trace runs here and XLA's compile on the background thread: the result is then
        the job's future (done at once when nothing was left to compile)."""
        slot = self._slot(program, name, args)
        if self._ready_at(slot, tier):
            return _done(False) if background else False
        if not slot.lock.acquire(blocking=not background):  # compiling elsewhere: wait there, not here
            return BACKGROUND.submit(lambda: self._after_compile(slot))
        try:
            if self._ready_at(slot, tier):
                fresh: bool | None = False
            elif self._load(slot):
                fresh = True
            else:
                lowered = self._lower(run, args)
                if background:
                    fresh = None  # compiled on the background thread, below
                else:
                    self._install(slot, lowered, tier)
                    fresh = True
        finally:
            slot.lock.release()
        if fresh is None:
            return self._submit(slot, lowered, tier)
        return _done(fresh) if background else fresh

    @staticmethod
    def _after_compile(slot: _Slot) -> bool:
        """Wait for the compile in progress in `slot` (whoever needs a better tier submitted it): False."""
        with slot.lock:
            return False

    @staticmethod
    def _ready_at(slot: _Slot, tier: Tier) -> bool:
        return slot.best is not None and (tier is Tier.QUICK or not slot.quick)

    def _slot(self, program: Any, name: str, args: tuple[Any, ...]) -> _Slot:
        """`program`'s slot, keyed (once) by its name, the model's structure and `args`' shapes."""
        slot = self._slots.get(program)
        if slot is None:
            self._structure_text = self._structure_text or self._structure()
            key = self.cache.key(name, self._structure_text, args)
            slot = self._slots[program] = _shared_slot(key, program)
        return slot

    def _load(self, slot: _Slot) -> bool:
        """Read the optimized programs from the cache into `slot`; False when it lacks them."""
        loaded = self.cache.load(slot.key) if self.cache.enabled else None
        if loaded is None or len(loaded) != 2:
            return False
        log.debug("compiled program read from %s", self.cache.directory)
        slot.best, slot.quick = (loaded[0], loaded[1]), False
        return True

    def _lower(self, run: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...], str | None]:
        """The traced (lowered) model program, ready for XLA at any tier, the rows' write's arguments, and
        the platform the arguments live on. Only the thread that calls the engine traces the model: Flax's
        graph merge inside a trace is not safe on two threads at once."""
        return run.lower(*args), (args[1], args[4]), placement.platform_of(args)

    def _install(self, slot: _Slot, lowered: tuple[Any, tuple[Any, ...], str | None], tier: Tier) -> None:
        """Compile `lowered` at `tier` into `slot` (the caller holds its lock), with the rows' write for the
        states as the compiled program leaves them; optimized ones XLA compiled here are kept in the cache."""
        run, (pools, slots), platform = lowered
        options = program_options(slot.program, tier, platform)
        keep = self.cache.enabled and tier is Tier.OPTIMIZED
        if keep:
            options = (options or {}) | KEPT_OPTIONS
        with compiled_here(keep) as compiled:
            compiled_run = run.compile(compiler_options=options)
            _, rows, _, _ = compiled_run.out_info
            write = None  # no rows: the program wrote its rows' states into the pools itself
            if rows:
                write = self.write_rows.lower(pools, slots, rows).compile(compiler_options=options)
        slot.best, slot.quick = (compiled_run, write), tier is Tier.QUICK
        if keep and not compiled.here:
            log.debug("JAX's cache gave back program %s: not kept (it would not serialize whole)", slot.key)
        elif keep:
            self.cache.save(slot.key, slot.best)

    def _submit(self, slot: _Slot, lowered: tuple[Any, Any], tier: Tier) -> concurrent.futures.Future:
        """Compile `lowered` at `tier` into `slot` on the background thread (unless it is ready by then)."""

        def job() -> bool:
            with slot.lock:
                if self._ready_at(slot, tier):
                    return False
                self._install(slot, lowered, tier)
                return True

        future = BACKGROUND.submit(job)
        future.add_done_callback(_log_failure)
        return future


def spec(x: Any) -> Any:
    """An argument as its shapes (a committed array keeps its placement; an uncommitted one goes where the
    program puts it)."""

    def leaf(a: Any) -> Any:
        weak = getattr(a, "weak_type", False)
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=_placement(a), weak_type=weak)

    return jax.tree_util.tree_map(leaf, x)


# The programs of this process by key: another runner of the same model and shape (engines built one after
# another) takes them from here, not from the disk.
_SLOTS: collections.OrderedDict[str, _Slot] = collections.OrderedDict()
_SLOTS_MAX = 64
_SLOTS_LOCK = threading.Lock()


def _shared_slot(key: str, program: Any) -> _Slot:
    with _SLOTS_LOCK:
        slot = _SLOTS.get(key)
        if slot is None:
            slot = _SLOTS[key] = _Slot(key, program)
        _SLOTS.move_to_end(key)
        while len(_SLOTS) > _SLOTS_MAX:
            _SLOTS.popitem(last=False)
        return slot


def forget_loaded() -> None:
    """Drop the programs kept in this process (with `jax.clear_caches`, to free their memory)."""
    with _SLOTS_LOCK:
        _SLOTS.clear()


class Background:
    """One thread that compiles programs in order while steps run (XLA releases the GIL while it compiles).
    `submit` returns the job's future. At exit (`stop`, registered with atexit) the jobs not started are
    cancelled and the one in progress is waited for: a thread still inside XLA when the interpreter
    finalizes aborts the process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                future.cancel()
                return future
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jaxhybrid-compile", daemon=True)
                self._thread.start()
                atexit.register(self.stop)
            self._jobs.put((job, future))
        return future

    def stop(self, timeout: float | None = None) -> None:
        """Cancel the jobs not started and wait for the one in progress."""
        with self._lock:
            self._stopped, thread = True, self._thread
            self._jobs.put(None)
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, future = item
            if self._stopped:
                future.cancel()
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job())
            except Exception as exc:
                future.set_exception(exc)
        while not self._jobs.empty():  # submitted after the stop: never started
            item = self._jobs.get()
            if item is not None:
                item[1].cancel()


BACKGROUND = Background()


def _done(result: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(result)
    return future


def _log_failure(job: concurrent.futures.Future) -> None:
    if not job.cancelled() and job.exception() is not None:
        log.warning("compiling a program in the background failed: %s", job.exception())
