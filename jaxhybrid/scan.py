"""The decoder layers as a scan over repeated layer groups (e.g. K K K M), so that a program traces and
compiles one group instead of every layer: compile time stops growing with depth (92 layers, Kimi K3's
depth, compile about what 8 do).

The model keeps its per-layer parameters (checkpoint names `model.layers.N.*`, sharding rules, training
and counting are unchanged); `split_for_scan` builds, once and outside any jitted program, the scanned
form: the model without the scanned layers (the "shell": embedding, lead layers, trailing partial group,
norm, head) plus one group's parameters stacked over the groups. `forward_scanned` reproduces
`HybridLM.forward_cached` with them. Layers that differ from the repeating group (the dense lead layers
`first_k_dense_replace`, a trailing partial group) run unrolled. Attention-residual configs (K3's
`attn_res_block_size`: a growing tuple of blocks, no carry of fixed shape) are not scanned.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxhybrid.cache import LayerCache
from jaxhybrid.config import ModelConfig
from jaxhybrid.model import HybridLM
from jaxhybrid.ops.moe import moe_experts_dropless_stacked


@dataclasses.dataclass(frozen=True)
class ScanLayout:
    """Which layers are scanned: `groups` groups of `period` layers from layer `start`; the rest unrolled."""

    num_layers: int
    start: int
    period: int
    groups: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.groups

    @property
    def lead(self) -> tuple[int, ...]:
        return tuple(range(self.start))

    @property
    def tail(self) -> tuple[int, ...]:
        return tuple(range(self.stop, self.num_layers))

    def layer(self, group: int, j: int) -> int:
        """The index of the `j`-th layer of scanned group `group`."""
        return self.start + group * self.period + j


def scan_layout(model: HybridLM, min_groups: int = 2) -> ScanLayout | None:
    """The shortest repeating group of identical layer structure after the dense lead layers, or None when
    there is none of at least `min_groups` groups (or the config uses attention residuals)."""
    return layout_of(model.config, [nnx.graphdef(layer) for layer in model.model.layers], min_groups)


def layout_of(cfg: ModelConfig, keys: Sequence[Any], min_groups: int = 2) -> ScanLayout | None:
    """`scan_layout` from one key per layer, equal for layers of identical structure (graph definitions, or
    a layer's (mixer, MoE) kind for planning without a model)."""
    if cfg.attn_res_block_size is not None:
        return None
    n, start = len(keys), cfg.first_k_dense_replace
    for period in range(1, (n - start) // min_groups + 1):
        groups = (n - start) // period
        if all(keys[start + i] == keys[start + i % period] for i in range(groups * period)):
            return ScanLayout(n, start, period, groups)
    return None


@dataclasses.dataclass(frozen=True)
class ScanDefs:
    """The static half of the scanned model: its layout and the graph definitions of shell and group."""

    layout: ScanLayout
    shell: Any  # nnx.GraphDef of the model holding only the unrolled layers (lead, then tail)
    group: Any  # nnx.GraphDef of one group (an nnx.List of `period` layers)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScanParams:
    """The arrays of the scanned model: the shell's state and the group's state with every leaf [G, ...]."""

    shell: Any
    groups: Any


def _stack(*xs: jax.Array) -> jax.Array:
    """Stack one leaf over the groups; on a mesh a leading unsharded axis before the layer's own spec."""
    sharding = xs[0].sharding if isinstance(xs[0], jax.Array) else None
    if isinstance(sharding, NamedSharding) and sharding.mesh.size > 1:
        out = NamedSharding(sharding.mesh, PartitionSpec(None, *sharding.spec))
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*xs)
    return jnp.stack(xs)


def split_for_scan(model: HybridLM, layout: ScanLayout) -> tuple[ScanDefs, ScanParams]:
    """The scanned form of `model` (built once: stacking copies the scanned layers' weights once; the model
    itself is not changed)."""
    layers = list(model.model.layers)
    shell = nnx.clone(model)
    kept = [*layout.lead, *layout.tail]
    shell.model.layers = nnx.List([list(shell.model.layers)[i] for i in kept])
    shell_def, shell_state = nnx.split(shell)
    groups = [
        nnx.split(nnx.List(layers[layout.layer(g, 0) : layout.layer(g, 0) + layout.period]))
        for g in range(layout.groups)
    ]
    stacked = jax.tree.map(_stack, *(state for _, state in groups))
    return ScanDefs(layout, shell_def, groups[0][0]), ScanParams(shell_state, stacked)


def stack_caches(layout: ScanLayout, caches: tuple[Any, ...]) -> tuple[Any, ...]:
    """Per-layer caches -> per position of the group, each leaf stacked over the groups [G, ...]."""
    return tuple(
        jax.tree.map(lambda *xs: jnp.stack(xs), *(caches[layout.layer(g, j)] for g in range(layout.groups)))
        for j in range(layout.period)
    )


def forward_scanned(
    defs: ScanDefs,
    params: ScanParams,
    tokens: jax.Array,
    cache: tuple[LayerCache, ...] | None,
    lengths: jax.Array | None = None,
) -> tuple[jax.Array, tuple[LayerCache, ...]]:
    """`HybridLM.forward_cached` (cache None: the full causal pass `__call__`) with the scanned layers run by
    `jax.lax.scan`: (logits [B, T, vocab], the new per-layer caches in layer order)."""
    layout = defs.layout
    shell = nnx.merge(defs.shell, params.shell)
    caches = (None,) * layout.num_layers if cache is None else cache
    new: list[Any] = [None] * layout.num_layers
    unrolled = iter(shell.model.layers)
    h = shell.model.embed_tokens(tokens)
    for i in layout.lead:
        h, new[i] = next(unrolled)(h, caches[i], lengths)

    stacked = nnx.merge(defs.group, params.groups)  # modules holding the [G, ...] arrays: read, never run

    def group_step(h: jax.Array, xs: tuple[jax.Array, tuple[Any, ...]]) -> tuple[jax.Array, tuple[Any, ...]]:
        # The group's weights are indexed out of the stacked arrays here rather than scanned over as `xs`:
        # XLA:CPU then reads a matrix-vector product's weights in place instead of copying them per step.
        g, group_caches = xs
        layers = nnx.merge(defs.group, jax.tree.map(lambda x: x[g], params.groups))
        out = []
        for layer, full, c in zip(layers, stacked, group_caches, strict=True):
            _experts_in_place(layer, full, g)
            h, c = layer(h, c, lengths)
            out.append(c)
        return h, tuple(out)

    xs_caches = (None,) * layout.period if cache is None else stack_caches(layout, caches)
    h, ys = jax.lax.scan(group_step, h, (jnp.arange(layout.groups), xs_caches))
    for g in range(layout.groups):
        for j in range(layout.period):
            new[layout.layer(g, j)] = jax.tree.map(lambda y: y[g], ys[j])  # noqa: B023
    for i in layout.tail:
        h, new[i] = next(unrolled)(h, caches[i], lengths)
    return shell.logits(h), tuple(new)


def _experts_in_place(layer: Any, stacked: Any, g: jax.Array) -> None:
    """Let `layer`'s routed experts take group `g`'s experts from the stacked weights
    (`moe_experts_dropless_stacked`; on the CPU each chosen expert is read in place, where slicing the group
    first copies all its E experts on every step, which a bandwidth-bound decode pays in full). The layer's
    sliced weights are then unused (and removed by XLA). The dense reference and a set `experts_fn` (expert
    parallelism) keep the sliced weights."""
    moe = getattr(layer, "block_sparse_moe", None)
    if moe is None or moe.experts_fn is not None or moe.impl != "dropless":
        return
    moe.experts_fn = functools.partial(_stacked_experts, stacked.block_sparse_moe.experts.weights(None), g)


def _stacked_experts(stacked, g, x, w1, w2, w3, weights, expert_ids, *, act, valid=None):
    del w1, w2, w3  # the group's slices: taken from `stacked` instead
    return moe_experts_dropless_stacked(x, *stacked, weights, expert_ids, group=g, act=act, valid=valid)
