"""The serving engine: many sequences at once on one model. Each step: the scheduler plans (host only), the
runner executes the plan's program calls (pools and compiled programs), each request takes what they gave
(sampled tokens, stop rules, prefix-store checkpoints: `serve.engine.execution`), and the engine reports
what each request produced. `generate` for batch use; `add_request` / `step` / `abort` for incremental use
(the HTTP server). `EngineAPI` is what callers may use; `ReplicatedEngine` implements it for several
processes. Reports are typed records (`serve.engine.records`), JSON only at the process boundary.

A request whose own serving raises fails alone (finish reason "error"); a step that raises without a
request to blame is the caller's to handle (`recover`, `serve.engine.failures`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np

from jaxhybrid.config import ModelConfig
from jaxhybrid.model import HybridLM, held_bytes
from serve.engine.accounts import Accounts
from serve.engine.config import EngineConfig, EngineShape, ProgramShape
from serve.engine.drafting import DraftModel
from serve.engine.executables import Tier
from serve.engine.execution import Execution
from serve.engine.failures import Failures
from serve.engine.pools import EnginePools, aligned_prefix
from serve.engine.records import Ledger, LoadOutcome, MemoryReport, StepEvents
from serve.engine.requests import (
    FinishReason,
    GenerateResult,
    QueueState,
    Request,
    RequestError,
    RequestOutput,
    check_cache_salt,
    check_request,
    stop_tokens,
)
from serve.engine.sampling import SamplingParams
from serve.engine.scheduler import Scheduler
from serve.engine.speculative import (
    Drafters,
    DraftMethod,
    DraftSource,
    EngineAcceptance,
    PromptLookup,
    SpeculationStats,
    StepCosts,
    drafting,
)
from serve.prefix.store import PrefixStore

log = logging.getLogger("jaxhybrid.engine")


def draft_source(model: HybridLM, target: ModelConfig, shape: EngineShape) -> DraftModel:
    """The draft model's `DraftSource` for an engine of `shape` (its vocabulary must be the target's)."""
    if model.config.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({model.config.vocab_size}) differs from the model's "
            f"({target.vocab_size})"
        )
    return DraftModel(model, shape)


class EngineAPI(Protocol):
    """What the CLI, the HTTP server and the benchmarks use of an engine."""

    model_config: ModelConfig
    config: EngineConfig
    max_model_len: int
    has_draft_model: bool  # requests may draft with speculative method "draft"

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str: ...

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def step(self, events: StepEvents | None = None) -> list[RequestOutput]: ...

    def observe(self) -> StepEvents | None: ...

    def has_unfinished(self) -> bool: ...

    def waits_for_reads(self) -> bool: ...

    def on_read_done(self, fn: Callable[[], None] | None) -> None: ...

    def active_requests(self) -> list[Request]: ...

    def queue_state(self) -> QueueState: ...

    def result(self, request_id: str) -> GenerateResult: ...

    def recover(self, reason: str) -> list[RequestOutput]: ...

    def flush(self) -> None: ...

    def ledger(self) -> Ledger: ...

    def take_events(self) -> list[Any]: ...

    def checkpoint_capacity(self) -> int | None: ...

    def memory(self) -> MemoryReport: ...

    def speculation_stats(self) -> SpeculationStats: ...


class Engine:
    """See the module doc. `mesh`: a device mesh the model's parameters are already sharded over
    (`sharding.placement`); the cache pools are then laid out on it too. Its collaborators: `pools` (the
    allocator, the runner, the prefix store), `scheduler` (the plan of each step), `failures` (a request or a
    step that failed), `execution` (a planned step's program calls and what they give) and `accounts` (the
    ledger and memory reports)."""

    def __init__(
        self,
        model: HybridLM | None,
        config: EngineConfig | None = None,
        mesh: Any = None,
        *,
        pools: EnginePools | None = None,
        model_config: ModelConfig | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drafter: DraftSource | None = None,
        step_costs: StepCosts | None = None,
        draft_model: HybridLM | None = None,
    ):
        """With `pools` and `model_config` instead of a model: this step loop over pools whose runner
        computes nothing, on a `clock` of its own (the simulator: `serve.sim.engine`). `drafter`: where
        speculating requests' drafts come from (default: prompt lookup); `step_costs`: what decode steps
        cost, with and without drafts (default: measured on the engine's clock, `StepCosts`);
        `draft_model`: a smaller model with the same vocabulary that requests may draft with
        (`serve.engine.drafting`)."""
        self.config = config = dataclasses.replace(config) if config else EngineConfig()
        self.model_config: ModelConfig = model.config if model is not None else model_config
        if pools is None:
            shape = EngineShape.resolve(config, self.model_config)
            if config.prefix is not None and config.prefix.enabled:
                config.prefix = aligned_prefix(config.prefix, shape.block_size)  # our own copy of the config
            pools = EnginePools.for_model(model, shape, config.prefix, mesh)
        self.mesh, self.pools, self.clock = mesh, pools, clock
        self.shape = pools.shape
        self.max_model_len = self.shape.max_model_len
        self.allocator, self.runner = pools.allocator, pools.runner  # (the runner: a `StepRunner`)
        self.store: PrefixStore | None = pools.store
        eos = self.model_config.eos_token_id
        self.step_costs = step_costs or StepCosts()
        self.has_draft_model = draft_model is not None or drafter is not None  # (a drafter drafts for all)
        self.draft = None if draft_model is None else draft_source(draft_model, self.model_config, self.shape)
        if drafter is None:
            drafter = Drafters({DraftMethod.NGRAM: PromptLookup()})
            if self.draft is not None:
                drafter.by_method[DraftMethod.DRAFT] = self.draft
        if config.speculative.method is DraftMethod.DRAFT and not self.has_draft_model:
            raise ValueError("speculative method 'draft' needs a draft model")
        self.scheduler = Scheduler(
            self.shape,
            self.allocator,
            self.store,
            clock,
            drafter=drafter,
            stop_ids=lambda r: stop_tokens(r.params, eos),
            step_costs=self.step_costs,
        )
        self.acceptance = EngineAcceptance()  # how far its drafts stood lately: a new request's prior
        self.failures = Failures(self.scheduler, pools)
        self.execution = Execution(pools, self.scheduler, self.failures, eos, self.step_costs, clock)
        model_bytes = held_bytes(model) if model is not None else 0  # the weights as held
        self.accounts = Accounts(self.scheduler, pools, model_bytes, self.draft)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.steps = 0

    # --- requests -----------------------------------------------------------------------------------------
    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; raises RequestError (changing nothing) when it cannot be served."""
        params = params or SamplingParams()
        if request_id is not None and request_id in self.requests:
            raise RequestError(f"request id '{request_id}' is already in use")
        prompt = self._check(prompt_ids, params)
        check_cache_salt(cache_salt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        seed = params.seed if params.seed is not None else int(self._seeds.integers(0, 2**31 - 1))
        req = Request(rid, prompt, params, seed, self.clock(), cache_salt)
        req.drafting = drafting(params.speculative, self.config.speculative, self.acceptance)
        self.requests[rid] = req
        self.scheduler.add(req)
        return rid

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError if `add_request` would refuse this prompt and these settings."""
        self._check(prompt_ids, params)

    def _check(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        vocab, usable = self.model_config.vocab_size, self.allocator.usable
        prompt = check_request(prompt_ids, params, vocab, self.max_model_len, self.shape.block_size, usable)
        most, spec = self.shape.speculative_tokens, params.speculative
        if spec is not None and spec.num_tokens > most:
            raise RequestError(f"num_speculative_tokens must be at most {most} on this server")
        if spec is not None and spec.method is DraftMethod.DRAFT and not self.has_draft_model:
            raise RequestError("speculative method 'draft': this server has no draft model")
        return prompt

    def abort(self, request_id: str) -> None:
        """Stop a request now and free its slot and blocks (e.g. the client went away)."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, FinishReason.ABORT)

    def forget(self, request_id: str) -> None:
        """Drop a finished request's record (a long-running server calls this once it has delivered it)."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def waits_for_reads(self) -> bool:
        """Unfinished requests, none of which can go on before a prefix read from disk ends (a step now
        would do nothing: wait for `on_read_done`'s call, or a new command)."""
        return self.scheduler.waits_for_reads()

    def on_read_done(self, fn: Callable[[], None] | None) -> None:
        """Call `fn()` from another thread whenever a prefix read from disk ends (None: nobody)."""
        if self.store is not None:
            self.store.on_read_done(fn)

    def active_requests(self) -> list[Request]:
        """Every request not finished: running, waiting for a slot, or waiting for its prefix from disk."""
        return self.scheduler.active()

    def queue_state(self) -> QueueState:
        return self.scheduler.queue_state()

    # --- one step: plan -> run -> update ------------------------------------------------------------------
    def observe(self) -> StepEvents | None:
        """What finished in the background since the last step (disk saves, disk reads): the only input of
        a step that depends on time. With several processes process 0 observes and sends it in the step
        log, so every process applies the same (`step(events)`)."""
        if self.store is None:
            return None
        loaded = tuple(LoadOutcome(*x) for x in self.scheduler.observe_loads())
        return StepEvents(self.store.observe(), loaded)

    def step(self, events: StepEvents | None = None) -> list[RequestOutput]:
        """Apply `events` (default: this process's own `observe`), then plan, run and update one step. If it
        raises, what it produced before (a request that finished, a request failed alone) is kept for
        `recover` (or the next step) to report: every request gets exactly one final output."""
        outputs = self.failures.take()
        try:
            self._step(events, outputs)
        except BaseException:
            self.failures.keep(outputs)
            raise
        return list(outputs.values())

    def _step(self, events: StepEvents | None, outputs: dict[str, RequestOutput]) -> None:
        self.steps += 1
        if self.store is not None:
            events = events if events is not None else self.observe()
            self.store.apply(events.disk)  # disk saves that finished become visible to lookups now
            self.scheduler.apply_loads(list(events.loaded))
        plan = self.scheduler.schedule()
        for req, exc in plan.failed:
            self.failures.report(req, exc, outputs)
        self.execution.run(plan, outputs)

    # --- batch use ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Serve every prompt to completion through the request API, results in prompt order (for scripts,
        benchmarks and tests); invalid requests raise first."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise RequestError(f"{len(sampling)} sampling settings for {len(prompts)} prompts")
        for prompt, params in zip(prompts, sampling, strict=True):
            self.validate(prompt, params)
        ids = [self.add_request(p, s) for p, s in zip(prompts, sampling, strict=True)]
        while any(not self.requests[i].finished for i in ids):
            self.step()
        results = [self.result(i) for i in ids]
        for i in ids:  # delivered: a long-lived engine keeps no finished request's tokens
            self.forget(i)
        return results

    def result(self, request_id: str) -> GenerateResult:
        """The request's tokens so far (all of them once it finished) and its stats."""
        req = self.requests[request_id]
        logprobs = list(req.logprobs) if req.params.logprobs else None
        return GenerateResult(
            request_id, list(req.generated), logprobs, str(req.finish_reason or ""), req.stats()
        )

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a step that raised with no request to blame (`Failures.recover`)."""
        return self.failures.recover(reason)

    def flush(self) -> None:
        """Wait for every pending disk save of the prefix store and make it visible (graceful shutdown)."""
        if self.store is not None:
            self.store.poll(wait=True)

    def close(self) -> None:
        """Flush, and let go of the prefix store's directory."""
        if self.store is not None:
            self.store.close()

    # --- accounts (`Accounts`) ---------------------------------------------------------------------------
    def ledger(self) -> Ledger:
        return self.accounts.ledger()

    def memory(self) -> MemoryReport:
        return self.accounts.memory()

    def take_events(self) -> list[Any]:
        return self.accounts.take_events()

    def checkpoint_capacity(self) -> int | None:
        return self.accounts.checkpoint_capacity()

    def speculation_stats(self) -> SpeculationStats:
        """Speculative decoding so far, all requests together (a copy)."""
        return dataclasses.replace(self.execution.speculation)

    # --- compiling ahead of first use (the server's warm-up; call between steps) -------------------------
    def compiled_programs(self) -> frozenset[ProgramShape]:
        """Model-program shapes compiled for this engine: running one of them compiles nothing."""
        return self.runner.compiled_programs()

    def compile_program(self, program: ProgramShape) -> bool:
        """Compile one model program ahead of its first use (and, while no request is in the engine, run it
        once on rows that touch only idle slots and the scratch block); False if it already was compiled."""
        return self.pools.compile_program(program, run_once=not self.has_unfinished())

    def compile_in_background(self, program: ProgramShape, tier: Tier = Tier.OPTIMIZED) -> Future:
        """Compile one model program at `tier` on the background compile thread while steps go on (a step
        that needs it meanwhile waits for that compile); the future's result is False if it already was."""
        return self.pools.compile_in_background(program, tier)

    def compile_helpers(self, rows: tuple[int, ...] | None = None, slot_programs: bool = True) -> None:
        """Compile the small programs every request meets (sampling for batches of `rows`, default every
        size; with `slot_programs` also slot reset, checkpoint copy and restore), changing no request."""
        self.pools.compile_helpers(rows, run_once=not self.has_unfinished(), slot_programs=slot_programs)
