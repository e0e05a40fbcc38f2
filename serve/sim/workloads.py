"""The seeded workloads of `bench prefix` and `bench route`: families of multi-round prompts that reuse
prefixes the way real traffic does, replayed (`serve.sim.replay`) through the engine or the simulator alike.

A workload is a frozen dataclass with a seed. `rounds(vocab)` is a generator: it yields a `Round` of prompts
and is sent back that round's sequences (each prompt + its answer), so a round may build on earlier answers.
A round's prompts are submitted together (`server.generate`); rounds follow one another. Token ids are
random in [3, vocab), int32 arrays (a 100K-token prompt costs 4 bytes a token, not a list). Families:
- `chat` (`ChatWorkload`): chats behind a shared system prompt; each turn extends the previous prompt and
  answer by a user message, or forks an earlier turn of its chat (reuse at turn ends).
- `docqa` (`DocQAWorkload`): many questions over a few long documents behind a short system prompt, the
  documents chosen with a Zipf skew (reuse at a document's end, not block aligned by default).
- `agentic` (`AgenticWorkload`): tool-calling traces that grow by answer + tool output, or fork an earlier
  sequence of themselves at an odd (never block-aligned) position; a retry forks where an earlier fork did.
- `longdoc` (`LongDocWorkload`, QuALITY-like): a few long documents of varied length, many one-shot
  questions on each, asked in a shuffled order (reuse at a document's end + a fixed instruction, never
  block aligned).
- `sysprompt` (`SysPromptWorkload`): several system prompts of varied length with Zipf popularity, each
  request one system prompt + a one-shot user turn (reuse at a system prompt's end).
The last two check the adaptive policy on workloads it was not tuned on (`TUNED`: the first three);
`--workload all` is all five.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator
from typing import Any, ClassVar, Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Fork:
    """Where a forked prompt left its trace: the first `position` tokens of the trace's sequence `source`
    (by round) are kept; `retry`: the fork reuses an earlier fork's point, else it is an edit at a new one."""

    trace: int
    source: int
    position: int
    retry: bool


@dataclasses.dataclass(frozen=True)
class Round:
    """The prompts one round submits together (and, for `agentic`, where its forked prompts branched)."""

    prompts: list[np.ndarray]
    forks: tuple[Fork, ...] = ()


Rounds = Generator[Round, list[np.ndarray], None]


class Workload(Protocol):
    name: ClassVar[str]
    seed: int
    max_tokens: int

    def rounds(self, vocab: int) -> Rounds: ...


class _Family:
    """What every family shares: built from parsed flags, a flag left at None keeping the family's default
    (the flags are shared between families, their defaults are not)."""

    @classmethod
    def from_args(cls, args: Any) -> Any:
        values = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in values.items() if v is not None})


class _Tokens:
    """A family's seeded draws: `n` random token ids in [3, vocab), or `between` lo..hi of them."""

    def __init__(self, seed: int, vocab: int):
        self.rng, self.vocab = np.random.default_rng(seed), vocab

    def __call__(self, n: int) -> np.ndarray:
        return self.rng.integers(3, self.vocab, n).astype(np.int32)

    def between(self, lo: int, hi: int) -> np.ndarray:
        return self(int(self.rng.integers(lo, hi + 1)))


@dataclasses.dataclass(frozen=True)
class ChatWorkload(_Family):
    """`conversations` chats share a system prompt of `system_len` tokens. Each of `turns` turns sends the
    previous prompt + the previous answer + a new user message of `user_min`..`user_max` tokens; with
    probability `branch_prob` a chat instead forks from an earlier turn of itself (a regenerated answer / an
    edited message), so continuations branch."""

    name: ClassVar[str] = "chat"
    seed: int = 0
    conversations: int = 6
    turns: int = 4
    system_len: int = 100
    user_min: int = 8
    user_max: int = 40
    max_tokens: int = 16
    branch_prob: float = 0.25

    def rounds(self, vocab: int) -> Rounds:
        tok = _Tokens(self.seed, vocab)
        rng, system = tok.rng, tok(self.system_len)
        history: list[list[np.ndarray]] = [[system] for _ in range(self.conversations)]  # chat per turn
        for _ in range(self.turns):
            prompts = []
            for chat in history:
                fork = len(chat) > 1 and rng.random() < self.branch_prob
                base = chat[int(rng.integers(1, len(chat)))] if fork else chat[-1]
                prompts.append(np.concatenate([base, tok.between(self.user_min, self.user_max)]))
            sequences = yield Round(prompts)
            for chat, seq in zip(history, sequences, strict=True):
                chat.append(seq)


