"""The engine's programs compiled for a TPU topology from any host, a CPU-only one included: what XLA itself
says one device of a replica holds and reads, before any TPU is rented.

With libtpu installed (`pip install -e ".[tpu]"`) JAX describes a named topology's devices
(`jax.experimental.topologies.get_topology_desc`, e.g. "v5e:2x2", "v6e:2x4", "tpu7x:2x2x4") without owning
any, and compiles for them ahead of time. Here the model is abstract (shapes only, nothing allocated), its
parameters and the engine's pools carry the shardings `sharding.rules` gives them on the replica's mesh, and
each program is the one the engine's runner would run there (`serve.engine.runner._programs`, with the pools'
shardings), lowered from those shapes and compiled by XLA for the TPU: the decode and verify steps, the
longest prefill chunk, and the prefix store's checkpoint copy and restore. The figures are XLA's per device:
`memory_analysis()` (argument, output, temporary and aliased bytes), `cost_analysis()` (flops, bytes
accessed) and the collectives in the compiled module; beside them a roofline time from the chip's published
peaks (`CHIPS`).
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxhybrid.config import ModelConfig
from jaxhybrid.model import abstract_model
from serve.engine import copies
from serve.engine import runner as runner_mod
from serve.engine.config import EngineShape, ProgramShape
from sharding.mesh import make_mesh
from sharding.placement import install_expert_parallel, pool_shardings, wants_expert_parallel
from sharding.rules import state_shardings

__all__ = [
    "CHIPS",
    "Chip",
    "PROGRAMS",
    "CompiledProgram",
    "TopOp",
    "collectives",
    "cut_layers",
    "top_ops",
    "roofline_s",
    "ProgramArguments",
    "TopologyError",
    "compile_engine_programs",
    "program_arguments",
    "replica_mesh",
    "topology_devices",
]


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU chip's peaks, per chip: bf16 matrix flops, HBM capacity and bandwidth, and bidirectional ICI
    bandwidth (the vendor's published figures; `CHIPS` cites them)."""

    name: str
    bf16_flops: float  # per second
    hbm_bytes: float
    hbm_bandwidth: float  # bytes per second
    ici_bandwidth: float  # bytes per second, bidirectional, all links of the chip
    devices_per_chip: int = 1  # JAX devices a chip shows as (TPU7x: one per TensorCore)


# Google Cloud's TPU pages (docs.cloud.google.com/tpu/docs/v5e, v5p, v6e, tpu7x); TPU7x's HBM and ICI
# bandwidth from Google's Ironwood announcement (7.37 TB/s, 1.2 TB/s). Keyed by the device kind libtpu names.
CHIPS = {
    "TPU v5 lite": Chip("v5e", 197e12, 16e9, 819e9, 400e9),
    "TPU v5": Chip("v5p", 459e12, 95 * 2**30, 2765e9, 1200e9),
    "TPU v6 lite": Chip("v6e", 918e12, 32e9, 1638e9, 800e9),
    "TPU7x": Chip("tpu7x", 2307e12, 192 * 2**30, 7370e9, 1200e9, devices_per_chip=2),
}

COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4}
_DTYPE_BYTES |= {"f32": 4, "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes)} of the collectives in a compiled module's text, each counted by the bytes of
    its result on one device (an async pair counted once, at its start)."""
    out: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([a-z-]+)\(", line)
        if match is None:
            continue
        op = match.group(2)
        kind = op.removesuffix("-start")
        if kind not in COLLECTIVES:
            continue
        shapes = re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", match.group(1))
        if op != kind:  # an async start's result holds its operands then its results: take the results
            shapes = shapes[len(shapes) // 2 :]
        size = sum(_DTYPE_BYTES.get(t, 4) * _prod(dims) for t, dims in shapes)
        entry = out.setdefault(kind, [0, 0])
        entry[0] += 1
        entry[1] += int(size)
    return {kind: (count, size) for kind, (count, size) in out.items()}


@dataclasses.dataclass(frozen=True)
class TopOp:
    """One instruction of a compiled module and the bytes it touches: its result's and its operands' (each
    counted whole, as its shape says: an approximation of what it reads and writes; a fusion may read only
    part of an operand, and buffers reused in place are counted each time)."""

    kind: str  # the HLO opcode: fusion, copy, custom-call, all-to-all, ...
    result: str  # its result's type without layouts, e.g. "bf16[8,7168]" or "(f32[8], s32[8])"
    operands: tuple[str, ...]  # each operand's type without layouts
    bytes: int  # result + operands
    op_name: str  # the tail of its metadata's op_name (the JAX operation it came from), or its HLO name

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "operands": list(self.operands)}


# instructions that move nothing themselves: their bytes are their callees' or their producers'
_NO_BYTES = ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call")
_SHAPE = re.compile(r"\b([a-z]+[0-9]+(?:e[0-9]+m[0-9]+[a-z]*)?|pred)\[([0-9,]*)\]")


def _shapes_bytes(text: str) -> int:
    return int(sum(_DTYPE_BYTES.get(t, 4) * _prod(dims) for t, dims in _SHAPE.findall(text)))


def _no_layout(text: str) -> str:
    """A type as the module prints it, less its layouts
    ("bf16[8,128]{1,0:T(8,128)(2,1)}" -> "bf16[8,128]")."""
    out, depth = [], 0
    for ch in text:
        depth += ch == "{"
        if not depth:
            out.append(ch)
        depth -= ch == "}" and depth > 0
    return "".join(out).strip()


def _operands(line: str, start: int) -> list[str]:
    """The operand list's top-level entries of the instruction whose "(" is at `start`."""
    depth, item, items = 0, [], []
    for ch in line[start:]:
        if ch in "({[":
            depth += 1
            if depth == 1 and ch == "(":
                continue
        elif ch in ")}]":
            depth -= 1
            if depth == 0:
                break
        if ch == "," and depth == 1:
            items.append("".join(item))
            item = []
            continue
        item.append(ch)
    items.append("".join(item))
    return [i.strip() for i in items if i.strip()]


def _operand_type(operand: str, types: dict[str, str]) -> str:
    """An operand's type: as printed before its name ("bf16[8]{0} %p"), else its instruction's ("%p")."""
    typed, _, name = operand.rpartition("%")
    return typed if _SHAPE.search(typed) else types.get(name.strip(), "")


def top_ops(hlo_text: str, count: int = 8) -> tuple[TopOp, ...]:
    """The `count` instructions of a compiled module that touch the most bytes (result + operands, by their
    shapes; `TopOp` says how approximate), largest first: every instruction of the computations that run as
    instructions (the entry, while bodies and conditions, called computations), none inside a fusion's
    computation (the fusion itself counts, by its operands and result). An async pair counts once, at its
    start, by its result (which holds its operands); moving nothing itself (a parameter, a tuple, a loop), an
    instruction is not listed. Where the bytes of a step go, before any profile: which copies, gathers and
    kernels dominate."""
    fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
    fused |= set(re.findall(r"\bto_apply=%?([\w.\-]+)", hlo_text))  # reducers: scalar bodies
    # a compiled module names its operands without their types: each instruction's type by its name
    types = dict(re.findall(r"^\s*(?:ROOT )?%(\S+) = (.+?) [a-z][a-z0-9-]*\(", hlo_text, re.MULTILINE))
    found: list[TopOp] = []
    comp = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            head = re.match(r"(?:ENTRY )?%?([\w.\-]+)", line)
            comp = head.group(1) if head and line.rstrip().endswith("{") else None
            continue
        if comp is None or comp in fused:
            continue
        match = re.match(r"\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9-]*)\(", line)
        if match is None or match.group(3) in _NO_BYTES or match.group(3).endswith("-done"):
            continue
        kind, result = match.group(3), match.group(2)
        operands = [] if kind.endswith("-start") else _operands(line, match.end() - 1)
        operands = [_no_layout(_operand_type(o, types)) for o in operands]
        operands = [o for o in operands if _SHAPE.search(o)]
        name = re.search(r'op_name="((?:[^"\\]|\\.)+)"', line)
        name = (name.group(1) if name else match.group(1)).replace("\\'", "'").replace('\\"', '"')
        found.append(
            TopOp(
                kind=kind,
                result=_no_layout(result),
                operands=tuple(operands),
                bytes=_shapes_bytes(result) + sum(_shapes_bytes(o) for o in operands),
                op_name=name if len(name) <= 80 else "..." + name[-77:],
            )
        )
    found.sort(key=lambda op: -op.bytes)
    return tuple(found[:count])


def cut_layers(cfg: ModelConfig, layers: int) -> ModelConfig:
    """`cfg` cut to its first `layers` layers, each of the same kind (KDA or MLA, dense or MoE) as in the full
    model: for compile studies (a 4-layer K3 compiles in minutes where 93 layers would take far longer). The
    full model's per-device figures scale with the layer count only approximately (the embedding and head
    do not scale; the pools and weights of each kind do)."""
    if not 1 <= layers <= cfg.num_hidden_layers:
        raise ValueError(f"--layers must be in 1..{cfg.num_hidden_layers} ({cfg.name}), got {layers}")
    return cfg.replace(
        num_hidden_layers=layers,
        kda_layers=tuple(i for i in cfg.kda_layers if i <= layers),
        full_attn_layers=tuple(i for i in cfg.full_attn_layers if i <= layers),
        first_k_dense_replace=min(cfg.first_k_dense_replace, layers),
    )


def _prod(dims: str) -> int:
    n = 1
    for d in dims.split(","):
        if d:
            n *= int(d)
    return n


class TopologyError(ValueError):
    """A topology that cannot be described here (no libtpu, an unknown name, a mesh that does not fit)."""


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """One engine program compiled for one device of the replica: XLA's bytes and costs, and the seconds
    lowering and compiling took on this host."""

    name: str  # "decode" or "prefill"
    rows: int
    length: int
    width: int  # block-table entries
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int  # outputs that reuse a donated argument's buffer (the pools)
    flops: float
    bytes_accessed: float
    compile_s: float
    cpu_calls: tuple[str, ...]  # custom calls to the CPU kernels found in the program (none, on a TPU)
    error: str | None = None  # XLA's refusal (its out-of-memory message), when it did not compile
    collectives: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # kind: (count, bytes)
    host_peak_bytes: int = 0  # this process's peak resident memory after the compile
    roofline_s: float | None = None  # the device's floor: flops, HBM reads and ICI traffic at their peaks
    top_ops: tuple[TopOp, ...] = ()  # the instructions touching the most bytes, largest first (`top_ops`)

    @property
    def collective_bytes(self) -> int:
        return sum(size for _, size in self.collectives.values())

    @property
    def peak_bytes(self) -> int:
        """What the device holds while the program runs: its arguments, its outputs that do not reuse an
        argument's buffer, and its temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    def as_dict(self) -> dict[str, Any]:
        out = {**dataclasses.asdict(self), "cpu_calls": list(self.cpu_calls), "peak_bytes": self.peak_bytes}
        out["collectives"] = {k: {"count": c, "bytes": b} for k, (c, b) in self.collectives.items()}
        out["top_ops"] = [op.as_dict() for op in self.top_ops]
        return out


def topology_devices(name: str) -> list[Any]:
    """The devices of TPU topology `name` ("v5e:2x2", "tpu7x:2x2x4", ...), described by libtpu on any host."""
    try:
        from jax.experimental import topologies

        return list(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
    except (ImportError, RuntimeError, ValueError) as exc:
        hint = "" if _has_libtpu() else ' (libtpu is not installed: pip install -e ".[tpu]")'
        raise TopologyError(f"cannot describe the TPU topology {name!r}{hint}: {exc}") from None


def _has_libtpu() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None


def replica_mesh(devices: list[Any], tensor: int, expert: int) -> Any:
    """The mesh of one replica (data=1): the first tensor x expert devices of the topology."""
    if tensor * expert > len(devices):
        raise TopologyError(f"tensor={tensor} x expert={expert} needs more than the {len(devices)} devices")
    return make_mesh({"data": 1, "expert": expert, "tensor": tensor}, devices=devices[: tensor * expert])


@dataclasses.dataclass(frozen=True)
class ProgramArguments:
    """The engine's model program (`run`, jitted with the pools' shardings) and its weight and pool
    arguments as placed shapes (ShapeDtypeStructs with NamedShardings on the mesh): nothing allocated."""

    run: Any
    verify: Any
    params: Any
    kda_pools: tuple[Any, ...]
    mla_pools: tuple[Any, ...]
    pools: tuple[Any, ...]  # every layer's, in layer order (what the prefix store's copies take)


def program_arguments(
    cfg: ModelConfig, mesh: Any, shape: EngineShape, dtype: Any = jnp.bfloat16, packed: bool = True
) -> ProgramArguments:
    """What the engine's runner would hold on `mesh` for `shape`, as shapes: the abstract model's parameters
    in the shardings `sharding.rules` gives them (expert parallelism where the mesh has an expert axis, as
    the engine installs it), the pools in `pool_shardings`'."""
    model = abstract_model(cfg, dtype, dequantize_experts=not packed)
    if wants_expert_parallel(cfg, mesh):
        install_expert_parallel(model, mesh)
    graphdef, state = nnx.split(model)

    def placed(tree: Any, shardings: Any) -> Any:
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)

    params = placed(state, state_shardings(model, mesh)).to_pure_dict()
    pool_placement = pool_shardings(
        cfg, mesh, slots=shape.slots, num_blocks=shape.num_blocks, block_size=shape.block_size
    )
    pools = placed(jax.eval_shape(lambda: runner_mod.empty_pools(cfg, shape)), pool_placement)
    programs = runner_mod._programs(graphdef, cfg.layer_types, pool_placement, None, False)
    return ProgramArguments(
        run=programs.run,
        verify=programs.verify,
        params=params,
        kda_pools=tuple(p for kind, p in zip(cfg.layer_types, pools, strict=True) if kind == "kda"),
        mla_pools=tuple(p for kind, p in zip(cfg.layer_types, pools, strict=True) if kind != "kda"),
        pools=pools,
    )


