"""Orbax checkpoints of model state that restore onto any mesh.

`save_state` writes every array shard from the process that holds it (Orbax/TensorStore; no gather to
one host). `restore_state` builds the target layout from the *target* mesh (`state_shardings` of an
abstract model) and hands Orbax `jax.ShapeDtypeStruct`s carrying those shardings, so each process reads
only the slices its devices own -- the mesh shape at save time does not matter.

The on-disk tree is the model state as a pure nested dict (`nnx.to_pure_dict`: module path -> array,
checkpoint names such as ``model/layers/0/self_attn/q_proj/weight``); layer indices become string keys.
"""

from __future__ import annotations

import os
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from sharding.rules import LogicalRules, state_shardings


def _stringify(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {str(k): _stringify(v) for k, v in tree.items()}
    return tree


def _restore_keys(tree: Any, like: Any) -> Any:
    """Map string keys back to the key types of `like` (nnx.List layers use int keys)."""
    if isinstance(like, dict):
        return {k: _restore_keys(tree[str(k)], v) for k, v in like.items()}
    return tree


def save_state(path: str | os.PathLike[str], state: nnx.State | nnx.Module, *, force: bool = False) -> None:
    """Save a (sharded) model or its `nnx.state` to directory `path` and wait until it is complete."""
    import orbax.checkpoint as ocp  # Orbax (and TensorStore) load when a checkpoint is read or written

    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    pure = _stringify(nnx.to_pure_dict(state))
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(os.path.abspath(path), pure, force=force)
        checkpointer.wait_until_finished()
    finally:
        checkpointer.close()


def restore_state(
    path: str | os.PathLike[str],
    abstract_model: nnx.Module,
    mesh: Mesh,
    rules: LogicalRules | None = None,
) -> nnx.State:
    """`nnx.state(abstract_model)` filled from the checkpoint at `path`, each array in its sharding on
    `mesh` (rules table as in `sharding.rules`). Shapes and dtypes must match the checkpoint."""
    import orbax.checkpoint as ocp  # Orbax (and TensorStore) load when a checkpoint is read or written

    abstract_state = nnx.state(abstract_model)
    shardings = state_shardings(abstract_model, mesh, rules)
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )
    pure_target = nnx.to_pure_dict(target)
    checkpointer = ocp.StandardCheckpointer()
    try:
        restored = checkpointer.restore(os.path.abspath(path), _stringify(pure_target))
    finally:
        checkpointer.close()
    nnx.replace_by_pure_dict(target, _restore_keys(restored, pure_target))
    return target