@dataclasses.dataclass(frozen=True)
class DocQAWorkload(_Family):
    """`documents` documents of `doc_len` tokens behind a shared `system_len`-token system prompt; each of
    `turns` rounds asks `questions` questions of `user_min`..`user_max` tokens, each about one document drawn
    with Zipf weights 1/rank**`doc_skew` (a few are popular). The reuse point is where a document ends,
    `shared_len` tokens in: 212 by default, off the boundary of any block of 8, 16, 32 or 64."""

    name: ClassVar[str] = "docqa"
    seed: int = 0
    documents: int = 4
    doc_len: int = 200
    questions: int = 8
    turns: int = 3
    system_len: int = 12
    user_min: int = 4
    user_max: int = 16
    max_tokens: int = 8
    doc_skew: float = 1.0

    @property
    def shared_len(self) -> int:
        return self.system_len + self.doc_len

    def rounds(self, vocab: int) -> Rounds:
        tok = _Tokens(self.seed, vocab)
        system = tok(self.system_len)
        docs = [np.concatenate([system, tok(self.doc_len)]) for _ in range(self.documents)]
        weights = 1.0 / np.arange(1, self.documents + 1) ** self.doc_skew
        for _ in range(self.turns):
            picks = tok.rng.choice(self.documents, size=self.questions, p=weights / weights.sum())
            yield Round([np.concatenate([docs[d], tok.between(self.user_min, self.user_max)]) for d in picks])