PROGRAMS = ("decode", "prefill", "packed", "verify", "checkpoint", "restore")


def compile_engine_programs(
    cfg: ModelConfig,
    mesh: Any,
    shape: EngineShape,
    dtype: Any = jnp.bfloat16,
    packed: bool = True,
    programs: tuple[str, ...] = PROGRAMS,
    top: int = 8,
    args: ProgramArguments | None = None,
) -> list[CompiledProgram]:
    """Compile the engine's `programs` for `shape` on `mesh` (any devices, TPU ones described by
    `topology_devices` included): the decode step of every slot, the longest prefill chunk and the verify
    step of every slot (a row's last token and its drafted ones), all at the widest block table (the full
    context); the packed prefill of short chunks, where the engine packs them; and the prefix store's copies
    of one slot: a checkpoint taken (its states and a block's KV) and restored. Each program keeps its `top`
    instructions by bytes (`top_ops`). `args`: `program_arguments` of the same, where the caller has them."""
    args = program_arguments(cfg, mesh, shape, dtype, packed) if args is None else args
    if shape.prefill_rows < 2 or not shape.pack_lengths:  # this engine packs no prefill chunks
        programs = tuple(p for p in programs if p != "packed")
    lowerings = {name: _lowering(name, args, mesh, shape) for name in programs}
    out = []
    for name, (rows, length, width, lower) in lowerings.items():
        start = time.perf_counter()
        lowered = lower()
        calls = tuple(sorted(set(re.findall(r"custom_call @(jaxhybrid_\w+)", lowered.as_text()))))
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as exc:  # XLA's out-of-memory refusal is a finding, not a crash
            seconds = round(time.perf_counter() - start, 2)
            error = str(exc).splitlines()[0]
            out.append(
                CompiledProgram(name, rows, length, width, 0, 0, 0, 0, 0.0, 0.0, seconds, calls, error)
            )
            continue
        seconds = time.perf_counter() - start
        memory, cost = compiled.memory_analysis(), compiled.cost_analysis() or {}
        text = compiled.as_text()
        found = collectives(text)
        flops, read = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
        out.append(
            CompiledProgram(
                name=name,
                rows=rows,
                length=length,
                width=width,
                argument_bytes=int(memory.argument_size_in_bytes),
                output_bytes=int(memory.output_size_in_bytes),
                temp_bytes=int(memory.temp_size_in_bytes),
                alias_bytes=int(memory.alias_size_in_bytes),
                flops=flops,
                bytes_accessed=read,
                compile_s=round(seconds, 2),
                cpu_calls=calls,
                collectives=found,
                host_peak_bytes=_host_peak_bytes(),
                roofline_s=roofline_s(mesh, flops, read, sum(size for _, size in found.values())),
                top_ops=top_ops(text, top),
            )
        )
    return out


