"""Speculative decoding: where drafted tokens come from, how many a request may draft, and its settings.

A decode row may carry up to k tokens drafted to follow its last sampled one; the runner's `verify` program
checks them all in one call (`serve.engine.sampling.verify`) and leaves the row's KDA state, conv window and
latent KV as if it had decoded only the tokens that stand. The scheduler decides how many a row may draft
(`DraftPlanner`): never past a position where the prefix store checkpoints, past max_tokens, or into blocks
it would have to evict or preempt for; and drafts stop before a stop token. So every event that reads a
row's state (a checkpoint, the end of a sequence) falls at the end of its verified window, whose state is
the one written.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

# The most drafted tokens a step may verify per row: its program's length - 1, so that a verified window
# attends as a decode step does (`jaxhybrid.layers.mla.ABSORBED_MAX_TOKENS`).
MAX_SPECULATIVE_TOKENS = 15


FIRST_PAUSE = 8  # the steps a request stops drafting for the first time its drafts stop paying


class DraftMethod(enum.StrEnum):
    OFF = "off"
    NGRAM = "ngram"  # prompt lookup: the tokens that followed the latest earlier match of the last n tokens
    DRAFT = "draft"  # the server's draft model (`serve.engine.drafting`)


class SpeculationError(ValueError):
    """Invalid speculative settings; the message names the problem."""


@dataclasses.dataclass(frozen=True)
class Speculation:
    """How a request drafts: `method`, and `num_tokens` (k), the most drafted tokens one step verifies."""

    method: DraftMethod = DraftMethod.OFF
    num_tokens: int = 4

    @property
    def enabled(self) -> bool:
        return self.method is not DraftMethod.OFF

    def validate(self, limit: int = MAX_SPECULATIVE_TOKENS) -> None:
        """Raise SpeculationError unless the method is known and 1 <= num_tokens <= `limit`."""
        if not isinstance(self.method, DraftMethod):
            raise SpeculationError(f"speculative method must be one of {[m.value for m in DraftMethod]}")
        k = self.num_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= limit:
            raise SpeculationError(f"num_speculative_tokens must be an int in [1, {limit}], got {k!r}")

    @classmethod
    def parse(cls, method: object, num_tokens: object = 4) -> Speculation:
        """From user input (a flag, a request's field): raises SpeculationError naming what is wrong."""
        if not isinstance(method, str) or method not in {m.value for m in DraftMethod}:
            raise SpeculationError(
                f"speculative method must be one of {[m.value for m in DraftMethod]}, got {method!r}"
            )
        spec = cls(DraftMethod(method), num_tokens)  # type: ignore[arg-type]
        spec.validate()
        return spec


class DraftSource(Protocol):
    """Proposes up to `k` tokens to follow a request's tokens (`req.tokens`: its prompt and what it generated
    so far). A source that runs programs of its own (a draft model) also says how many it has run so far,
    `programs_run() -> int`: a drafting during which that grew compiled or loaded one, and its time is not
    what drafting costs a step."""

    def propose(self, req: Any, k: int) -> list[int]: ...


def count_programs(source: Any) -> int:
    """How many programs of its own `source` has run so far (`DraftSource`; 0 for one that runs none)."""
    count = getattr(source, "programs_run", None)
    return 0 if count is None else count()


@dataclasses.dataclass
class NgramIndex:
    """The latest start of every n-gram (n in `sizes`) of a growing token list that has a token after it,
    brought up to date in the time of the tokens added since the last call."""

    sizes: range
    latest: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    size: int = 0  # the list's length when last brought up to date

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix of `tokens` that has one."""
        for n in self.sizes:
            for start in range(max(0, self.size - n), max(0, len(tokens) - n)):
                self.latest[tuple(tokens[start : start + n])] = start
        self.size = len(tokens)
        for n in reversed(self.sizes):
            start = self.latest.get(tuple(tokens[len(tokens) - n :])) if len(tokens) > n else None
            if start is not None:
                return [int(t) for t in tokens[start + n : start + n + k]]
        return []


@dataclasses.dataclass
class PromptLookup:
    """Prompt-lookup drafts (vLLM's `ngram`): for n from `max_n` down to `min_n`, find the latest earlier
    occurrence of the last n tokens and propose the k tokens that followed it. Each request keeps its own
    index of n-grams (`Request.ngrams`), extended by the tokens it gained since its last step."""

    min_n: int = 2
    max_n: int = 4

    def propose(self, req: Any, k: int) -> list[int]:
        if req.ngrams is None:
            req.ngrams = NgramIndex(range(self.min_n, self.max_n + 1))
        return req.ngrams.lookup(req.tokens, k)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The drafts for `tokens` (from a new index)."""
        return NgramIndex(range(self.min_n, self.max_n + 1)).lookup(list(tokens), k)


class StepCosts:
    """Seconds of a decode step by its rows, with and without drafts (the median of the last `window` steps
    of each: a step slowed by the machine's other work moves it little, a context that grows moves it), and
    whether a step with drafts pays: its expected tokens per second at least `margin` times a plain step's
    (a step that merely breaks even gains nothing, and the estimates err both ways). A verify
    step runs every row over the longest window, so on hardware where that costs much more than one token
    (a CPU's MoE reads more experts for more tokens) drafts that stand only now and then lose; until both
    are measured for a row count it tries the missing one. Where drafts do not pay it tries them again
    after `retry` plain steps, then after twice as many each time a try was all that verified (up to
    `longest_retry`), and after `retry` again once drafts paid (0: every step with drafts verifies them). A
    step that compiled (or first loaded) a program is not counted, nor the first step of each kind.
    Drafting counts toward the step it drafted for (a draft model runs programs of its own)."""

    def __init__(self, retry: int = 64, margin: float = 1.2, window: int = 9, longest_retry: int = 4096):
        self.retry, self.margin, self.longest_retry = retry, margin, longest_retry
        self.window = window
        self._recent: dict[tuple[bool, int], collections.deque[float]] = {}
        self._seen: set[tuple[bool, int]] = set()
        self._since_verify: dict[int, int] = {}
        self._retry_after: dict[int, int] = {}  # by row count: plain steps before drafts are tried again
        self._drafting = 0.0
        self._drafting_compiled = False

    def drafted(self, seconds: float, compiled: bool = False) -> None:
        """Time spent drafting for the coming step; `compiled`: the drafting first ran a program of its own
        (the coming step is then not counted, as one that compiled)."""
        self._drafting += seconds
        self._drafting_compiled |= compiled

    def observe(self, verify: bool, rows: int, seconds: float, compiled: bool = False) -> None:
        """A step of `rows` rows (`verify`: with drafts) took `seconds`; `compiled`: it first ran a program
        (its time went mostly to compiling it, not to the step)."""
        seconds, self._drafting = seconds + self._drafting, 0.0
        compiled, self._drafting_compiled = compiled or self._drafting_compiled, False
        key = (verify, rows)
        if verify:  # a try (drafts verified only because it was time to) backs off; drafts that paid reset it
            wait = self._wait(rows)
            tried = self.retry > 0 and self._since_verify.get(rows, 0) >= wait
            self._retry_after[rows] = min(2 * wait, self.longest_retry) if tried else self.retry
        self._since_verify[rows] = 0 if verify else self._since_verify.get(rows, 0) + 1
        if compiled:
            return
        if key not in self._seen:
            self._seen.add(key)
            return
        self._recent.setdefault(key, collections.deque(maxlen=self.window)).append(seconds)

    def seconds(self, verify: bool, rows: int) -> float | None:
        """What a step of `rows` rows costs (`verify`: with drafts), None before one was counted."""
        recent = self._recent.get((verify, rows))
        return statistics.median(recent) if recent else None

    def pays(self, rows: int, expected_tokens: float) -> bool:
        """Whether a step of `rows` rows that are expected to give `expected_tokens` tokens with drafts
        should verify them (else it decodes one token a row)."""
        verify, plain = self.seconds(True, rows), self.seconds(False, rows)
        if verify is None or self._since_verify.get(rows, 0) >= self._wait(rows):
            return True
        if plain is None:
            return False
        return expected_tokens * plain >= self.margin * rows * verify

    def _wait(self, rows: int) -> int:
        return self._retry_after.get(rows, self.retry)


class DraftPlanner:
    """The scheduler's part in speculation: which decode rows carry drafts this step, and how many. A row
    drafts within what is left of the step's token budget and of the free blocks (a draft never evicts or
    preempts), never past a checkpoint position of the prefix store or the request's max_tokens, and stops
    before a stop token: whatever of a window stands, the row's checkpoints and its end then fall at the
    window's end. A step verifies its drafts only when that is expected to pay (`StepCosts`)."""

    def __init__(
        self,
        shape: Any,
        allocator: Any,
        store: Any,
        drafter: DraftSource,
        stop_ids: Callable[[Any], frozenset[int]],
        costs: StepCosts | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.shape, self.allocator, self.store = shape, allocator, store
        self.drafter, self.stop_ids = drafter, stop_ids
        self.costs, self.clock = costs or StepCosts(), clock

    def plan(self, decode: list[Any], budget: int) -> dict[str, list[int]]:
        """Drafted tokens by request id for `decode` rows of requests that speculate (blocks for them taken
        from the free ones now), or none when verifying them is not expected to pay."""
        out: dict[str, list[int]] = {}
        needs: dict[str, int] = {}
        free, expected = self.allocator.num_free, float(len(decode))
        limits = {r.id: r.drafting.limit() for r in decode if r.drafting is not None}
        best = len(decode) + sum(r.drafting.expected(limits[r.id]) for r in decode if r.id in limits)
        if not limits or not self.costs.pays(self.shape.decode_rows(len(decode)), best):
            return out  # not even every draft standing as often as before would pay: propose none
        t0, programs = self.clock(), count_programs(self.drafter)
        for req in decode:
            if req.id not in limits or budget <= 0:
                continue
            drafts = self._drafts(req, min(budget, limits[req.id]), free)
            if not drafts:
                continue
            need = math.ceil((req.num_computed + 1 + len(drafts)) / self.shape.block_size) - len(req.blocks)
            needs[req.id], free = max(need, 0), free - max(need, 0)
            out[req.id] = drafts
            budget -= len(drafts)
            expected += req.drafting.expected(len(drafts))
        self.costs.drafted(self.clock() - t0, compiled=count_programs(self.drafter) != programs)
        if not out or not self.costs.pays(self.shape.decode_rows(len(decode)), expected):
            return {}
        for req in decode:
            if needs.get(req.id):
                req.blocks += self.allocator.allocate(needs[req.id])
        return out

    def _drafts(self, req: Any, budget: int, free: int) -> list[int]:
        n = req.num_computed
        k = min(self.shape.speculative_tokens, budget)
        k = min(k, req.params.max_tokens - len(req.generated) - 1)
        if self.store is not None:
            k = min(k, self.store.chunk_limit(req) - 1)
        if k <= 0:
            return []
        drafts = truncate_at_stop(self.drafter.propose(req, k)[:k], self.stop_ids(req))
        room = (len(req.blocks) + free) * self.shape.block_size - (n + 1)
        return drafts[: max(room, 0)]


def drafting(
    params_spec: Speculation | None, default: Speculation, engine: EngineAcceptance | None = None
) -> AdaptiveK | None:
    """A new request's drafting state: from its own settings, else the engine's (None: it does not
    speculate); its acceptance starts from what `engine` measured of its method's drafts."""
    spec = params_spec or default
    if not spec.enabled:
        return None
    base = None if engine is None else engine.of(spec.method)
    return AdaptiveK(spec.num_tokens, spec.method, acceptance=Acceptance(base=base))


class Drafters:
    """The draft source of each method (a request drafts from its own method's)."""

    def __init__(self, by_method: dict[DraftMethod, DraftSource]):
        self.by_method = by_method

    def propose(self, req: Any, k: int) -> list[int]:
        return self.by_method[req.drafting.method].propose(req, k)

    def programs_run(self) -> int:
        return sum(count_programs(source) for source in self.by_method.values())


def truncate_at_stop(drafts: list[int], stop_ids: frozenset[int]) -> list[int]:
    """`drafts` up to (not including) its first stop token: a sequence then ends only at a window's end."""
    for i, token in enumerate(drafts):
        if token in stop_ids:
            return drafts[:i]
    return drafts


@dataclasses.dataclass
class Acceptance:
    """How far drafts stand, as a geometric law: each drafted token stands with probability q once those
    before it did, so a window of n drafts is expected to give q + q^2 + ... + q^n accepted tokens. Each
    verified window counts its accepted drafts as successes and its rejection (if one came) as one failure,
    both decayed by `decay` per window (recent windows count more); `weight` pseudo-trials of the prior q
    (`base`'s current q, else `prior`) pull the estimate while the windows are few."""

    base: Acceptance | None = None
    prior: float = 1.0  # before any window: every draft stands, so that drafting gets tried at all
    weight: float = 1.0
    decay: float = 0.8
    stood: float = 0.0
    fell: float = 0.0

    def q(self) -> float:
        prior = self.prior if self.base is None else self.base.q()
        return (self.stood + self.weight * prior) / (self.stood + self.fell + self.weight)

    def expected(self, drafts: int) -> float:
        """Accepted tokens expected of `drafts` drafted ones."""
        q = self.q()
        return sum(q**j for j in range(1, drafts + 1))

    def record(self, drafted: int, accepted: int) -> None:
        self.stood = self.decay * self.stood + accepted
        self.fell = self.decay * self.fell + (accepted < drafted)
        if self.base is not None:
            self.base.record(drafted, accepted)


class EngineAcceptance:
    """An engine's acceptance by draft method (a slower `Acceptance` over all its requests' windows): the
    prior of each new request's, so that a request starts from what drafts did lately, not from the belief
    that every draft stands."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.by_method: dict[DraftMethod, Acceptance] = {}

    def of(self, method: DraftMethod) -> Acceptance:
        return self.by_method.setdefault(method, Acceptance(decay=self.decay))


@dataclasses.dataclass
class AdaptiveK:
    """A request's draft length and its drafts' acceptance (`Acceptance`). A draft model's length (each
    drafted token one step of it): after a window accepted in full, one more (up to `most`); after a
    rejection, one more than it accepted. Prompt lookup's stays `most`: a lookup costs nothing and a verify
    window runs at its full length whatever a row drafts, so fewer drafts would save nothing. When the
    acceptance's q falls below `floor` the request stops drafting for `pause` steps, a pause that doubles each
    time (up to `longest_pause`) and resets once a draft stands again. Whether a step verifies the drafts at
    all is the step's decision (`StepCosts`), from the tokens they are expected to give."""

    most: int
    method: DraftMethod = DraftMethod.NGRAM
    k: int = 0
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
    paused: int = 0
    pause: int = FIRST_PAUSE
    floor: float = 0.25
    longest_pause: int = 256

    def __post_init__(self) -> None:
        self.k = self.k or self.most

    def limit(self) -> int:
        """How many tokens this step may draft (0 while paused; each call is one step)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.k

    def expected(self, drafts: int) -> float:
        """Accepted tokens expected of `drafts` drafted ones."""
        return self.acceptance.expected(drafts)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.acceptance.record(drafted, accepted)
        if self.method is DraftMethod.NGRAM:
            self.k = self.most
        else:
            self.k = min(self.k + 1, self.most) if accepted == drafted else max(1, accepted + 1)
        if self.acceptance.q() < self.floor:
            self.paused = self.pause
            self.pause = min(2 * self.pause, self.longest_pause)
        elif accepted:
            self.pause = FIRST_PAUSE


@dataclasses.dataclass
class SpeculationStats:
    """A request's (or an engine's) drafting so far: verified windows, drafted and accepted tokens."""

    windows: int = 0  # steps of a request that carried drafts
    drafted: int = 0
    accepted: int = 0

    def add(self, drafted: int, accepted: int) -> None:
        self.windows += 1
        self.drafted += drafted
        self.accepted += accepted

    @property
    def mean_accepted(self) -> float:
        """Accepted drafts per verify step (the tokens a step gave beyond one)."""
        return self.accepted / self.windows if self.windows else 0.0
