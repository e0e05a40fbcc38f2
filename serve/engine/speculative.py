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

# What steps and drafts are taken to cost, in plain steps, where every process of a replicated engine must
# decide alike (`StepCosts.lockstep`): a clock's readings differ from process to process.
LOCKSTEP_STEP = {False: 1.0, True: 2.0}  # a plain step, a verify step
LOCKSTEP_DRAFT_TOKEN = {"ngram": 0.0, "draft": 0.25}  # one drafted token, by method


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


def draft_lengths(most: int) -> tuple[int, ...]:
    """The lengths a draft model drafts at, for an engine whose verify steps carry up to `most` drafts: the
    powers of two below `most`, and `most`. Its run-ahead has one program per length (and table width), so
    a shorter draft runs fewer of its steps; a length between two runs the longer one's, cut."""
    out, n = {most}, 1
    while n < most:
        out.add(n)
        n *= 2
    return tuple(sorted(out))


@dataclasses.dataclass(frozen=True)
class Offer:
    """A decode row that may draft this step: its `method`, the accepted tokens it expects of n drafts
    (`expected(n)`), and the lengths it may draft at (ascending)."""

    method: DraftMethod
    expected: Callable[[int], float]
    lengths: tuple[int, ...]


class Joined(Sequence[int]):
    """`head + tail` without building it: a request's tokens (its prompt and what it generated), of which a
    step reads only a few, as lookups and shadow windows do."""

    __slots__ = ("head", "tail")

    def __init__(self, head: Sequence[int], tail: Sequence[int]):
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, i: Any) -> Any:
        n = len(self.head)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            stop = max(start, stop)
            if start >= n:
                return list(self.tail[start - n : stop - n])
            return list(self.head[start:stop]) + list(self.tail[: max(0, stop - n)])
        i = i + len(self) if i < 0 else i
        return self.head[i] if i < n else self.tail[i - n]


@dataclasses.dataclass
class NgramIndex:
    """The latest start of every n-gram (n in `sizes`) of a growing token list that has a token after it,
    brought up to date in the time of the tokens added since the last call."""

    sizes: range
    latest: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    size: int = 0  # the list's length when last brought up to date

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the longest suffix of `tokens` that has one.
        `tokens` only grows from call to call; what is read of it is one slice (the tokens since the last
        call and the few before them) and the drafts."""
        size = len(tokens)
        base = max(0, self.size - self.sizes[-1])
        recent = list(tokens[base:size])  # every n-gram that ends in a new token, and the suffixes
        for n in self.sizes:
            lo, hi = max(0, self.size - n), max(0, size - n)
            if hi > lo:  # each n-gram starting in [lo, hi) by its start, later ones over earlier
                grams = zip(*(recent[lo - base + j : hi - base + j] for j in range(n)), strict=True)
                self.latest.update(zip(grams, range(lo, hi), strict=True))
        self.size = size
        for n in reversed(self.sizes):
            start = self.latest.get(tuple(recent[len(recent) - n :])) if size > n else None
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
        return req.ngrams.lookup(Joined(req.prompt, req.generated), k)

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The drafts for `tokens` (from a new index)."""
        return NgramIndex(range(self.min_n, self.max_n + 1)).lookup(list(tokens), k)


