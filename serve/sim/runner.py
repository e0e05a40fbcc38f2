"""A runner with the engine runner's step interface and no model (`SimRunner`), and where the tokens it
"samples" come from: each request's answer (`Answers`: seeded random ids, or the engine's own answers) and,
for speculative decoding, drafts right with a seeded probability (`AnswerDrafts`). A program call computes
nothing: its FLOPs are counted (`serve.sim.cost.CostModel`) and advance a clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from serve.engine.requests import Request
from serve.engine.runner import Verified
from serve.sim.cost import CostModel

# the answer a request generates: (its prompt, max_tokens) -> token ids (at least max_tokens of them)
Answers = Callable[[list[int], int], list[int]]


class SimSource:
    """The prefix store's CheckpointSource in a simulation (`SimRunner.copies`): nothing to copy, so
    placeholders (the store accounts the byte sizes it was built with, not what the source returns)."""

    def take(self, slot: int, block: int) -> tuple[Any, Any]:
        return (), None

    def gather(self, blocks: list[int]) -> Any:
        return None

    def gathered_bytes(self, blocks: int) -> int:
        return 0

    def pack(self, states: Any, kv_full: Any, num_full: int, tail: Any) -> dict[str, Any]:
        return {}

    @staticmethod
    def to_host(tree: Any) -> Any:
        return tree


class AnswerDrafts:
    """A seeded acceptance model of speculative decoding: a request's drafts are the next k tokens of its
    answer (`answer_of(request)`), each replaced by another token with probability 1 - `accept`, decided by a
    hash of (seed, the request's prompt, the position): the same drafts in the engine and in the simulator,
    whatever order they are asked in. A draft stands as long as it equals the answer (greedy verification)."""

    def __init__(self, answer_of: Callable[[Any], list[int]], accept: float, vocab: int, seed: int = 0):
        self.answer_of, self.accept, self.vocab, self.seed = answer_of, accept, vocab, seed

    def propose(self, req: Any, k: int) -> list[int]:
        done = len(req.generated)
        answer = self.answer_of(req)[done : done + k]
        key = hashlib.sha256(np.asarray([self.seed, *req.prompt], np.int64).tobytes()).digest()
        out = []
        for i, token in enumerate(answer):
            position = (done + i).to_bytes(8, "little")
            draw = int.from_bytes(hashlib.sha256(key + position).digest()[:8], "little") / 2**64
            out.append(int(token) if draw < self.accept else 3 + (int(token) - 2) % (self.vocab - 3))
        return out


def random_answers(vocab: int, seed: int = 0) -> Answers:
    """Seeded random ids (there is no model to answer); drawn in the order requests first need them."""
    rng = np.random.default_rng(seed)
    return lambda prompt, n: rng.integers(3, vocab, n).tolist()


def prompt_answers(vocab: int, seed: int = 0) -> Answers:
    """Seeded random ids that depend on the prompt alone (the same answer whichever replica serves it, and
    in whatever order: what a greedy model gives)."""

    def answer(prompt: Any, n: int) -> list[int]:
        key = hashlib.sha256(np.asarray([seed, *prompt], np.int64).tobytes()).digest()
        return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(3, vocab, n).tolist()

    return answer


class SimRunner:
    """The runner's step interface (`serve.engine.runner.Runner`) with no model: a program call computes
    nothing, counts its FLOPs and moves the clock by them; the tokens it "samples" are each request's answer
    (`Answers`, drawn the first time the request needs one). Logits are placeholders (one value a row: the
    store only tests kept logits for None, the scheduler indexes them).

    It is also the prefix store's CheckpointSource (`serve.prefix.types`), as the engine's runner is: there
    is nothing to copy, so it hands out placeholders (the store accounts the byte sizes it was built with,
    not what the source returns)."""

    def __init__(self, answers: Answers, cost: CostModel):
        self.answers, self.cost = answers, cost
        self.copies = SimSource()  # what the prefix store takes its checkpoints from
        self.clock = 0.0  # simulated seconds
        self.flops = {"prefill": 0.0, "decode": 0.0}
        self._answers: dict[str, list[int]] = {}

    def now(self) -> float:
        return self.clock

    def _spend(self, kind: str, flops: float) -> None:
        self.flops[kind] += flops
        if self.cost.flops_per_s > 0:
            self.clock += flops / self.cost.flops_per_s

    def _next(self, reqs: Sequence[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.zeros(len(reqs), np.int64)
        for i, req in enumerate(reqs):
            if req is not None:
                ids[i] = self.answer(req)[len(req.generated)]
        return ids, np.zeros(len(reqs), np.float32)

    def answer(self, req: Request) -> list[int]:
        """The tokens `req` generates (drawn the first time anyone asks)."""
        answer = self._answers.get(req.id)
        if answer is None:
            answer = self._answers[req.id] = self.answers(req.prompt, req.params.max_tokens)
        return answer

    def forget(self, request_id: str) -> None:
        self._answers.pop(request_id, None)

    def reset_slot(self, slot: int) -> None:
        pass

    def restore(self, restore: Any) -> None:
        pass

    def pools_lost(self) -> bool:
        return False

    def compiled_programs(self) -> frozenset:
        """Always empty: a simulated step compiles nothing."""
        return frozenset()

    def decode(self, reqs: list[Request]) -> tuple[np.ndarray, np.ndarray]:
        self._spend("decode", sum(self.cost.flops(r.num_computed, 1) for r in reqs))
        return self._next(reqs)

    def verify(self, reqs: list[Request], drafts: list[list[int]]) -> Verified:
        """A decode step with drafts: each row's drafts stand while they equal its answer (greedy), then its
        answer's next token; the FLOPs of every row's last token and drafts."""
        self._spend(
            "decode",
            sum(self.cost.flops(r.num_computed, 1 + len(d)) for r, d in zip(reqs, drafts, strict=True)),
        )
        width = 1 + max(len(d) for d in drafts)
        tokens = np.zeros((len(reqs), width), np.int64)
        accepted = np.zeros(len(reqs), np.int64)
        for i, (req, row) in enumerate(zip(reqs, drafts, strict=True)):
            done = len(req.generated)
            answer = self.answer(req)[done : done + width]
            a = next((j for j, t in enumerate(row) if t != answer[j]), len(row))
            accepted[i] = a
            tokens[i, : a + 1] = answer[: a + 1]
        return Verified(tokens, np.zeros(tokens.shape, np.float32), accepted)

    def prefill_rows(self, reqs: list[Request], ns: list[int]) -> np.ndarray:
        self._spend("prefill", sum(self.cost.flops(r.num_computed, n) for r, n in zip(reqs, ns, strict=True)))
        return np.zeros((len(reqs), 1), np.float32)

    def sample(self, logits: Any, rows: list[Request | None]) -> tuple[np.ndarray, np.ndarray]:
        return self._next(rows)
