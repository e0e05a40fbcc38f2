"""A workload's replay through anything that serves it (the engine, or the simulator of `serve.sim.engine`:
both meet exactly the same prompts), what the replay observed, and the lower bound of the prefill work it
needed.

`lower_bound_tokens`: the prompt tokens a replay had to compute even with a checkpoint at every token and
unlimited memory (see there).
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from serve.engine.records import Ledger
from serve.engine.requests import GenerateResult, RequestError
from serve.engine.sampling import SamplingParams
from serve.sim.workloads import Workload


class Server(Protocol):
    """What a replay needs of an engine (`Engine` and `SimEngine` both are one)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[GenerateResult]: ...

    def ledger(self) -> Ledger: ...


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


@dataclasses.dataclass(frozen=True)
class Served:
    """One request as replayed: its round, and its prompt and generated tokens in one array (the prompt is a
    view of it, so a replay keeps no second copy of its prompts)."""

    round: int
    prompt_len: int
    tokens: np.ndarray

    @property
    def prompt(self) -> np.ndarray:
        return self.tokens[: self.prompt_len]

    @property
    def generated(self) -> np.ndarray:
        return self.tokens[self.prompt_len :]


@dataclasses.dataclass
class Replay:
    """What one replay observed: every request's tokens and stats (in submission order, round by round) and
    the ledger's checkpoint accounts and store counters after each round."""

    stats: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    ledgers: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    served: list[Served] = dataclasses.field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        """The bench's row: reuse, recompute, the prompt tokens computed against their lower bound, TTFT, and
        peak checkpoint bytes per tier (at round ends; under a budget the store never holds more)."""
        prompt = sum(s["prompt_tokens"] for s in self.stats)
        hit = sum(s["prefix_hit_tokens"] for s in self.stats)
        # the engine counts a prompt token computed in a decode row (the last one, when one is pending: after
        # a hit at len - 1, or a chunk that left one) as no prefill; a request computed at least prompt - hit
        computed = sum(
            max(s["prefill_tokens_computed"], s["prompt_tokens"] - s["prefix_hit_tokens"]) for s in self.stats
        )
        ms = 1e3 * np.asarray([s["time_to_first_token_s"] for s in self.stats])
        tiers = ("device", "host", "disk")
        peak = {t: max(led["checkpoint_bytes"][t] for led in self.ledgers) for t in tiers}
        bound = lower_bound_tokens(self.served)
        last = self.ledgers[-1]
        return {
            "requests": len(self.stats),
            "prompt_tokens": prompt,
            "hit_tokens": hit,
            "hit_rate": hit / prompt,
            "recomputed_tokens": sum(s["recomputed_tokens"] for s in self.stats),
            "prefill_tokens_computed": sum(s["prefill_tokens_computed"] for s in self.stats),
            "prompt_tokens_computed": computed,
            "lower_bound_tokens": bound,
            "vs_lower_bound": computed / bound if bound else None,
            "ttft_mean_ms": float(ms.mean()),
            "ttft_p50_ms": float(np.percentile(ms, 50)),
            "ttft_p95_ms": float(np.percentile(ms, 95)),
            "peak_checkpoint_bytes": peak,
            "peak_checkpoint_total_bytes": max(
                sum(led["checkpoint_bytes"][t] for t in tiers) for led in self.ledgers
            ),
            "hits": last.get("hits", 0),
            "dropped_checkpoints": last.get("dropped_checkpoints", 0),
        }


class WorkloadError(ValueError):
    """A workload the benchmark's engine cannot serve (a prompt longer than its context)."""


def replay(
    server: Server, workload: Workload, vocab: int, progress: Callable[[int, int], None] | None = None
) -> Replay:
    """Serve the workload round by round (a round's prompts together) and record what each request did;
    `progress(rounds, requests)` after each round (those served so far)."""
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0, ignore_eos=True)
    out = Replay()
    rounds = workload.rounds(vocab)
    batch = next(rounds, None)
    for index in itertools.count():
        if batch is None:
            break
        try:
            results = server.generate(batch.prompts, params)
        except RequestError as exc:
            raise WorkloadError(
                f"workload {workload.name!r} does not fit: {exc} (raise --max-model-len, or shorten its "
                "prompts)"
            ) from None
        sequences = []
        for prompt, res in zip(batch.prompts, results, strict=True):
            seq = np.concatenate([prompt, np.asarray(res.token_ids, np.int32)])
            sequences.append(seq)
            out.served.append(Served(index, len(prompt), seq))
            out.stats.append(res.stats)
        ledger = server.ledger().to_json()
        out.ledgers.append({k: ledger[k] for k in LEDGER_KEYS if k in ledger})
        if progress is not None:
            progress(index + 1, len(out.served))
        try:
            batch = rounds.send(sequences)
        except StopIteration:
            batch = None
    return out


