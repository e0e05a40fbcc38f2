"""`jaxhybrid route`: the replica index answers how far a replica can resume a prompt (hand-built events);
over two live replicas the state-aware policy sends a chat's next turn to the replica holding its state
(the replica's own count of cached prompt tokens is the oracle) where round-robin does not; a replica that
dies is drained without a client seeing an error, and one that comes back is re-admitted and followed
from its restarted event numbering."""

import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import jax.numpy as jnp
import pytest
from flax import nnx
from servers import free_port, uvicorn_thread, wait_healthy

from benchmarks.route import CharTokenizer
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer, TokenizerError
from serve.engine.engine import Engine, EngineConfig
from serve.http.app import create_app
from serve.http.kv_events import EventPublisher
from serve.prefix.events import BlockRemoved, BlockStored, StateRemoved, StateStored
from serve.prefix.store import PrefixStoreConfig
from serve.route.app import create_router_app
from serve.route.backends import Backend, BackendSpec
from serve.route.index import Match, ReplicaIndex
from serve.route.policies import Chooser, Policy

BS = 8
H = [bytes([i]) * 32 for i in range(8)]


def test_the_index_resumes_at_the_deepest_checkpoint_on_the_prompts_path():
    idx = ReplicaIndex()
    prompt = list(range(100, 130))
    idx.apply(
        [
            BlockStored([H[1], H[2]], None, prompt[:16], BS),
            BlockStored([H[3]], H[2], prompt[16:24], BS),
            StateStored(b"a" * 32, 8, "interval", "device", H[1], [], 1),
            StateStored(b"b" * 32, 19, "junction", "host", H[2], prompt[16:19], 1),
            StateStored(b"c" * 32, 24, "interval", "disk", H[3], [], 1),  # disk: not counted
            StateStored(b"d" * 32, 20, "prompt_end", "device", H[2], [7, 7, 7, 7], 1),  # another tail
        ]
    )
    # b ends a chain there (nothing extends it): a prompt resuming from it continues it; a does not
    assert idx.match(prompt) == Match(kv_tokens=24, resumable=19, continues=True)
    assert idx.match(prompt[:19]) == Match(kv_tokens=16, resumable=8)  # a hit leaves a token to compute
    assert idx.match([1] + prompt[1:]) == Match(0, 0)
    idx.apply([StateRemoved(b"b" * 32, "host")])
    assert idx.match(prompt).resumable == 8
    idx.apply([BlockRemoved([H[1]])])  # the first block gone: nothing is reachable
    assert idx.match(prompt) == Match(0, 0)


def test_the_index_counts_the_chains_whose_latest_state_a_replica_keeps():
    """Three conversations behind one system prompt, checkpointed at its end (a junction) and each at its
    own end: three chains; a conversation's earlier state is no chain of its own, nor a disk copy; a chain
    whose end goes, ends at what is left of it (here the system prompt, which then ends a chain)."""
    idx = ReplicaIndex()
    system, convs = list(range(100, 116)), [[40 + 8 * c + i for i in range(8)] for c in range(3)]
    idx.apply([BlockStored([H[1], H[2]], None, system, BS)])
    idx.apply([StateStored(b"s" * 32, 16, "junction", "device", H[2], [], 1)])
    for c, conv in enumerate(convs):
        idx.apply(
            [
                BlockStored([H[3 + c]], H[2], conv, BS),
                StateStored(bytes([c]) * 32, 20, "prompt_end", "host", H[2], conv[:4], 1),  # extended
                StateStored(bytes([c + 10]) * 32, 24, "sequence_end", "device", H[3 + c], [], 1),
            ]
        )
    idx.apply([StateStored(b"x" * 32, 30, "interval", "disk", H[3], [1, 2, 3, 4, 5, 6], 1)])
    assert (idx.checkpoints, idx.chains) == (8, 3)
    assert idx.match(system + convs[0] + [9]) == Match(24, 24, continues=True)
    assert idx.match(system + [1, 2, 3]) == Match(16, 16, continues=False)  # a new chain behind the prompt
    idx.apply([StateRemoved(bytes([c + 10]) * 32, "device") for c in range(3)])
    assert idx.chains == 3  # the prompt ends (20) are the latest now
    idx.apply([StateRemoved(bytes([c]) * 32, "host") for c in range(3)])
    assert idx.chains == 1 and idx.match(system + [1]).continues


