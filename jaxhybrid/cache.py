"""Per-layer cache pytrees and their byte counts.

A KDA layer keeps a fixed-size state (conv inputs + fp32 recurrent state); an MLA layer keeps the
compressed latent (`c` and the shared rope key) of every token. The model's cached forward takes
and returns a tuple with one entry per layer; nothing is stored inside the modules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxhybrid.config import ModelConfig


class KDACache(NamedTuple):
    """conv: [B, 3*H*d, K-1] last K-1 inputs of the q/k/v convs (oldest first); state: [B, H, d, d] fp32."""

    conv: jax.Array
    state: jax.Array


class KDAPoolRows(NamedTuple):
    """The rows of a program call in a pool of KDA caches (the serving engine's layout): `conv` their slots'
    conv windows [B, ...] (gathered: small), `state` the whole pool of states [S, H, d, d] and `rows` [B]
    int32 their slots. A one-token step reads each row's state where it lies (`kda_decode`'s `rows`: XLA
    would copy a slot out of the pool first); any other use takes `gathered()`."""

    conv: jax.Array
    state: jax.Array
    rows: jax.Array

    def gathered(self) -> KDACache:
        return KDACache(conv=self.conv, state=self.state[self.rows])


class KDAPoolInPlace(NamedTuple):
    """The pools of a one-token step that writes its rows' new caches into their slots in place (the CPU
    engine's decode program): `conv` [S, C, K-1] and `state` [S, H, d, d] whole, `rows` [B] int32 the rows'
    distinct slots. The layer returns a `KDACache` of the updated pools, not of the rows."""

    conv: jax.Array
    state: jax.Array
    rows: jax.Array


class MLACache(NamedTuple):
    """kv: [B, S, kv_lora_rank + rope] latent per position; length: [B] int32 tokens written so far."""

    kv: jax.Array
    length: jax.Array


class PagedMLACache(NamedTuple):
    """A paged latent pool shared by many sequences (the serving engine's layout).

    pool: [num_blocks, block_size, latent] for one MLA layer; block_table: [B, max_blocks] int32 block ids
    of each row's positions in order; length: [B] int32 tokens already written. Block 0 is the scratch
    block: padded tokens are written there, so it must never hold a sequence's data.
    """

    pool: jax.Array
    block_table: jax.Array
    length: jax.Array


class MLAView(NamedTuple):
    """One MLA layer's paged pool as its rows read it, for a program that writes the pool outside the layer
    (the scanned engine program, where the layers' pools are not scan inputs): view [B, S, L] (`read_paged`
    of the pool through the block tables), length [B] int32 tokens already written. The layer returns an
    `MLAWrite`."""

    view: jax.Array
    length: jax.Array


class MLAWrite(NamedTuple):
    """What an MLA layer run on an `MLAView` leaves to write: its new latents [B, T, L] as attention read
    them (`write_paged` puts them into the pool) and length [B] after them."""

    new: jax.Array
    length: jax.Array


SCRATCH_BLOCK = 0

LayerCache = KDACache | MLACache | PagedMLACache | MLAView | MLAWrite


def kda_zero_state(cfg: ModelConfig, batch: int, dtype: jnp.dtype = jnp.float32) -> KDACache:
    """One KDA layer's empty state for `batch` sequences (conv inputs in `dtype`, recurrent state fp32)."""
    return KDACache(
        conv=jnp.zeros((batch, 3 * cfg.kda_proj_dim, cfg.short_conv_kernel_size - 1), dtype),
        state=jnp.zeros((batch, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
    )


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype: jnp.dtype = jnp.float32
) -> tuple[LayerCache, ...]:
    """Zero caches for `batch` sequences of up to `max_len` tokens (MLA latent in `dtype`)."""
    out: list[LayerCache] = []
    for kind in cfg.layer_types:
        if kind == "kda":
            out.append(kda_zero_state(cfg, batch, dtype))
        else:
            out.append(
                MLACache(
                    kv=jnp.zeros((batch, max_len, cfg.latent_dim), dtype),
                    length=jnp.zeros((batch,), jnp.int32),
                )
            )
    return tuple(out)


def kda_state_bytes(
    cfg: ModelConfig, dtype: jnp.dtype = jnp.bfloat16, checkpoint_dtype: jnp.dtype | None = None
) -> dict[str, int]:
    """Bytes of one sequence's live KDA state over all KDA layers (recurrent fp32 + conv in `dtype`); with
    `checkpoint_dtype`, of a state checkpoint kept at that precision (`narrowed`)."""
    conv_dtype, state_dtype = np.dtype(dtype), np.dtype(np.float32)
    if checkpoint_dtype is not None:
        conv_dtype, state_dtype = (
            narrowed(conv_dtype, checkpoint_dtype),
            narrowed(state_dtype, checkpoint_dtype),
        )
    recurrent = cfg.num_kda_layers * cfg.kda_num_heads * cfg.kda_head_dim * cfg.kda_head_dim
    conv = cfg.num_kda_layers * 3 * cfg.kda_proj_dim * (cfg.short_conv_kernel_size - 1)
    recurrent, conv = recurrent * state_dtype.itemsize, conv * conv_dtype.itemsize
    return {"recurrent": recurrent, "conv": conv, "total": recurrent + conv}


# What a state checkpoint may be kept in (`--checkpoint-dtype`): float32 keeps it exact; bfloat16 halves the
# recurrent state's bytes (and an fp32 conv window's) at the cost of a rounding on resume.
CHECKPOINT_DTYPES = ("float32", "bfloat16")


def narrowed(dtype: jnp.dtype, checkpoint_dtype: jnp.dtype | str | None) -> np.dtype:
    """The dtype an array of `dtype` is kept in by a checkpoint of `checkpoint_dtype`: that one where it is
    narrower, else its own (a checkpoint never widens what it copies)."""
    dtype = np.dtype(dtype)
    if checkpoint_dtype is None:
        return dtype
    ck = np.dtype(checkpoint_dtype)
    return ck if ck.itemsize < dtype.itemsize else dtype


def mla_kv_bytes(cfg: ModelConfig, tokens: int, dtype: jnp.dtype = jnp.bfloat16) -> int:
    """Bytes of the latent KV of `tokens` positions over all MLA layers."""
    return cfg.num_mla_layers * tokens * cfg.latent_dim * np.dtype(dtype).itemsize


def cache_bytes_per_sequence(
    cfg: ModelConfig, context: int, dtype: jnp.dtype = jnp.bfloat16
) -> dict[str, int]:
    """The per-sequence cache of a model at `context` tokens: MLA KV + KDA state."""
    state = kda_state_bytes(cfg, dtype)
    kv = mla_kv_bytes(cfg, context, dtype)
    return {
        "context": context,
        "kv_bytes": kv,
        "state_bytes": state["total"],
        "recurrent_state_bytes": state["recurrent"],
        "conv_state_bytes": state["conv"],
        "total_bytes": kv + state["total"],
    }


@dataclasses.dataclass(frozen=True)
class CheckpointBytes:
    """State checkpoints: how many, and what they hold: the KDA states, plus a copy of the partial last
    block's latent KV in each of the `tails` off a block boundary (as the prefix store keeps them)."""

    count: int
    tails: int
    state_bytes: int
    tail_kv_bytes: int

    @property
    def nbytes(self) -> int:
        return self.state_bytes + self.tail_kv_bytes

    @classmethod
    def at(
        cls,
        cfg: ModelConfig,
        positions: Iterable[int],
        block_size: int,
        dtype: jnp.dtype = jnp.bfloat16,
        checkpoint_dtype: jnp.dtype | None = None,
    ) -> CheckpointBytes:
        """Checkpoints at `positions` with KV blocks of `block_size` tokens (states in `checkpoint_dtype`)."""
        positions = list(positions)
        tails = sum(1 for p in positions if p % block_size)
        return cls(
            count=len(positions),
            tails=tails,
            state_bytes=len(positions) * kda_state_bytes(cfg, dtype, checkpoint_dtype)["total"],
            tail_kv_bytes=tails * mla_kv_bytes(cfg, block_size, dtype),
        )


def memory_report(
    cfg: ModelConfig,
    context: int,
    interval: int | None,
    dtype: jnp.dtype = jnp.bfloat16,
    hbm_bytes: int | None = None,
    checkpoints: CheckpointBytes | None = None,
    checkpoint_dtype: jnp.dtype | None = None,
) -> dict[str, int | float | None]:
    """The analytic per-sequence ledger at `context` tokens: MLA KV, KDA live state, state checkpoints every
    `interval` tokens (floor(context / interval) of them, states only, kept in `checkpoint_dtype`), against
    an all-MLA model of the same depth. `checkpoints`: what is held instead (e.g. a chat's every kind,
    `serve.prefix.ledger`)."""
    if context < 1:
        raise ValueError(f"context must be positive, got {context}")
    if interval is not None and interval < 1:
        raise ValueError(f"interval must be positive, got {interval}")
    per = cache_bytes_per_sequence(cfg, context, dtype)
    ck_state = kda_state_bytes(cfg, dtype, checkpoint_dtype)
    if checkpoints is None:
        n = context // interval if interval else 0
        checkpoints = CheckpointBytes(n, 0, n * ck_state["total"], 0)
    num_checkpoints, checkpoint_bytes = checkpoints.count, checkpoints.nbytes
    all_mla = cfg.num_hidden_layers * context * cfg.latent_dim * np.dtype(dtype).itemsize
    total = per["kv_bytes"] + per["state_bytes"] + checkpoint_bytes
    out: dict[str, int | float | None] = {
        "config": cfg.name,
        "context": context,
        "interval": interval,
        "dtype": np.dtype(dtype).name,
        "kv_bytes": per["kv_bytes"],
        "state_bytes": per["state_bytes"],
        "recurrent_state_bytes": per["recurrent_state_bytes"],
        "conv_state_bytes": per["conv_state_bytes"],
        "num_checkpoints": num_checkpoints,
        "checkpoint_bytes": checkpoint_bytes,
        "checkpoint_dtype": narrowed(np.float32, checkpoint_dtype).name,
        "checkpoint_recurrent_bytes": num_checkpoints * ck_state["recurrent"],
        "checkpoint_tail_kv_bytes": checkpoints.tail_kv_bytes,
        "total_bytes": total,
        "all_mla_kv_bytes": all_mla,
        "saving_pct": 100.0 * (all_mla - total) / all_mla,
        "saving_pct_without_checkpoints": 100.0 * (all_mla - total + checkpoint_bytes) / all_mla,
    }
    if hbm_bytes is not None:
        out["hbm_bytes"] = hbm_bytes
        out["sequences_fit"] = hbm_bytes // total
        out["sequences_fit_without_checkpoints"] = hbm_bytes // (total - checkpoint_bytes)
        out["sequences_fit_all_mla"] = hbm_bytes // all_mla
    return out


# KDA:MLA layouts of `memory --ratios`: (name, KDA layers per MLA layer; None = no MLA layer, 0 = no KDA).
LAYOUTS: tuple[tuple[str, int | None], ...] = (
    ("all-MLA", 0),
    ("1:1", 1),
    ("3:1", 3),
    ("7:1", 7),
    ("all-KDA", None),
)


def with_layout(cfg: ModelConfig, kda_per_mla: int | None) -> ModelConfig:
    """`cfg` with its depth and widths but another mix: every (r + 1)-th layer MLA, the rest KDA (r =
    `kda_per_mla`; 0 = every layer MLA, None = every layer KDA)."""
    layers = range(1, cfg.num_hidden_layers + 1)
    if kda_per_mla is None:
        mla: tuple[int, ...] = ()
    else:
        mla = tuple(i for i in layers if i % (kda_per_mla + 1) == 0)
    return cfg.replace(kda_layers=tuple(i for i in layers if i not in mla), full_attn_layers=mla)


def layout_report(
    cfg: ModelConfig,
    contexts: list[int],
    interval: int | None,
    dtype: jnp.dtype = jnp.bfloat16,
    hbm_bytes: int | None = None,
    checkpoint_dtype: jnp.dtype | None = None,
) -> list[dict[str, int | float | str | None]]:
    """`memory_report` for the config's own layout and each of LAYOUTS at each context: the per-sequence
    bytes of the same depth and widths with every KDA:MLA mix, with and without state checkpoints every
    `interval` tokens."""
    rows = []
    variants = [(f"config ({cfg.num_kda_layers}:{cfg.num_mla_layers})", cfg)]
    variants += [(name, with_layout(cfg, ratio)) for name, ratio in LAYOUTS]
    for name, variant in variants:
        for context in contexts:
            rep = memory_report(
                variant, context, interval, dtype, hbm_bytes, checkpoint_dtype=checkpoint_dtype
            )
            rows.append(
                {
                    "layout": name,
                    "kda_layers": variant.num_kda_layers,
                    "mla_layers": variant.num_mla_layers,
                    **rep,
                    "bytes_without_checkpoints": rep["total_bytes"] - rep["checkpoint_bytes"],
                }
            )
    return rows
