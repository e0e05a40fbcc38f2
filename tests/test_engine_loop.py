"""The server's engine thread: a cancelled future never kills it, a failing request fails alone, failing
steps are contained (then the engine reports itself down), and a stalled step shows in the health."""

import asyncio
import concurrent.futures
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest
from faults import block_reads
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.http.app import EngineLoop, Sink, Unavailable
from serve.prefix.store import PrefixStoreConfig

GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


def make_engine(model):
    return Engine(model, EngineConfig(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=64))


class Collector:
    """Runs an asyncio loop in a thread so Sinks can deliver; collects every request's events."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.queues: dict[str, asyncio.Queue] = {}

    def sink(self, rid: str) -> Sink:
        q = asyncio.Queue()
        self.queues[rid] = q
        return Sink(self.loop, q)

    def events(self, rid: str, timeout: float = 60.0) -> list:
        """Every event of `rid` up to its final one."""

        async def drain():
            out = []
            while not out or not out[-1].finished:
                out.append(await self.queues[rid].get())
            return out

        return asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def running(model):
    engine = make_engine(model)
    loop = EngineLoop(engine, stall_timeout=0.5)
    loop.start()
    col = Collector()
    yield engine, loop, col
    loop.stop(30)
    col.close()


def hold(loop: EngineLoop, seconds: float) -> concurrent.futures.Future:
    """Keep the engine thread busy for `seconds` (commands queued meanwhile wait)."""
    return loop.call(lambda e: time.sleep(seconds))


def tokens_of(events) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def serve_alone(model, prompt) -> list[int]:
    return make_engine(model).generate([prompt], GREEDY)[0].token_ids


def test_a_cancelled_call_or_submission_never_kills_the_engine_thread(running):
    engine, loop, col = running
    hold(loop, 0.3)
    snap = loop.snapshot()
    assert snap.cancel()  # what asyncio does to a /metrics snapshot that timed out
    add = loop.submit([5, 6, 7], GREEDY, "gone", None, col.sink("gone"))
    assert add.cancel()  # a client that went away before its request was queued
    ok = loop.call(lambda e: len(e.requests))
    assert ok.result(10) == 0  # the cancelled submission was never added
    assert loop.alive and loop.health() is None
    fut = loop.submit([5, 6, 7], GREEDY, "next", None, col.sink("next"))
    assert fut.result(10) == "next"
    assert len(tokens_of(col.events("next"))) == 5


def test_a_client_that_leaves_during_submission_does_not_leave_its_request_running(running):
    """The asyncio side of submit: the awaiting task is cancelled while the engine thread is busy; once the
    engine takes the submission it is aborted, so no slot stays held for a client that is gone."""
    from serve.http.app import Prepared, Server

    engine, loop, col = running
    server = Server.__new__(Server)
    server.loop = loop

    async def submit_then_cancel():
        prep = Prepared("completion", [5, 6, 7], GREEDY, (), False, False, False, None)
        task = asyncio.ensure_future(server.submit(prep, "left"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    hold(loop, 0.3)
    asyncio.run(submit_then_cancel())
    deadline = time.monotonic() + 10
    while loop.call(lambda e: e.has_unfinished() or bool(e.requests)).result(10):
        assert time.monotonic() < deadline, "the abandoned request is still in the engine"
        time.sleep(0.05)
    assert loop.alive


def test_a_request_that_fails_fails_alone(running, model, monkeypatch):
    engine, loop, col = running
    find = engine.store.find

    def broken(seq):
        if seq.cache_salt == "poison":
            raise OSError("injected: the prefix store failed for this request")
        return find(seq)

    monkeypatch.setattr(engine.store, "find", broken)
    prompts = {"a": [5, 6, 7, 8], "b": [9, 10, 11], "c": [12, 13, 14, 15, 16]}
    hold(loop, 0.2)  # all three join one step
    for rid, prompt in prompts.items():
        salt = "poison" if rid == "b" else None
        assert loop.submit(prompt, GREEDY, rid, salt, col.sink(rid)).result(10) == rid
    got = {rid: col.events(rid) for rid in prompts}
    assert got["b"][-1].finish_reason == "error" and "injected" in got["b"][-1].error
    for rid in ("a", "c"):
        assert got[rid][-1].finish_reason == "length" and got[rid][-1].error is None
        assert tokens_of(got[rid]) == serve_alone(model, prompts[rid])
    assert loop.health() is None and loop.step_failures == 0
    state = loop.call(
        lambda e: (
            len(e.scheduler.running),
            len(e.scheduler.free_slots),
            e.allocator.num_used,
            len(e.requests),
        )
    )
    running_n, free, used, held = state.result(10)
    assert running_n == 0 and free == 2 and held == 0
    assert used == len(engine.store.held_blocks)  # no block leaked by the failed request


def test_failing_steps_end_their_requests_then_the_engine_goes_down(running, monkeypatch):
    engine, loop, col = running
    real = engine.runner.run_program

    def flaky(tokens, *args):
        if tokens.shape[1] == 1:  # the decode program (all slots): no single request to blame
            raise RuntimeError("injected device failure")
        return real(tokens, *args)

    monkeypatch.setattr(engine.runner, "run_program", flaky)
    assert loop.submit([5, 6, 7], GREEDY, "x", None, col.sink("x")).result(10) == "x"
    ev = col.events("x")[-1]
    assert ev.finish_reason == "error" and "injected device failure" in ev.error
    assert loop.health() is None and loop.step_failures == 1  # one failed step: contained
    monkeypatch.setattr(engine.runner, "run_program", real)
    assert loop.submit([5, 6, 7], GREEDY, "y", None, col.sink("y")).result(10) == "y"
    assert col.events("y")[-1].finish_reason == "length" and loop.step_failures == 0
    monkeypatch.setattr(engine.runner, "run_program", flaky)
    for i in range(loop.max_step_failures):
        rid = f"z{i}"
        assert loop.submit([5, 6, 7], GREEDY, rid, None, col.sink(rid)).result(10) == rid
        assert col.events(rid)[-1].finish_reason == "error"
    assert loop.failed is not None and "no request completed" in loop.health()
    with pytest.raises(Unavailable):
        loop.submit([5, 6, 7], GREEDY, "late", None, col.sink("late")).result(10)


def test_a_stalled_step_shows_in_the_health_and_clears(running):
    engine, loop, col = running
    original = engine.step
    release = threading.Event()

    def stuck():
        release.wait(30)
        return original()

    engine.step = stuck
    try:
        assert loop.submit([5, 6, 7], GREEDY, "s", None, col.sink("s")).result(10) == "s"
        deadline = time.monotonic() + 10
        while loop.health() is None:
            assert time.monotonic() < deadline, "no stall reported"
            time.sleep(0.05)
        assert loop.health().startswith("stalled")
    finally:
        engine.step = original
        release.set()
    col.events("s")
    assert loop.health() is None


def test_a_request_the_recovery_does_not_report_still_gets_a_final_event(running, monkeypatch):
    """Every client's wait ends: if a failed step's recovery reports nothing for a request the engine no
    longer serves, the loop ends it with an error event instead of leaving its client waiting."""
    engine, loop, col = running
    recover = engine.recover

    def forgetful(reason):
        recover(reason)
        return []  # what an engine that loses its outputs would report

    step = engine.step

    def broken(*args):
        step(*args)  # the request is admitted and running, then the step fails
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(engine, "recover", forgetful)
    monkeypatch.setattr(engine, "step", broken)
    assert loop.submit([5, 6, 7], GREEDY, "o", None, col.sink("o")).result(10) == "o"
    ev = col.events("o", timeout=120)[-1]
    assert ev.finished and ev.finish_reason == "error" and "failed engine step" in ev.error
    assert loop.call(lambda e: len(e.requests)).result(10) == 0


def test_a_failure_outside_any_step_ends_every_wait_and_marks_the_engine_down(running, monkeypatch):
    """A bug that escapes the engine thread's own handling (here: `forget` raising while outputs are
    delivered) ends the thread; every client still gets a final event and /health reports it."""
    engine, loop, col = running

    def broken(rid):
        raise RuntimeError("injected bug while delivering")

    monkeypatch.setattr(engine, "forget", broken)
    hold(loop, 0.3)  # both are queued in one round
    for rid in ("p", "q"):
        assert loop.submit([5, 6, 7], GREEDY, rid, None, col.sink(rid)).result(10) == rid
    for rid in ("p", "q"):
        assert col.events(rid, timeout=120)[-1].finished
    assert "injected bug" in (loop.health() or "")
    with pytest.raises(Unavailable):
        loop.submit([5, 6, 7], GREEDY, "r", None, col.sink("r")).result(10)


def test_a_held_disk_read_makes_the_loop_wait_not_spin(model, tmp_path, monkeypatch):
    """Issue 27.4: while the only unfinished requests wait for prefix reads from disk, the engine thread
    waits for a command or a read to finish instead of stepping: the step count stays put however often it
    is woken; an abort and a new request are served meanwhile; once the read is released its request is
    served from what was read, with the tokens of an engine without the store."""
    cfg = PrefixStoreConfig(checkpoint_interval=1024, sequence_end_checkpoints=False, store_dir=str(tmp_path))
    shape = dict(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=64)
    rng = np.random.default_rng(3)
    stored = [rng.integers(3, 512, n).tolist() for n in (20, 25)]
    first = Engine(model, EngineConfig(prefix=cfg, **shape))
    first.generate(stored, GREEDY)
    first.close()
    release = block_reads(monkeypatch)
    engine = Engine(model, EngineConfig(prefix=cfg, **shape))
    loop, col = EngineLoop(engine), Collector()
    loop.start()
    steps = lambda: loop.call(lambda e: e.steps).result(10)
    try:
        x, y, other = stored[0] + [9, 10], stored[1] + [11, 12], rng.integers(3, 512, 7).tolist()
        for rid, prompt in (("x", x), ("y", y)):
            assert loop.submit(prompt, GREEDY, rid, None, col.sink(rid)).result(10) == rid
        deadline = time.monotonic() + 60
        while loop.call(lambda e: e.ledger().disk_loading).result(10) < 2:
            assert time.monotonic() < deadline, "the reads never started"
            time.sleep(0.01)
        before = steps()
        for _ in range(5):  # every call wakes the thread; time for it to spin if it would
            time.sleep(0.05)
            assert steps() == before
        loop.abort("x")
        assert col.events("x")[-1].finish_reason == "abort"
        assert loop.submit(other, GREEDY, "o", None, col.sink("o")).result(10) == "o"
        served = col.events("o")
        before = steps()
        for _ in range(5):
            time.sleep(0.05)
            assert steps() == before
        assert loop.call(lambda e: e.ledger().disk_loading).result(10) == 1  # y still waits for its read
        release.set()
        got = col.events("y")
    finally:
        release.set()
        loop.stop(30)
        col.close()
        engine.close()
    assert got[-1].finish_reason == "length" and got[-1].cached_tokens == len(stored[1])
    ref = Engine(model, EngineConfig(prefix=None, **shape)).generate([y, other], GREEDY)
    assert [tokens_of(got), tokens_of(served)] == [r.token_ids for r in ref]