def test_a_new_chain_goes_to_a_replica_whose_store_can_keep_it():
    """Replica 0 holds the shared system prompt and as many chains as its capacity keeps (2.5 checkpoints a
    chain); a new conversation behind that prompt goes to replica 1 (it computes the prompt there once: the
    chain it would push out on 0 would compute its own part again at later turns: `EVICT_WEIGHT` x the new
    one's own part), unless 0's capacity is unknown; a conversation continuing a chain on 0 stays there."""
    backends = [Backend(BackendSpec(f"http://127.0.0.1:{i + 1}")) for i in range(2)]
    chooser = Chooser(backends, Policy.STATE_AWARE)
    system = list(range(100, 164))  # 8 blocks
    hashes = [bytes([200, i]) * 16 for i in range(20)]
    events = [
        BlockStored(hashes[:8], None, system, BS),
        StateStored(b"s" * 32, 64, "junction", "device", hashes[7], [], 1),
    ]
    convs = [[10 + c] * BS for c in range(4)]
    for c, conv in enumerate(convs):
        events += [
            BlockStored([hashes[8 + c]], hashes[7], conv, BS),
            StateStored(bytes([c]) * 32, 72, "sequence_end", "device", hashes[8 + c], [], 1),
        ]
    backends[0].index.apply(events)
    assert backends[0].chains == 4
    new = system + [7] * 40  # on 0: 40 to compute + 2 x 40 pushed out > 104 to compute on 1
    assert chooser.rank(new)[0].backend is backends[0]  # capacity unknown: the shared prompt wins
    backends[0].capacity = 10  # (4 + 1) x 2.5 > 10
    ranked = chooser.rank(new)
    assert ranked[0].backend is backends[1] and ranked[1].evicts > 0 and ranked[1].new_chain
    backends[0].capacity = 13  # (4 + 1) x 2.5 <= 13: room for one more
    assert chooser.rank(new)[0].backend is backends[0]
    backends[0].capacity = 10
    going_on = chooser.rank(system + convs[2] + [5] * 4)
    assert going_on[0].backend is backends[0] and not going_on[0].new_chain and going_on[0].evicts == 0
    ticket = backends[1].start(ranked[0].prefill, ranked[0].prefixes, ranked[0].new_chain)
    assert backends[1].chains == 1
    ticket.end()
    assert backends[1].chains == 0


def test_state_aware_keeps_up_with_kv_only_under_a_tight_checkpoint_budget(capsys):
    """Each replica's store keeps about 10 checkpoints (0.1 MB of 9,600-byte states): chats gathered behind
    the shared system prompt on two replicas would push each other's states out of their stores; weighing
    each replica's capacity spreads them."""
    out = run_bench(
        capsys,
        "--simulate",
        "--workload",
        "chat",
        "--conversations",
        "16",
        "--device-cache-mb",
        "0.1",
        "--host-cache-mb",
        "0",
        "--checkpoint-interval",
        "64",
        "--policies",
        "state-aware,kv-only",
    )
    rows = {r["policy"]: r["prompt_tokens_computed"] for r in out["rows"]}
    assert rows["state-aware"] <= 1.05 * rows["kv-only"], rows


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


class Replica:
    """A `serve` app with a prefix store publishing its events, on fixed ports so it can come back."""

    def __init__(self, model, tokenizer=None):
        self.model, self.port, self.tokenizer = model, free_port(), tokenizer or ByteTokenizer(512)
        self.events, self.replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"

    def spec(self) -> BackendSpec:
        return BackendSpec(f"http://127.0.0.1:{self.port}", self.events, self.replay)

    def app(self):
        prefix = PrefixStoreConfig(checkpoint_interval=16, events=True)
        config = EngineConfig(max_slots=2, block_size=BS, prefill_chunk=32, max_model_len=256, prefix=prefix)
        self.engine = Engine(self.model, config)
        return create_app(
            self.engine, self.tokenizer, "tiny", events=EventPublisher(self.events, self.replay)
        )


def complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(
        f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()


def cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def router(replicas, policy: Policy):
    backends = [Backend(r.spec()) for r in replicas]
    return backends, create_router_app(
        backends, Chooser(backends, policy), replicas[0].tokenizer, health_interval=0.2
    )


def test_state_aware_routing_sends_a_chats_next_turn_to_its_state(model):
    replicas = [Replica(model), Replica(model)]
    with contextlib.ExitStack() as stack:
        for r in replicas:
            stack.enter_context(uvicorn_thread(r.app(), port=r.port))
        for i, (policy, hit) in enumerate(((Policy.STATE_AWARE, True), (Policy.ROUND_ROBIN, False))):
            backends, app = router(replicas, policy)
            with uvicorn_thread(app) as url:
                turn1 = [400 + i] + list(range(3, 59))  # 57 tokens: checkpoints at 16, 32, 48, 57
                complete(url, turn1)
                wait_for(lambda: any(b.index.checkpoints for b in backends))  # noqa: B023
                out = complete(url, turn1 + [5, 6, 7])
                assert (cached(out) >= 48) == hit, policy


def test_a_text_conversation_continues_its_answer_on_the_replica_holding_that_state(model):
    """`bench route --text`: every id is one character both ways, so the next turn's text (the previous
    prompt, the answer's text as the replica returned it, a new message) resumes from the state after the
    answer."""
    tok = CharTokenizer(512)
    ids = list(range(512))
    assert tok.encode(tok.decode(ids)) == ids and len(tok.decode(ids)) == 512
    with pytest.raises(TokenizerError):
        tok.encode("a")
    replicas = [Replica(model, tok), Replica(model, tok)]
    with contextlib.ExitStack() as stack:
        for r in replicas:
            stack.enter_context(uvicorn_thread(r.app(), port=r.port))
        backends, app = router(replicas, Policy.STATE_AWARE)
        with uvicorn_thread(app) as url:
            turn1 = tok.decode([7, *range(100, 150)])
            body = {"prompt": turn1, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
            assert len(answer) == 6
            wait_for(lambda: sum(b.index.checkpoints for b in backends) >= 4)
            body["prompt"] = turn1 + answer + tok.decode([9, 9, 9])
            out = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
            assert out["usage"]["prompt_tokens"] == 51 + 6 + 3
            assert cached(out) > 51  # past the first prompt: its answer's state was kept and found


def test_a_dead_replica_is_drained_without_an_error_and_readmitted_when_it_returns(model):
    replicas = [Replica(model), Replica(model)]
    servers = [uvicorn_thread(r.app(), port=r.port) for r in replicas]
    for cm in servers:
        cm.__enter__()
    backends, app = router(replicas, Policy.STATE_AWARE)
    try:
        with uvicorn_thread(app) as url:
            prompt = list(range(3, 45))
            complete(url, prompt)
            wait_for(lambda: any(len(b.index) for b in backends))
            holder = next(i for i, b in enumerate(backends) if len(b.index))
            servers[holder].__exit__(None, None, None)  # the replica holding the chat goes away
            for n in range(3):  # the next turns go to the other replica: no client sees an error
                complete(url, prompt + [7] * (n + 1))
            stats = httpx.get(f"{url}/route/stats").json()["backends"]
            assert not stats[holder]["healthy"] and stats[holder]["blocks"] == 0
            assert stats[1 - holder]["healthy"] and stats[1 - holder]["chains"] >= 1
            # the capacity it weighs is the one the replica's /health gives: its budgets over a state's bytes
            engine, prefix = replicas[1 - holder].engine, replicas[1 - holder].engine.config.prefix
            capacity = (prefix.device_bytes + prefix.host_bytes) // engine.shape.checkpoint_bytes
            assert stats[1 - holder]["checkpoint_capacity"] == capacity > 0
            # it comes back (a new process: an empty store, its events numbered from 1 again)
            servers[holder] = uvicorn_thread(replicas[holder].app(), port=replicas[holder].port)
            servers[holder].__enter__()
            wait_for(lambda: backends[holder].healthy)
            for n in range(4):  # fresh prompts: both replicas are as good, so they take turns
                complete(url, [450 + n] + list(range(3, 40)))
            wait_for(lambda: len(backends[holder].index) > 0)  # followed again
            assert backends[holder].routed > 1
    finally:
        for cm in servers:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)


def run_bench(capsys, *flags) -> dict:
    from serve.cli import main

    assert main(["bench", "route", *flags]) == 0
    return json.loads(capsys.readouterr().out)


SMALL = (
    "--workload",
    "chat",
    "--conversations",
    "8",
    "--turns",
    "3",
    "--max-model-len",
    "512",
    "--chunk",
    "64",
)


def test_bench_route_simulated_state_aware_computes_less_than_round_robin(capsys):
    out = run_bench(capsys, "--simulate", *SMALL)
    rows = {r["policy"]: r for r in out["rows"]}
    assert set(rows) == {"state-aware", "kv-only", "round-robin"}
    for r in rows.values():
        assert sum(r["per_replica"]) == r["requests"] == 24
        assert r["lower_bound_tokens"] <= r["prompt_tokens_computed"] <= r["prompt_tokens"]
    assert rows["state-aware"]["prompt_tokens_computed"] < 0.8 * rows["round-robin"]["prompt_tokens_computed"]


@pytest.mark.slow
def test_the_simulated_router_agrees_with_the_live_one_on_a_small_case():
    """Requests sent one at a time (each after the previous one is done), every policy over 4 live replicas of
    tiny routes each request where the simulator does and computes the prompt tokens it says."""
    cmd = [sys.executable, "-m", "serve.cli", "bench", "route", "--one-at-a-time", *SMALL]
    out = [
        subprocess.run(cmd + flag, capture_output=True, text=True, check=True).stdout
        for flag in (["--simulate"], [])
    ]
    sim, live = (json.loads(o)["rows"] for o in out)
    for s, lv in zip(sim, live, strict=True):  # every policy
        assert (lv["policy"], lv["prompt_tokens_computed"]) == (s["policy"], s["prompt_tokens_computed"])
        assert lv["per_replica"] == s["per_replica"]


class LossyPublisher(EventPublisher):
    """Publishes like the real one but drops the batches whose per-topic numbers are in `lose` (they stay
    buffered for replay, as the real publisher's would after a network drop)."""

    def __init__(self, *args, lose: set[int], **kw):
        self.lose = lose
        super().__init__(*args, **kw)

    def _send(self, events):
        pub = self._pub

        class Dropping:
            def send_multipart(_, frames):  # noqa: N805
                if int.from_bytes(frames[1], "big", signed=True) not in self.lose:
                    pub.send_multipart(frames)

        self._pub = Dropping()
        try:
            super()._send(events)
        finally:
            self._pub = pub


def test_lost_events_are_replayed_so_a_removed_checkpoint_is_never_routed_on():
    pub = LossyPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", lose={2, 3})
    backend = Backend(BackendSpec("http://127.0.0.1:1", pub.bound, pub.replay_bound))
    try:
        wait_for(lambda: backend.follower.replays >= 2)  # the first catch-up (nothing yet)
        prompt = list(range(10, 40))
        state = StateStored(b"s" * 32, 16, "interval", "device", H[2], [], 1)
        steps = [
            [BlockStored([H[1], H[2]], None, prompt[:16], BS), state],  # kv 1, state 1
            [BlockStored([H[3]], H[2], prompt[16:24], BS)],  # kv 2: lost
            [StateRemoved(state.key, "device"), BlockRemoved([H[3]])],  # kv 3, state 2: lost
            [BlockStored([H[4]], H[2], [0] * 8, BS)],  # kv 4: shows the gap
        ]
        for events in steps:
            pub.publish(events)
        time.sleep(0.2)
        pub.publish([StateStored(b"t" * 32, 8, "interval", "device", H[1], [], 1)])  # state 3: shows its gap
        wait_for(lambda: backend.follower.last == pub.seq)
        with backend.lock:
            # not 16: that one is gone (8 is the only checkpoint left: it ends a chain)
            assert backend.index.match(prompt) == Match(kv_tokens=16, resumable=8, continues=True)
            assert len(backend.index) == len(pub.contents.blocks) == 3
    finally:
        backend.close()
        pub.close()


def start_replica(port: int, events: str, replay: str, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "serve.cli", "serve", "--config", "tiny", "--port", str(port)]
    cmd += ["--warmup", "none", "--max-model-len", "256", "--slots", "2"]
    cmd += ["--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def streamed(url: str, prompt: list[int]) -> tuple[bool, int]:
    """(ended with [DONE], token chunks received) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
            if r.status_code != 200:
                return False, 0
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return True, chunks
                if line.startswith("data: ") and '"text"' in line:
                    chunks += 1
    except httpx.HTTPError:
        pass
    return False, chunks


@pytest.mark.slow
def test_kill_9_a_replica_mid_run_fails_no_request_that_had_not_started_streaming(tmp_path):
    """Two `jaxhybrid serve` processes behind the router; 12 streamed requests in flight when one replica is
    killed with SIGKILL: every request that had not received a token is answered by the other replica (only
    streams already under way may end early); the router drops the dead replica's index at once, and when it
    is started again re-admits it and rebuilds its index from its events."""
    ports = [free_port(), free_port()]
    ends = [(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}") for _ in ports]
    logs = [open(tmp_path / f"replica{i}.log", "w") for i in range(2)]  # noqa: SIM115
    procs = [start_replica(p, *e, log) for p, e, log in zip(ports, ends, logs, strict=True)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    backends = [Backend(BackendSpec(u, *e)) for u, e in zip(urls, ends, strict=True)]
    app = create_router_app(
        backends, Chooser(backends, Policy.STATE_AWARE), ByteTokenizer(512), health_interval=0.2
    )
    try:
        for i, url in enumerate(urls):
            wait_healthy(
                url,
                lambda i=i: procs[i].poll() is None,
                lambda i=i: (tmp_path / f"replica{i}.log").read_text(),
                180,
            )
        with uvicorn_thread(app) as router_url:
            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                futures = [
                    pool.submit(streamed, router_url, [300 + n] + list(range(3, 40))) for n in range(12)
                ]
                wait_for(lambda: backends[0].in_flight > 0 and backends[1].in_flight > 0, 60)
                procs[0].kill()  # SIGKILL
                results = [f.result() for f in futures]
            assert all(ok or chunks > 0 for ok, chunks in results), results
            assert sum(ok for ok, _ in results) >= 10
            wait_for(lambda: not backends[0].healthy)
            assert len(backends[0].index) == 0
            # it comes back on the same ports: re-admitted, its index rebuilt from its (new) events
            procs[0] = start_replica(ports[0], *ends[0], logs[0])
            wait_healthy(
                urls[0], lambda: procs[0].poll() is None, lambda: (tmp_path / "replica0.log").read_text(), 180
            )
            wait_for(lambda: backends[0].healthy)
            for n in range(6):
                assert streamed(router_url, [350 + n] + list(range(3, 30)))[0]
            wait_for(lambda: len(backends[0].index) > 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()


def test_a_prompt_goes_where_its_prefix_was_just_routed_before_any_event_shows_it():
    """Two prompts sharing 64 tokens arrive together: state-aware sends the second where the first went (its
    store computes the shared part once), though that replica is busier; once the first is done, the
    prefix is forgotten (the events say what is held from then on)."""
    backends = [Backend(BackendSpec(f"http://127.0.0.1:{i + 1}")) for i in range(2)]
    chooser = Chooser(backends, Policy.STATE_AWARE)
    shared = list(range(3, 67))
    first = chooser.rank(shared + [1, 2, 3])[0]
    ticket = first.backend.start(first.prefill, first.prefixes)
    second = chooser.rank(shared + [4, 5])
    assert second[0].backend is first.backend and second[0].saved == 64
    assert second[1].saved == 0
    ticket.end()
    assert not first.backend.pending and chooser.rank(shared + [4, 5])[0].saved == 0


def test_a_replicas_queue_holds_prefill_until_the_first_token():
    """The load a new request weighs is the prompt tokens queued ahead of it: a long prompt routed to a
    replica outweighs a 64-token shared prefix there (0.3 x 400 > 64) until its first token comes, and then
    it no longer does (it decodes beside the newcomer's prefill); ending a request releases it once."""
    backends = [Backend(BackendSpec(f"http://127.0.0.1:{i + 1}")) for i in range(2)]
    chooser = Chooser(backends, Policy.STATE_AWARE, load_weight=0.3)
    shared = list(range(3, 67))
    long_prompt = shared + list(range(100, 436))  # 400 tokens, none cached anywhere
    first = chooser.rank(long_prompt)[0]
    assert first.prefill == 400
    ticket = first.backend.start(first.prefill, first.prefixes)
    assert first.backend.queued == 400
    busy = chooser.rank(shared + [4, 5])
    assert busy[0].backend is not first.backend  # 66 + 0.3 x 0 < 2 + 0.3 x 400
    ticket.first_token()
    assert first.backend.queued == 0 and first.backend.in_flight == 1
    free = chooser.rank(shared + [4, 5])
    assert free[0].backend is first.backend and free[0].saved == 64
    ticket.end()
    ticket.end()
    assert (first.backend.queued, first.backend.in_flight, first.backend.pending) == (0, 0, {})


@pytest.mark.parametrize("bench", ["route", "prefix"])
def test_a_workload_longer_than_the_context_is_a_clear_error_not_a_traceback(capsys, bench):
    """`longdoc`'s documents (543 tokens with its question) do not fit --max-model-len 512: the bench says
    which workload and which flag, and exits 2."""
    from serve.cli import main

    argv = ["bench", bench, "--simulate", "--workload", "longdoc", "--max-model-len", "512", "--chunk", "64"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "workload 'longdoc'" in err and "--max-model-len" in err and "Traceback" not in err
