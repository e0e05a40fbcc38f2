"""Per-device bytes of a model's weights on a mesh, from the sharding rules alone (no devices): the weight
half of `jaxhybrid plan` (the engine's pools are counted by `serve.plan` with the engine's own sizing).

A mesh here is an `jax.sharding.AbstractMesh` with the axes of `sharding.mesh.AXES`; every array is placed by
`sharding.rules` exactly as `create_sharded_model` / `shard_model` place it, and a device holds
``prod(sharding.shard_shape(shape)) * itemsize`` bytes of it (the rules only split a dimension that divides,
so every device holds the same bytes).

Speed: `nnx.eval_shape` of Kimi K3 (93 layers, 2,736 arrays) takes many minutes on a small CPU. Layers of
one kind (mixer, dense or MoE feed-forward) have identical shapes and axes, so `ModelShapes` traces one layer
per kind (a 3-layer model for K3) and counts each layer of the real model from its kind.

MXFP4 routed experts: with `packed`, each dense expert weight [.., out, in] is counted as the uint8 pair the
packed model holds (`w*_packed` [.., out, in/2] + `w*_scale` [.., out, in/32]) with the dense weight's
logical axes dimension by dimension, each placed by the rules. When `jaxhybrid.model.abstract_model` takes
`dequantize_experts` (packed experts in the model itself), the flag is passed and the model's own arrays are
walked instead.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, NamedSharding

from jaxhybrid.config import ModelConfig
from jaxhybrid.model import abstract_model
from jaxhybrid.weights.mxfp4 import GROUP
from sharding.mesh import AXES
from sharding.rules import LogicalRules, logical_to_spec, logical_units, variable_axes

ROUTED_EXPERT_WEIGHTS = ("w1", "w2", "w3")


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    """A device-less mesh with the engine's axes (data, expert, tensor; missing ones 1) and Auto types."""
    return AbstractMesh(
        tuple(int(sizes.get(a, 1)) for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES)
    )


def shard_nbytes(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding) -> int:
    """Bytes one device holds of an array of `shape` / `dtype` placed by `sharding`."""
    return int(np.prod(sharding.shard_shape(tuple(shape)), dtype=np.int64)) * np.dtype(dtype).itemsize


def tree_shard_nbytes(structs: Any, shardings: Any) -> int:
    """Bytes one device holds of a pytree of ShapeDtypeStructs placed by a matching pytree of shardings."""
    leaves = jax.tree.leaves(structs)
    return sum(
        shard_nbytes(s.shape, s.dtype, sh) for s, sh in zip(leaves, jax.tree.leaves(shardings), strict=True)
    )


def layer_kind(cfg: ModelConfig, layer: int) -> tuple[str, bool]:
    """(mixer, has MoE) of a 0-indexed layer: layers of one kind have identical parameter shapes."""
    return cfg.layer_types[layer], cfg.is_moe_layer(layer)


def kind_config(cfg: ModelConfig) -> tuple[ModelConfig, tuple[tuple[str, bool], ...]]:
    """`cfg` with one layer per kind, in the order the kinds first occur (dense lead layers stay first), and
    the kind of each of its layers."""
    kinds: list[tuple[str, bool]] = []
    for i in range(cfg.num_hidden_layers):
        if layer_kind(cfg, i) not in kinds:
            kinds.append(layer_kind(cfg, i))
    reduced = cfg.replace(
        num_hidden_layers=len(kinds),
        first_k_dense_replace=sum(1 for _, moe in kinds if not moe),
        kda_layers=tuple(i + 1 for i, (mixer, _) in enumerate(kinds) if mixer == "kda"),
        full_attn_layers=tuple(i + 1 for i, (mixer, _) in enumerate(kinds) if mixer != "kda"),
    )
    return reduced, tuple(kinds)


def _supports_dequantize_flag() -> bool:
    return "dequantize_experts" in inspect.signature(abstract_model).parameters


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Bytes one device holds of the model's arrays (parameters and buffers): the routed experts (packed
    or dense), everything else, and the per-layer totals of the real model's layers (for the engine's
    scanned copy of repeated layers)."""

    experts: int
    other: int
    layers: tuple[int, ...]

    @property
    def total(self) -> int:
        return self.experts + self.other


class ModelShapes:
    """The abstract model of a config, traced once (one layer per kind) and placed on any mesh.

    `packed`: count MXFP4 routed experts packed (only when `cfg.expert_quant == "mxfp4"`; otherwise the
    experts are dense at `dtype` either way)."""

    def __init__(self, cfg: ModelConfig, dtype: Any = jnp.bfloat16, *, packed: bool = True):
        self.cfg, self.dtype = cfg, jnp.dtype(dtype)
        self.packed = packed and cfg.expert_quant == "mxfp4"
        reduced, self.kinds = kind_config(cfg)
        kwargs: dict[str, Any] = {"allow_unimplemented": True}
        self.native_packing = _supports_dequantize_flag()
        if self.native_packing:
            kwargs["dequantize_experts"] = not self.packed
        model = abstract_model(reduced, self.dtype, **kwargs)
        self.units = logical_units(cfg)
        # (path, ShapeDtypeStruct, logical axes) of every array of the reduced model
        self.arrays = [
            (tuple(str(p) for p in path), var.get_value(), variable_axes(var))
            for path, var in nnx.to_flat_state(nnx.state(model))
            if hasattr(var.get_value(), "shape")
        ]
        self._cache: dict[tuple[tuple[int, ...], Any], WeightBytes] = {}

    def _arrays_of(self, path: tuple[str, ...], struct: Any, axes: Any) -> list[tuple[tuple[int, ...], Any]]:
        """(shape, dtype) of what the engine holds for one array: a dense routed expert weight becomes its
        packed codes and scales when counted packed here (not by the model itself)."""
        routed = "experts" in path and "shared_experts" not in path and path[-1] in ROUTED_EXPERT_WEIGHTS
        if routed and self.packed and not self.native_packing:
            *lead, cols = struct.shape
            return [((*lead, cols // 2), np.uint8), ((*lead, cols // GROUP), np.uint8)]
        return [(tuple(struct.shape), struct.dtype)]

    def weight_bytes(self, mesh: AbstractMesh, rules: LogicalRules | None = None) -> WeightBytes:
        key = (tuple(mesh.axis_sizes), None if rules is None else tuple(sorted(rules.items())))
        if key in self._cache:
            return self._cache[key]
        kind_bytes: dict[tuple[str, bool], int] = {}
        experts = head = 0
        counts = {k: 0 for k in self.kinds}
        for i in range(self.cfg.num_hidden_layers):
            counts[layer_kind(self.cfg, i)] += 1
        for path, struct, axes in self.arrays:
            nbytes = sum(
                shard_nbytes(
                    shape, dtype, NamedSharding(mesh, logical_to_spec(axes, shape, mesh, rules, self.units))
                )
                for shape, dtype in self._arrays_of(path, struct, axes)
            )
            is_layer = path[:2] == ("model", "layers")
            times = counts[self.kinds[int(path[2])]] if is_layer else 1
            if "experts" in path and "shared_experts" not in path:
                experts += nbytes * times
            if is_layer:
                kind = self.kinds[int(path[2])]
                kind_bytes[kind] = kind_bytes.get(kind, 0) + nbytes
            else:
                head += nbytes
        layers = tuple(kind_bytes[layer_kind(self.cfg, i)] for i in range(self.cfg.num_hidden_layers))
        out = WeightBytes(experts=experts, other=head + sum(layers) - experts, layers=layers)
        self._cache[key] = out
        return out
