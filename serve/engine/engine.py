"""The serving engine: many sequences at once on one model. Each step: the scheduler plans (host only), the
runner executes (pools and compiled programs), the engine updates (sampled tokens, stop rules, prefix-store
checkpoints) and reports what each request produced. `generate` for batch use; `add_request` / `step` /
`abort` for incremental use (the HTTP server). `EngineAPI` is what callers may use; `ReplicatedEngine`
implements it for several processes.

A request whose own serving raises fails alone (finish reason "error"); a step that raises without a
request to blame is the caller's to handle (`recover`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import jax
import numpy as np

from jaxhybrid.config import ModelConfig
from jaxhybrid.model import HybridLM, held_bytes
from serve.engine.config import EngineConfig, EngineShape, ProgramShape
from serve.engine.drafting import DraftModel
from serve.engine.executables import Tier
from serve.engine.pools import EnginePools, aligned_prefix
from serve.engine.requests import (
    FinishReason,
    GenerateResult,
    QueueState,
    Request,
    RequestError,
    RequestOutput,
    check_cache_salt,
    check_request,
    stop_reason,
    stop_tokens,
)
from serve.engine.sampling import SamplingParams
from serve.engine.scheduler import PrefillJob, Scheduler, prefill_calls
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


def draft_source(model: HybridLM, target: ModelConfig, shape: EngineShape) -> Any:
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

    def step(self, events: dict[str, Any] | None = None) -> list[RequestOutput]: ...

    def observe(self) -> dict[str, Any] | None: ...

    def has_unfinished(self) -> bool: ...

    def waits_for_reads(self) -> bool: ...

    def on_read_done(self, fn: Callable[[], None] | None) -> None: ...

    def active_requests(self) -> list[Request]: ...

    def queue_state(self) -> QueueState: ...

    def result(self, request_id: str) -> GenerateResult: ...

    def recover(self, reason: str) -> list[RequestOutput]: ...

    def flush(self) -> None: ...

    def ledger(self) -> dict[str, Any]: ...

    def take_events(self) -> list[Any]: ...

    def checkpoint_capacity(self) -> int | None: ...

    def memory(self) -> dict[str, Any]: ...

    def speculation_stats(self) -> dict[str, Any]: ...


class BatchAPI:
    """`Engine.generate`: prompts served to completion through the engine's own request API (add_request,
    step, result, forget), for scripts, benchmarks and tests."""

    requests: dict[str, Request]

    def generate(
        self: Engine,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateResult]:
        """Serve every prompt to completion, results in prompt order; invalid requests raise first."""
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


class Failures:
    """What the engine does when serving fails: one request alone (`_fail`), or a whole step (`recover`)."""

    runner: Any
    scheduler: Scheduler
    pools: EnginePools
    _unreported: dict[str, RequestOutput]

    def _fail(self, req: Request, exc: BaseException, outputs: dict[str, RequestOutput]) -> None:
        """End `req` with an error because serving it raised; everyone else goes on. If the failed program
        took the pools with it, the whole step fails instead (the caller's `recover`)."""
        if self.runner.pools_lost():
            raise RuntimeError("the cache pools were lost in a failed program call") from exc
        if not req.finished:
            self.scheduler.finish(req, FinishReason.ERROR)
        self._report_failure(req, exc, outputs)

    def _report_failure(self, req: Request, exc: BaseException, outputs: dict[str, RequestOutput]) -> None:
        req.error = f"{type(exc).__name__}: {exc}"
        log.error("request %s failed: %s", req.id, req.error, exc_info=exc)
        outputs[req.id] = RequestOutput(
            req.id, [], [], True, FinishReason.ERROR, req.prefix_hit_tokens, req.error
        )

    def recover(self, reason: str) -> list[RequestOutput]:
        """After a step that raised with no single request to blame: end every running request with an
        error (its cached state may be half written), rebuild the pools if the failed program consumed
        them (the prefix store then forgets its KV blocks; its checkpoints are copies and stay), keep the
        waiting requests. Returns the outputs that tell their clients, with what the failed step produced
        before it raised (a request that finished in it gets its own final output)."""
        outputs, self._unreported = self._unreported, {}
        for req in self.scheduler.drop_running():
            req.error = f"the engine step failed: {reason}"
            out = outputs.setdefault(req.id, RequestOutput(req.id, [], [], True, None, req.prefix_hit_tokens))
            out.finished, out.finish_reason, out.error = True, FinishReason.ERROR, req.error
        self.pools.rebuild_lost()
        return list(outputs.values())


class AheadOfUse:
    """Compiling the engine's programs ahead of their first use (the server's warm-up; call between steps)."""

    runner: Any
    pools: EnginePools

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
        return self.runner.compile_in_background(program, tier)

    def compile_helpers(self, rows: tuple[int, ...] | None = None, slot_programs: bool = True) -> None:
        """Compile the small programs every request meets (sampling for batches of `rows`, default every
        size; with `slot_programs` also slot reset, checkpoint copy and restore), changing no request."""
        self.pools.compile_helpers(rows, run_once=not self.has_unfinished(), slot_programs=slot_programs)


class Accounts:
    """What the engine holds and did: its requests and slots, the memory ledger, its bytes, and speculative
    decoding's counts."""

    scheduler: Scheduler
    pools: EnginePools
    shape: EngineShape
    speculation: SpeculationStats
    model_bytes: int
    draft: Any  # the draft model's DraftModel, or None

    # views for callers that inspect (tests, benchmarks)
    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

    @property
    def waiting(self) -> Any:
        return self.scheduler.waiting

    @property
    def free_slots(self) -> list[int]:
        return self.scheduler.free_slots

    @property
    def block_bytes(self) -> int:
        return self.shape.block_bytes

    @property
    def state_bytes_per_slot(self) -> int:
        return self.shape.state_bytes

    def ledger(self) -> dict[str, Any]:
        """Every byte the engine and its prefix store hold, and what reuse saved or cost."""
        return self.scheduler.ledger()

    def take_events(self) -> list[Any]:
        """The prefix store's KV and state events since the last call (`serve.prefix.events`; none without a
        store or without `PrefixStoreConfig.events`)."""
        store = self.pools.store
        return [] if store is None else store.take_events()

    def checkpoint_capacity(self) -> int | None:
        """Checkpoints the prefix store keeps in device and host memory at most (None: no store); a router
        reads it from /health to spread conversations over replicas whose stores can keep them."""
        store = self.pools.store
        return None if store is None else store.capacity

    def speculation_stats(self) -> dict[str, Any]:
        """Speculative decoding so far: windows verified (steps of a request with drafts), drafted and
        accepted tokens, accepted drafts per window."""
        return {**dataclasses.asdict(self.speculation), "mean_accepted": self.speculation.mean_accepted}

    def memory(self) -> dict[str, Any]:
        """Bytes held by the engine: KV blocks (used/free), live KDA states, and per running request."""
        out = {**self.pools.memory(self.running, self.scheduler.memory_of), "model_bytes": self.model_bytes}
        if self.draft is not None:
            out["draft_model_bytes"] = self.draft.held_bytes()  # its weights and its own pools
        return out


class Engine(BatchAPI, Failures, AheadOfUse, Accounts):
    """See the module doc. `mesh`: a device mesh the model's parameters are already sharded over
    (`sharding.placement`); the cache pools are then laid out on it too."""

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
        self.model_bytes = held_bytes(model) if model is not None else 0  # the weights as held
        self.shape = pools.shape
        self.max_model_len = self.shape.max_model_len
        self.allocator, self.runner = pools.allocator, pools.runner
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
        self.speculation = SpeculationStats()  # every request's verify steps, drafted and accepted tokens
        self.acceptance = EngineAcceptance()  # how far its drafts stood lately: a new request's prior
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._seeds = np.random.default_rng(config.seed)
        self.steps = 0
        self._unreported: dict[str, RequestOutput] = {}  # produced by a step that then raised

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
    def observe(self) -> dict[str, Any] | None:
        """What finished in the background since the last step (disk saves, disk reads): the only input of
        a step that depends on time. With several processes process 0 observes and sends it in the step
        log, so every process applies the same (`step(events)`)."""
        if self.store is None:
            return None
        return {"disk": self.store.observe(), "loaded": self.scheduler.observe_loads()}

    def step(self, events: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply `events` (default: this process's own `observe`), then plan, run and update one step. If it
        raises, what it produced before (a request that finished, a request failed alone) is kept for
        `recover` (or the next step) to report: every request gets exactly one final output."""
        outputs, self._unreported = self._unreported, {}
        try:
            self._step(events, outputs)
        except BaseException:
            self._unreported = outputs
            raise
        return list(outputs.values())

    def _step(self, events: dict[str, Any] | None, outputs: dict[str, RequestOutput]) -> None:
        self.steps += 1
        if self.store is not None:
            events = events if events is not None else self.observe()
            self.store.apply(events["disk"])  # disk saves that finished become visible to lookups now
            self.scheduler.apply_loads(events["loaded"])
        plan = self.scheduler.schedule()
        for req, exc in plan.failed:
            self._report_failure(req, exc, outputs)
        for adm in plan.admissions:
            req = adm.request
            try:
                t0 = time.perf_counter()
                if adm.restore is None:
                    self.runner.reset_slot(req.slot)
                else:
                    self.runner.restore(adm.restore)
                    self.store.attached(req, adm.attachment, self.runner, t0)
            except Exception as exc:  # noqa: BLE001 - this request only (the step fails if the pools went)
                self._fail(req, exc, outputs)
        decode = [r for r in plan.decode if r.running]
        drafts = [plan.drafts.get(r.id, []) for r in decode]
        if any(drafts):
            self._verify(decode, drafts, outputs)
        elif decode:
            self._decode(decode, outputs)
        # (a job whose request is no longer running: a decode row's checkpoint failed it)
        for group in prefill_calls(self.shape, [j for j in plan.prefill if j.request.running]):
            try:
                self._prefill(group, outputs)
            except Exception as exc:  # noqa: BLE001 - these requests only
                for job in group:
                    self._fail(job.request, exc, outputs)

    def _measured(self, verify: bool, rows: int, step: Callable[[], Any]) -> tuple[Any, float]:
        """(what `step` returned, its seconds), the seconds told to `step_costs` as a decode step of `rows`
        requests (`verify`: with drafts), marked when it first ran a program (compiling, not stepping)."""
        t0, programs = self.clock(), len(self.runner.compiled_programs())
        out = step()
        dt, compiled = self.clock() - t0, len(self.runner.compiled_programs()) > programs
        self.step_costs.observe(verify, self.shape.decode_rows(rows), dt, compiled)
        return out, dt

    def _decode(self, reqs: list[Request], outputs: dict[str, RequestOutput]) -> None:
        (ids, logps), dt = self._measured(False, len(reqs), lambda: self.runner.decode(reqs))
        for req, token, logp in zip(reqs, ids, logps, strict=True):
            req.decode_time += dt
            self._take(req, [int(token)], [float(logp)], outputs)

    def _verify(
        self, reqs: list[Request], drafts: list[list[int]], outputs: dict[str, RequestOutput]
    ) -> None:
        """A decode step whose rows carry drafted tokens: each request takes its accepted drafts and the
        token after them, one at a time as `_decode` takes one (the prefix store sees every position; the
        scheduler's limits put its checkpoints and the request's end at the window's end)."""
        verified, dt = self._measured(True, len(reqs), lambda: self.runner.verify(reqs, drafts))
        self.step_costs.verified(len(reqs) + int(verified.accepted.sum()))
        for i, req in enumerate(reqs):
            accepted = int(verified.accepted[i])
            req.decode_time += dt
            if drafts[i]:
                req.drafting.record(len(drafts[i]), accepted)
                req.speculation.add(len(drafts[i]), accepted)
                self.speculation.add(len(drafts[i]), accepted)
            tokens = [int(t) for t in verified.tokens[i, : accepted + 1]]
            self._take(req, tokens, [float(x) for x in verified.logprobs[i, : accepted + 1]], outputs)

    def _take(
        self, req: Request, tokens: list[int], logprobs: list[float], outputs: dict[str, RequestOutput]
    ) -> None:
        """`req` computed its next len(tokens) positions and sampled `tokens` after them: one at a time, the
        prefix store sees each position and the token is appended (until the request ends). A failure here
        is this request's alone (e.g. a checkpoint that could not be kept)."""
        try:
            for token, logprob in zip(tokens, logprobs, strict=True):
                req.num_computed += 1
                if self.store is not None:
                    self.store.on_computed(req, self.runner)
                self._append(req, token, logprob, outputs)
                if req.finished:
                    break
        except Exception as exc:  # noqa: BLE001
            self._fail(req, exc, outputs)

    def _prefill(self, jobs: list[PrefillJob], outputs: dict[str, RequestOutput]) -> None:
        """One program call for `jobs`; the requests whose prompt it finished sample their first token."""
        req = jobs[0].request
        if len(jobs) == 1 and jobs[0].tokens == 0 and req.stored_logits is not None:
            # full prefix hit: sample from the kept logits
            logits, req.stored_logits = req.stored_logits, None
            ids, logps = self.runner.sample(logits, [req])
            self._append(req, int(ids[0]), float(logps[0]), outputs)
            return
        t0 = self.clock()
        reqs = [j.request for j in jobs]
        logits = self.runner.prefill_rows(reqs, [j.tokens for j in jobs])
        for job in jobs:
            job.request.num_computed += job.tokens
            job.request.prefill_tokens += job.tokens
        rows = [r if r.pending == 0 else None for r in reqs] + [None] * (logits.shape[0] - len(reqs))
        if any(rows):
            ids, logps = self.runner.sample(logits, rows)
        else:
            jax.block_until_ready(logits)
        dt = self.clock() - t0
        for i, req in enumerate(reqs):
            req.prefill_time += dt
            try:  # from here on a failure is this request's alone (e.g. a checkpoint that could not be kept)
                if self.store is not None:
                    self.store.on_computed(req, self.runner, logits[i])
                if req.pending == 0:
                    self._append(req, int(ids[i]), float(logps[i]), outputs)
            except Exception as exc:  # noqa: BLE001
                self._fail(req, exc, outputs)

    def _append(self, req: Request, token: int, logprob: float, outputs: dict[str, RequestOutput]) -> None:
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        req.generated.append(token)
        req.logprobs.append(logprob)
        reason = stop_reason(req, token, self.model_config.eos_token_id, self.max_model_len)
        if reason is not None:
            if self.store is not None and req.slot is not None:
                self.store.on_finished(req, self.runner)
            self.scheduler.finish(req, reason)
        out = outputs.setdefault(req.id, RequestOutput(req.id, [], [], False, None, req.prefix_hit_tokens))
        out.new_token_ids.append(token)
        out.new_logprobs.append(logprob)
        out.finished, out.finish_reason = req.finished, req.finish_reason

    # --- batch API -----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every pending disk save of the prefix store and make it visible (graceful shutdown)."""
        if self.store is not None:
            self.store.poll(wait=True)

    def close(self) -> None:
        """Flush, and let go of the prefix store's directory."""
        if self.store is not None:
            self.store.close()