# --- the lower bound -------------------------------------------------------------------------------------
def lower_bound_tokens(served: Sequence[Served], block: int = 64) -> int:
    """Prompt tokens a replay must compute with a state checkpoint at every token and unlimited memory.

    Requests in submission order: request i computes len(prompt_i) - L_i, where L_i is its longest common
    prefix with what was computed before it, at most len(prompt_i) - 1 (one token gives the next-token
    logits), or 0 when an earlier request had exactly this prompt (its prompt-end logits can be kept). Before
    it means: every request of earlier rounds, its prompt and its answer but the answer's last token (that
    one is sampled, never fed back, so no state exists after it); requests earlier in the same round, their
    prompt only (they run beside it). `block`: the index's granularity (any value gives the same answer)."""
    return sum(s.prompt_len - depth for s, depth in zip(served, overlap_depths(served, block), strict=True))


def overlap_depths(served: Sequence[Served], block: int = 64) -> list[int]:
    """Per request, L_i of `lower_bound_tokens` (the whole prompt when an earlier request had exactly it): the
    deepest state it could resume from, what an offline placement (`serve.prefix.placement`) is given."""
    index, seen, out = PrefixIndex(block), set(), []
    for _, group in itertools.groupby(served, key=lambda s: s.round):
        group = list(group)
        for s in group:
            prompt = s.prompt
            key = hashlib.blake2b(np.ascontiguousarray(prompt, np.int32).tobytes(), digest_size=16).digest()
            if key in seen:
                out.append(len(prompt))
                continue
            seen.add(key)
            out.append(min(index.longest_prefix(prompt), len(prompt) - 1))
            index.add(prompt)
        for s in group:
            index.add(s.tokens[: max(len(s.tokens) - 1, s.prompt_len)])
    return out


class PrefixIndex:
    """Every prefix of the token sequences added, for longest-common-prefix queries: a node per distinct
    prefix of whole `block`s (keyed by a chained hash), holding the distinct continuations of up to `block`
    tokens seen after it, sorted (as bytes), so the longest common prefix of a query with any of them is with
    a neighbour of the query's place in that order. Memory: the distinct tokens added, not all of them."""

    def __init__(self, block: int = 64):
        self.step = 4 * block  # bytes of a block of int32 tokens
        self.nodes: dict[bytes, list[bytes]] = {b"": []}

    @staticmethod
    def _data(tokens: Sequence[int] | np.ndarray) -> bytes:
        return np.ascontiguousarray(tokens, np.int32).tobytes()

    @staticmethod
    def _child(node: bytes, piece: bytes) -> bytes:
        return hashlib.blake2b(node + piece, digest_size=16).digest()

    def add(self, tokens: Sequence[int] | np.ndarray) -> None:
        data, node = self._data(tokens), b""
        for start in range(0, len(data), self.step):
            piece, children = data[start : start + self.step], self.nodes[node]
            i = bisect.bisect_left(children, piece)
            if i == len(children) or children[i] != piece:
                children.insert(i, piece)
            if len(piece) < self.step:
                return
            node = self._child(node, piece)
            self.nodes.setdefault(node, [])

    def longest_prefix(self, tokens: Sequence[int] | np.ndarray) -> int:
        """The longest common prefix (tokens) of `tokens` with any sequence added."""
        data, node, start = self._data(tokens), b"", 0
        while True:
            piece, children = data[start : start + self.step], self.nodes[node]
            i = bisect.bisect_left(children, piece)
            if len(piece) == self.step and i < len(children) and children[i] == piece:
                node, start = self._child(node, piece), start + self.step
                continue
            return start // 4 + max(
                (_common(children[j], piece) for j in (i - 1, i) if 0 <= j < len(children)), default=0
            )


def _common(a: bytes, b: bytes) -> int:
    """Leading int32 tokens two byte strings share."""
    n = min(len(a), len(b)) // 4
    x, y = np.frombuffer(a, np.int32, n), np.frombuffer(b, np.int32, n)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if len(diff) else n
