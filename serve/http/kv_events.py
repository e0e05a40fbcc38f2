"""Publishing the prefix store's events (`serve.prefix.events`) over ZMQ, as vLLM's KV-event publisher does,
so that a router (ours, or one that reads vLLM's events) knows what each replica holds.

A PUB socket sends one multipart message per topic per engine step: `[topic, seq, payload]`, `seq` an 8-byte
big-endian signed counter per topic (a subscriber that sees a gap knows it lost messages) and `payload` an
encoded batch. The KV topic carries only vLLM's event types; the state topic our checkpoint events.

Replay: a ROUTER socket answers `[b"", start_seq]` (vLLM's request: the KV topic) or `[b"", topic, start_seq]`
with `[b"", seq, payload]` for every batch still buffered from `start_seq` on, then `[b"", -1, b""]`. When
`start_seq` is older than the buffer (a router that started late, or lost more than the buffer holds) the
answer is one snapshot batch instead, numbered with the topic's last seq: AllBlocksCleared (AllStatesCleared)
followed by everything held now, from the events published so far (`Contents`).

The engine thread calls `publish`; a thread of its own owns the sockets (ZMQ sockets are not thread-safe).
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from typing import Any

import zmq

from serve.prefix.events import KV_TOPIC, STATE_TOPIC, Contents, Event, encode, topic_of

log = logging.getLogger("jaxhybrid.events")

END = -1
BUFFER = 10_000  # batches kept per topic for replay
POLL_MS = 20


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


class EventPublisher:
    """See the module doc. `endpoint`, `replay_endpoint`: ZMQ addresses to bind (e.g. tcp://*:5557)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None = None, buffer: int = BUFFER, dp_rank: int = 0
    ):
        self.endpoint, self.replay_endpoint, self.dp_rank = endpoint, replay_endpoint, dp_rank
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER) if replay_endpoint else None
        try:
            self._pub.bind(endpoint)
            if self._replay is not None:
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot bind the events socket: {exc}") from None
        # what was bound (a port given as * resolved)
        self.bound = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_bound = (
            None if self._replay is None else self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        )
        self.seq = {KV_TOPIC: 0, STATE_TOPIC: 0}
        self._buffers = {t: collections.deque(maxlen=buffer) for t in self.seq}
        self.contents = Contents()
        self._queue: queue.Queue[list[Event] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="jaxhybrid-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        """Send `events` (one engine step's, in order) from the publisher's thread."""
        if events:
            self._queue.put(events)

    def close(self, timeout: float = 5.0) -> None:
        """Send what was published, then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    # --- the publisher's thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                try:
                    events = self._queue.get(timeout=POLL_MS / 1000 if self._replay is not None else None)
                except queue.Empty:
                    events = []
                if events is None:
                    return
                self._send(events)
                while self._replay is not None and self._replay.poll(0):
                    self._answer(self._replay.recv_multipart())
        except Exception:
            log.exception("the events publisher stopped")
        finally:
            self._close_sockets()

    def _send(self, events: list[Event]) -> None:
        for topic in (KV_TOPIC, STATE_TOPIC):
            mine = [e for e in events if topic_of(e) == topic]
            if not mine:
                continue
            self.seq[topic] += 1
            payload = encode(mine, dp_rank=self.dp_rank)
            self._pub.send_multipart([topic.encode(), seq_bytes(self.seq[topic]), payload])
            self._buffers[topic].append((self.seq[topic], payload))
            self.contents.apply(mine)

    def _answer(self, frames: list[bytes]) -> None:
        """One replay request (see the module doc); a malformed one gets the end marker alone."""
        identity, parts = frames[0], [f for f in frames[1:] if f]
        topic = KV_TOPIC
        if len(parts) == 2:
            topic = parts[0].decode(errors="replace")
        out: list[tuple[int, bytes]] = []
        if topic in self.seq and parts and len(parts[-1]) == 8:
            start = int.from_bytes(parts[-1], "big", signed=True)
            buffered, last = self._buffers[topic], self.seq[topic]
            oldest = buffered[0][0] if buffered else last + 1
            if start < oldest and start <= last:
                out = [(last, encode(self.contents.snapshot(topic), dp_rank=self.dp_rank))]
            else:
                out = [(s, p) for s, p in buffered if s >= start]
        for seq, payload in out:
            self._replay.send_multipart([identity, b"", seq_bytes(seq), payload])
        self._replay.send_multipart([identity, b"", seq_bytes(END), b""])

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=100)
        self._ctx.term()


def subscribe(endpoint: str, topics: tuple[str, ...] = (KV_TOPIC, STATE_TOPIC)) -> Any:
    """A SUB socket on `endpoint` for `topics` (what a router or a test reads the events with)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    for t in topics:
        sub.setsockopt(zmq.SUBSCRIBE, t.encode())
    sub.connect(endpoint)
    return sub


def replay(endpoint: str, topic: str, start: int, timeout_ms: int = 5000) -> list[tuple[int, bytes]]:
    """Ask `endpoint` (a publisher's replay socket) for `topic`'s batches from `start` on: [(seq, batch)]."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", topic.encode(), seq_bytes(start)])
        out = []
        while True:
            _, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == END:
                return out
            out.append((seq, payload))
    finally:
        sock.close()
