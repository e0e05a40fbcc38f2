"""Prefix-store events: what the events say is held equals what the store holds (blocks in every tier of
eviction, checkpoints in every tier), each announced block's hash recomputes from its parent and tokens, and a
checkpoint's position from its block and tail; the ZMQ publisher numbers batches per topic, replays what a
subscriber missed and answers a late one with a snapshot that rebuilds the same contents; a served request's
events reach a subscriber."""

import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
import zmq
from flax import nnx
from servers import uvicorn_thread

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.http.app import create_app
from serve.http.kv_events import EventPublisher, replay, subscribe
from serve.prefix.events import (
    KV_TOPIC,
    STATE_TOPIC,
    BlockRemoved,
    BlockStored,
    Contents,
    StateStored,
    decode,
    encode,
)
from serve.prefix.store import PrefixStoreConfig

BS = 8


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


def rounds(seed: int) -> list[list[list[int]]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 400, 21).tolist()
    chats = [system + rng.integers(3, 400, int(n)).tolist() for n in rng.integers(3, 15, 3)]
    out = [list(chats)]
    for _ in range(3):
        chats = [c + rng.integers(3, 400, int(rng.integers(2, 12))).tolist() for c in chats]
        out.append(list(chats))
    return out


def depth(contents: Contents, h: bytes | None) -> int:
    n = 0
    while h is not None:
        h, n = contents.blocks[h][0], n + 1
    return n


@pytest.mark.parametrize("eviction", ["value", "lru"])
def test_the_events_describe_what_the_store_holds(model, tmp_path, eviction):
    """A pool small enough to evict, budgets that demote and drop, a disk tier: after every round the events
    so far say exactly which blocks and which checkpoints (per tier) the store holds."""
    prefix = PrefixStoreConfig(
        checkpoint_interval=16,
        device_bytes=25_000,
        host_bytes=45_000,
        store_dir=str(tmp_path),
        eviction=eviction,
        events=True,
    )
    config = EngineConfig(
        max_slots=2, block_size=BS, prefill_chunk=16, max_model_len=128, num_blocks=17, prefix=prefix
    )
    eng = Engine(model, config)
    store, seen = eng.store, Contents()
    root = store.hasher.root(None)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for prompts in rounds(1):
        eng.generate(prompts, params)
        eng.flush()
        seen.apply(eng.take_events())
        assert set(seen.blocks) == set(store.blocks.hashes())
        held = {(ck.key, ck.tier) for ck in store.checkpoints} | {(k, "disk") for k in store.disk.entries}
        assert set(seen.states) == held
    counts = eng.ledger().prefix.memory
    assert counts.evicted_blocks > 0 and counts.demotions > 0 and counts.dropped_checkpoints > 0
    for h, (parent, tokens) in seen.blocks.items():  # the hash is what the chain of the tokens gives
        assert store.hasher.extend([parent or root], tokens, None, 1)[1] == h
    for ev in seen.states.values():
        if ev.block_hash is None or ev.block_hash in seen.blocks:
            assert ev.position == depth(seen, ev.block_hash) * BS + len(ev.tail)


def test_a_batch_round_trips_and_a_snapshot_rebuilds_the_contents():
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    events = [
        BlockStored([a, b], None, list(range(16)), 8),
        BlockStored([c], a, list(range(16, 24)), 8),
        StateStored(b"k" * 32, 20, "prompt_end", "device", b, [5, 6, 7, 8], 100),
        BlockRemoved([c]),
    ]
    ts, got, rank = decode(encode(events, ts=1.5, dp_rank=3))
    assert (ts, got, rank) == (1.5, events, 3)
    contents = Contents()
    contents.apply(got)
    assert set(contents.blocks) == {a, b} and contents.blocks[b] == (a, tuple(range(8, 16)))
    rebuilt = Contents()
    rebuilt.apply([BlockStored([c], None, [0] * 8, 8)])  # stale: the snapshot clears it
    for topic in (KV_TOPIC, STATE_TOPIC):
        rebuilt.apply(decode(encode(contents.snapshot(topic)))[1])
    assert rebuilt.blocks == contents.blocks and rebuilt.states == contents.states
    with pytest.raises(ValueError, match="not an event batch"):
        decode(b"\x93garbage")


def receive(sub, n: int, timeout_s: float = 10.0) -> list[tuple[str, int, list]]:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        if sub.poll(100):
            topic, seq, payload = sub.recv_multipart()
            out.append((topic.decode(), int.from_bytes(seq, "big", signed=True), decode(payload)[1]))
    return out


def test_the_publisher_numbers_batches_per_topic_replays_and_snapshots():
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer=2)
    sub = subscribe(pub.bound)
    try:
        time.sleep(0.3)  # a SUB socket misses what is published before it is connected (ZMQ's slow joiner)
        a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
        steps = [
            [
                BlockStored([a], None, list(range(8)), 8),
                StateStored(b"s" * 32, 8, "interval", "device", a, [], 9),
            ],
            [BlockStored([b], a, list(range(8, 16)), 8)],
            [BlockStored([c], b, list(range(16, 24)), 8), BlockRemoved([c])],
        ]
        for events in steps:
            pub.publish(events)
        got = receive(sub, 4)
        assert [(t, s) for t, s, _ in got] == [(KV_TOPIC, 1), (STATE_TOPIC, 1), (KV_TOPIC, 2), (KV_TOPIC, 3)]
        assert [e for t, _, evs in got if t == KV_TOPIC for e in evs] == [
            e for s in steps for e in s if e.TAG != "StateStored"
        ]
        # what is still buffered is replayed as it was sent
        assert [s for s, _ in replay(pub.replay_bound, KV_TOPIC, 2)] == [2, 3]
        # older than the buffer (2 batches): one snapshot numbered with the last seq
        ((seq, payload),) = replay(pub.replay_bound, KV_TOPIC, 1)
        late = Contents()
        late.apply(decode(payload)[1])
        ((_, states),) = replay(pub.replay_bound, STATE_TOPIC, 0)
        late.apply(decode(states)[1])
        want = Contents()
        want.apply([e for s in steps for e in s])
        assert seq == 3 and late.blocks == want.blocks and late.states == want.states
        assert replay(pub.replay_bound, KV_TOPIC, 4) == []  # nothing newer
    finally:
        sub.close()
        pub.close()


def test_a_served_request_publishes_its_blocks_and_checkpoints(model):
    prefix = PrefixStoreConfig(checkpoint_interval=16, events=True)
    engine = Engine(
        model, EngineConfig(max_slots=2, block_size=BS, prefill_chunk=16, max_model_len=128, prefix=prefix)
    )
    pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    app = create_app(engine, ByteTokenizer(512), "tiny", events=pub)
    sub = subscribe(pub.bound)
    try:
        with uvicorn_thread(app) as url:
            time.sleep(0.3)
            body = {"prompt": list(range(3, 40)), "max_tokens": 2, "temperature": 0}
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            got = receive(sub, 100, timeout_s=3.0)  # every batch of the request's steps
            seen = Contents()
            seen.apply(e for _, _, evs in got for e in evs)
            assert {t for t, _, _ in got} == {KV_TOPIC, STATE_TOPIC}
            assert len(seen.blocks) == 4  # the 37-token prompt's full blocks
            # the interval checkpoints and the prompt end's
            assert {e.position for e in seen.states.values()} >= {16, 32, 37}
    finally:
        sub.close()
    with pytest.raises(zmq.ZMQError):  # the app's end closed the publisher's sockets
        pub._pub.send(b"x")
