"""One step's program calls and what they give, once the scheduler has planned it: slot resets and prefix
restores for the admitted requests, the decode call (a verify call where rows carry drafts) and the
prefill calls; then each request takes its sampled tokens one at a time (the prefix store sees every
position, the stop rules may end it) and its output for the step grows. A failure met here is one
request's alone (`Failures.fail`), unless the pools went with it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

from serve.engine.failures import Failures
from serve.engine.pools import EnginePools
from serve.engine.requests import Request, RequestOutput, stop_reason
from serve.engine.scheduler import PrefillJob, Scheduler, StepPlan, prefill_calls
from serve.engine.speculative import SpeculationStats, StepCosts


class Execution:
    """See the module doc, over the runner and store of `pools`. Owns `speculation`: every request's verify
    steps, drafted and accepted tokens. `eos`: the model's end token (a stop rule); `step_costs` is told
    what each decode step cost (the scheduler's drafts read it); `clock` stamps the requests' times."""

    def __init__(
        self,
        pools: EnginePools,
        scheduler: Scheduler,
        failures: Failures,
        eos: int | None,
        step_costs: StepCosts,
        clock: Callable[[], float],
    ):
        self.shape, self.runner, self.store = pools.shape, pools.runner, pools.store
        self.scheduler, self.failures, self.eos = scheduler, failures, eos
        self.step_costs, self.clock = step_costs, clock
        self.speculation = SpeculationStats()

    def run(self, plan: StepPlan, outputs: dict[str, RequestOutput]) -> None:
        """Run `plan`'s program calls; what each request produced goes into `outputs`."""
        for adm in plan.admissions:
            req = adm.request
            try:
                t0 = time.perf_counter()
                if adm.restore is None:
                    self.runner.reset_slot(req.slot)
                else:
                    self.runner.restore(adm.restore)
                    self.store.attached(req, adm.attachment, self.runner.copies, t0)
            except Exception as exc:  # noqa: BLE001 - this request only (the step fails if the pools went)
                self.failures.fail(req, exc, outputs)
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
                    self.failures.fail(job.request, exc, outputs)

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
                    self.store.on_computed(req, self.runner.copies)
                self._append(req, token, logprob, outputs)
                if req.finished:
                    break
        except Exception as exc:  # noqa: BLE001
            self.failures.fail(req, exc, outputs)

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
                    self.store.on_computed(req, self.runner.copies, logits[i])
                if req.pending == 0:
                    self._append(req, int(ids[i]), float(logps[i]), outputs)
            except Exception as exc:  # noqa: BLE001
                self.failures.fail(req, exc, outputs)

    def _append(self, req: Request, token: int, logprob: float, outputs: dict[str, RequestOutput]) -> None:
        if req.first_token_time is None:
            req.first_token_time = self.clock()
        req.generated.append(token)
        req.logprobs.append(logprob)
        reason = stop_reason(req, token, self.eos, self.shape.max_model_len)
        if reason is not None:
            if self.store is not None and req.slot is not None:
                self.store.on_finished(req, self.runner.copies)
            self.scheduler.finish(req, reason)
        out = outputs.setdefault(req.id, RequestOutput(req.id, [], [], False, None, req.prefix_hit_tokens))
        out.new_token_ids.append(token)
        out.new_logprobs.append(logprob)
        out.finished, out.finish_reason = req.finished, req.finish_reason