@dataclasses.dataclass(frozen=True)
class AgenticWorkload(_Family):
    """`conversations` tool-calling traces behind a shared `system_len`-token system prompt, each starting
    with a task of `user_min`..`user_max` tokens. In each later round (`turns` in all) a trace grows by its
    last answer + a tool output of `tool_min`..`tool_max` tokens, or with probability `fork_prob` forks: an
    earlier sequence of the trace (a prompt + its answer) is cut after the system prompt and new tokens
    (`tool_min`..`tool_max`) follow. With probability `retry_prob` (when the trace has forked before) the
    fork is a retry at an earlier fork's point, else an edit at a new one; the cut is at an odd position, so
    never on the boundary of an even-sized block. The trace goes on from the forked sequence."""

    name: ClassVar[str] = "agentic"
    seed: int = 0
    conversations: int = 4
    turns: int = 6
    system_len: int = 64
    user_min: int = 16
    user_max: int = 32
    tool_min: int = 16
    tool_max: int = 48
    max_tokens: int = 8
    fork_prob: float = 0.3
    retry_prob: float = 0.5

    def __post_init__(self) -> None:
        if self.user_min < 2 or self.tool_min < 1:
            raise ValueError("agentic: user messages need >= 2 tokens (a fork point after the system prompt)")

    def rounds(self, vocab: int) -> Rounds:
        tok = _Tokens(self.seed, vocab)
        rng, system = tok.rng, tok(self.system_len)
        prompts = [
            np.concatenate([system, tok.between(self.user_min, self.user_max)])
            for _ in range(self.conversations)
        ]
        traces: list[list[np.ndarray]] = [[] for _ in range(self.conversations)]  # sequences, round by round
        points: list[list[tuple[int, int]]] = [[] for _ in range(self.conversations)]  # (source, position)
        forks: list[Fork] = []
        for index in range(self.turns):
            sequences = yield Round(prompts, tuple(forks))
            for trace, seq in zip(traces, sequences, strict=True):
                trace.append(seq)
            if index == self.turns - 1:
                return
            prompts, forks = [], []
            for t, trace in enumerate(traces):
                if rng.random() >= self.fork_prob:
                    prompts.append(np.concatenate([trace[-1], tok.between(self.tool_min, self.tool_max)]))
                    continue
                retry = bool(points[t]) and rng.random() < self.retry_prob
                if retry:
                    source, position = points[t][int(rng.integers(len(points[t])))]
                else:
                    source = int(rng.integers(len(trace)))
                    position = self._odd_position(rng, len(trace[source]))
                    points[t].append((source, position))
                forks.append(Fork(t, source, position, retry))
                prompts.append(
                    np.concatenate([trace[source][:position], tok.between(self.tool_min, self.tool_max)])
                )

    def _odd_position(self, rng: np.random.Generator, length: int) -> int:
        """An odd cut in system_len + 1 .. length - 1 (one exists: a sequence holds >= 2 task tokens and an
        answer token after the system prompt)."""
        first = self.system_len + 1 + self.system_len % 2
        return first + 2 * int(rng.integers(0, (length - 1 - first) // 2 + 1))


@dataclasses.dataclass(frozen=True)
class LongDocWorkload(_Family):
    """QuALITY-like long-document QA: `documents` documents of `doc_min`..`doc_max` tokens behind a short
    `system_len`-token system prompt; each document gets `questions` one-shot questions, every one the
    document + a fixed `instruction_len`-token instruction (the same for every question) + a question of
    `user_min`..`user_max` tokens. All questions are shuffled and sent `per_round` a round. A document's
    length is drawn so that its shared part (system + document + instruction) is odd: never on the
    boundary of an even-sized block."""

    name: ClassVar[str] = "longdoc"
    seed: int = 0
    documents: int = 3
    doc_min: int = 280
    doc_max: int = 520
    questions: int = 10
    per_round: int = 6
    system_len: int = 8
    instruction_len: int = 6
    user_min: int = 8
    user_max: int = 24
    max_tokens: int = 4

    def rounds(self, vocab: int) -> Rounds:
        tok = _Tokens(self.seed, vocab)
        system, instruction = tok(self.system_len), tok(self.instruction_len)
        docs = []
        for _ in range(self.documents):
            n = int(tok.rng.integers(self.doc_min, self.doc_max + 1))
            n += (self.system_len + n + self.instruction_len + 1) % 2  # the shared part's length is odd
            docs.append(np.concatenate([system, tok(n), instruction]))
        order = tok.rng.permutation(np.repeat(np.arange(self.documents), self.questions))
        prompts = [np.concatenate([docs[d], tok.between(self.user_min, self.user_max)]) for d in order]
        for start in range(0, len(prompts), self.per_round):
            yield Round(prompts[start : start + self.per_round])


@dataclasses.dataclass(frozen=True)
class SysPromptWorkload(_Family):
    """Several system prompts and one-shot user turns: `prompts` system prompts of `system_min`..`system_max`
    tokens, each request one of them, drawn with Zipf weights 1/rank**`skew`, + a user turn of
    `user_min`..`user_max` tokens; `turns` rounds of `per_round` requests."""

    name: ClassVar[str] = "sysprompt"
    seed: int = 0
    prompts: int = 5
    system_min: int = 40
    system_max: int = 400
    skew: float = 1.1
    turns: int = 4
    per_round: int = 8
    user_min: int = 8
    user_max: int = 64
    max_tokens: int = 8

    def rounds(self, vocab: int) -> Rounds:
        tok = _Tokens(self.seed, vocab)
        systems = [tok.between(self.system_min, self.system_max) for _ in range(self.prompts)]
        weights = 1.0 / np.arange(1, self.prompts + 1) ** self.skew
        for _ in range(self.turns):
            picks = tok.rng.choice(self.prompts, size=self.per_round, p=weights / weights.sum())
            user = [tok.between(self.user_min, self.user_max) for _ in picks]
            yield Round([np.concatenate([systems[s], u]) for s, u in zip(picks, user, strict=True)])


FAMILIES: dict[str, type[Any]] = {
    w.name: w for w in (ChatWorkload, DocQAWorkload, AgenticWorkload, LongDocWorkload, SysPromptWorkload)
}
TUNED = ("chat", "docqa", "agentic")  # the families the adaptive policy's constants were chosen on
