"""Mixture-of-experts array functions: sigmoid router with group-limited top-k, and gated-MLP experts.

Everything here is a pure function of arrays. Weights stay in checkpoint layout ``[out, in]``
(router ``[E, D]``; experts ``w1/w3: [E, F, D]``, ``w2: [E, D, F]``) so loading needs no transposes.

Two expert implementations share one signature:

* :func:`moe_experts_dropless` - sort the ``N * k`` (token, expert) pairs by expert and run grouped
  matmuls with :func:`jax.lax.ragged_dot_general`. Static shapes, no capacity factor, nothing dropped.
* :func:`moe_experts_dense` - the reference: every expert on every token, combined with a ``[N, E]``
  weight matrix. ``E`` times the FLOPs; use it for tests only.

Every expert implementation takes the gated activation as the keyword ``act`` (a static
:class:`~jaxhybrid.ops.activations.GatedActivation`; SiLU by default, SiTU for Kimi K3).

Packed experts: every implementation also takes an :class:`~jaxhybrid.ops.mxfp4.MXFP4` (uint8 codes and
E8M0 scales, ``.shape`` the logical [E, out, in]) for ``w1``/``w2``/``w3`` and dequantizes to the rows'
dtype only what it reads: the CPU loop one chosen expert per iteration, the grouped ``ragged_dot`` path the
up-to-``min(N * k, E)`` distinct experts of the step (:func:`grouped_matmul`; on a TPU inside a shard_map
the Pallas kernel reads them packed, :func:`grouped_matmul_for`), the block-sparse form one expert per
block; the dense reference dequantizes all. Packed weights are for inference (no derivative).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxhybrid.ops import dense, int8, mxfp4, native, placement, precision, registry
from jaxhybrid.ops.activations import SILU, GatedActivation, gated_act
from jaxhybrid.ops.int8 import Int8
from jaxhybrid.ops.mxfp4 import ExpertWeight, as_dense, expert_slice, is_packed
from jaxhybrid.ops.pallas import moe as pallas_moe
from jaxhybrid.ops.stacks import flat_index

__all__ = [
    "route",
    "moe_experts_dropless",
    "moe_experts_ragged",
    "moe_experts_blocked",
    "moe_experts_skipping",
    "moe_experts_skipping_stacked",
    "moe_experts_dropless_stacked",
    "moe_experts_dense",
    "moe_experts_dense_stacked",
    "moe_experts_grouped",
    "moe_experts_grouped_stacked",
    "grouped_matmul",
    "grouped_matmul_for",
]

# Checkpoint-layout expert weights are [E, out, in]; tokens are [M, in]. Contract lhs dim 1 with rhs
# dim 2, the ragged lhs dim 0 selects the rhs group dim 0 -> [M, out].
_RAGGED_DN = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [2]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0],
)


def route(
    x: jax.Array,
    gate_weight: jax.Array,
    bias: jax.Array | None,
    *,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    renormalize: bool = True,
    scaling: float = 1.0,
) -> tuple[jax.Array, jax.Array]:
    """Pick ``top_k`` experts per token with a sigmoid router (DeepSeek-V3 / Kimi style).

    The router runs in float32 because near-tied scores decide discrete choices. The correction
    ``bias`` only steers *which* experts are chosen (load balancing); the returned weights are the
    un-biased sigmoid scores of the chosen experts, optionally renormalised to sum to one, then
    multiplied by ``scaling``. With ``n_group > 1`` the experts are split into ``n_group`` contiguous
    groups, each group is scored by the sum of its two best biased scores, and only the
    ``topk_group`` best groups may contribute experts.

    Args:
      x: ``[N, D]`` token activations.
      gate_weight: ``[E, D]`` router weight (checkpoint layout ``[out, in]``).
      bias: ``[E]`` ``e_score_correction_bias``, or ``None`` for zeros.

    Returns:
      ``(weights [N, top_k] float32, expert_ids [N, top_k] int32)``, experts in descending order of
      biased score.
    """
    num_experts = gate_weight.shape[0]
    if num_experts % n_group:
        raise ValueError(f"num_experts={num_experts} is not divisible by n_group={n_group}")
    group_size = num_experts // n_group
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
    if not 1 <= top_k <= topk_group * group_size:
        raise ValueError(f"top_k={top_k} exceeds the {topk_group * group_size} experts in kept groups")

    logits = jnp.dot(
        x.astype(jnp.float32),
        gate_weight.astype(jnp.float32).T,
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    scores = jax.nn.sigmoid(logits)  # [N, E]
    biased = scores if bias is None else scores + bias.astype(jnp.float32)

    if n_group > 1:
        grouped = biased.reshape(biased.shape[0], n_group, group_size)
        group_scores = jax.lax.top_k(grouped, min(2, group_size))[0].sum(axis=-1)  # [N, G]
        _, kept = jax.lax.top_k(group_scores, topk_group)  # [N, topk_group]
        keep = (
            jnp.zeros(group_scores.shape, dtype=bool).at[jnp.arange(kept.shape[0])[:, None], kept].set(True)
        )
        biased = jnp.where(keep[:, :, None], grouped, -jnp.inf).reshape(biased.shape)

    _, expert_ids = jax.lax.top_k(biased, top_k)
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if renormalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    weights = weights * jnp.float32(scaling)
    return weights, expert_ids.astype(jnp.int32)


def check_expert_shapes(x: jax.Array, w1: ExpertWeight, w2: ExpertWeight, w3: ExpertWeight) -> None:
    """Fail early with a readable message instead of an opaque dot-general shape error."""
    num_experts, ffn, dim = w1.shape
    if x.shape[-1] != dim or w3.shape != w1.shape or w2.shape != (num_experts, dim, ffn):
        raise ValueError(
            f"expected x [N, D], w1/w3 [E, F, D], w2 [E, D, F]; got x {x.shape}, w1 {w1.shape}, "
            f"w3 {w3.shape}, w2 {w2.shape}"
        )
    if len({type(w) for w in (w1, w2, w3)}) > 1:
        raise ValueError("w1, w2 and w3 must be all MXFP4, all int8 or all dense")


def grouped_matmul(lhs: jax.Array, w: ExpertWeight, group_sizes: jax.Array) -> jax.Array:
    """Rows `lhs` [M, K] sorted by group, `group_sizes` [G] rows of each (summing to at most M), times each
    group's weight `w` [G, N, K] transposed: [M, N] float32, rows past the groups zero. XLA's ``ragged_dot``
    (the reference and XLA form of `jaxhybrid.ops.pallas.moe.grouped_matmul`). A packed or int8 weight is
    dequantized to the rows' dtype only for the up-to-``min(M, G)`` groups with rows: those groups' weights
    are taken (in group order, so the rows stay sorted) and the sizes compacted to them."""
    if not isinstance(w, jax.Array):
        most = min(w.shape[0], lhs.shape[0])
        used = jnp.flatnonzero(group_sizes > 0, size=most, fill_value=0)
        real = jnp.arange(most) < jnp.sum(group_sizes > 0)
        group_sizes = jnp.where(real, group_sizes[used], 0)
        w = expert_slice(w, jnp.where(real, used, used[0]))  # the fill, no rows: a used expert again
    dense = as_dense(w, lhs.dtype)
    return jax.lax.ragged_dot_general(
        lhs,
        dense,
        group_sizes.astype(jnp.int32),
        _RAGGED_DN,
        precision=precision.of(lhs, dense),
        preferred_element_type=jnp.float32,
    )


def grouped_matmul_for(
    w: ExpertWeight, platform: str | None
) -> Callable[[jax.Array, ExpertWeight, jax.Array], jax.Array]:
    """The grouped matmul (:func:`grouped_matmul`'s signature) for experts `w` in a program on `platform`
    whose arrays are each device's own (None where that is not so or not known): on a TPU, packed experts
    through the Pallas kernel of `jaxhybrid.ops.pallas.moe`, which reads the codes of only the experts with
    rows and dequantizes them in VMEM (XLA's form writes each used expert dequantized to HBM, then reads it);
    otherwise :func:`grouped_matmul`. The one place an op registry takes this choice over."""
    if platform == "tpu" and is_packed(w):
        return pallas_moe.grouped_matmul
    return grouped_matmul


def _local_platform(x: jax.Array) -> str | None:
    """The platform of `x`'s devices where the program's arrays are each device's own, as a Mosaic kernel
    needs (traced inside a ``shard_map`` over every axis of the mesh); None elsewhere (XLA partitions the
    program, and cannot partition a Mosaic kernel)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or not mesh.are_all_axes_manual:
        return None
    return placement.platform_of(x)


def _pair_keys(expert_ids: jax.Array, valid: jax.Array | None, num_experts: int) -> jax.Array:
    """[N * k] sort key of each (token, expert) pair: its expert, or `num_experts` for a row not valid."""
    flat = expert_ids.reshape(-1)
    if valid is None:
        return flat
    return jnp.where(jnp.repeat(valid.reshape(-1), expert_ids.shape[1]), flat, num_experts)


def _valid_weights(weights: jax.Array, valid: jax.Array | None) -> jax.Array:
    """Routing weights with the rows that are not valid zeroed (they then add nothing)."""
    return weights if valid is None else jnp.where(valid.reshape(-1, 1), weights, 0)


def moe_experts_ragged(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Weighted sum of the chosen gated-MLP experts, computed only for routed (token, expert) pairs.

    The ``N * k`` pairs are stably sorted by expert id so each expert's rows are contiguous; the
    per-expert row counts (a length-``E`` bincount) drive three grouped matmuls. Results are scaled
    by the routing weights and scatter-added back to their tokens. Shapes are static (always
    ``N * k`` rows), so the function jits once per ``(N, k)``.

    Args:
      x: ``[N, D]`` tokens.
      w1, w3: ``[E, F, D]`` gate and up projections; w2: ``[E, D, F]`` down projection.
      weights: ``[N, k]`` routing weights; expert_ids: ``[N, k]`` ids, each in ``[0, E)``.
      act: the gated activation (static).

    Returns:
      ``[N, D]`` in ``x.dtype``; matmuls accumulate in float32.
    """
    check_expert_shapes(x, w1, w2, w3)
    num_tokens, k = expert_ids.shape
    num_experts = w1.shape[0]

    # Pairs of rows that are not valid sort after every group, where the grouped matmuls skip them.
    key = _pair_keys(expert_ids, valid, num_experts)
    order = jnp.argsort(key, stable=True)  # pair index, grouped by expert
    token_of_row = order // k
    rows = jnp.take(x, token_of_row, axis=0)  # [N*k, D]
    group_sizes = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    matmul = grouped_matmul_for(w1, _local_platform(x))

    gate = matmul(rows, w1, group_sizes)
    up = matmul(rows, w3, group_sizes)
    hidden = gated_act(gate, up, act).astype(x.dtype)
    out_rows = matmul(hidden, w2, group_sizes)  # [N*k, D] float32
    w = weights.reshape(-1)[order].astype(jnp.float32)[:, None]
    out_rows = jnp.where((key[order] < num_experts)[:, None], out_rows * w, 0.0)
    out = jnp.zeros((num_tokens, x.shape[-1]), jnp.float32).at[token_of_row].add(out_rows)
    return out.astype(x.dtype)


def moe_experts_dense(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Reference for :func:`moe_experts_dropless`: run every expert on every token, then combine.

    Builds a ``[N, E]`` combine matrix holding each token's routing weight for each expert (zero if
    not chosen; repeated ids add up, as in the dropless path) and contracts it with all expert
    outputs. Costs ``E / k`` times the useful FLOPs and ``N * E * F`` memory; for tests.
    """
    check_expert_shapes(x, w1, w2, w3)
    num_tokens = x.shape[0]
    num_experts = w1.shape[0]
    weights = _valid_weights(weights, valid)
    combine = (
        jnp.zeros((num_tokens, num_experts), jnp.float32)
        .at[jnp.arange(num_tokens)[:, None], expert_ids]
        .add(weights.astype(jnp.float32))
    )
    w1, w2, w3 = (as_dense(w, x.dtype) for w in (w1, w2, w3))
    gate = precision.einsum_f32("nd,efd->nef", x, w1)
    up = precision.einsum_f32("nd,efd->nef", x, w3)
    out_all = precision.einsum_f32("nef,edf->ned", gated_act(gate, up, act).astype(x.dtype), w2)
    out = jnp.einsum("ne,ned->nd", combine, out_all, precision=precision.of(combine, out_all))
    return out.astype(x.dtype)


def _block_rows(pairs: int, num_experts: int) -> int:
    """Rows per block: 1 while pairs are few (gather exactly the experts used), else about pairs / experts."""
    if pairs <= num_experts:
        return 1
    return 1 << max(0, (pairs // num_experts).bit_length() - 1)


class _Blocks(NamedTuple):
    """The (token, expert) pairs sorted by expert into blocks of ``m`` rows that each belong to one expert."""

    order: jax.Array  # [P] pair index of each sorted position
    dest: jax.Array  # [P] row of each sorted pair; `num_rows` (out of range) for a pair in no block
    in_block: jax.Array  # [P] bool: the sorted pair has a block (its row was valid)
    block_expert: jax.Array  # [num_rows // m] expert of each block
    used_blocks: jax.Array  # scalar: blocks holding at least one pair (they come first)
    num_rows: int  # static: rows of the largest layout, a multiple of m
    expert_blocks: jax.Array  # [E] blocks of each expert (its blocks are consecutive, in expert order)


def _sorted_blocks(key: jax.Array, num_experts: int, m: int) -> _Blocks:
    """Sort pairs by `key` (an expert id, or `num_experts` for a pair in no block) and pad each expert's run
    of pairs to a multiple of `m` rows."""
    pairs = key.shape[0]
    num_rows = -(-(pairs + num_experts * (m - 1)) // m) * m
    order = jnp.argsort(key, stable=True)
    sorted_key = key[order]
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts]
    padded = -(-counts // m) * m
    padded_end = jnp.cumsum(padded)
    start, padded_start = jnp.cumsum(counts) - counts, padded_end - padded
    in_block = sorted_key < num_experts
    safe = jnp.minimum(sorted_key, num_experts - 1)
    dest = jnp.where(in_block, padded_start[safe] + jnp.arange(pairs) - start[safe], num_rows)
    block_expert = jnp.minimum(
        jnp.searchsorted(padded_end, jnp.arange(num_rows // m) * m, side="right"), num_experts - 1
    )
    return _Blocks(order, dest, in_block, block_expert, padded_end[-1] // m, num_rows, padded // m)


def _block_rows_of(x: jax.Array, blocks: _Blocks, k: int) -> jax.Array:
    """[num_rows, D]: each sorted pair's token at its row; padding rows (and pairs in no block) are zero."""
    rows = jnp.zeros((blocks.num_rows, x.shape[-1]), x.dtype)
    return rows.at[blocks.dest].set(jnp.take(x, blocks.order // k, axis=0), mode="drop")


def _sorted_weights(blocks: _Blocks, weights: jax.Array) -> jax.Array:
    """[P] float32 routing weight of each sorted pair; 0 for a pair in no block."""
    return jnp.where(blocks.in_block, weights.reshape(-1)[blocks.order].astype(jnp.float32), 0.0)


def _combine(out: jax.Array, blocks: _Blocks, weights: jax.Array, k: int, num_tokens: int) -> jax.Array:
    """Each token's sum of its pairs' block outputs [num_rows, D] times their routing weights (float32)."""
    w = _sorted_weights(blocks, weights)
    out_rows = out.at[blocks.dest].get(mode="fill", fill_value=0.0) * w[:, None]
    return jnp.zeros((num_tokens, out.shape[-1]), jnp.float32).at[blocks.order // k].add(out_rows)


def moe_experts_blocked(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Dropless experts as a block-sparse batched matmul: the static CPU form (what training differentiates).

    XLA:CPU lowers ``ragged_dot`` to a dense masked product (every expert on every row). Here the
    ``N * k`` pairs are sorted by expert and each expert's rows padded to a multiple of ``m``, so every
    block of ``m`` rows belongs to one expert; each block gathers its expert's weights and runs one small
    matmul. Work is ``blocks * m`` rows (at most ``N * k + E * (m - 1)``), nothing is dropped, and the
    number of blocks is static. Same contract as :func:`moe_experts_dropless`.
    """
    check_expert_shapes(x, w1, w2, w3)
    num_tokens, k = expert_ids.shape
    num_experts, _, dim = w1.shape
    weights = _valid_weights(weights, valid)  # static shapes: rows not valid are computed, then dropped
    m = _block_rows(num_tokens * k, num_experts)
    blocks = _sorted_blocks(expert_ids.reshape(-1), num_experts, m)
    num_blocks, block_expert = blocks.num_rows // m, blocks.block_expert
    rows = _block_rows_of(x, blocks, k)
    b1, b3, b2 = (as_dense(expert_slice(w, block_expert), x.dtype) for w in (w1, w3, w2))
    rows = rows.reshape(num_blocks, m, dim)
    gate = precision.einsum_f32("bmd,bfd->bmf", rows, b1)
    up = precision.einsum_f32("bmd,bfd->bmf", rows, b3)
    hidden = gated_act(gate, up, act).astype(x.dtype)  # rounded as every expert form rounds it
    out = precision.einsum_f32("bmf,bdf->bmd", hidden, b2).reshape(-1, dim)
    return _combine(out, blocks, weights, k, num_tokens).astype(x.dtype)


def _rows_per_block(num_tokens: int, pairs: int, num_experts: int) -> int:
    """Up to 8 pairs per expert on average (decode-sized batches): one pair per block. A one-row block's
    matmuls are matrix-vector products that XLA:CPU runs on the expert's weights in place, and an expert's
    next pair re-reads them from the cache; a block of 2 or more rows copies its expert's weights out of the
    stacked array first, which costs more than re-reading the weights once per pair. Larger batches: about
    pairs / experts rows per block."""
    return 1 if pairs <= 8 * num_experts else _block_rows(pairs, num_experts)


def moe_experts_skipping(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Dropless experts that touch only the experts in use: the CPU path.

    As in :func:`moe_experts_blocked`, the pairs are sorted by expert into blocks of ``m`` rows of one
    expert each, but the blocks run in a loop whose trip count is the number of blocks in use: an expert no
    valid row chose is never read, and rows with ``valid`` False (an engine's idle slots, a prompt's
    padding) are not routed at all. One-row blocks read their expert's weights in place; with larger blocks
    (a prompt) each expert in use is taken out of its stack once, for all of its blocks. The loop's trip
    count is data-dependent, so the derivative is that of :func:`moe_experts_blocked` (computed in the
    backward pass). Same contract as :func:`moe_experts_dropless`.
    """
    check_expert_shapes(x, w1, w2, w3)
    if valid is None:
        valid = jnp.ones(expert_ids.shape[:1], bool)
    if is_packed(w1) or isinstance(w1, Int8):  # inference only: no derivative through integer codes
        return _skipping_forward(x, w1, w2, w3, weights, expert_ids, valid.reshape(-1), act)
    return _skipping(x, w1, w2, w3, weights, expert_ids, valid.reshape(-1), act)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _skipping(x, w1, w2, w3, weights, expert_ids, valid, act):
    return _skipping_forward(x, w1, w2, w3, weights, expert_ids, valid, act)


def _skipping_fwd(x, w1, w2, w3, weights, expert_ids, valid, act):
    y = _skipping_forward(x, w1, w2, w3, weights, expert_ids, valid, act)
    return y, (x, w1, w2, w3, weights, expert_ids, valid)


def _skipping_bwd(act, res, g):
    x, w1, w2, w3, weights, expert_ids, valid = res

    def blocked(x, w1, w2, w3, weights):
        return moe_experts_blocked(x, w1, w2, w3, weights, expert_ids, act=act, valid=valid)

    _, vjp = jax.vjp(blocked, x, w1, w2, w3, weights)
    return (*vjp(g), None, None)


_skipping.defvjp(_skipping_fwd, _skipping_bwd)


def _skipping_forward(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    valid: jax.Array,
    act: GatedActivation,
    group: jax.Array | None = None,
) -> jax.Array:
    """The loop of :func:`moe_experts_skipping` (valid given); with `group`, the weights are stacked over
    groups ([G, E, ...]) and the loop reads expert (group, e) in place."""
    num_tokens, k = expert_ids.shape
    num_experts, _, dim = w1.shape[-3:]
    if _pairs_in_one_call(x, w1, num_tokens * k, num_experts):
        return _kernel_pairs(x, w1, w2, w3, weights, expert_ids, valid, act, group)

    def pick(w: ExpertWeight, e: jax.Array) -> jax.Array:
        """Expert e (of `group`) read in place; a packed one dequantized here, one expert at a time."""
        return as_dense(expert_slice(w, e if group is None else (group, e)), x.dtype)

    m = _rows_per_block(num_tokens, num_tokens * k, num_experts)
    # Pairs of rows not valid sort last, into no block; the loop runs the blocks in use only.
    blocks = _sorted_blocks(_pair_keys(expert_ids, valid, num_experts), num_experts, m)
    # Each row of the layout names its token (num_tokens: padding) and routing weight (0 for padding). A block
    # gathers its m tokens from x and adds its weighted outputs into the [N, D] sum in place, so no buffer of
    # the padded layout's size ([num_rows, D], up to twice the pairs) is written, read or combined.
    token = jnp.full((blocks.num_rows,), num_tokens, jnp.int32)
    token = token.at[blocks.dest].set(blocks.order // k, mode="drop")
    weight = jnp.zeros((blocks.num_rows,), jnp.float32)
    weight = weight.at[blocks.dest].set(_sorted_weights(blocks, weights), mode="drop")

    def one_row(e: jax.Array, r: jax.Array) -> jax.Array:
        """[1, D] -> [1, D] through packed expert e: each product decodes the codes as it sums them
        (`mxfp4.matvec`), so no dequantized expert is written (the decode-sized blocks)."""
        at = e if group is None else (group, e)
        v = r[0].astype(jnp.float32)
        gate, up = (mxfp4.matvec(expert_slice(w, at), v) for w in (w1, w3))
        hidden = gated_act(gate, up, act).astype(hidden_dtype).astype(jnp.float32)  # as `rows` rounds it
        return mxfp4.matvec(expert_slice(w2, at), hidden)[None]

    def rows(e: jax.Array, r: jax.Array) -> jax.Array:
        return dense_rows((pick(w1, e), pick(w3, e), pick(w2, e)), r)

    def dense_rows(ws: tuple[jax.Array, jax.Array, jax.Array], r: jax.Array) -> jax.Array:
        """[m, D] -> [m, D] through an expert's dense (gate, up, down) matrices."""
        a, c, b = ws
        gate = precision.einsum_f32("md,fd->mf", r, a)
        up = precision.einsum_f32("md,fd->mf", r, c)
        return precision.einsum_f32("mf,df->md", gated_act(gate, up, act).astype(r.dtype), b)

    def int8_rows(e: jax.Array, r: jax.Array) -> jax.Array:
        """[m, D] -> [m, D] through int8 expert e, read in place (`int8.matmul`: the CPU kernel)."""
        at = e if group is None else (group, e)
        r = r.astype(jnp.float32)
        gate, up = (int8.matmul(r, w, at) for w in (w1, w3))
        return int8.matmul(gated_act(gate, up, act), w2, at)

    hidden_dtype = x.dtype  # the dtype `rows` rounds its hidden activations to
    if isinstance(w1, Int8):
        expert_rows = int8_rows
    else:
        expert_rows = one_row if m == 1 and is_packed(w1) else rows

    def add_block(i: jax.Array, acc: jax.Array, y_of: Callable[[jax.Array], jax.Array]) -> jax.Array:
        """Block i's rows through `y_of` ([m, D] -> [m, D]), weighted, added into their tokens' sums."""
        t = jax.lax.dynamic_slice_in_dim(token, i * m, m)
        y = y_of(jnp.take(x, t, axis=0, mode="fill", fill_value=0))
        return acc.at[t].add(y * jax.lax.dynamic_slice_in_dim(weight, i * m, m)[:, None], mode="drop")

    zeros = jnp.zeros((num_tokens, dim), jnp.float32)
    if m == 1 or (isinstance(w1, Int8) and int8.kernel_takes(m)):  # products that read experts in place
        block = lambda i, acc: add_block(i, acc, functools.partial(expert_rows, blocks.block_expert[i]))  # noqa: E731
        return jax.lax.fori_loop(0, blocks.used_blocks, block, zeros).astype(x.dtype)

    # Blocks of many rows: XLA:CPU's product copies an expert out of its stack (an int8 or packed one is
    # dequantized) before it reads it, so each expert in use is taken out once, for all of its blocks.
    used = jnp.flatnonzero(blocks.expert_blocks > 0, size=num_experts, fill_value=0)
    first = jnp.cumsum(blocks.expert_blocks) - blocks.expert_blocks

    def expert(j: jax.Array, acc: jax.Array) -> jax.Array:
        e = used[j]
        ws = (pick(w1, e), pick(w3, e), pick(w2, e))
        y_of = functools.partial(dense_rows, ws)
        end = first[e] + blocks.expert_blocks[e]
        return jax.lax.fori_loop(first[e], end, lambda i, acc: add_block(i, acc, y_of), acc)

    out = jax.lax.fori_loop(0, jnp.sum(blocks.expert_blocks > 0), expert, zeros)
    return out.astype(x.dtype)


# Up to this many (token, expert) pairs, or this many per expert on average, int8 (and float32) experts run
# as one kernel product per projection (each expert in use read once, no loop); past that the kernel's
# matrix-vector body on many rows costs more than the expert loop's dequantized products (on `small`'s MoE
# layer the two cross between 64 and 128 tokens), unless the kernels have their blocked matrix product
# (AVX-512), which takes every pair of a prompt (`_pairs_in_one_call`).
INT8_PAIRS = 16
INT8_PAIRS_PER_EXPERT = 8


def _pairs_in_one_call(x: jax.Array, w1: ExpertWeight, pairs: int, num_experts: int) -> bool:
    """Whether `pairs` (token, expert) pairs run as one kernel product per projection: decode-sized ones,
    and a prompt's where the kernels have their blocked matrix product (AVX-512), which reads each expert
    in place for all its rows (int8 or float32 experts)."""
    if placement.platform_of(x) not in (placement.CPU, None):  # unknown: the kernels' ops choose again
        return False
    if not registry.allows(registry.Kind.NATIVE):
        return False
    small = pairs <= max(INT8_PAIRS, INT8_PAIRS_PER_EXPERT * num_experts)
    blocked = native.gemm_rows() > 0
    if isinstance(w1, Int8):
        return small or blocked
    return (small or blocked) and not is_packed(w1) and dense.kernel_applies(x, w1)


def _kernel_pairs(
    x: jax.Array,
    w1: Int8 | jax.Array,
    w2: Int8 | jax.Array,
    w3: Int8 | jax.Array,
    weights: jax.Array,
    expert_ids: jax.Array,
    valid: jax.Array,
    act: GatedActivation,
    group: jax.Array | None,
) -> jax.Array:
    """int8 or float32 experts through the CPU kernels (`_pairs_in_one_call` says when): no sort and no loop;
    gate and up are one kernel product, down another (`matmul_pairs_many` of `int8` or `dense`), over all
    (token, expert) pairs, every pair's expert read in place (pairs of rows not valid read nothing)."""
    num_tokens, k = expert_ids.shape
    ids = expert_ids.reshape(-1)
    ids = flat_index(w1.shape[:-2], ids if group is None else (group, ids))
    ids = jnp.where(jnp.repeat(valid, k), ids, -1)
    rows = jnp.repeat(x.astype(jnp.float32), k, axis=0)
    if isinstance(w1, Int8):
        w1, w2, w3 = (int8.flatten(w) for w in (w1, w2, w3))
        products = int8.matmul_pairs_many
    else:
        w1, w2, w3 = (dense.flatten(w) for w in (w1, w2, w3))
        products = dense.matmul_pairs_many
    gate, up = products(rows, [w1, w3], ids)
    (y,) = products(gated_act(gate, up, act), [w2], ids)
    out = jnp.sum(y.reshape(num_tokens, k, -1) * _valid_weights(weights, valid)[..., None], axis=1)
    return out.astype(x.dtype)


def moe_experts_skipping_stacked(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    group: jax.Array,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """:func:`moe_experts_skipping` of group `group` of experts stacked over layer groups (w1/w3
    [G, E, F, D], w2 [G, E, D, F]; the scanned layers of `jaxhybrid.scan`): each chosen expert is read in
    place from the stacked arrays, where taking ``w1[group]`` first would copy all E experts of the layer on
    every step. Equals ``moe_experts_skipping(x, w1[group], w2[group], w3[group], ...)``; forward only."""
    check_expert_shapes(x, *(expert_slice(w, 0) for w in (w1, w2, w3)))
    if valid is None:
        valid = jnp.ones(expert_ids.shape[:1], bool)
    return _skipping_forward(x, w1, w2, w3, weights, expert_ids, valid.reshape(-1), act, group)


def moe_experts_grouped(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """:func:`moe_experts_ragged` as accelerators run it: int8 experts dequantized first (the int8 kernel is
    the CPU's)."""
    ws = (w1, w2, w3)
    if isinstance(w1, Int8):
        ws = tuple(as_dense(w, x.dtype) for w in ws)
    return moe_experts_ragged(x, *ws, weights, expert_ids, act=act, valid=valid)


MOE_EXPERTS_DROPLESS = registry.Op(
    "moe_experts_dropless",
    moe_experts_dense,
    registry.Implementation(registry.Kind.XLA, moe_experts_skipping, registry.CPU),
    registry.Implementation(registry.Kind.XLA, moe_experts_grouped, registry.ACCELERATORS),
)


def moe_experts_dropless(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Dropless routed experts as `jaxhybrid.ops.registry` chooses: grouped matmuls on accelerators
    (:func:`moe_experts_grouped`: XLA's ``ragged_dot``, or the Pallas kernel for packed experts on a TPU
    inside a shard_map); on the CPU (where ragged_dot computes every expert) the loop over the experts in use
    (:func:`moe_experts_skipping`, differentiated as the block-sparse form); the reference
    :func:`moe_experts_dense`. All equal.

    ``valid`` ``[N]`` bool (optional): rows that are not valid (idle slots, padding) are not routed and
    come back as zeros. Every expert implementation takes it, so it is part of the shared signature."""
    return MOE_EXPERTS_DROPLESS(x, w1, w2, w3, weights, expert_ids, act=act, valid=valid)


def _group_of(group: jax.Array, *ws: ExpertWeight) -> tuple[ExpertWeight, ...]:
    return tuple(expert_slice(w, group) for w in ws)


def moe_experts_dense_stacked(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    group: jax.Array,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """:func:`moe_experts_dense` of group `group`'s experts (the reference of the stacked form)."""
    return moe_experts_dense(x, *_group_of(group, w1, w2, w3), weights, expert_ids, act=act, valid=valid)


def moe_experts_grouped_stacked(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    group: jax.Array,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """:func:`moe_experts_ragged` on group `group`'s slice, unpacked experts cast to the rows' dtype."""
    ws = _group_of(group, w1, w2, w3)
    if not is_packed(ws[0]):
        ws = tuple(as_dense(w, x.dtype).astype(x.dtype) for w in ws)
    return moe_experts_ragged(x, *ws, weights, expert_ids, act=act, valid=valid)


MOE_EXPERTS_DROPLESS_STACKED = registry.Op(
    "moe_experts_dropless_stacked",
    moe_experts_dense_stacked,
    registry.Implementation(registry.Kind.XLA, moe_experts_skipping_stacked, registry.CPU),
    registry.Implementation(registry.Kind.XLA, moe_experts_grouped_stacked, registry.ACCELERATORS),
)


def moe_experts_dropless_stacked(
    x: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    weights: jax.Array,
    expert_ids: jax.Array,
    *,
    group: jax.Array,
    act: GatedActivation = SILU,
    valid: jax.Array | None = None,
) -> jax.Array:
    """:func:`moe_experts_dropless` of group `group` of experts stacked over layer groups (w1/w3 [G, E, F, D],
    w2 [G, E, D, F]), as `jaxhybrid.ops.registry` chooses: on the CPU :func:`moe_experts_skipping_stacked`
    (the chosen experts read in place), on accelerators :func:`moe_experts_grouped_stacked`; the reference
    :func:`moe_experts_dense_stacked`. Forward only."""
    return MOE_EXPERTS_DROPLESS_STACKED(x, w1, w2, w3, weights, expert_ids, group=group, act=act, valid=valid)
