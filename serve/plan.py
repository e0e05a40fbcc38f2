"""Which mesh, and how many sequences fit: the planning behind `jaxhybrid plan` (and its sweep).

A slice of `chips` chips is served by `data` replicas, each one engine (one server) on an (expert x tensor)
mesh of its own: the engine keeps one KV pool replicated over its mesh (`sharding.rules`: the block axis and
the latent are whole on every device), so a data axis inside one engine would add no KV room; replicas
behind the router do. For every (tensor, expert) whose product divides the chips, the bytes one device of a
replica holds are added up from the same code the engine runs: the weights from the abstract model and the
sharding rules (`sharding.plan`), the pools from `EngineShape.resolve` and `empty_pools` placed by
`sharding.placement.pool_shardings`. The largest slot count whose total fits `hbm_bytes` is the replica's
sequences; the slice holds `data` times that.

Bytes per device, by kind:
- experts / other weights: routed experts (MXFP4 packed, or dense at the weight dtype) and every other
  parameter and buffer; `scanned_copy`: the engine's stacked copy of repeated layers when it scans them
  (`serve.engine.config.scan_mode`; never for attention-residual configs such as Kimi K3).
- kv_pool: the paged MLA latent pool of `slots * ceil(context / block_size) + 1` blocks (the engine's sizing
  for every slot at full context), replicated over the replica.
- live_states: the slots' KDA recurrent states (fp32) and conv windows, slots over expert, heads over tensor.
- checkpoints: state checkpoints on the device: each holds one slot's states, heads over tensor and whole
  over expert (what `Runner.take` returns); `checkpoint_interval` gives floor(context / interval) per
  sequence (interval checkpoints only, on block boundaries: no partial KV block); `device_cache_bytes`, when
  set, caps them as the prefix store's device budget does (the rest go to host memory).
- activations: an estimate (`activation_bytes`), not a measurement.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding

from jaxhybrid.cache import kda_state_bytes, narrowed
from jaxhybrid.config import ModelConfig
from jaxhybrid.scan import layout_of
from serve.engine.config import EngineConfig, EngineShape, scan_mode
from serve.engine.runner import empty_pools
from serve.report import fmt_bytes
from sharding.mesh import format_mesh_shape
from sharding.placement import pool_shardings
from sharding.plan import ModelShapes, WeightBytes, abstract_mesh, layer_kind, tree_shard_nbytes
from sharding.rules import logical_to_spec, logical_units

KDA_CHUNK = 64  # the chunkwise KDA form's chunk (jaxhybrid.ops.kda)
FP32 = 4


class PlanError(ValueError):
    """A request the planner cannot take (bad numbers); the message says which."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    chips: int
    hbm_bytes: int
    context: int
    chips_per_host: int | None = None
    dtype: str = "bfloat16"  # weights, KV pool and conv windows (the KDA recurrent state is fp32)
    packed: bool = True  # MXFP4 routed experts kept packed (configs with expert_quant: mxfp4)
    block_size: int = 16
    prefill_chunk: int = 512
    checkpoint_interval: int = 0  # 0: no state checkpoints
    device_cache_bytes: int | None = None  # cap on checkpoint bytes on the device (None: every sequence's)
    checkpoint_dtype: str = "float32"  # what the checkpoints keep the states in (`--checkpoint-dtype`)
    scan_layers: str = "auto"
    mesh: dict[str, int] | None = None  # only this replica mesh (expert, tensor)

    def validate(self) -> None:
        for name in ("chips", "hbm_bytes", "context", "block_size", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise PlanError(f"{name} must be positive, got {getattr(self, name)}")
        if self.checkpoint_interval < 0 or self.checkpoint_interval % self.block_size:
            raise PlanError(
                f"the checkpoint interval ({self.checkpoint_interval}) must be 0 or a positive multiple of "
                f"the block size ({self.block_size})"
            )
        if self.chips_per_host is not None and self.chips_per_host < 1:
            raise PlanError(f"chips per host must be positive, got {self.chips_per_host}")


@dataclasses.dataclass(frozen=True)
class DeviceBytes:
    """Bytes one device of a replica holds, by kind (see the module doc)."""

    experts: int
    other_weights: int
    scanned_copy: int
    kv_pool: int
    live_states: int
    checkpoints: int
    activations: int

    @property
    def weights(self) -> int:
        return self.experts + self.other_weights + self.scanned_copy

    @property
    def total(self) -> int:
        return sum(dataclasses.astuple(self))

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class MeshPlan:
    """A replica mesh that fits: `slots` sequences per replica (the engine's --slots), `data` replicas."""

    tensor: int
    expert: int
    data: int
    slots: int
    num_blocks: int
    checkpoints_per_device: int
    device_cache_bytes: int  # the prefix store's device budget those checkpoints take (--device-cache-mb)
    bytes: DeviceBytes

    @property
    def sequences_per_slice(self) -> int:
        return self.slots * self.data

    @property
    def mesh(self) -> str:
        return format_mesh_shape({"data": 1, "expert": self.expert, "tensor": self.tensor})

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out.update(
            bytes=self.bytes.as_dict(),
            sequences_per_replica=self.slots,
            sequences_per_slice=self.sequences_per_slice,
            mesh=self.mesh,
        )
        return out


@dataclasses.dataclass(frozen=True)
class Rejected:
    tensor: int
    expert: int
    data: int
    reason: str

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    request: PlanRequest
    chosen: MeshPlan | None
    fitting: tuple[MeshPlan, ...]
    rejected: tuple[Rejected, ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": dataclasses.asdict(self.request),
            "chosen": None if self.chosen is None else self.chosen.as_dict(),
            "fitting": [m.as_dict() for m in self.fitting],
            "rejected": [r.as_dict() for r in self.rejected],
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _local(mesh: AbstractMesh, cfg: ModelConfig, name: str, size: int) -> int:
    """How much of a dimension of logical `name` and `size` one device holds under the rules."""
    spec = logical_to_spec((name,), (size,), mesh, None, logical_units(cfg))
    return NamedSharding(mesh, spec).shard_shape((size,))[0]


def activation_bytes(cfg: ModelConfig, mesh: AbstractMesh, shape: EngineShape, packed: bool) -> int:
    """Estimated peak temporaries per device of the engine's largest programs: the max of a prefill call
    (one row of the longest prefill program, `prefill_chunk` or the context if shorter, against the whole
    context) and a decode step (every slot, one token,
    whole context). Layers run one after another, so it is the residual stream plus the largest single
    layer's temporaries, per device (heads, expert widths and slots at their rules' split):
    - stream: h and the partial sum, plus (attention residuals) one fp32 [T, D] vector per closed block;
    - MLA prefill (the expanded form over the rows' view of the pool): the view and its compute-dtype copy
      [S, latent], per-head keys and values fp32 and cast [H, S, nope + v], scores and their exp fp32
      [H, T, S], the mask [T, S]; MLA decode: the view of every row and its scores [B, H, S] (x2);
    - KDA: q, k, v and their convolutions fp32 [T, 3 H d] (x2), two states [H, d, d] fp32, three [H, T, 64]
      fp32 chunk matrices;
    - MoE: router scores fp32 [T, E], dispatched rows sent and received [T k, latent], w1, w3 and their
      activation fp32 [T k, F]; packed experts add one layer's local experts dequantized to the dtype.
    XLA may fuse some of these away or keep more alive; treat the figure as headroom to leave, not a bound."""
    units_tensor = lambda name, size: _local(mesh, cfg, name, size)  # noqa: E731
    cb, kb = jnp.dtype(shape.kv_dtype).itemsize, jnp.dtype(shape.kv_dtype).itemsize
    ctx = shape.table_buckets[-1] * shape.block_size
    t, D, lat = shape.bucket(min(shape.prefill_chunk, shape.max_model_len)), cfg.hidden_size, cfg.latent_dim
    res_blocks = math.ceil(cfg.num_hidden_layers / cfg.attn_res_block_size) if cfg.attn_res_block_size else 0

    def stream(tokens: int) -> int:
        return (res_blocks + 2) * tokens * D * FP32

    peak = 0
    if cfg.num_mla_layers:
        h = units_tensor("heads", cfg.num_attention_heads)
        nv = cfg.qk_nope_head_dim + cfg.v_head_dim
        mla = ctx * lat * (kb + cb) + h * ctx * nv * (FP32 + cb) + 2 * h * t * ctx * FP32 + t * ctx
        rows = _local(mesh, cfg, "batch", shape.slots)
        decode = rows * ctx * lat * (kb + cb) + 2 * rows * h * ctx * FP32
        peak = max(stream(t) + mla, stream(shape.slots) + decode)
    if cfg.num_kda_layers:
        hk, d = units_tensor("kda_heads", cfg.kda_num_heads), cfg.kda_head_dim
        kda = 2 * t * 3 * hk * d * FP32 + 2 * hk * d * d * FP32 + 3 * hk * t * KDA_CHUNK * FP32
        peak = max(peak, stream(t) + kda)
    if cfg.num_moe_layers:
        k, width = cfg.num_experts_per_token, cfg.routed_expert_hidden_size or cfg.hidden_size
        f = units_tensor("expert_mlp", cfg.moe_intermediate_size)
        moe = t * cfg.num_experts * FP32 + 2 * t * k * width * cb + 3 * t * k * f * FP32
        if packed:
            moe += _local(mesh, cfg, "experts", cfg.num_experts) * 3 * f * width * cb
        peak = max(peak, stream(t) + moe)
    return peak + shape.prefill_rows * cfg.vocab_size * FP32  # the logits (replicated)


class Planner:
    """Plans for one model config (its abstract model traced once, `sharding.plan.ModelShapes`); `plan` may
    be called for many requests (a sweep)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self._shapes: dict[tuple[str, bool], ModelShapes] = {}
        self._pools: dict[tuple[Any, ...], tuple[int, int]] = {}

    def shapes(self, dtype: str, packed: bool) -> ModelShapes:
        key = (dtype, packed and self.cfg.expert_quant == "mxfp4")
        if key not in self._shapes:
            self._shapes[key] = ModelShapes(self.cfg, jnp.dtype(dtype), packed=packed)
        return self._shapes[key]

    def engine_shape(self, req: PlanRequest, slots: int) -> EngineShape:
        """The engine's resolved shape for `slots` sequences of `req.context` tokens (no prefix store: its
        device budget is counted separately)."""
        config = EngineConfig(
            max_slots=slots,
            block_size=req.block_size,
            prefill_chunk=req.prefill_chunk,
            max_model_len=req.context,
            kv_dtype=req.dtype,
            scan_layers=req.scan_layers,
            prefix=None,
        )
        return EngineShape.resolve(config, self.cfg)

    def pool_bytes(
        self, shape: EngineShape, mesh: AbstractMesh, checkpoint_dtype: str = "float32"
    ) -> tuple[int, int]:
        """(KV pool, KDA state pools) bytes one device holds of the engine's pools; the states kept in
        `checkpoint_dtype` (a checkpoint's copy of them)."""
        key = (shape.slots, shape.num_blocks, shape.block_size, shape.kv_dtype.name, tuple(mesh.axis_sizes))
        key += (checkpoint_dtype,)
        if key not in self._pools:
            self._pools[key] = self._pool_bytes(shape, mesh, checkpoint_dtype)
        return self._pools[key]

    def _pool_bytes(self, shape: EngineShape, mesh: AbstractMesh, checkpoint_dtype: str) -> tuple[int, int]:
        structs = jax.eval_shape(lambda: empty_pools(self.cfg, shape))
        narrow = lambda s: jax.ShapeDtypeStruct(s.shape, narrowed(s.dtype, checkpoint_dtype))  # noqa: E731
        shardings = pool_shardings(
            self.cfg, mesh, slots=shape.slots, num_blocks=shape.num_blocks, block_size=shape.block_size
        )
        kinds = self.cfg.layer_types
        kda = [
            (jax.tree.map(narrow, s), sh)
            for k, s, sh in zip(kinds, structs, shardings, strict=True)
            if k == "kda"
        ]
        mla = [(s, sh) for k, s, sh in zip(kinds, structs, shardings, strict=True) if k != "kda"]
        return (
            tree_shard_nbytes([s for s, _ in mla], [sh for _, sh in mla]),
            tree_shard_nbytes([s for s, _ in kda], [sh for _, sh in kda]),
        )

    def scanned_copy(self, req: PlanRequest, weights: WeightBytes) -> int:
        """Per-device bytes of the engine's stacked copy of the scanned layers (`split_for_scan`)."""
        cfg = self.cfg
        layout = layout_of(cfg, [layer_kind(cfg, i) for i in range(cfg.num_hidden_layers)])
        if scan_mode(req.scan_layers, layout.groups if layout else 0) == "off" or layout is None:
            return 0
        return sum(weights.layers[layout.start : layout.stop])

    def device_bytes(
        self, req: PlanRequest, mesh: AbstractMesh, weights: WeightBytes, scanned: int, slots: int
    ) -> tuple[DeviceBytes, EngineShape, int, int]:
        """(bytes by kind, engine shape, checkpoints on the device, their global bytes) for `slots`."""
        shape = self.engine_shape(req, slots)
        kv, states = self.pool_bytes(shape, mesh)
        checkpoints = 0
        checkpoint_bytes = kda_state_bytes(self.cfg, shape.kv_dtype, req.checkpoint_dtype)["total"]
        if req.checkpoint_interval:
            checkpoints = slots * (req.context // req.checkpoint_interval)
            if req.device_cache_bytes is not None:
                checkpoints = min(checkpoints, req.device_cache_bytes // checkpoint_bytes)
        # a checkpoint: one slot's states, not split, in the checkpoints' dtype
        one_slot = self.pool_bytes(self.engine_shape(req, 1), mesh, req.checkpoint_dtype)[1]
        rows = DeviceBytes(
            experts=weights.experts,
            other_weights=weights.other,
            scanned_copy=scanned,
            kv_pool=kv,
            live_states=states,
            checkpoints=checkpoints * one_slot,
            activations=activation_bytes(self.cfg, mesh, shape, self.shapes(req.dtype, req.packed).packed),
        )
        return rows, shape, checkpoints, checkpoints * checkpoint_bytes

    def mesh_plan(self, req: PlanRequest, tensor: int, expert: int, slots: int) -> MeshPlan:
        """The bytes per device of `slots` sequences on a replica of (expert, tensor), fitting or not."""
        mesh = abstract_mesh({"expert": expert, "tensor": tensor})
        weights = self.shapes(req.dtype, req.packed).weight_bytes(mesh)
        rows, shape, n, budget = self.device_bytes(req, mesh, weights, self.scanned_copy(req, weights), slots)
        return MeshPlan(
            tensor, expert, req.chips // (tensor * expert), slots, shape.num_blocks, n, budget, rows
        )

    def fit(self, req: PlanRequest, tensor: int, expert: int) -> MeshPlan | str:
        """The most slots whose bytes fit on a replica of (expert, tensor), or why none does."""

        def plan_for(slots: int) -> MeshPlan:
            return self.mesh_plan(req, tensor, expert, slots)

        def fits(slots: int) -> bool:
            return plan_for(slots).bytes.total <= req.hbm_bytes

        one = plan_for(1)
        if one.bytes.total > req.hbm_bytes:
            b = one.bytes
            return (
                f"does not fit: weights {fmt_bytes(b.weights)} + activations {fmt_bytes(b.activations)} "
                f"+ one sequence {fmt_bytes(b.total - b.weights - b.activations)} "
                f"> {fmt_bytes(req.hbm_bytes)} per chip"
            )
        # Slots split over the expert axis only in multiples of it (else the rules keep the states whole):
        # the most multiples that fit, then the few counts between it and the next multiple.
        g = expert
        lo, hi = 0, 1
        while fits(hi * g):
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid * g) else (lo, mid)
        best = max(1, lo * g)
        for slots in range(lo * g + g - 1, best, -1):
            if fits(slots):
                best = slots
                break
        return plan_for(best)

    def candidates(self, req: PlanRequest) -> list[tuple[int, int]]:
        if req.mesh is not None:
            t, e = req.mesh.get("tensor", 1), req.mesh.get("expert", 1)
            if req.mesh.get("data", 1) != 1 or req.chips % (t * e):
                raise PlanError(
                    f"--mesh gives a replica's expert and tensor sizes; expert x tensor ({e * t}) must "
                    f"divide the {req.chips} chips (data is the number of replicas)"
                )
            return [(t, e)]
        return [(t, e) for t in _divisors(req.chips) for e in _divisors(req.chips // t)]

    def reject_reason(self, req: PlanRequest, tensor: int, expert: int) -> str | None:
        """Why a replica mesh is not considered, before counting bytes (None: it is)."""
        cfg = self.cfg
        if req.chips_per_host is not None and tensor > req.chips_per_host:
            return f"tensor={tensor} spans more than one host of {req.chips_per_host} chips"
        for name, heads in (("attention", cfg.num_attention_heads), ("KDA", cfg.kda_num_heads)):
            if tensor > 1 and heads and heads % tensor:
                return f"tensor={tensor} does not divide the {heads} {name} heads (they would be replicated)"
        if expert > 1 and not cfg.num_moe_layers:
            return f"expert={expert}: the model has no routed experts"
        if expert > 1 and cfg.num_experts % expert:
            return f"expert={expert} does not divide the {cfg.num_experts} experts (they would be replicated)"
        return None

    def plan(self, req: PlanRequest) -> Plan:
        req.validate()
        fitting: list[MeshPlan] = []
        rejected: list[Rejected] = []
        for tensor, expert in self.candidates(req):
            data = req.chips // (tensor * expert)
            reason = self.reject_reason(req, tensor, expert)
            result = self.fit(req, tensor, expert) if reason is None else reason
            if isinstance(result, str):
                rejected.append(Rejected(tensor, expert, data, result))
            else:
                fitting.append(result)
        # most sequences per slice, then the larger replica (fewer copies of the weights), then less tensor
        fitting.sort(key=lambda m: (-m.sequences_per_slice, m.data, m.tensor))
        return Plan(req, fitting[0] if fitting else None, tuple(fitting), tuple(rejected))


def sweep(planner: Planner, base: PlanRequest, **axes: list[Any]) -> list[Plan]:
    """`planner.plan` for every combination of the request fields in `axes` (e.g. chips=[16, 32])."""
    names = list(axes)
    return [
        planner.plan(dataclasses.replace(base, **dict(zip(names, values, strict=True))))
        for values in itertools.product(*(axes[n] for n in names))
    ]
