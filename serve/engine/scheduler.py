"""The scheduler: host code only. From the queues, the free slots and blocks (and the prefix store's
matches) it plans one engine step: admissions (with the prefix restores they need), decode rows, prefill
chunks, and the preemptions that made room. It runs no model; the runner executes the plan.

Policy: requests are admitted in arrival order while a slot, the blocks for their first chunk and the token
budget allow (a request whose prefix is on disk waits for it in the background and lets the next one go
first). Every running request with one token to extend is decoded; prefill chunks (continuing ones in
admission order first, then the newly admitted) share the rest of the budget and end on checkpoint positions.
With the adaptive checkpoint policy a waiting request whose prompt shares a prefix that a running request is
still computing is passed over until that request has checkpointed the shared part (in-batch sharing; the
requests behind it go first). When blocks run out, cached blocks only the store holds are evicted first, then
the newest running request is preempted (recomputed from its tokens when it is readmitted). The plan is fixed
only once admission is done: a request preempted meanwhile keeps no job, one readmitted keeps only its newest.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from jaxhybrid.cache import SCRATCH_BLOCK
from serve.engine.blocks import BlockAllocator
from serve.engine.config import EngineShape
from serve.engine.records import Ledger, RequestMemory
from serve.engine.requests import FinishReason, QueueState, Request, RequestStatus
from serve.engine.runner import Restore
from serve.engine.speculative import DraftPlanner, DraftSource, PromptLookup, StepCosts
from serve.prefix.store import Attachment, Hit, HitLoads, PrefixLedger, PrefixStore

QUEUE_LOOKAHEAD = 64  # queued requests whose shared prefixes with running ones are cut each step


@dataclasses.dataclass
class Admission:
    """A request admitted this step: the device work before it runs (zero its slot, or restore a hit)."""

    request: Request
    order: int
    restore: Restore | None = None  # None: start from the empty state
    attachment: Attachment | None = None


@dataclasses.dataclass
class PrefillJob:
    request: Request
    tokens: int


@dataclasses.dataclass
class StepPlan:
    admissions: list[Admission] = dataclasses.field(default_factory=list)
    decode: list[Request] = dataclasses.field(default_factory=list)
    prefill: list[PrefillJob] = dataclasses.field(default_factory=list)
    preempted: list[Request] = dataclasses.field(default_factory=list)
    failed: list[tuple[Request, BaseException]] = dataclasses.field(default_factory=list)
    drafts: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # decode rows' drafted tokens


def prefill_calls(shape: EngineShape, jobs: list[PrefillJob]) -> list[list[PrefillJob]]:
    """A step's prefill jobs as program calls: chunks that pack (`EngineShape.packs`) `prefill_rows` to a
    call, after the others, which run one to a call, each kind in plan order."""
    packs = [shape.packs(j.tokens, len(j.request.blocks)) for j in jobs]
    short = [j for j, p in zip(jobs, packs, strict=True) if p]
    alone = [[j] for j, p in zip(jobs, packs, strict=True) if not p]
    return alone + [short[i : i + shape.prefill_rows] for i in range(0, len(short), shape.prefill_rows)]


class DiskLoads:
    """The requests waiting for their prefix to be read from disk (`loading`), and those that ended while
    their read ran (`abandoned`: the read's result is discarded when it is done). The scheduler starts a
    read (`start`), asks which ended (`observe`, on process 0 or the only process) and gives back to its
    queue those that go on (`apply`, the same on every process from process 0's observation); the reads
    themselves are the prefix store's (`loads`, None without a disk tier: then nothing is ever loaded)."""

    def __init__(self, loads: HitLoads | None):
        self.loads = loads
        self.loading: list[Request] = []
        self.abandoned: list[Request] = []

    def __len__(self) -> int:
        return len(self.loading)

    def pending(self) -> list[Request]:
        """The requests still waiting for a read (not ended meanwhile)."""
        return [r for r in self.loading if not r.finished]

    def start(self, req: Request, hit: Hit) -> None:
        """Read `req`'s disk hit in the background; `req` waits here until it is done."""
        req.load = self.loads.start(hit)
        self.loading.append(req)

    def abandon(self, req: Request) -> None:
        """`req` ended: if its read runs, the read goes on and its result is discarded (`apply`)."""
        if req in self.loading:
            self.loading.remove(req)
            self.abandoned.append(req)

    def observe(self, idle: bool) -> list[list[Any]]:
        """[request id, read ok, failed for a reason that may pass] of every disk read that finished; when
        the scheduler is `idle` (nothing else to do), wait a moment for one first."""
        if not self.loading and not self.abandoned:
            return []
        if self.loading and idle:
            self.loads.wait([r.load for r in self.loading], timeout=0.05)
        reads = self.loading + self.abandoned
        done = sorted((r for r in reads if self.loads.ready(r.load)), key=lambda r: r.arrival)
        return [[r.id, *self.loads.outcome(r.load)] for r in done]

    def blocked(self, idle: bool) -> bool:
        """The scheduler is `idle` but for requests whose reads have not ended: a step would do nothing."""
        if not self.loading or not idle:
            return False
        return not any(self.loads.ready(r.load) for r in self.loading + self.abandoned)

    def apply(self, done: list[list[Any]]) -> list[Request]:
        """Finish the reads `observe` saw end (every process follows process 0's outcome); returns the
        requests that go back to the front of the queue, in arrival order, with what was read."""
        by_id = {r.id: r for r in self.loading + self.abandoned}
        back = []  # the reads are finished last first, in the same order on every process
        for rid, ok, transient in reversed(done):
            req = by_id[rid]
            (self.loading if req in self.loading else self.abandoned).remove(req)
            self.loads.finish(req.load, leader_ok=ok, leader_transient=transient)
            if req.finished:  # aborted while it waited
                req.load = None
                continue
            back.append(req)
        return back[::-1]


class Scheduler:
    """Plans each engine step (the module doc says how). It owns the queues (`waiting`, `running`), the free
    slots and the admission order; its collaborators: `allocator` (BlockAllocator: the pool's blocks), `store`
    (PrefixStore, optional: matches, restores, checkpoint positions, cached blocks to evict), `loads`
    (DiskLoads: the requests waiting for their prefix from disk) and `drafts` (DraftPlanner: the drafted
    tokens of decode rows that speculate)."""

    def __init__(
        self,
        shape: EngineShape,
        allocator: BlockAllocator,
        store: PrefixStore | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drafter: DraftSource | None = None,
        stop_ids: Callable[[Request], frozenset[int]] = lambda req: frozenset(),
        step_costs: StepCosts | None = None,
    ):
        """`clock`: when requests finish (the simulator's is simulated seconds). `drafter`: where the decode
        rows of requests that speculate get their drafted tokens; `stop_ids`: the tokens that end a request
        (drafts stop before them); `step_costs`: whether a step's drafts pay (`StepCosts`)."""
        self.shape, self.allocator, self.store, self.clock = shape, allocator, store, clock
        self.drafts = DraftPlanner(
            shape, allocator, store, drafter or PromptLookup(), stop_ids, step_costs, clock
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loads = DiskLoads(store.loads if store is not None else None)
        self.free_slots = list(range(shape.slots))
        self._order = itertools.count()
        self._plan: StepPlan | None = None

    # --- queues -----------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loads)

    def active(self) -> list[Request]:
        return [*self.running, *self.waiting, *self.loads.pending()]

    def queue_state(self) -> QueueState:
        """Requests waiting for their prefix from disk count as waiting (they take a slot once read)."""
        return QueueState(len(self.running), len(self.waiting) + len(self.loads), len(self.free_slots))

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End `req` (from any state): its slot and blocks are freed."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.loads.abandon(req)  # its read goes on; `apply_loads` discards the result
        self._release(req)
        req.status, req.finish_reason, req.finish_time = RequestStatus.FINISHED, reason, self.clock()

    # --- prefixes read from disk: `DiskLoads` ----------------------------------------------------------
    def observe_loads(self) -> list[list[Any]]:
        """The disk reads that ended (`DiskLoads.observe`; with nothing else to do, it waits a moment)."""
        return self.loads.observe(idle=not self.running and not self.waiting)

    def waits_for_reads(self) -> bool:
        """Requests are unfinished, but none can go on before a disk read ends: a step would do nothing."""
        return self.loads.blocked(idle=not self.running and not self.waiting)

    def apply_loads(self, done: list[list[Any]]) -> None:
        """Requests whose prefix was read go back to the front of the queue (`DiskLoads.apply`)."""
        self.waiting.extendleft(reversed(self.loads.apply(done)))

    # --- one step ---------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = self._plan = StepPlan()
        budget = self.shape.max_batched_tokens
        by_order = sorted(self.running, key=lambda r: r.order)
        for req in by_order:
            if req.running and req.pending == 1:
                self._ensure_blocks(req, req.num_computed + 1)
        budget -= sum(1 for r in self.running if r.pending == 1)  # reserved for the decode rows
        if self.store is not None:  # before the chunks are cut: where queued prompts will leave running ones
            self.store.expect(itertools.islice(self.waiting, QUEUE_LOOKAHEAD), self.running)
        planned: list[tuple[Request, int, int]] = []  # (request, tokens, its admission order when planned)
        for req in by_order:
            if budget <= 0:
                break
            if req.running and req.pending > 1:
                n = self._chunk(req, budget)
                if self._ensure_blocks(req, req.num_computed + n):
                    planned.append((req, n, req.order))
                    budget -= n
        self._admit(budget, planned)
        plan.prefill = [PrefillJob(r, n) for r, n, order in planned if r.running and r.order == order]
        chunked = {id(j.request) for j in plan.prefill}
        plan.decode = [r for r in self.running if r.pending == 1 and id(r) not in chunked]
        left = self.shape.max_batched_tokens - len(plan.decode) - sum(j.tokens for j in plan.prefill)
        plan.drafts = self.drafts.plan(plan.decode, left)
        kept = []
        for adm in plan.admissions:
            if adm.request.running and adm.request.order == adm.order:
                kept.append(adm)
            elif adm.attachment is not None:  # preempted again before it ran
                self.store.detach(adm.attachment)
        plan.admissions = kept
        self._plan = None
        return plan

    def ledger(self) -> Ledger:
        """Every byte the running requests and the prefix store hold, and what reuse saved or cost (the
        engine's ledger, and the simulator's)."""
        live_blocks = {b for r in self.running for b in r.blocks}
        live_kv = len(live_blocks) * self.shape.block_bytes
        live_state = len(self.running) * self.shape.state_bytes
        if self.store is None:
            return Ledger(live_kv, live_state, False, PrefixLedger())
        return Ledger(live_kv, live_state, True, self.store.ledger(live_blocks), len(self.loads))

    def _admit(self, budget: int, planned: list[tuple[Request, int, int]]) -> None:
        deferred: list[Request] = []  # waiting for a running request's checkpoint of a shared prefix
        while self.waiting and self.free_slots and budget > 0:
            req = self.waiting[0]
            if self._waits_for_shared_prefix(req, planned):
                deferred.append(self.waiting.popleft())
                continue
            try:
                admitted, n = self._admit_one(req, budget)
            except Exception as exc:  # noqa: BLE001 - e.g. an unreadable prefix: this request only
                self.finish(req, FinishReason.ERROR)
                self._plan.failed.append((req, exc))
                continue
            if not admitted:
                break
            if n is not None:
                planned.append((req, n, req.order))
                budget -= n
        self.waiting.extendleft(reversed(deferred))

    def _waits_for_shared_prefix(self, req: Request, planned: list[tuple[Request, int, int]]) -> bool:
        """In-batch sharing (the adaptive checkpoint policy): when a running request is computing a prefix
        `req` shares, `req` waits for that request's checkpoint at the end of the shared part (it is cut
        there, this step's chunk too) instead of computing the prefix a second time."""
        found = self.store.shared_prefix(req, self.running) if self.store is not None else None
        if found is None:
            return False
        leader, shared = found
        leader.cuts.add(shared)
        for i, (r, n, order) in enumerate(planned):
            if r is leader and r.num_computed < shared < r.num_computed + n:
                planned[i] = (r, shared - r.num_computed, order)
        return True

    def _admit_one(self, req: Request, budget: int) -> tuple[bool, int | None]:
        """Admit the first waiting request: (False, None) when it does not fit now (admission stops; also when
        it was admitted and had to preempt itself for blocks), else (True, its first chunk), or (True, None)
        when it left the queue without a job (waiting for its prefix to be read from disk). Its lookup counts
        (`PrefixStore.record`) when it is admitted or its read starts, not at every step it waits."""
        store, bs = self.store, self.shape.block_size
        hit = store.find(req) if store is not None else None  # no side effect: it may not fit yet
        load = req.load
        if hit is not None and hit.disk is not None and (load is None or load.hit.disk is not hit.disk):
            self.waiting.popleft()  # the prefix is on disk: read it in the background, the others go on
            self.loads.start(req, hit)
            store.record(hit)
            return True, None
        reuse = hit.hit if hit is not None else 0
        n = min(req.pending - reuse, self.shape.prefill_chunk, budget)
        shared = len(hit.blocks) if hit is not None else 0
        evictable = store.evictable() if store is not None else 0
        if math.ceil((reuse + n) / bs) - shared > self.allocator.num_free + evictable:
            return False, None
        if hit is not None and hit.disk is None:  # (a disk hit was counted when its read started)
            store.record(hit)
        self.waiting.popleft()
        req.slot = self.free_slots.pop(0)
        req.status, req.order = RequestStatus.RUNNING, next(self._order)
        req.load = None
        self.running.append(req)
        adm = Admission(req, req.order)
        self._plan.admissions.append(adm)
        att = store.attach(hit, load) if hit is not None and hit.hit > 0 else None
        if att is not None:
            adm.attachment = att  # from here on `schedule` detaches it if the admission does not stand
            adm.restore = self._give_prefix(req, att)
            if adm.restore is None:  # preempted itself for blocks: wait for the next step, keeping its read
                adm.attachment = None
                store.detach(att)
                req.load = load
                return False, None
            req.prefix_hit_tokens += hit.hit
        elif hit is not None:
            hit = Hit(0, hit.matched, [])  # nothing reused (a disk entry that could not be read, too)
            store.missed(hit)
        if hit is not None:
            req.recomputed_tokens += hit.recomputed
            cut = store.junction(req, hit)
            if cut is not None:
                req.cuts.add(cut)
        n = self._chunk(req, budget)
        if not self._ensure_blocks(req, req.num_computed + n):
            # It preempted itself: it is first in the queue again with its slot free, and taking it again
            # in this step would repeat exactly this; the running requests free blocks as they go on.
            req.load = load  # what was read from disk serves its next admission
            return False, None
        return True, n

    def _give_prefix(self, req: Request, att: Attachment) -> Restore | None:
        """The request's blocks for a hit: its shared blocks, fresh ones where a disk prefix's block is not
        in the pool, and its own copy of a partial last block; the Restore that fills them. None when it
        was preempted for blocks."""
        bs, hit, layout = self.shape.block_size, att.hit, list(att.layout)
        fresh = [j for j, b in enumerate(layout) if b is None]
        req.blocks = [b for b in layout if b is not None]
        if fresh:
            if not self._ensure_blocks(req, (len(req.blocks) + len(fresh)) * bs):
                return None
            for j, block in zip(fresh, req.blocks[len(req.blocks) - len(fresh) :], strict=True):
                layout[j] = block
            req.blocks = layout
        tail_block = SCRATCH_BLOCK
        if hit.hit % bs:  # copy-on-write: the partial block is the request's own, it writes the rest of it
            if not self._ensure_blocks(req, hit.hit):
                return None
            tail_block = req.blocks[-1]
        req.num_computed = hit.hit
        if att.logits is not None and hit.hit == len(req.tokens):
            req.stored_logits = att.logits[None]
        return Restore(
            slot=req.slot,
            states=att.states,
            tail_block=tail_block,
            tail_kv=att.tail_kv,
            fill_blocks=[layout[j] for j in fresh],
            fill_kv=att.fill_kv[:, fresh] if fresh else None,
        )

    # --- blocks and slots -------------------------------------------------------------------------------
    def _chunk(self, req: Request, budget: int) -> int:
        """Next prefill piece: bounded by the chunk and the budget, and ending on a checkpoint position."""
        n = min(req.pending, self.shape.prefill_chunk, budget)
        if self.store is not None:
            n = min(n, self.store.chunk_limit(req))
        return n

    def _ensure_blocks(self, req: Request, upto: int) -> bool:
        """Give `req` blocks for its first `upto` positions, evicting cached blocks, then preempting the
        newest running requests if needed. False when `req` itself had to be preempted."""
        need = math.ceil(upto / self.shape.block_size) - len(req.blocks)
        while need > self.allocator.num_free:
            if self.store is not None and self.store.evict_one():
                continue
            victim = max(self.running, key=lambda r: r.order)
            self._preempt(victim)
            if victim is req:
                return False
        if need > 0:
            req.blocks += self.allocator.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Give back the request's slot and blocks; it is recomputed from its tokens when readmitted."""
        self._release(req)
        req.status, req.num_computed, req.stored_logits = RequestStatus.WAITING, 0, None
        req.checkpoint_base, req.indexed_blocks = None, 0
        req.preemptions += 1
        self.waiting.appendleft(req)
        if self._plan is not None:
            self._plan.preempted.append(req)

    def _release(self, req: Request) -> None:
        if req.blocks:
            self.allocator.release(req.blocks)
            req.blocks = []
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None
        if req in self.running:
            self.running.remove(req)

    def drop_running(self) -> list[Request]:
        """End every running request (a failed step); the waiting ones stay."""
        ended = list(self.running)
        for req in ended:
            self.finish(req, FinishReason.ERROR)
        return ended

    def memory_of(self, req: Any) -> RequestMemory:
        kv_bytes = len(req.blocks) * self.shape.block_bytes
        return RequestMemory(len(req.blocks), kv_bytes, self.shape.state_bytes, req.num_computed)
