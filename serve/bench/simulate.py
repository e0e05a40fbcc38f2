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

Order: requests are admitted, chunked, evicted and preempted by the engine's `Scheduler`, step by step as
`Engine.step` runs them, so concurrency within a turn meets the store in the engine's order. A request is
built only when the scheduler can meet it (the queue is kept longer than every admission a step can make),
so thousands of 100K-token prompts need not exist as Python lists at once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jaxhybrid.config import ModelConfig
from serve.bench.throughput import prefill_flops
from serve.engine.blocks import BlockAllocator
from serve.engine.config import EngineConfig, EngineShape
from serve.engine.requests import GenerateResult, Request, RequestError, stop_reason
from serve.engine.sampling import SamplingParams
from serve.engine.scheduler import Scheduler, StepPlan
from serve.prefix.store import PrefixStore

# what a checkpoint keeps where the engine keeps next-token logits (the store only tests it for None and the
# scheduler indexes it with [None])
PLACEHOLDER_LOGITS = np.zeros((1,), np.float32)

# the answer a request generates: (its prompt, max_tokens) -> token ids (at least max_tokens of them)
Answers = Callable[[list[int], int], list[int]]


def random_answers(vocab: int, seed: int = 0) -> Answers:
    """Seeded random ids (there is no model to answer); drawn in the order requests first need them."""
    rng = np.random.default_rng(seed)
    return lambda prompt, n: rng.integers(3, vocab, n).tolist()


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
        from jaxhybrid.counting import count_params

        return cls(cfg, float(count_params(cfg)["active_params_without_embedding"]), flops_per_s)

    def flops(self, start: int, tokens: int) -> float:
        return prefill_flops(self.cfg, self.matmul_params, tokens, start)["flops"]


class SimEngine:
    """`generate` and `ledger` as `Engine` has them (what `serve.bench.workloads.replay` needs), run by the
    engine's scheduler and prefix store over placeholder caches (see the module doc)."""

    def __init__(self, cfg: ModelConfig, config: EngineConfig, answers: Answers, cost: CostModel):
        self.model_config, self.config, self.answers, self.cost = cfg, config, answers, cost
        self.shape = shape = EngineShape.resolve(config, cfg)
        self.max_model_len = shape.max_model_len
        self.allocator = BlockAllocator(shape.num_blocks)
        self.source = SimSource()
        self.store: PrefixStore | None = None
        if config.prefix is not None and config.prefix.enabled:
            if config.prefix.store_dir is not None:
                raise ValueError("the simulator has no disk tier (drop store_dir)")
            self.store = PrefixStore(
                config.prefix,
                block_size=shape.block_size,
                block_bytes=shape.block_bytes,
                state_bytes=shape.state_bytes,
                fingerprint=hashlib.sha256(f"simulated:{cfg.name}".encode()).digest(),
                allocator=self.allocator,
            )
        self.scheduler = Scheduler(shape, self.allocator, self.store)
        self.clock = 0.0  # simulated seconds
        self.flops = {"prefill": 0.0, "decode": 0.0}
        self.steps = 0
        self._ids = itertools.count()
        self._answers: dict[str, list[int]] = {}

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
                reqs[i] = req
                self.scheduler.add(req)
            self.step()
        out = []
        for i in range(len(prompts)):
            req = reqs[i]
            self._answers.pop(req.id, None)
            out.append(GenerateResult(req.id, list(req.generated), None, str(req.finish_reason), req.stats()))
        return out

    def ledger(self) -> dict[str, Any]:
        """The engine's ledger (`Engine.ledger`): live bytes, and the store's accounts."""
        return self.scheduler.ledger()

    # --- one step, as Engine.step: plan -> (simulated) run -> update ----------------------------------------
    def step(self) -> None:
        self.steps += 1
        plan = self.scheduler.schedule()
        if plan.failed:  # only a disk read fails a request in the scheduler, and there is no disk tier
            raise RuntimeError(f"simulated requests failed: {[str(e) for _, e in plan.failed]}")
        for adm in plan.admissions:
            if adm.restore is not None:
                self.store.attached(adm.request, adm.attachment, self.source, time.perf_counter())
        decode = [r for r in plan.decode if r.running]
        self._advance(plan, decode)
        for req in decode:
            req.num_computed += 1
            if self.store is not None:
                self.store.on_computed(req, self.source)
            self._append(req)
        for job in plan.prefill:
            req, n = job.request, job.tokens
            if not req.running:
                continue
            if n == 0 and req.stored_logits is not None:  # full prefix hit: "sample" from the kept logits
                req.stored_logits = None
                self._append(req)
                continue
            req.num_computed += n
            req.prefill_tokens += n
            if self.store is not None:
                self.store.on_computed(req, self.source, PLACEHOLDER_LOGITS)
            if req.pending == 0:
                self._append(req)

    def _advance(self, plan: StepPlan, decode: list[Request]) -> None:
        """The step's FLOPs (decode rows, prefill chunks) and the clock they move: first tokens of this
        step are stamped at its end."""
        prefill = sum(self.cost.flops(j.request.num_computed, j.tokens) for j in plan.prefill if j.tokens)
        dec = sum(self.cost.flops(r.num_computed, 1) for r in decode)
        self.flops["prefill"] += prefill
        self.flops["decode"] += dec
        if self.cost.flops_per_s > 0:
            self.clock += (prefill + dec) / self.cost.flops_per_s

    def _append(self, req: Request) -> None:
        answer = self._answers.get(req.id)
        if answer is None:
            answer = self._answers[req.id] = self.answers(req.prompt, req.params.max_tokens)
        token = answer[len(req.generated)]
        if req.first_token_time is None:
            req.first_token_time = self.clock
        req.generated.append(token)
        reason = stop_reason(req, token, self.model_config.eos_token_id, self.max_model_len)
        if reason is not None:
            if self.store is not None and req.slot is not None:
                self.store.on_finished(req, self.source)
            self.scheduler.finish(req, reason)
            req.finish_time = self.clock

    def _check(self, length: int, params: SamplingParams) -> None:
        """The engine's length checks (`check_request`) without its per-token ones (the ids are ours)."""
        total = length + params.max_tokens
        if not length or total > self.max_model_len:
            raise RequestError(
                f"prompt of {length} + {params.max_tokens} tokens: outside 1..{self.max_model_len}"
            )
        if math.ceil(total / self.shape.block_size) > self.allocator.usable:
            raise RequestError(f"a request needs {math.ceil(total / self.shape.block_size)} blocks")
