"""The seeded multi-turn chat workload of `bench prefix`, and its replay through anything that serves it (the
engine, or the simulator of `serve.bench.simulate`): both meet exactly the same prompts.

`--conversations` chats share a system prompt of `--system-len` tokens. Each of `--turns` turns sends the
previous prompt + the previous answer + a new user message of `--user-min`..`--user-max` tokens; with
probability `--branch-prob` a chat instead forks from an earlier turn of itself (a regenerated answer / an
edited message), so continuations branch. All chats of one turn are submitted together; turns follow one
another. Token ids are int32 arrays (a 100K-token chat of thousands costs 4 bytes a token, not a list).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from serve.engine.requests import GenerateResult
from serve.engine.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class ChatWorkload:
    seed: int = 0
    conversations: int = 6
    turns: int = 4
    system_len: int = 100
    user_min: int = 8
    user_max: int = 40
    max_tokens: int = 16
    branch_prob: float = 0.25

    @classmethod
    def from_args(cls, args: Any) -> ChatWorkload:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


class Server(Protocol):
    """What a replay needs of an engine (`Engine` and `SimEngine` both are one)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[GenerateResult]: ...

    def ledger(self) -> dict[str, Any]: ...


# the ledger's checkpoint accounts (per tier, and per kind and tier)
CHECKPOINT_KEYS = ("checkpoints", "checkpoint_bytes", "checkpoints_by_kind", "checkpoint_bytes_by_kind")
LEDGER_KEYS = (
    *CHECKPOINT_KEYS,
    "hits",
    "lookups",
    "saves",
    "demotions",
    "dropped_checkpoints",
    "evicted_blocks",
)


@dataclasses.dataclass
class Replay:
    """What one replay observed: every request's stats (in submission order, turn by turn) and the
    ledger's checkpoint accounts and store counters after each turn."""

    stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ledgers: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The bench's row: reuse, recompute, TTFT and peak checkpoint bytes per tier."""
        prompt = sum(s["prompt_tokens"] for s in self.stats)
        hit = sum(s["prefix_hit_tokens"] for s in self.stats)
        ms = 1e3 * np.asarray([s["time_to_first_token_s"] for s in self.stats])
        peak = {
            t: max(led["checkpoint_bytes"][t] for led in self.ledgers) for t in ("device", "host", "disk")
        }
        return {
            "requests": len(self.stats),
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "hit_rate": hit / prompt,
            "recomputed_tokens": sum(s["recomputed_tokens"] for s in self.stats),
            "prefill_tokens_computed": sum(s["prefill_tokens_computed"] for s in self.stats),
            "ttft_mean_ms": float(ms.mean()),
            "ttft_p95_ms": float(np.percentile(ms, 95)),
            "peak_checkpoint_bytes": peak,
            "hits": self.ledgers[-1].get("hits", 0),
        }


def replay(server: Server, workload: ChatWorkload, vocab: int) -> Replay:
    """Serve the workload turn by turn (a turn's prompts together) and record what each request did."""
    w = workload
    rng = np.random.default_rng(w.seed)
    tok = lambda n: rng.integers(3, vocab, n).astype(np.int32)
    system = tok(w.system_len)
    history: list[list[np.ndarray]] = [[system] for _ in range(w.conversations)]  # conversation per turn
    params = SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)
    out = Replay()
    for _ in range(w.turns):
        prompts = []
        for chat in history:
            fork = len(chat) > 1 and rng.random() < w.branch_prob
            base = chat[int(rng.integers(1, len(chat)))] if fork else chat[-1]
            prompts.append(np.concatenate([base, tok(int(rng.integers(w.user_min, w.user_max + 1)))]))
        results = server.generate(prompts, params)
        for chat, prompt, res in zip(history, prompts, results, strict=True):
            chat.append(np.concatenate([prompt, np.asarray(res.token_ids, np.int32)]))
            out.stats.append(res.stats)
        ledger = server.ledger()
        out.ledgers.append({k: ledger[k] for k in LEDGER_KEYS if k in ledger})
    return out
