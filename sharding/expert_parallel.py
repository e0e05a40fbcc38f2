"""Expert parallelism: route tokens to the devices that hold their experts and back, dropless.

`make_expert_parallel_fn(mesh)` returns a callable with the signature of
`jaxhybrid.ops.moe.moe_experts_dropless` ``(x [N, D], w1 [E, F, D], w2 [E, D, F], w3 [E, F, D],
weights [N, k], expert_ids [N, k], *, act) -> [N, D]`` (the weights dense or packed `MXFP4`, which stay
packed across the shard_map and are dequantized per device for the experts its rows use) that the model's
MoE layers call instead of their local implementation (`MoE.experts_fn`, installed with
`jaxhybrid.model.set_experts_fn`).

Layout inside ``shard_map`` (mesh axes data, expert, tensor):

* tokens ``x``/``weights``/``ids`` are split over ``(data, expert)`` (the rules' ``batch`` axes; N is
  zero-padded to a multiple outside the shard_map, padded rows carry weight 0);
* the expert stacks are split over ``expert`` (E/ep experts per device) and their intermediate size F
  over ``tensor`` when it divides (each tensor rank computes a partial output; one psum over ``tensor``
  at the end). Both follow `sharding.rules.RULES`, so no weight moves at call time.

Per device, with n local tokens and P = n*k (token, expert) pairs:

1. sort the pairs by expert id (stable); since experts are laid out contiguously per device, the sorted
   pairs are also grouped by destination device; ``send_sizes[d]`` pairs go to device d;
2. exchange the token rows (and each row's local expert id) over ``expert``;
3. on the receiver, sort the received rows by local expert and run the gated-MLP experts (activation
   ``act``, SiLU or SiTU) as three grouped matmuls (`jax.lax.ragged_dot_general`; rows of padding form
   no group);
4. send the output rows back the same way, multiply by the routing weights, scatter-add per token (fp32).

Nothing is dropped: buffers are sized for the worst case (all P pairs of every source to one device).
Two exchanges implement step 2 and 4:

* ``"padded"`` (runs everywhere, XLA:CPU included): a fixed-size `jax.lax.all_to_all` of a
  ``[ep, P, D]`` buffer, slot d holding the rows for device d, zero-padded. Moves ep*P rows per device
  each way (ep times the real traffic) -- what a dropless static-shape all_to_all costs.
* ``"ragged"`` (GPU/TPU): `jax.lax.ragged_all_to_all` moves only the real rows; offsets come from one
  all_gather of the [ep] send sizes. The receive buffer is still sized ep*P rows (the dropless worst
  case), but traffic is the real P rows. XLA:CPU does not implement it (UNIMPLEMENTED).
* ``"ragged_emulated"``: the ragged algorithm with `ragged_all_to_all_emulated` (all_gather / all_to_all
  based, the semantics of `jax.lax.ragged_all_to_all`'s docstring, its size precondition checked), so the
  ragged path's bookkeeping (offsets, send and receive sizes, placement) is tested on CPU and only the
  collective itself is not. Not meant for production.

``exchange="auto"`` picks ``"padded"`` on CPU meshes and ``"ragged"`` elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from jaxhybrid.ops.activations import SILU, GatedActivation, gated_act
from jaxhybrid.ops.moe import check_expert_shapes, grouped_matmul_for
from jaxhybrid.ops.mxfp4 import GROUP, MXFP4, ExpertWeight, is_packed

EXCHANGES = ("auto", "padded", "ragged", "ragged_emulated")


def default_exchange(mesh: Mesh) -> str:
    """ "padded" on CPU (no ragged_all_to_all in XLA:CPU), "ragged" on accelerators."""
    platform = mesh.devices.reshape(-1)[0].platform
    return "padded" if platform == "cpu" else "ragged"


def ragged_all_to_all_emulated(
    operand: jax.Array,
    output: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    output_offsets: jax.Array,
    recv_sizes: jax.Array,
    *,
    axis_name: str,
) -> jax.Array:
    """`jax.lax.ragged_all_to_all` (one slice per peer) from dense collectives, as its docstring defines it.

    Each operand travels whole (all_gather); each sender's offsets for this receiver arrive by all_to_all.
    Receiver r writes, for every source s, `recv_sizes[s]` rows of ``operand_s`` from ``input_offsets_s[r]``
    at ``output[output_offsets_s[r]:]``. Where the op's precondition ``send_sizes == all_to_all(recv_sizes)``
    fails on this receiver (the real op is undefined there), the whole result is poisoned (NaN, or the
    integer minimum), so a caller whose sizes disagree cannot pass a test. For tests on XLA:CPU."""
    ep = jax.lax.axis_size(axis_name)

    def from_each_source(per_peer: jax.Array) -> jax.Array:  # [ep]: source s's entry for this device
        return jax.lax.all_to_all(per_peer, axis_name, 0, 0, tiled=True)

    operands = jax.lax.all_gather(operand, axis_name)  # [ep, M, ...]
    in_off, out_off = from_each_source(input_offsets), from_each_source(output_offsets)
    sent = from_each_source(send_sizes)
    m = operand.shape[0]
    j = jnp.arange(m)
    for s in range(ep):
        rows = jnp.take(operands[s], jnp.clip(in_off[s] + j, 0, m - 1), axis=0)
        dst = jnp.where(j < recv_sizes[s], out_off[s] + j, output.shape[0])  # out of range: dropped
        output = output.at[dst].set(rows.astype(output.dtype), mode="drop")
    dtype = output.dtype
    poison = jnp.nan if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
    return jnp.where(jnp.all(sent == recv_sizes), output, jnp.asarray(poison, dtype))


def _grouped_experts(
    rows: jax.Array,
    keys: jax.Array,
    w1: ExpertWeight,
    w2: ExpertWeight,
    w3: ExpertWeight,
    dtype: Any,
    act: GatedActivation = SILU,
    platform: str | None = None,
) -> jax.Array:
    """rows [M, D] with local expert ids `keys` [M] (E_loc = padding) -> expert outputs [M, D] fp32, in
    the order of `rows` (padding rows give zeros that nobody reads). Three grouped matmuls
    (`grouped_matmul_for` the mesh's `platform`: the arrays here are each device's own): packed (MXFP4) local
    experts are read only where the received rows use them, through the Pallas kernel on a TPU (no
    dequantized copy), elsewhere dequantized for those experts only."""
    num_local = w1.shape[0]
    order = jnp.argsort(keys, stable=True)
    sorted_rows = jnp.take(rows, order, axis=0)
    sizes = jnp.bincount(keys, length=num_local + 1)[:num_local].astype(jnp.int32)
    matmul = grouped_matmul_for(w1, platform)
    hidden = gated_act(matmul(sorted_rows, w1, sizes), matmul(sorted_rows, w3, sizes), act).astype(dtype)
    out = matmul(hidden, w2, sizes)
    return jnp.zeros_like(out).at[order].set(out)


def _exchange_padded(
    rows: jax.Array,
    local_key: jax.Array,
    dest: jax.Array,
    send_sizes: jax.Array,
    experts: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    ep: int,
    axis: str,
    num_local: int,
    combine_dtype: Any,
) -> jax.Array:
    p, d = rows.shape
    send_offsets = jnp.cumsum(send_sizes) - send_sizes
    slot = jnp.arange(p) - send_offsets[dest]  # position inside destination's slot (sorted -> contiguous)
    send = jnp.zeros((ep, p, d), rows.dtype).at[dest, slot].set(rows)
    send_keys = jnp.full((ep, p), num_local, jnp.int32).at[dest, slot].set(local_key)
    recv = jax.lax.all_to_all(send, axis, 0, 0)  # recv[s] = what source s sent here
    recv_keys = jax.lax.all_to_all(send_keys, axis, 0, 0)
    out = experts(recv.reshape(ep * p, d), recv_keys.reshape(ep * p))
    back = jax.lax.all_to_all(out.astype(combine_dtype).reshape(ep, p, d), axis, 0, 0)
    return back[dest, slot]  # [P, D]: the result of each sorted pair


def _exchange_ragged(
    rows: jax.Array,
    local_key: jax.Array,
    dest: jax.Array,
    send_sizes: jax.Array,
    experts: Callable[[jax.Array, jax.Array], jax.Array],
    *,
    ep: int,
    axis: str,
    num_local: int,
    combine_dtype: Any,
    ragged_a2a: Callable[..., jax.Array],
) -> jax.Array:
    del dest
    p, d = rows.shape
    me = jax.lax.axis_index(axis)
    sizes = jax.lax.all_gather(send_sizes, axis)  # [src, dst] pairs sent from src to dst
    before_src = jnp.cumsum(sizes, axis=0) - sizes  # rows from earlier sources, per receiver
    before_dst = jnp.cumsum(sizes, axis=1) - sizes  # each sender's offset of its chunk for dst
    send_offsets = before_dst[me]
    output_offsets = before_src[me]  # where my chunk lands in each receiver's buffer
    recv_sizes = sizes[:, me]
    recv_offsets = before_src[:, me]  # where each source's chunk sits in my buffer
    recv = ragged_a2a(
        rows,
        jnp.zeros((ep * p, d), rows.dtype),
        send_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis,
    )
    keys = ragged_a2a(
        local_key[:, None],
        jnp.full((ep * p, 1), num_local, jnp.int32),
        send_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis,
    )[:, 0]
    out = experts(recv, keys).astype(combine_dtype)
    # Back: my rows from source s go to s, at the offset where s kept its chunk for me.
    return ragged_a2a(
        out,
        jnp.zeros((p, d), combine_dtype),
        recv_offsets,
        recv_sizes,
        before_dst[:, me],
        send_sizes,
        axis_name=axis,
    )


def make_expert_parallel_fn(
    mesh: Mesh,
    *,
    exchange: str = "auto",
    expert_axis: str = "expert",
    token_axes: Sequence[str] = ("data", "expert"),
    tensor_axis: str | None = "tensor",
    combine_dtype: Any = jnp.float32,
) -> Callable[..., jax.Array]:
    """A dropless expert-parallel replacement for `moe_experts_dropless` on `mesh` (see module docstring).

    Args:
      exchange: "auto", "padded", "ragged" or "ragged_emulated".
      token_axes: mesh axes the tokens are split over inside the shard_map (must include `expert_axis`
        for the exchange to spread work; axes missing from the mesh are ignored).
      tensor_axis: mesh axis over which the experts' intermediate size F is split (when it divides F).
      combine_dtype: dtype of the expert outputs sent back (fp32 matches the local implementation; bf16
        halves the return traffic).
    """
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")
    if expert_axis not in mesh.shape:
        raise ValueError(f"mesh has no '{expert_axis}' axis (axes: {tuple(mesh.axis_names)})")
    kind = default_exchange(mesh) if exchange == "auto" else exchange
    platform = mesh.devices.reshape(-1)[0].platform
    ragged_a2a = jax.lax.ragged_all_to_all if kind == "ragged" else ragged_all_to_all_emulated
    ep = mesh.shape[expert_axis]
    tok_axes = tuple(a for a in token_axes if a in mesh.shape)
    tok_shards = int(np.prod([mesh.shape[a] for a in tok_axes]))
    tok_spec = PartitionSpec(tok_axes if tok_axes else None, None)
    tp = mesh.shape[tensor_axis] if tensor_axis is not None and tensor_axis in mesh.shape else 1

    def experts_fn(
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
        check_expert_shapes(x, w1, w2, w3)
        if valid is not None:  # rows not valid add nothing (they are still exchanged: static shapes)
            weights = jnp.where(valid.reshape(-1, 1), weights, 0)
        num_experts, ffn, _ = w1.shape
        if num_experts % ep:
            raise ValueError(
                f"expert parallelism over {ep} devices needs num_experts divisible by {ep}, got {num_experts}"
            )
        num_local = num_experts // ep
        packed = is_packed(w1)
        # As `sharding.rules` splits F: packed experts only on whole scale groups (F/32 units).
        split_f = tp > 1 and (ffn // GROUP if packed else ffn) % tp == 0
        t = tensor_axis if split_f else None
        up_spec, down_spec = PartitionSpec(expert_axis, t, None), PartitionSpec(expert_axis, None, t)
        if packed:  # codes and scales of a packed weight shard alike
            up_spec, down_spec = MXFP4(up_spec, up_spec), MXFP4(down_spec, down_spec)
        n = x.shape[0]
        pad = (-n) % tok_shards
        if pad:
            x = jnp.pad(x, ((0, pad), (0, 0)))
            weights = jnp.pad(weights, ((0, pad), (0, 0)))
            expert_ids = jnp.pad(expert_ids, ((0, pad), (0, 0)))

        def body(x, w1, w2, w3, weights, ids):
            n_loc, k = ids.shape
            flat = ids.reshape(-1)
            order = jnp.argsort(flat, stable=True)
            sorted_ids = flat[order]
            token_of_row = order // k
            rows = jnp.take(x, token_of_row, axis=0)
            dest = sorted_ids // num_local
            local_key = (sorted_ids - dest * num_local).astype(jnp.int32)
            send_sizes = jnp.bincount(dest, length=ep).astype(jnp.int32)

            def experts(r: jax.Array, keys: jax.Array) -> jax.Array:
                return _grouped_experts(r, keys, w1, w2, w3, x.dtype, act, platform)

            common = dict(ep=ep, axis=expert_axis, num_local=num_local, combine_dtype=combine_dtype)
            if kind == "padded":
                back = _exchange_padded(rows, local_key, dest, send_sizes, experts, **common)
            else:
                back = _exchange_ragged(
                    rows, local_key, dest, send_sizes, experts, ragged_a2a=ragged_a2a, **common
                )
            out_rows = back.astype(jnp.float32) * weights.reshape(-1)[order].astype(jnp.float32)[:, None]
            out = jnp.zeros((n_loc, x.shape[-1]), jnp.float32).at[token_of_row].add(out_rows)
            if split_f:
                out = jax.lax.psum(out, tensor_axis)
            return out.astype(x.dtype)

        y = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(
                tok_spec,
                up_spec,
                down_spec,
                up_spec,
                tok_spec,
                tok_spec,
            ),
            out_specs=tok_spec,
        )(x, w1, w2, w3, weights, expert_ids)
        return y[:n] if pad else y

    experts_fn.exchange = kind  # type: ignore[attr-defined]
    return experts_fn
