"""Which implementation of an op runs: every op with more than one implementation declares them in one
:class:`Op` beside its public function (``kda.KDA_DECODE`` for ``kda.kda_decode``: its reference, then each
other with its kind, the platforms it is for and a predicate on the op's arguments), the public function
calls the Op, and :func:`choose` picks the implementation. :func:`implementations` lists every declared one.
(The declarations sit in the ops' modules, not in this one: the ops import this module, and no two modules
import each other.)

Kinds (:class:`Kind`):

- ``reference``: the plain JAX reference, the oracle of every other (it runs everywhere);
- ``xla``: an XLA formulation for a platform where it differs from the reference (the CPU's expert loop,
  the accelerators' grouped ``ragged_dot``);
- ``native``: a CPU kernel of `jaxhybrid.ops.native`, an XLA FFI custom call;
- ``pallas``: a Pallas TPU / GPU kernel; it takes ``interpret=`` and, asked for where it is not compiled
  (the CPU, in tests), runs interpreted.

Where an op runs is placement's rule (`jaxhybrid.ops.placement`): the platform of its first argument's
devices or of the mesh; where neither says (a program traced from shapes alone), the choice for each
platform is traced and ``jax.lax.platform_dependent`` keeps the one for the platform the program is
lowered for (a TPU program holds no CPU custom call).

The kernels mode (:class:`Mode`) says which kinds may run, in this order of preference, the first entry of
its platform whose predicate holds winning (the reference always holds):

- ``auto`` (the default): native, pallas, xla, reference;
- ``pallas``: pallas (interpreted off its platforms), then xla, then reference;
- ``xla``: xla, then reference;
- ``reference``: the reference only.

The mode comes from ``$JAXHYBRID_KERNELS`` (for tests), the command line's ``--kernels`` (:func:`set_mode`)
or the block of ``with registry.kernels("reference"):``. It is a JAX configuration option that is part of
jit's cache key, so a trace made under one mode is never reused under another, and the engine's
compiled-program cache keys on it too (`serve.engine.executables`).

Registering a Pallas kernel is one implementation added to its op. The Pallas modules import their op's
module (its shape checks), so they add themselves when imported (:meth:`Op.register`), e.g. at the end of
`jaxhybrid/ops/pallas/kda.py`, for a kernel of the op's signature plus ``interpret``::

    kda.KDA_DECODE_INTO_POOL.register(
        registry.Implementation(
            registry.Kind.PALLAS,
            kda_decode_into_pool_pallas,  # (q, k, v, g, beta, pool, rows, *, interpret=False)
            registry.TPU,  # compiled there (auto picks it there); interpreted elsewhere under `pallas`
            takes,  # the op's arguments -> bool: e.g. T == 1, a float32 pool, inside a shard_map
        )
    )

and a module that runs the op (the layer) imports the Pallas module. ``kda_decode_states_pallas(q, k, v,
g, beta, pool, rows, *, interpret=False)`` goes the same way into ``kda.KDA_DECODE_STATES`` (whose
``initial_state, rows`` are then the pool and its rows), with a predicate that asks for ``rows is not
None``. The chunked prefill (``kda_chunked_pallas``) needs ``kda.kda_chunked`` made an Op first (its
reference: today's ``kda_chunked``). A Mosaic kernel compiles only where the program's arrays are each
device's own (inside a ``shard_map``), which its predicate checks. tests/test_registry.py then runs each,
interpreted on the CPU, against its op's reference (an op new to the registry adds its example arguments
there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
from jax._src import config as jax_config  # a configuration option of our own, part of jit's cache key

from jaxhybrid.ops import placement

__all__ = [
    "ENV",
    "Kind",
    "Mode",
    "Implementation",
    "KernelsError",
    "Op",
    "allows",
    "choose",
    "cpu_kernel",
    "from_env",
    "implementations",
    "kernels",
    "mode",
    "op",
    "set_mode",
]

ENV = "JAXHYBRID_KERNELS"
CPU = frozenset({placement.CPU})
TPU = frozenset({"tpu"})
ACCELERATORS = frozenset({"tpu", "gpu"})
PLATFORMS = ("cpu", "tpu", "gpu")  # as `jax.Device.platform` says; `platform_dependent` names gpu cuda/rocm


class Kind(enum.Enum):
    """What an implementation is (module docstring)."""

    REFERENCE = "reference"
    XLA = "xla"
    NATIVE = "native"
    PALLAS = "pallas"


class Mode(enum.Enum):
    """Which kinds may run (module docstring)."""

    AUTO = "auto"
    REFERENCE = "reference"
    XLA = "xla"
    PALLAS = "pallas"


PREFERENCE: dict[Mode, tuple[Kind, ...]] = {
    Mode.AUTO: (Kind.NATIVE, Kind.PALLAS, Kind.XLA, Kind.REFERENCE),
    Mode.PALLAS: (Kind.PALLAS, Kind.XLA, Kind.REFERENCE),
    Mode.XLA: (Kind.XLA, Kind.REFERENCE),
    Mode.REFERENCE: (Kind.REFERENCE,),
}


class KernelsError(ValueError):
    """A kernels mode that is not one of :class:`Mode`'s."""


