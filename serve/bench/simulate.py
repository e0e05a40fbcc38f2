"""The engine's loop without a model (`bench prefix --simulate`): the same scheduler, prefix store, eviction
policy and block allocator, so hits, recomputed tokens and checkpoint bytes are the engine's own, for any
config (Kimi K3 included) and budgets no machine here holds.

What is simulated: the model. A prefill chunk or a decode row computes nothing; its FLOPs are counted
analytically (`serve.bench.throughput.prefill_flops`) and advance a clock at `flops_per_s`, from which the
time to first token is estimated (compute-bound: decode and copies cost FLOPs only). The tokens a request
generates come from an `Answers` source: seeded random ids, or the engine's own answers (the agreement
test). Checkpoints hold placeholders (`SimSource`); the store sizes each from the analytic byte counts it
is built with, as in the engine (`EngineShape.block_bytes` / `state_bytes`), so its tiers, budgets and
eviction behave as with real copies. There is no disk tier.

One step loop: the simulator is the engine itself (`Engine` given `pools`) over a runner that computes
nothing (`SimRunner`), so requests are admitted, chunked, packed into program calls, evicted, preempted and
failed by the engine's own code, and meet the store in the engine's order. First tokens are stamped on the
simulated clock at the end of their program call, as the engine stamps them. A request is built only when
the scheduler can meet it (the queue is kept longer than every admission a step can make), so thousands of
100K-token prompts need not exist as Python lists at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxhybrid.config import ModelConfig
from jaxhybrid.counting import count_params
from serve.bench.throughput import prefill_flops
from serve.engine.config import EngineConfig, EngineShape
from serve.engine.engine import Engine
from serve.engine.pools import EnginePools
from serve.engine.records import Ledger
from serve.engine.requests import GenerateResult, Request, RequestError
from serve.engine.runner import Verified
from serve.engine.sampling import SamplingParams
from serve.engine.speculative import SpeculationStats, StepCosts, drafting

# the answer a request generates: (its prompt, max_tokens) -> token ids (at least max_tokens of them)
Answers = Callable[[list[int], int], list[int]]


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


class SimSource:
    """The prefix store's CheckpointSource in a simulation: nothing to copy, so placeholders (the store
    accounts the byte sizes it was built with, not what the source returns)."""

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


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Analytic FLOPs of the model and the rate a step's FLOPs are computed at."""

    cfg: ModelConfig
    matmul_params: float  # active params per token without the embedding (`jaxhybrid.counting`)
    flops_per_s: float

    @classmethod
    def of(cls, cfg: ModelConfig, flops_per_s: float) -> CostModel:
        return cls(cfg, float(count_params(cfg)["active_params_without_embedding"]), flops_per_s)

    def flops(self, start: int, tokens: int) -> float:
        return prefill_flops(self.cfg, self.matmul_params, tokens, start)["flops"]


class SimRunner:
    """The runner's step interface (`serve.engine.runner.Runner`) with no model: a program call computes
    nothing, counts its FLOPs and moves the clock by them; the tokens it "samples" are each request's answer
    (`Answers`, drawn the first time the request needs one). Logits are placeholders (one value a row: the
    store only tests kept logits for None, the scheduler indexes them)."""

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


class SimEngine:
    """`generate` and `ledger` as `Engine` has them (what `serve.bench.workloads.replay` needs): the engine's
    step loop over a `SimRunner` (see the module doc)."""

    def __init__(
        self,
        cfg: ModelConfig,
        config: EngineConfig,
        answers: Answers,
        cost: CostModel,
        draft_acceptance: float | None = None,
        seed: int = 0,
    ):
        """`draft_acceptance`: with `config.speculative` on, drafts from `AnswerDrafts` right with this
        probability each (None: every draft right)."""
        self.model_config, self.config = cfg, config
        self.shape = shape = EngineShape.resolve(config, cfg)
        self.max_model_len = shape.max_model_len
        self.runner = SimRunner(answers, cost)
        if config.prefix is not None and config.prefix.enabled and config.prefix.store_dir is not None:
            raise ValueError("the simulator has no disk tier (drop store_dir)")
        fingerprint = hashlib.sha256(f"simulated:{cfg.name}".encode()).digest()
        pools = EnginePools.build(shape, self.runner, config.prefix, fingerprint)
        self.allocator, self.store = pools.allocator, pools.store
        accept = 1.0 if draft_acceptance is None else draft_acceptance
        drafter = AnswerDrafts(self.runner.answer, accept, cfg.vocab_size, seed)
        # every draft is verified: a clock of FLOPs cannot tell when a verify step pays (a real one reads
        # the weights once for all its tokens)
        self.engine = Engine(
            None,
            config,
            pools=pools,
            model_config=cfg,
            clock=self.runner.now,
            drafter=drafter,
            step_costs=StepCosts(retry=0),
        )
        self.scheduler = self.engine.scheduler
        self._ids = itertools.count()

    @property
    def clock(self) -> float:
        """Simulated seconds so far."""
        return self.runner.clock

    @property
    def flops(self) -> dict[str, float]:
        return self.runner.flops

    @property
    def steps(self) -> int:
        return self.engine.steps

    def speculation_stats(self) -> SpeculationStats:
        return self.engine.speculation_stats()

    # --- what a replay uses ------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateResult]:
        """Serve every prompt to completion (submitted together, in order); results in prompt order."""
        for prompt in prompts:
            self._check(len(prompt), sampling)
        queue = deque(enumerate(prompts))
        reqs: dict[int, Request] = {}
        keep = 2 * self.shape.slots + 1  # more than one step admits (a preemption puts its victim first)
        while queue or self.scheduler.has_unfinished():
            while queue and len(self.scheduler.waiting) < keep:
                i, prompt = queue.popleft()
                prompt = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
                req = Request(f"sim-{next(self._ids)}", prompt, sampling, 0, self.clock)
                req.drafting = drafting(sampling.speculative, self.config.speculative, self.engine.acceptance)
                reqs[i] = req
                self.scheduler.add(req)
            self.step()
        out = []
        for i in range(len(prompts)):
            req = reqs[i]
            self.runner.forget(req.id)
            out.append(GenerateResult(req.id, list(req.generated), None, str(req.finish_reason), req.stats()))
        return out

    def ledger(self) -> Ledger:
        """The engine's ledger (`Engine.ledger`): live bytes, and the store's accounts."""
        return self.engine.ledger()

    def step(self) -> None:
        """One step of the engine's loop (plan -> simulated run -> update)."""
        self.engine.step()

    def _check(self, length: int, params: SamplingParams) -> None:
        """The engine's length checks (`check_request`) without its per-token ones (the ids are ours)."""
        total = length + params.max_tokens
        if not length or total > self.max_model_len:
            raise RequestError(
                f"prompt of {length} + {params.max_tokens} tokens: outside 1..{self.max_model_len}"
            )
        if math.ceil(total / self.shape.block_size) > self.allocator.usable:
            raise RequestError(f"a request needs {math.ceil(total / self.shape.block_size)} blocks")