class StepCosts:
    """Seconds of a decode step by its rows, with and without drafts (the median of the last `window` steps
    of each: a step slowed by the machine's other work moves it little, a context that grows moves it), and
    seconds of one row's drafting by method and length (a draft model runs a step of its own per drafted
    token; a lookup costs next to nothing). From them: how many tokens each row drafts (`lengths`) and
    whether a step with drafts pays (`pays`): its expected tokens per second at least `margin` times a plain
    step's (a step that merely breaks even gains nothing, and the estimates err both ways). A verify step
    runs every row over the longest window, so on hardware where that costs much more than one token (a
    CPU's MoE reads more experts for more tokens) drafts that stand only now and then lose; until both are
    measured for a row count it tries the missing one. Where drafts do not pay it tries them again after
    `retry` plain steps, then after twice as many each time a try was all that verified (up to
    `longest_retry`), and after `retry` again once drafts paid (0: every step with drafts verifies them). A
    step that compiled (or first loaded) a program is not counted, nor its draftings, nor the first of each
    kind.

    `lockstep()`: the engine runs in lockstep with other processes (`serve.engine.replicated`), each of which
    must plan the same steps; the seconds it is told are replaced by fixed ones (`LOCKSTEP_STEP`,
    `LOCKSTEP_DRAFT_TOKEN`), so its decisions follow the tokens alone."""

    def __init__(self, retry: int = 64, margin: float = 1.2, window: int = 9, longest_retry: int = 4096):
        self.retry, self.margin, self.longest_retry = retry, margin, longest_retry
        self.window = window
        self._recent: dict[tuple[bool, int], collections.deque[float]] = {}
        self._ratios: dict[int, collections.deque[float]] = {}  # by row count: verify over plain seconds
        self._seen: set[tuple[bool, int]] = set()
        self._drafts: dict[tuple[DraftMethod, int], collections.deque[float]] = {}  # by (method, length)
        self._drafts_seen: set[tuple[DraftMethod, int]] = set()
        self._since_verify: dict[int, int] = {}
        self._retry_after: dict[int, int] = {}  # by row count: plain steps before drafts are tried again
        self.decay = 0.9
        self._expected: tuple[int, float] | None = None
        self._drafts_expected = self._drafts_gave = 0.0
        self.locked = False

    def lockstep(self) -> None:
        """From now on decide from fixed costs, not from the clock (see the class doc)."""
        self.locked = True
        self._recent.clear()
        self._ratios.clear()
        self._drafts.clear()

    def drafted(self, method: DraftMethod, tokens: int, seconds: float, compiled: bool = False) -> None:
        """One row's drafting of `tokens` tokens by `method` took `seconds`; `compiled`: it first ran a
        program of its own (its time went to compiling it)."""
        if self.locked:
            seconds, compiled = LOCKSTEP_DRAFT_TOKEN[method.value] * tokens, False
        key = (method, tokens)
        if compiled or tokens <= 0:
            return
        if key not in self._drafts_seen:  # the first of each kind, as with steps
            self._drafts_seen.add(key)
            return
        self._drafts.setdefault(key, collections.deque(maxlen=self.window)).append(seconds)

    def draft_seconds(self, method: DraftMethod, tokens: int) -> float:
        """What one row's drafting of `tokens` tokens by `method` costs: the median of its recent draftings
        at that length; else a line through the lengths measured (through 0 where one is); 0 before any, so
        that drafts are tried (and measured)."""
        if tokens <= 0:
            return 0.0
        known = {n: statistics.median(d) for (m, n), d in self._drafts.items() if m is method and d}
        if tokens in known:
            return known[tokens]
        if len(known) < 2:
            return sum(s * tokens / n for n, s in known.items())
        slope, intercept = statistics.linear_regression(list(known), list(known.values()))
        return max(intercept + slope * tokens, 0.0)

    def observe(self, verify: bool, rows: int, seconds: float, compiled: bool = False) -> None:
        """A step of `rows` rows (`verify`: with drafts) took `seconds`; `compiled`: it first ran a program
        (its time went mostly to compiling it, not to the step)."""
        if self.locked:
            seconds, compiled = LOCKSTEP_STEP[verify], False
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
        plain = self.seconds(False, rows)
        if verify and plain:
            self._ratios.setdefault(rows, collections.deque(maxlen=self.window)).append(seconds / plain)
        self._recent.setdefault(key, collections.deque(maxlen=self.window)).append(seconds)

    def seconds(self, verify: bool, rows: int) -> float | None:
        """What a step of `rows` rows costs (`verify`: with drafts), None before one was counted. A verify
        step's is a plain step's now times its recent ratio to the plain step of its time, where known: a
        context that grows slows both, and verify steps are measured the more rarely."""
        recent = self._recent.get((verify, rows))
        if not recent:
            return None
        ratios = self._ratios.get(rows) if verify else None
        plain = self.seconds(False, rows) if ratios else None
        return plain * statistics.median(ratios) if plain else statistics.median(recent)

    def lengths(self, rows: int, running: int, offers: Sequence[Offer]) -> list[int] | None:
        """How many tokens each of `offers` drafts this step (0: none), for the most tokens per second of a
        verify step of `rows` rows (its program's; `running` of them requests): its tokens (the requests'
        one each and the drafts' expected, scaled as in `pays`) over its seconds (the step's and the rows'
        drafting). That ratio is maximised by Dinkelbach's iteration: each row's length for the current
        rate (its expected tokens less the rate times its drafting's seconds), then the rate of those
        lengths, until the rate stops rising. None where the best does not beat a plain step by `margin`.
        Until a verify step is measured, or when it is time to try drafts again, every row drafts its
        longest."""
        verify, plain = self.seconds(True, rows), self.seconds(False, rows)
        if verify is None or self._since_verify.get(rows, 0) >= self._wait(rows):
            return [o.lengths[-1] for o in offers]
        if plain is None:
            return None
        scale, costs = self.calibration(), {}
        for o in offers:  # what each (method, length) costs, once a step
            for n in o.lengths:
                if (o.method, n) not in costs:
                    costs[o.method, n] = self.draft_seconds(o.method, n)
        # each row's candidates: (length, tokens it is expected to add, seconds its drafting costs)
        tables = [
            [(0, 0.0, 0.0)] + [(n, scale * o.expected(n), costs[o.method, n]) for n in o.lengths]
            for o in offers
        ]
        picks, rate = [t[-1] for t in tables], 0.0
        for _ in range(32):  # the rate rises at every round and the choices are finite: a few rounds
            new = (running + sum(p[1] for p in picks)) / (verify + sum(p[2] for p in picks))
            if new <= rate * (1 + 1e-12):
                break
            rate = new
            picks = [max(t, key=lambda p: p[1] - rate * p[2]) for t in tables]
        return [p[0] for p in picks] if rate * plain >= self.margin * running else None

    def pays(self, rows: int, expected_tokens: float, running: int | None = None) -> bool:
        """Whether a step of `rows` rows (its program's; `running` of them requests, default all) that are
        expected to give `expected_tokens` tokens with drafts made already should verify them (else it
        decodes one token a request). The tokens drafts are expected to add are scaled by what verified
        steps gave against what they were expected to (`verified`): the steps chosen are those whose
        estimate ran high."""
        running = rows if running is None else running
        verify, plain = self.seconds(True, rows), self.seconds(False, rows)
        if verify is None or self._since_verify.get(rows, 0) >= self._wait(rows):
            return True
        if plain is None:
            return False
        expected_tokens = running + self.calibration() * (expected_tokens - running)
        return expected_tokens * plain >= self.margin * running * verify

    def expect(self, running: int, expected_tokens: float) -> None:
        """The coming verify step's `running` requests are expected to give `expected_tokens` tokens."""
        self._expected = (running, expected_tokens)

    def verified(self, tokens: int) -> None:
        """The verify step `expect` spoke of gave `tokens` tokens."""
        if self._expected is None:
            return
        (running, expected), self._expected = self._expected, None
        self._drafts_expected = self.decay * self._drafts_expected + (expected - running)
        self._drafts_gave = self.decay * self._drafts_gave + (tokens - running)

    def calibration(self) -> float:
        """Tokens verified drafts gave over what they were expected to (recent steps weighted more, half a
        token's worth of prior at 1), within [0.5, 1.5]: it corrects an estimate, it does not stop drafting
        (a row's acceptance does that), so a ratio learned while drafts missed cannot keep verify steps
        off once they stand again."""
        ratio = (self._drafts_gave + 0.5) / (self._drafts_expected + 0.5)
        return min(max(ratio, 0.5), 1.5)

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
        from the free ones now), or none when verifying them is not expected to pay. Each row drafts the
        length `StepCosts.lengths` chooses for it (a draft model's at one of `draft_lengths`)."""
        out: dict[str, list[int]] = {}
        needs: dict[str, int] = {}
        free, expected = self.allocator.num_free, float(len(decode))
        offers: dict[str, Offer] = {}
        for req in decode:
            if req.drafting is not None:
                req.drafting.settle(Joined(req.prompt, req.generated))
                k = req.drafting.limit()
                if k > 0:
                    offers[req.id] = Offer(req.drafting.method, req.drafting.expected, self._lengths(req, k))
        rows = self.shape.decode_rows(len(decode))
        chosen = self.costs.lengths(rows, len(decode), list(offers.values())) if offers else None
        if chosen is None or not any(chosen):
            self._shadow(decode)  # drafting is not expected to pay: only the free lookups, to learn
            return out
        lengths = dict(zip(offers, chosen, strict=True))
        timed: list[tuple[DraftMethod, int, float]] = []  # each row's drafting: (method, length, seconds)
        programs = count_programs(self.drafter)
        for req in decode:
            n = min(budget, lengths.get(req.id, 0))
            if n <= 0:
                continue
            t0 = self.clock()
            drafts = self._drafts(req, n, free)
            timed.append((req.drafting.method, n, self.clock() - t0))
            if not drafts:
                continue
            need = math.ceil((req.num_computed + 1 + len(drafts)) / self.shape.block_size) - len(req.blocks)
            needs[req.id], free = max(need, 0), free - max(need, 0)
            out[req.id] = drafts
            budget -= len(drafts)
            expected += req.drafting.expected(len(drafts))
        compiled = count_programs(self.drafter) != programs  # then no drafting of this step is what it costs
        for method, n, seconds in timed:
            self.costs.drafted(method, n, seconds, compiled)
        self._shadow([r for r in decode if r.id not in out])
        if not out or not self.costs.pays(rows, expected, len(decode)):
            for req in decode:
                if req.id in out:
                    req.drafting.watch(req.num_computed + 1, out[req.id])
            return {}
        for req in decode:
            if needs.get(req.id):
                req.blocks += self.allocator.allocate(needs[req.id])
        self.costs.expect(len(decode), expected)
        return out

    def _lengths(self, req: Any, k: int) -> tuple[int, ...]:
        """The lengths `req` may draft at this step, at most `k`: a lookup's cost does not grow with its
        length, so its own k; a draft model's, the lengths its run-ahead programs have."""
        if req.drafting.method is not DraftMethod.DRAFT:
            return (k,)
        return tuple(sorted({n for n in draft_lengths(self.shape.speculative_tokens) if n < k} | {k}))

    def _shadow(self, rows: list[Any]) -> None:
        """Prompt-lookup drafts for `rows` (which carry none this step: paused, or their drafting not
        expected to pay) that watch none, compared with the tokens that come instead of verified
        (`RowDrafting.watch`): what drafts would give keeps being measured while none are verified, and a
        paused row whose drafts stand again drafts again. A draft model's drafts are not made for this
        (each costs a step of it)."""
        for req in rows:
            k = req.drafting
            if k is not None and k.method is DraftMethod.NGRAM and k.watching():
                k.watch(req.num_computed + 1, self._propose(req, k.most))

    def _drafts(self, req: Any, budget: int, free: int) -> list[int]:
        k = min(self.shape.speculative_tokens, budget)
        if self.store is not None:
            k = min(k, self.store.chunk_limit(req) - 1)
        drafts = self._propose(req, k)
        room = (len(req.blocks) + free) * self.shape.block_size - (req.num_computed + 1)
        return drafts[: max(room, 0)]

    def _propose(self, req: Any, k: int) -> list[int]:
        """Up to `k` drafts for `req`, none past its max_tokens, ending before a stop token."""
        k = min(k, req.params.max_tokens - len(req.generated) - 1)
        if k <= 0:
            return []
        return truncate_at_stop(self.drafter.propose(req, k)[:k], self.stop_ids(req))


def drafting(
    params_spec: Speculation | None, default: Speculation, engine: EngineAcceptance | None = None
) -> RowDrafting | None:
    """A new request's drafting state: from its own settings, else the engine's (None: it does not
    speculate); its acceptance starts from what `engine` measured of its method's drafts."""
    spec = params_spec or default
    if not spec.enabled:
        return None
    base = None if engine is None else engine.of(spec.method)
    return RowDrafting(spec.num_tokens, spec.method, acceptance=Acceptance(base=base))


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
class RowDrafting:
    """A request's most drafts (`most`) and its drafts' acceptance (`Acceptance`). How many it drafts in a
    step is the step's choice (`StepCosts.lengths`, from the acceptance and what drafting costs: a lookup
    next to nothing, a draft model one of its steps a token). When the acceptance's q falls below `floor`
    the request stops drafting for `pause` steps, a pause that doubles each time (up to `longest_pause`)
    and resets once a draft stands again. Whether a step verifies the drafts at all is the step's decision
    (`StepCosts.pays`), from the tokens they are expected to give."""

    most: int
    method: DraftMethod = DraftMethod.NGRAM
    acceptance: Acceptance = dataclasses.field(default_factory=Acceptance)
    paused: int = 0
    pause: int = FIRST_PAUSE
    floor: float = 0.25
    longest_pause: int = 256
    # drafts compared with the tokens that come instead of verified: (position of the first, drafts)
    shadow: tuple[int, tuple[int, ...]] | None = None
    quiet: int = 0  # steps before the next shadow window (`watching`)

    def limit(self) -> int:
        """How many tokens this step may draft (0 while paused; each call is one step)."""
        if self.paused > 0:
            self.paused -= 1
            return 0
        return self.most

    def expected(self, drafts: int) -> float:
        """Accepted tokens expected of `drafts` drafted ones."""
        return self.acceptance.expected(drafts)

    def watching(self) -> bool:
        """Whether to start a shadow window now (each call is one step); every step would cost a lookup each
        for little more to learn."""
        if self.shadow is not None:
            return False
        self.quiet -= 1
        return self.quiet < 0

    def watch(self, position: int, drafts: Sequence[int]) -> None:
        """Drafts proposed for `position` on that were not verified: `settle` compares them with the tokens
        that come there (the window a verify step would have had; one at a time)."""
        if self.shadow is None and drafts:
            self.shadow = (position, tuple(drafts))

    def settle(self, tokens: Sequence[int]) -> None:
        """Count the watched drafts as a window of the acceptance (not of the pause, which is about what
        drafting costs) once `tokens` (the request's) show how far they stand."""
        if self.shadow is None:
            return
        position, drafts = self.shadow
        came = tokens[position : position + len(drafts)]
        accepted = next((i for i, (a, b) in enumerate(zip(came, drafts, strict=False)) if a != b), len(came))
        if accepted < len(came) or len(came) == len(drafts):
            self.shadow, self.quiet = None, self.most
            self.acceptance.record(len(drafts), accepted)
            if self.acceptance.q() >= self.floor:  # they stand again: no need to wait out a pause
                self.paused = 0

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.acceptance.record(drafted, accepted)
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

    def to_json(self) -> dict[str, Any]:
        """The counts and `mean_accepted`, for the HTTP server, the metrics and the benchmarks' rows."""
        return {**dataclasses.asdict(self), "mean_accepted": self.mean_accepted}
