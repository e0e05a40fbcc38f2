"""The analytic ledger of a chat: which state checkpoints the prefix store holds after a conversation, by
kind, and their bytes (what `jaxhybrid memory --turns` reports and a live engine's ledger reproduces).

It mirrors `PrefixStore.on_computed` / `on_finished` for one conversation served turn by turn with nothing
evicted: every position is computed once or more (each turn resumes at or before the previous turn's end),
and a checkpoint is keyed by its prefix, so one position holds one checkpoint whatever took it first:
- interval: every multiple of the interval up to the last computed position, N*T - 1 (the last reply
  token is sampled, never fed back); it wins where a prompt or a sequence also ends there;
- prompt_end: where each turn's prompt ends, i*T - R (R reply tokens per turn);
- sequence_end: the last computed position of each turn, i*T - 1. It is kept, not replaced, when the next
  turn's prompt extends it (it is that turn's hit); with R = 1 it is the prompt end.
A checkpoint that does not end on a block boundary also holds its partial last block's KV. The next-token
logits a prompt end keeps ([vocab] fp32) are not in the store's checkpoint bytes, so not here either.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxhybrid.cache import CheckpointBytes, memory_report
from jaxhybrid.config import ModelConfig
from serve.prefix.types import CheckpointKind


@dataclasses.dataclass(frozen=True)
class Chat:
    """`turns` turns of `turn_tokens` tokens each: a user message, then a reply of `reply_tokens`; turn
    i's prompt is the whole conversation before its reply."""

    turns: int
    turn_tokens: int
    reply_tokens: int

    def __post_init__(self) -> None:
        if self.turns < 1 or self.turn_tokens < 2:
            raise ValueError(
                f"a chat needs turns >= 1 and turn tokens >= 2, got {self.turns}, {self.turn_tokens}"
            )
        if not 1 <= self.reply_tokens < self.turn_tokens:
            raise ValueError(f"reply tokens must be in 1..{self.turn_tokens - 1}, got {self.reply_tokens}")

    @property
    def context(self) -> int:
        return self.turns * self.turn_tokens

    def prompt_end(self, turn: int) -> int:
        """Prompt length of turn `turn` (1-based)."""
        return turn * self.turn_tokens - self.reply_tokens

    def sequence_end(self, turn: int) -> int:
        """Positions computed when turn `turn` finishes."""
        return turn * self.turn_tokens - 1


@dataclasses.dataclass(frozen=True)
class CheckpointPolicy:
    """The store settings that decide what is kept (`PrefixStoreConfig` and the engine's block size);
    `interval` None: no interval checkpoints (an analytic what-if; the store always has an interval)."""

    interval: int | None
    block_size: int = 16
    prompt_end: bool = True
    sequence_end: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be positive, got {self.block_size}")
        if self.interval is not None and (self.interval < 1 or self.interval % self.block_size):
            raise ValueError(
                f"interval ({self.interval}) must be a positive multiple of the block size "
                f"({self.block_size})"
            )


def chat_checkpoints(chat: Chat, policy: CheckpointPolicy) -> dict[int, CheckpointKind]:
    """Position -> kind of every checkpoint the store holds after `chat`."""
    last = chat.sequence_end(chat.turns)
    held: dict[int, CheckpointKind] = {}
    if policy.interval:
        held = dict.fromkeys(range(policy.interval, last + 1, policy.interval), CheckpointKind.INTERVAL)
    for turn in range(1, chat.turns + 1):  # within a turn the prompt end comes first
        if policy.prompt_end:
            held.setdefault(chat.prompt_end(turn), CheckpointKind.PROMPT_END)
        if policy.sequence_end:
            held.setdefault(chat.sequence_end(turn), CheckpointKind.SEQUENCE_END)
    return held


def chat_ledger(
    cfg: ModelConfig,
    chat: Chat,
    policy: CheckpointPolicy,
    dtype: jnp.dtype = jnp.bfloat16,
    checkpoint_dtype: jnp.dtype | None = None,
) -> dict[CheckpointKind, CheckpointBytes]:
    """The checkpoints `chat` leaves in the store, by kind (every kind present, possibly empty)."""
    held = chat_checkpoints(chat, policy)
    return {
        kind: CheckpointBytes.at(
            cfg, [p for p, k in held.items() if k is kind], policy.block_size, dtype, checkpoint_dtype
        )
        for kind in CheckpointKind
    }


def chat_report(
    cfg: ModelConfig,
    chat: Chat,
    policy: CheckpointPolicy,
    dtype: jnp.dtype = jnp.bfloat16,
    hbm_bytes: int | None = None,
    checkpoint_dtype: jnp.dtype | None = None,
) -> dict[str, Any]:
    """`memory_report` at the end of `chat` (context N*T) with every checkpoint kind it leaves: the totals
    under the report's keys, the split under `checkpoints_by_kind` / `checkpoint_bytes_by_kind` /
    `checkpoint_tails_by_kind` (how many carry a partial KV block)."""
    by_kind = chat_ledger(cfg, chat, policy, dtype, checkpoint_dtype)
    parts = list(by_kind.values())
    total = CheckpointBytes(
        count=sum(c.count for c in parts),
        tails=sum(c.tails for c in parts),
        state_bytes=sum(c.state_bytes for c in parts),
        tail_kv_bytes=sum(c.tail_kv_bytes for c in parts),
    )
    rep: dict[str, Any] = memory_report(
        cfg, chat.context, policy.interval, dtype, hbm_bytes, total, checkpoint_dtype
    )
    rep.update(
        chat={
            **dataclasses.asdict(chat),
            "block_size": policy.block_size,
            "prompt_end_checkpoints": policy.prompt_end,
            "sequence_end_checkpoints": policy.sequence_end,
        },
        checkpoints_by_kind={k.value: c.count for k, c in by_kind.items()},
        checkpoint_bytes_by_kind={k.value: c.nbytes for k, c in by_kind.items()},
        checkpoint_tails_by_kind={k.value: c.tails for k, c in by_kind.items()},
    )
    return rep