def _lowering(name: str, args: ProgramArguments, mesh: Any, shape: EngineShape) -> tuple[int, int, int, Any]:
    """(rows, tokens per row, block-table width, a function lowering program `name` from placed shapes), as
    the runner has it."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def spec(dims: tuple[int, ...], dtype: Any = jnp.int32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype, sharding=replicated)

    widest = shape.table_buckets[-1]
    if name in ("decode", "prefill", "packed", "verify"):
        if name == "packed":
            program = shape.packed(shape.pack_lengths[-1])
        else:
            rows, length = {
                "decode": (shape.slots, 1),
                "prefill": (1, shape.prefill_chunk),
                "verify": (shape.slots, shape.speculative_tokens + 1),
            }[name]
            program = ProgramShape(rows, length, widest, verify=name == "verify")
        rows, length, width = program.rows, program.length, program.width
        ints = tuple(spec(d) for d in [(rows, length), (rows,), (rows, width), (rows,), (rows,)])
        model = (args.params, args.kda_pools, args.mla_pools, *ints)
        if name != "verify":
            return rows, length, width, lambda: args.run.lower(*model)
        n = rows * length  # each position's sampling settings and key, as `Runner.verify` passes them
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), n))
        sampling = (
            spec((n,), jnp.float32),
            spec((n,)),
            spec((n,), jnp.float32),
            spec(keys.shape, keys.dtype),
        )
        return rows, length, width, lambda: args.verify.lower(*model, *sampling)
    slot, block = spec(()), spec(())
    if name == "checkpoint":
        return 1, 0, 0, lambda: copies.take.lower(args.pools, slot, block)
    if name == "restore":
        states, kv = jax.eval_shape(copies.take, args.pools, slot, block)
        states, kv = jax.tree.map(lambda a: spec(a.shape, a.dtype), (states, kv))
        return 1, 0, 0, lambda: copies.put.lower(args.pools, slot, states, block, kv)
    raise ValueError(f"no engine program {name!r}: one of {', '.join(PROGRAMS)}")


def roofline_s(mesh: Any, flops: float, read_bytes: float, collective_bytes: float) -> float | None:
    """The least time one device can take for a program of these per-device figures: the slowest of its
    flops at the chip's bf16 peak, its bytes at HBM bandwidth, and its collectives' bytes at the ICI
    bandwidth (each device's share of its chip, where a chip shows as several devices). None for a device
    kind `CHIPS` does not list."""
    devices = list(mesh.devices.flat)
    chip = CHIPS.get(devices[0].device_kind)
    if chip is None:
        return None
    share = chip.devices_per_chip
    return max(
        flops / (chip.bf16_flops / share),
        read_bytes / (chip.hbm_bandwidth / share),
        collective_bytes / (chip.ici_bandwidth / share),
    )


def _host_peak_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux
