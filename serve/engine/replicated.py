"""The engine on several processes: every process runs the same engine loop on the same requests.

With a mesh that spans several processes (`sharding.multihost.initialize`), every process holds some
shards of the parameters and the cache pools, and every jitted program is one SPMD program that all
processes must call, in the same order, with the same host-side inputs. The engine's scheduler is
deterministic host code (block allocator, slot lists, request order; request seeds come from the
request or from the engine's seeded counter), so identical engines fed identical inputs in the same
order take identical decisions and call identical programs. Speculation's decisions (which rows draft, how
many tokens, whether a step verifies) read what steps cost, which each process would time on its own clock:
with several processes they follow fixed costs instead (`StepCosts.lockstep`). `ReplicatedEngine` provides
the identical inputs:

* Process 0 (the leader) owns the request intake. Its `add_request`, `abort` and `forget` act on its own
  engine at once, exactly as on a plain engine (errors reach the caller, the request is visible in
  `engine.requests`), and are also appended to a log, with the request id and sampling seed the leader's
  engine resolved, so that no follower draws its own.
* Once per `step`, every process takes part in a broadcast from process 0 of the log since the last step
  (a JSON document, length-prefixed, as uint8 through `jax.experimental.multihost_utils.
  broadcast_one_to_all`: one collective for the length, a second only when there is something to send,
  padded to a power of two so few shapes compile). Followers replay the log in order, which brings their
  engines to the leader's state; then every process runs `Engine.step`.
* The leader consumes the outputs; followers run `follow()` (step until the leader closes).

It implements `serve.engine.engine.EngineAPI`, so it stands in for an `Engine` in the CLI and the HTTP
server's engine loop; what is not replicated (results, ledgers, validation) reads the local engine.
Sampling is identical on all processes: a request's token depends only on its logits (replicated by the
engine's programs), its seed and its step (`serve.engine.sampling.request_key`).

The prefix store is replicated the same way: its decisions are deterministic host code over identical
inputs, its checkpoints stay sharded on the devices (the host tier keeps each process's shards), and what
finishes in the background at a time of its own (disk saves and reads) is observed by the leader and
applied by every process at the same step, from the leader's observations in the step log (`StepLog`,
`StepEvents`: typed here, JSON only on the wire).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from serve.engine.engine import Engine, EngineConfig, GenerateResult, RequestOutput
from serve.engine.records import NO_EVENTS, Ledger, MemoryReport, StepEvents
from serve.engine.requests import QueueState
from serve.engine.sampling import SamplingParams
from serve.engine.speculative import SpeculationStats
from sharding.multihost import Peers


class ReplicatedEngineError(RuntimeError):
    """Misuse of a replicated engine (an intake call on a follower, a step after close)."""


def check_engine_config(config: EngineConfig) -> EngineConfig:
    """The engine settings for a multi-process run (every setting works with several processes)."""
    return config


@dataclasses.dataclass
class StepLog:
    """What process 0 sends every process before a step: the intake operations since the last step (in
    order: ["add", id, prompt, sampling fields, cache salt], ["abort", id], ["forget", id]), whether to
    close, and what its engine observed finishing in the background. JSON on the wire only."""

    ops: list[list[Any]] = dataclasses.field(default_factory=list)
    close: bool = False
    events: StepEvents = NO_EVENTS

    def says_something(self) -> bool:
        return bool(self.ops) or self.close or self.events.has_news()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"log": self.ops, "close": self.close}
        if self.events.has_news():
            out["events"] = self.events.to_json()
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StepLog:
        events = StepEvents.from_json(data["events"]) if "events" in data else NO_EVENTS
        return cls(data["log"], data["close"], events)


class ReplicatedEngine:
    """Runs `engine` in lockstep on every process; process 0 owns the intake (see the module doc).

    In a single process this is a thin pass-through (no broadcast), so callers can use it unconditionally.

    `idle_wait_s` (a server): the leader reports work at all times (`has_unfinished`), and a step with
    nothing to do waits that long before its broadcast, so an idle server still steps (the followers,
    blocked in the broadcast, hear from it every `idle_wait_s`) without spinning, and a new request waits
    at most that long."""

    def __init__(self, engine: Engine, idle_wait_s: float | None = None):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.process_index = jax.process_index()
        self.process_count = jax.process_count()
        self.is_leader = self.process_index == 0
        self.peers = Peers(self.process_index, self.process_count)
        if self.process_count > 1:  # every process plans the same steps: no decision may read its clock
            engine.step_costs.lockstep()
        self.closed = False
        self._log: list[list[Any]] = []  # leader: operations applied since the last broadcast
        self._close = False
        self.broadcast_bytes = 0  # payload bytes broadcast so far (without padding)

    # --- EngineAPI: what is not replicated reads the local engine ----------------------------------------
    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def has_draft_model(self) -> bool:
        return self.engine.has_draft_model

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_ids, params)

    def active_requests(self) -> list[Any]:
        return self.engine.active_requests()

    def queue_state(self) -> QueueState:
        return self.engine.queue_state()

    def result(self, request_id: str) -> GenerateResult:
        return self.engine.result(request_id)

    def flush(self) -> None:
        self.engine.flush()

    def ledger(self) -> Ledger:
        return self.engine.ledger()

    def memory(self) -> MemoryReport:
        return self.engine.memory()

    def speculation_stats(self) -> SpeculationStats:
        return self.engine.speculation_stats()

    # --- intake (leader only) -------------------------------------------------------------------------
    def _leader_only(self, what: str) -> None:
        if not self.is_leader:
            raise ReplicatedEngineError(
                f"{what} is only called on process 0 (this is process {self.process_index})"
            )
        if self.closed or self._close:
            raise ReplicatedEngineError(f"{what} after close()")

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> str:
        """`Engine.add_request` here, and on every process at the next step (same id, same seed)."""
        self._leader_only("add_request")
        rid = self.engine.add_request(prompt_ids, params, request_id, cache_salt)
        req = self.engine.requests[rid]
        fields = dataclasses.asdict(dataclasses.replace(req.params, seed=req.seed))
        fields["stop_token_ids"] = [int(t) for t in fields["stop_token_ids"]]
        self._log.append(["add", rid, req.prompt, fields, cache_salt])
        return rid

    def abort(self, request_id: str) -> None:
        """`Engine.abort` here, and on every process at the next step."""
        self._leader_only("abort")
        self.engine.abort(request_id)
        self._log.append(["abort", request_id])

    def forget(self, request_id: str) -> None:
        """`Engine.forget` here, and on every process at the next step (keeps the request tables equal)."""
        self._leader_only("forget")
        self.engine.forget(request_id)
        self._log.append(["forget", request_id])

    def close(self) -> None:
        """Tell every process to leave its loop; takes effect at the next `step` (which then runs nothing)."""
        self._leader_only("close")
        self._close = True

    def has_unfinished(self) -> bool:
        """Unfinished requests, or operations not yet sent (the next step sends them); always True on a
        leader of several processes with `idle_wait_s` (it keeps the followers stepping)."""
        if self.idle_wait_s is not None and self.process_count > 1 and not self.closed:
            return True
        return bool(self._log) or self.engine.has_unfinished()

    def waits_for_reads(self) -> bool:
        """`Engine.waits_for_reads` with one process. With several never: the followers wait in the leader's
        next broadcast, so the leader keeps stepping (its engine's wait for a read paces those steps)."""
        if self.process_count > 1 or self._log or self._close:
            return False
        return self.engine.waits_for_reads()

    def on_read_done(self, fn: Callable[[], None] | None) -> None:
        self.engine.on_read_done(fn)

    # --- the lockstep -------------------------------------------------------------------------------
    def _exchange(self) -> StepLog:
        """The leader's log since the last step, its close flag, and what its engine observed finishing in
        the background (`Engine.observe`), on every process. Nothing to say costs one small collective."""
        sent = None
        if self.is_leader:
            events = self.engine.observe()
            log = StepLog(self._log, self._close, NO_EVENTS if events is None else events)
            self._log = []
            if self.process_count == 1:
                return log
            if log.says_something():
                sent = log.to_json()
        got = self.peers.broadcast(sent)
        if got is None:
            return StepLog()
        self.broadcast_bytes += len(json.dumps(got))  # payload bytes (without padding), alike everywhere
        return StepLog.from_json(got)

    def _replay(self, log: list[list[Any]]) -> None:
        """A follower applies the leader's operations in the leader's order."""
        for op in log:
            if op[0] == "add":
                _, rid, prompt, fields, salt = op
                fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
                self.engine.add_request(prompt, SamplingParams(**fields), rid, salt)
            elif op[0] == "abort":
                self.engine.abort(op[1])
            elif op[0] == "forget":
                self.engine.forget(op[1])
            else:
                raise ReplicatedEngineError(f"unknown operation {op[0]!r} from process 0")

    def step(self) -> list[RequestOutput]:
        """Bring every process to the leader's requests, then one `Engine.step`. Every process must call it
        the same number of times; after a close, returns [] and sets `closed`."""
        if self.closed:
            raise ReplicatedEngineError("step() after close")
        idle = self.is_leader and not (self._log or self._close or self.engine.has_unfinished())
        if idle and self.idle_wait_s is not None:
            time.sleep(self.idle_wait_s)
        log = self._exchange()
        if not self.is_leader:
            self._replay(log.ops)
        if log.close:
            self.closed = True
            return []
        return self.engine.step(log.events if log.events.has_news() else NO_EVENTS)

    def recover(self, reason: str) -> list[RequestOutput]:
        """A failed step cannot be recovered with several processes (the lockstep is broken, a collective
        may have failed with a peer): raise, so the server reports itself down at once."""
        if self.process_count > 1:
            raise ReplicatedEngineError(f"a step failed with several processes: {reason}")
        return self.engine.recover(reason)

    def follow(self) -> int:
        """A follower's loop: step until the leader closes; returns the number of steps run."""
        steps = 0
        while not self.closed:
            self.step()
            steps += 1
        return steps

    def generate(
        self, requests: Sequence[tuple[Sequence[int], SamplingParams, str | None]]
    ) -> list[GenerateResult] | None:
        """Serve (prompt, params, cache_salt) requests to completion on every process, then close. The leader
        validates all first (on an invalid one it serves none, closes, and raises) and gets the results in
        order; followers get None."""
        if not self.is_leader:
            self.follow()
            return None
        try:
            for prompt, params, _ in requests:
                self.engine.validate(prompt, params)
        except Exception:
            self.close()  # release the followers
            self.step()
            raise
        ids = [self.add_request(p, s, cache_salt=salt) for p, s, salt in requests]
        while self.has_unfinished():
            self.step()
        self.close()
        self.step()
        return [self.engine.result(i) for i in ids]
