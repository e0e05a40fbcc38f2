"""The replicas behind a router: each one's address, health, requests in flight, and what it holds, kept up
to date from its prefix-store events by a follower thread.

`EventFollower` subscribes to a replica's events (`serve.http.kv_events`) and applies them to its
`ReplicaIndex` in order. It first catches up through the replay socket (everything buffered, or a snapshot),
and again whenever a topic's sequence number skips (lost messages), goes back (the replica restarted: its
index is cleared first), or nothing came for a second (the last messages may have been lost). Live messages
already covered by a replay are dropped. While the replica is down its index is empty (`Backend.down`), so
nothing is routed on what it may no longer hold.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter

import zmq

from serve.http.kv_events import replay, subscribe
from serve.prefix.events import KV_TOPIC, STATE_TOPIC, decode
from serve.route.index import ReplicaIndex

log = logging.getLogger("jaxhybrid.route")
POLL_MS = 100
IDLE_CATCH_UP_S = 1.0  # after this long without a message, ask the replay socket whether one was lost


@dataclasses.dataclass
class BackendSpec:
    """`URL[,events=ENDPOINT[,replay=ENDPOINT]]` as `jaxhybrid route --backend` takes it."""

    url: str
    events: str | None = None
    replay: str | None = None

    @classmethod
    def parse(cls, text: str) -> BackendSpec:
        url, *rest = [p.strip() for p in text.split(",")]
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"backend {text!r}: the first part must be its http(s):// URL")
        fields = {}
        for part in rest:
            key, sep, value = part.partition("=")
            if not sep or key not in ("events", "replay") or not value:
                raise ValueError(
                    f"backend {text!r}: expected events=ENDPOINT or replay=ENDPOINT, got {part!r}"
                )
            fields[key] = value
        if "replay" in fields and "events" not in fields:
            raise ValueError(f"backend {text!r}: replay= needs events=")
        return cls(url.rstrip("/"), **fields)


@dataclasses.dataclass
class Ticket:
    """A request routed to `backend`, until it ends: its prefill counts in the replica's queue until its first
    token (after that it decodes beside a newcomer's prefill, at little cost to it), its prefixes until it
    ends (the replica's events show them once computed, a little later)."""

    backend: Backend
    prefill: int
    prefixes: tuple[bytes, ...]
    new_chain: bool = False  # it continues no chain the replica keeps: one more there (`Backend.chains`)
    queued: bool = True
    done: bool = False

    def first_token(self) -> None:
        if self.queued:
            self.queued = False
            self.backend.queued -= self.prefill

    def end(self) -> None:
        """Answered, failed or passed on (once)."""
        if self.done:
            return
        self.first_token()
        self.done = True
        b = self.backend
        b.in_flight -= 1
        b.new_chains -= self.new_chain
        for digest in self.prefixes:  # (not `+counter`: that rebuilds every request's digests each time)
            if b.pending[digest] > 1:
                b.pending[digest] -= 1
            else:
                del b.pending[digest]


class Backend:
    """One replica: where it is, whether it answers, its requests in flight and what it holds."""

    def __init__(self, spec: BackendSpec):
        self.spec, self.url = spec, spec.url
        self.index = ReplicaIndex()
        self.lock = threading.Lock()  # the index: the follower writes, request handlers read
        self.healthy = True
        self.in_flight = 0  # requests routed here and not finished
        self.queued = 0  # prompt tokens of those not past their first token: the prefill a new one waits for
        self.routed = 0
        self.pending: Counter[bytes] = Counter()  # prefix digests of the requests in flight here
        self.new_chains = 0  # requests in flight here that continue no chain it keeps
        self.capacity: int | None = None  # checkpoints its store keeps in memory at most (/health), if known
        self.follower = EventFollower(self) if spec.events else None

    @property
    def chains(self) -> int:
        """The chains its store keeps in memory (`ReplicaIndex.chains`) and those its requests in flight add
        (`Ticket.new_chain`)."""
        with self.lock:
            return self.index.chains + self.new_chains

    def start(self, prefill: int, prefixes: tuple[bytes, ...], new_chain: bool = False) -> Ticket:
        """A request was routed here: `prefill` prompt tokens to compute, its prompt's prefixes, whether it
        starts a chain here (it continues none the replica keeps)."""
        self.in_flight += 1
        self.queued += prefill
        self.routed += 1
        self.new_chains += new_chain
        self.pending.update(prefixes)
        return Ticket(self, prefill, prefixes, new_chain)

    def down(self) -> None:
        """It stopped answering: forget what it held (it may have lost it), route nothing there."""
        if self.healthy:
            log.warning("backend %s is down: drained from routing", self.url)
        self.healthy = False
        with self.lock:
            self.index.clear()
        if self.follower is not None:
            self.follower.resync.set()

    def up(self) -> None:
        if not self.healthy:
            log.info("backend %s answers again: re-admitted", self.url)
        self.healthy = True

    def close(self) -> None:
        if self.follower is not None:
            self.follower.stop()


class EventFollower:
    """See the module doc."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.last = {KV_TOPIC: 0, STATE_TOPIC: 0}
        self.resync = threading.Event()
        self.resync.set()
        self._stopping = threading.Event()
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name=f"route-events-{backend.url}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        self._thread.join(5)

    def _run(self) -> None:
        sub = subscribe(self.backend.spec.events)
        heard = time.monotonic()
        try:
            while not self._stopping.is_set():
                if self.resync.is_set() and self.backend.healthy:
                    self.resync.clear()
                    self._catch_up(restart=True)
                if sub.poll(POLL_MS):
                    topic, seq, payload = sub.recv_multipart()
                    seq = int.from_bytes(seq, "big", signed=True)
                    self._live(topic.decode(errors="replace"), seq, payload)
                    heard = time.monotonic()
                elif time.monotonic() - heard > IDLE_CATCH_UP_S and self.backend.healthy:
                    self._catch_up(restart=False)  # the last batches may have been lost: nothing shows a gap
                    heard = time.monotonic()
        except Exception:
            log.exception("following the events of %s stopped", self.backend.url)
        finally:
            sub.close(linger=0)

    def _live(self, topic: str, seq: int, payload: bytes) -> None:
        last = self.last.get(topic)
        if last is None or seq <= 0:
            return
        if seq == 1 and last > 1:  # numbering began again: the replica restarted
            self._catch_up(restart=True)
            if self.backend.spec.replay is not None:
                return  # the replay brought this batch
        elif seq <= last:
            return  # a replay already brought it
        elif seq > last + 1 and self.backend.spec.replay is not None:
            self._catch_up(restart=False, topics=(topic,))
            if seq <= self.last[topic]:
                return
            if seq > self.last[topic] + 1:
                self.resync.set()  # still missing: try again from scratch
                return
        self._apply(topic, seq, payload)

    def _catch_up(self, restart: bool, topics: tuple[str, ...] = (KV_TOPIC, STATE_TOPIC)) -> None:
        """Replay `topics` from after what was applied; after a restart (or a resync) from nothing. A
        replay is every buffered batch, or one snapshot that rebuilds the topic's contents."""
        if restart:
            with self.backend.lock:
                self.backend.index.clear()
            self.last = dict.fromkeys(self.last, 0)
        endpoint = self.backend.spec.replay
        if endpoint is None:
            return
        for topic in topics:
            try:
                batches = replay(endpoint, topic, self.last[topic] + 1, timeout_ms=2000)
            except zmq.ZMQError as exc:
                log.warning("replaying %s's %s events failed: %s", self.backend.url, topic, exc)
                self.resync.set()
                return
            self.replays += 1
            for seq, payload in batches:
                self._apply(topic, seq, payload)

    def _apply(self, topic: str, seq: int, payload: bytes) -> None:
        try:
            events = decode(payload)[1]
        except ValueError as exc:
            log.warning("%s sent a batch that does not decode: %s", self.backend.url, exc)
            return
        with self.backend.lock:
            self.backend.index.apply(events)
        self.last[topic] = seq
