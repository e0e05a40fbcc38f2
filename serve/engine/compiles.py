"""A runner's model programs: which compiled program runs a shape (the unrolled, scanned or in-place form of
`run`, or `verify`), and compiling them ahead of their first use, at a tier, on this thread or the
background one (what the warm-up calls). `Compiles` owns that bookkeeping; the runner owns the pools."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from serve.engine.config import ProgramShape
from serve.engine.executables import ModelExecutables, Tier


@dataclasses.dataclass(frozen=True)
class Programs:
    """The compiled programs of one model structure: `run` (the model over a batch of rows: reads the KDA
    pools, donates and returns the MLA pools, returns the rows' `Last` and new KDA states), `write_rows`
    (those states into their slots of the donated KDA pools) and `sample`. Each model program returns
    (`Last`, rows' KDA states or (), new KDA pools or (), MLA pools).

    `run_in_place`, where kernels can (one CPU device, float32 pools), is `run` for one token per row that
    donates the KDA pools too and writes its rows' states into them itself (`KDAPoolInPlace`): no rows' write;
    there `verify` too sets its rows' accepted states into the pools it donates (`stacks.set_rows`). Other
    programs leave the rows to `write_rows`: in one program with the model, XLA fuses the read of a
    layer's old conv window into its scatter of the new one, cannot then update the pool in place and copies
    every KDA pool twice per step (the cost grows with the slots); a program that returned the pools it did
    not change would copy each once."""

    run: Any
    write_rows: Any
    sample: Any
    verify: Any  # `run` for rows that carry drafted tokens (`_verify_fn`; in place with `run_in_place`)
    run_scanned: Any = None  # `run` over the scanned form (`jaxhybrid.scan`), when the engine scans
    run_in_place: Any = None


Pools = tuple[Any, ...]


def split_pools(layer_types: tuple[str, ...], pools: Pools) -> tuple[Pools, Pools]:
    """(KDA state pools, MLA latent pools) of `pools` (one a layer), each in layer order: what a model program
    reads and donates."""
    kda = tuple(p for kind, p in zip(layer_types, pools, strict=True) if kind == "kda")
    mla = tuple(p for kind, p in zip(layer_types, pools, strict=True) if kind != "kda")
    return kda, mla


class Compiles:
    """The model programs of one runner by shape: which jitted function and parameters run a chunk length
    (`select`), the executable compiled for a shape (`get`), and compiling ahead (`compile`). `pool_specs`:
    the pools' shapes and shardings (what a compile needs of them, on any thread)."""

    def __init__(
        self,
        programs: Programs,
        params: Any,
        scan_params: Any,
        scan_mode: str,
        layer_types: tuple[str, ...],
        pool_specs: tuple[Any, ...],
        executables: ModelExecutables,
    ):
        self.programs, self.params = programs, params
        self.scan_params, self.scan_mode = scan_params, scan_mode
        self.layer_types, self.pool_specs, self.executables = layer_types, pool_specs, executables
        self._background: set[ProgramShape] = set()  # programs handed to the background compile by `soon`

    def select(self, length: int) -> tuple[Any, Any]:
        """(jitted model function, its parameters) for chunks of `length` tokens: scanned over the layer
        groups when the engine's `scan_layers` says so for this length, else unrolled (one token per row:
        writing its rows' KDA states in place where the programs can)."""
        scanned = self.scan_params is not None and (self.scan_mode == "all" or length > 1)
        if scanned:
            return self.programs.run_scanned, self.scan_params
        if length == 1 and self.programs.run_in_place is not None:
            return self.programs.run_in_place, self.params
        return self.programs.run, self.params

    def name(self, run: Any) -> str:
        """The name of jitted model function `run` (part of its programs' key)."""
        if run is self.programs.verify:
            return "verify" if self.programs.run_in_place is None else "verify_in_place"
        if run is self.programs.run_in_place:
            return "run_in_place"
        return "run_scanned" if run is self.programs.run_scanned else "run"

    def get(self, program: ProgramShape, inputs: tuple[Any, ...]) -> tuple[Any, Any]:
        """(model program, rows' write) compiled for `program`; `inputs`: the jitted model function, then
        its arguments."""
        run, *args = inputs
        return self.executables.get(program, self.name(run), run, tuple(args))

    def shapes(self) -> frozenset[ProgramShape]:
        """The model-program shapes run or compiled so far (calling one compiles nothing)."""
        return self.executables.shapes()

    def optimized(self) -> frozenset[ProgramShape]:
        """The model-program shapes whose optimized form is ready (the rest are quick, or not compiled)."""
        return frozenset(p for p in self.executables.shapes() if self.executables.optimized(p))

    def ready(self, program: ProgramShape) -> bool:
        return self.executables.ready(program)

    def compile(self, program: ProgramShape, tier: Tier, background: bool = False) -> Any:
        """Compile the model program of `program`'s shape at `tier` (or better); False if it already was.
        Only shapes are looked at, not the pools' contents. With `background`, traced here and compiled on
        the background compile thread: a future of that bool (done at once when nothing was left)."""
        return self.executables.compile(program, *self._ahead_args(program), tier, background=background)

    def soon(self, program: ProgramShape) -> None:
        """Compile `program` optimized in the background, once (a step meanwhile runs without it)."""
        if program not in self._background:
            self._background.add(program)
            self.compile(program, Tier.OPTIMIZED, background=True)

    def _ahead_args(self, program: ProgramShape) -> tuple[str, Any, tuple[Any, ...]]:
        """(name, jitted model function, its arguments as shapes) of `program`."""
        rows = program.rows
        run, params = (self.programs.verify, self.params) if program.verify else self.select(program.length)
        kda, mla = split_pools(self.layer_types, self.pool_specs)
        ints = [(rows, program.length), (rows,), (rows, program.width), (rows,), (rows,)]
        args = tuple(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ints)
        if program.verify:  # each position's sampling settings and key, as `Runner.verify` passes them
            n = rows * program.length
            f32, i32 = jax.ShapeDtypeStruct((n,), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32)
            keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))
            args += (f32, i32, f32, keys)
        return self.name(run), run, (params, kda, mla, *args)