def _always(*_: Any, **__: Any) -> bool:
    return True


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of an op: `fn` takes the op's arguments (a Pallas one also ``interpret=``);
    `platforms` are where it runs (None: everywhere); `applies` says from the op's arguments (shapes,
    dtypes, whether a kernel is built) whether it takes them; `op` the op's name (its :class:`Op` sets it)."""

    kind: Kind
    fn: Callable[..., Any]
    platforms: frozenset[str] | None = None
    applies: Callable[..., bool] = _always
    op: str = ""

    @property
    def name(self) -> str:
        return f"{self.op}:{self.kind.value}:{self.fn.__name__}"

    def usable(self, platform: str, mode: Mode) -> bool:
        """Whether it may run in a program on `platform` under `mode` (whatever the arguments)."""
        if self.kind not in PREFERENCE[mode]:
            return False
        if self.platforms is None or platform in self.platforms:
            return True
        return self.kind is Kind.PALLAS and mode is Mode.PALLAS  # interpreted

    def interpreted(self, platform: str) -> bool:
        """Whether it runs interpreted on `platform`: a Pallas kernel off its platforms."""
        return self.kind is Kind.PALLAS and self.platforms is not None and platform not in self.platforms

    def bound(self, platform: str) -> Callable[..., Any]:
        """`fn` as it runs on `platform` (a Pallas kernel told whether it is interpreted)."""
        if self.kind is Kind.PALLAS:
            return functools.partial(self.fn, interpret=self.interpreted(platform))
        return self.fn


def cpu_kernel(fn: Callable[..., Any], applies: Callable[..., bool]) -> Implementation:
    """A native CPU kernel (`jaxhybrid.ops.native`) taking the arguments `applies` accepts."""
    return Implementation(Kind.NATIVE, fn, CPU, applies)


_OPS: dict[str, Op] = {}  # every Op declared, by name (the op modules declare theirs when imported)


