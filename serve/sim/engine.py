"""The engine's loop without a model (`bench prefix --simulate`): the same scheduler, prefix store, eviction
policy and block allocator, so hits, recomputed tokens and checkpoint bytes are the engine's own, for any
config (Kimi K3 included) and budgets no machine here holds.

What is simulated: the model. A prefill chunk or a decode row computes nothing; its FLOPs are counted
analytically (`serve.sim.cost`) and advance a clock at `flops_per_s`, from which the time to first token
is estimated (compute-bound: decode and copies cost FLOPs only). The tokens a request generates come from
an `Answers` source: seeded random ids, or the engine's own answers (the agreement test). Checkpoints hold
placeholders (`SimRunner` is the store's checkpoint source); the store sizes each from the analytic byte
counts it is built with, as in the engine (`EngineShape.block_bytes` / `state_bytes`), so its tiers,
budgets and eviction behave as with real copies. There is no disk tier.

One step loop: the simulator is the engine itself (`Engine` given `pools`) over a runner that computes
nothing (`SimRunner`), so requests are admitted, chunked, packed into program calls, evicted, preempted and
failed by the engine's own code, and meet the store in the engine's order. First tokens are stamped on the
simulated clock at the end of their program call, as the engine stamps them. A request is built only when
the scheduler can meet it (the queue is kept longer than every admission a step can make), so thousands of
100K-token prompts need not exist as Python lists at once.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import deque
from collections.abc import Sequence

import numpy as np

from jaxhybrid.config import ModelConfig
from serve.engine.config import EngineConfig, EngineShape
from serve.engine.engine import Engine
from serve.engine.pools import EnginePools
from serve.engine.records import Ledger
from serve.engine.requests import GenerateResult, Request, RequestError
from serve.engine.sampling import SamplingParams
from serve.engine.speculative import SpeculationStats, StepCosts, drafting
from serve.sim.cost import CostModel
from serve.sim.runner import AnswerDrafts, Answers, SimRunner


class SimEngine:
    """`generate` and `ledger` as `Engine` has them (what `serve.sim.replay.replay` needs): the engine's
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