class Op:
    """An op's implementations: `reference` (the plain JAX one, which runs everywhere) and `others`.
    Calling it runs the implementation :func:`choose` picks."""

    def __init__(self, name: str, reference: Callable[..., Any], *others: Implementation):
        if name in _OPS:
            raise ValueError(f"op {name} is declared twice")
        if any(o.kind is Kind.REFERENCE for o in others):
            raise ValueError(f"op {name}: one reference")
        self.name = name
        entries = (Implementation(Kind.REFERENCE, reference), *others)
        self.implementations = tuple(dataclasses.replace(e, op=name) for e in entries)
        _OPS[name] = self

    @property
    def reference(self) -> Implementation:
        return self.implementations[0]

    def register(self, implementation: Implementation) -> None:
        """Add `implementation` (not a reference) to this op, e.g. a Pallas kernel from its own module."""
        if implementation.kind is Kind.REFERENCE:
            raise ValueError(f"op {self.name}: one reference")
        self.implementations += (dataclasses.replace(implementation, op=self.name),)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The op on `args`/`kwargs`, where its first argument says the platform; where it does not, one
        implementation per platform, kept by ``platform_dependent`` at lowering (module docstring)."""
        known = placement.platform_of(args[0])
        if known is not None:
            return choose(self, known, args, kwargs).bound(known)(*args, **kwargs)
        picks = {p: choose(self, p, args, kwargs) for p in PLATFORMS}
        forms = {p: functools.partial(entry.bound(p), *args, **kwargs) for p, entry in picks.items()}
        # the TPU's form is the default: a branch is traced only where a platform's form differs from it
        default = (picks["tpu"], picks["tpu"].interpreted("tpu"))
        branches = {p: forms[p] for p, entry in picks.items() if (entry, entry.interpreted(p)) != default}
        if not branches:
            return forms["tpu"]()
        if "gpu" in branches:
            branches["cuda"] = branches["rocm"] = branches.pop("gpu")
        return jax.lax.platform_dependent(**branches, default=forms["tpu"])


def implementations() -> tuple[Implementation, ...]:
    """Every implementation of every op declared so far (each op module declares its ops when imported)."""
    return tuple(e for op in _OPS.values() for e in op.implementations)


def op(name: str) -> Op:
    """The op declared as `name`."""
    return _OPS[name]


def choose(op: Op, platform: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Implementation:
    """The implementation of `op` that runs `args`/`kwargs` in a program on `platform` under the current
    mode (module docstring)."""
    now = mode()
    for kind in PREFERENCE[now]:
        for entry in op.implementations:
            if entry.kind is kind and entry.usable(platform, now) and entry.applies(*args, **kwargs):
                return entry
    return op.reference


def allows(kind: Kind) -> bool:
    """Whether the current mode lets implementations of `kind` run (for a caller that chooses a whole path
    by whether an op will take its kernel, e.g. the engine's in-place pool updates)."""
    return kind in PREFERENCE[mode()]


def from_env(environ: Mapping[str, str] = os.environ) -> Mode:
    """The mode `$JAXHYBRID_KERNELS` names (unset or empty: auto); KernelsError for any other value."""
    return parse(environ.get(ENV) or Mode.AUTO.value, f"${ENV}")


def parse(value: str, source: str) -> Mode:
    """`value` as a Mode; KernelsError naming `source` (a flag, a variable) otherwise."""
    try:
        return Mode(value)
    except ValueError:
        choices = ", ".join(m.value for m in Mode)
        raise KernelsError(f"{source}={value!r}: the kernels mode is one of {choices}") from None


def _initial() -> tuple[Mode, str | None]:
    try:
        return from_env(), None
    except KernelsError as e:
        return Mode.AUTO, str(e)


_START, _ENV_PROBLEM = _initial()
# JAX reads an option's default from the variable of its name in capitals: not $JAXHYBRID_KERNELS, which
# this module reads itself (a bad value then fails the first op, with the choices, not the import)
_STATE = jax_config.enum_state(
    "jaxhybrid_kernels_mode",
    [m.value for m in Mode],
    _START.value,
    help="which op implementations run (jaxhybrid.ops.registry)",
    include_in_jit_key=True,
    include_in_trace_context=True,
)
_set_explicitly = False


def mode() -> Mode:
    """The current kernels mode. A bad `$JAXHYBRID_KERNELS` raises KernelsError here (importing never
    fails) unless a mode was set explicitly."""
    if _ENV_PROBLEM is not None and not _set_explicitly:
        raise KernelsError(_ENV_PROBLEM)
    return Mode(_STATE.value)


def set_mode(value: Mode | str | None) -> Mode:
    """Set the process's mode (every thread: the engine compiles on others): `value`, or with None the one
    `$JAXHYBRID_KERNELS` names now (KernelsError for a bad one). Returns it."""
    global _set_explicitly
    chosen = from_env() if value is None else value if isinstance(value, Mode) else parse(value, "--kernels")
    jax.config.update(_STATE.name, chosen.value)
    _set_explicitly = True
    return chosen


@contextlib.contextmanager
def kernels(value: Mode | str) -> Iterator[Mode]:
    """The block runs under mode `value` (process-wide, as :func:`set_mode`); the previous mode after."""
    global _set_explicitly
    before, explicitly = _STATE.get_global(), _set_explicitly
    chosen = set_mode(value)
    try:
        yield chosen
    finally:
        jax.config.update(_STATE.name, before)
        _set_explicitly = explicitly
