"""The engine on two processes x 4 CPU devices (gloo, localhost) forming one 8-device mesh: every process
runs the same engine loop, process 0 owns the intake and broadcasts it (`serve.engine.replicated`). The
oracle is the plain single-process engine on one device, fed the same requests at the same steps."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import subprocess_xla_flags
from flax import nnx
from oracles import FullPass, assert_matches_full_pass
from servers import free_port, wait_healthy

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.cli import main
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
MESH = "data=2,expert=2,tensor=2"
# Shapes that need only two compiled model programs (one prefill bucket, one block-table width; each
# costs ~5 s of compile per process on 2 cores): every process compiles its programs itself. Paging over
# several blocks on a mesh is covered by tests/test_sharded_engine.py.
ENGINE = {"max_slots": 4, "block_size": 64, "prefill_chunk": 16, "max_model_len": 64}
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> Path:
    """A persistent compilation cache shared by the tests' processes (process 0 reuses its programs)."""
    return tmp_path_factory.mktemp("jax-cache")


def process_env(cache: Path, local_devices: int) -> dict[str, str]:
    """The environment of one of the two processes: its simulated devices, the shared compilation cache,
    and this repository importable."""
    env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags(local_devices)}
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_two(make_cmd, tmp_path: Path, cache: Path, local_devices: int = 4) -> list[tuple[int, str, str]]:
    """Start process 0 and 1 (`make_cmd(i, port)`), wait, and kill both on timeout or any failure;
    returns (returncode, stdout, stderr) per process."""
    port = free_port()
    env = process_env(cache, local_devices)
    procs = []
    try:
        for i in range(2):
            out, err = open(tmp_path / f"out{i}.txt", "w+"), open(tmp_path / f"err{i}.txt", "w+")
            procs.append(
                (subprocess.Popen(make_cmd(i, port), env=env, stdout=out, stderr=err, text=True), out, err)
            )
        results = []
        for p, out, err in procs:
            p.wait(timeout=TIMEOUT_S)
            out.seek(0), err.seek(0)
            results.append((p.returncode, out.read(), err.read()))
        return results
    finally:
        for p, out, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            out.close(), err.close()


def schedule() -> list[dict]:
    """Prompts of 5..40 tokens (some longer than the 16-token prefill chunk) arriving at steps 0..3;
    one is aborted while it decodes."""
    rng = np.random.default_rng(0)
    return [
        {"step": 0, "prompt": rng.integers(3, 512, 5).tolist(), "max_tokens": 6},
        {"step": 0, "prompt": rng.integers(3, 512, 40).tolist(), "max_tokens": 6},
        {"step": 1, "prompt": rng.integers(3, 512, 9).tolist(), "max_tokens": 8, "abort_at_step": 4},
        {"step": 2, "prompt": rng.integers(3, 512, 17).tolist(), "max_tokens": 5},
        {"step": 3, "prompt": rng.integers(3, 512, 33).tolist(), "max_tokens": 4},
    ]


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The single-device oracle: tiny, seed-0 weights, the same engine shape, no prefix store (as on
    several processes, `serve.engine.replicated.check_engine_config`)."""
    return Engine(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)), EngineConfig(**ENGINE, prefix=None))


@pytest.fixture(scope="module")
def full_pass() -> FullPass:
    """The full causal pass of the same weights: tokens and per-token logprobs."""
    return FullPass(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)))


def replay(engine: Engine, sched: list[dict]) -> tuple[dict, int]:
    """The worker's leader loop on one plain engine: {request id: (tokens, finish reason)}, steps run."""
    start = engine.steps
    step = 0
    while step <= max(s["step"] for s in sched) or engine.has_unfinished():
        for i, s in enumerate(sched):
            if s["step"] == step:
                params = SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=True)
                engine.add_request(s["prompt"], params, request_id=f"s{i}")
            if s.get("abort_at_step") == step:
                engine.abort(f"s{i}")
        engine.step()
        step += 1
    out = {
        f"s{i}": (engine.requests[f"s{i}"].generated, engine.requests[f"s{i}"].finish_reason)
        for i in range(len(sched))
    }
    for rid in out:
        engine.forget(rid)
    return out, engine.steps - start


@pytest.mark.slow
def test_two_processes_run_the_engine_in_lockstep(tmp_path, engine, compile_cache):
    """Requests added on process 0 at different steps (and one abort) reach process 1 at the same steps:
    both processes end with identical engine records (tokens, finish reasons, step count), equal to the
    single-process engine's."""
    sched = schedule()
    (tmp_path / "schedule.json").write_text(json.dumps(sched))
    worker = Path(__file__).with_name("multihost_engine_worker.py")

    def cmd(i: int, port: int) -> list[str]:
        return [
            sys.executable,
            str(worker),
            f"--coordinator=127.0.0.1:{port}",
            "--num-processes=2",
            f"--process-id={i}",
            "--local-devices=4",
            f"--mesh={MESH}",
            f"--schedule={tmp_path / 'schedule.json'}",
            f"--engine={json.dumps(ENGINE)}",
            f"--out={tmp_path / f'records{i}.json'}",
        ]

    for rc, out, err in run_two(cmd, tmp_path, compile_cache):
        assert rc == 0, (out + err)[-3000:]
    records = [json.loads((tmp_path / f"records{i}.json").read_text()) for i in range(2)]
    assert records[0]["results"] == records[1]["results"]
    assert records[0]["steps"] == records[1]["steps"]
    assert records[0]["broadcast_bytes"] == records[1]["broadcast_bytes"] > 0

    want, steps = replay(engine, sched)
    got = {rid: (r["tokens"], r["finish_reason"]) for rid, r in records[0]["results"].items()}
    assert got == want
    assert records[0]["steps"] == steps
    assert got["s2"][1] == "abort" and 0 < len(got["s2"][0]) < 8  # aborted mid-decode


@pytest.mark.slow
def test_generate_cli_on_two_processes(tmp_path, engine, compile_cache):
    """`jaxhybrid generate --coordinator ... --num-processes 2 --process-id I` : process 0 reads the prompts
    file and prints one JSON line per prompt, the single-process tokens; process 1 prints a summary only."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 512, n).tolist() for n in (7, 38, 20)]
    lines = [{"prompt_ids": p, "max_tokens": m} for p, m in zip(prompts, (5, 4, 6), strict=True)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    flags = [f"--{k.replace('_', '-').replace('max-slots', 'slots')}={v}" for k, v in ENGINE.items()]

    def cmd(i: int, port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "serve.cli",
            "generate",
            "--config=tiny",
            *([f"--prompts-file={tmp_path / 'prompts.jsonl'}"] if i == 0 else []),  # followers read none
            "--ignore-eos",
            "--json",
            f"--mesh={MESH}",
            *flags,
            f"--coordinator=127.0.0.1:{port}",
            "--num-processes=2",
            f"--process-id={i}",
        ]

    (rc0, out0, err0), (rc1, out1, err1) = run_two(cmd, tmp_path, compile_cache)
    assert rc0 == 0 and rc1 == 0, (err0 + err1)[-3000:]
    got = [json.loads(x)["token_ids"] for x in out0.splitlines()]
    want = [
        r.token_ids
        for r in engine.generate(
            prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (5, 4, 6)]
        )
    ]
    assert got == want
    assert out1 == "" and "process 1 of 2: followed process 0" in err1


@pytest.mark.slow  # 2 processes x 2 starts compile every program (3.5 min); test_prefix_disk restarts one
def test_the_prefix_store_on_two_processes_with_a_disk_tier_survives_a_restart(
    tmp_path, engine, full_pass, compile_cache
):
    """2 processes x 4 devices, prefix store on with --store-dir: greedy tokens equal one process without any
    cache; prompts that extend earlier ones hit them (partial-block prompt-end checkpoints of sharded states,
    kept in the host tier as each process's shards); after both processes restart, follow-up turns resume
    from the disk tier."""
    rng = np.random.default_rng(2)
    first = [rng.integers(3, 512, n).tolist() for n in (20, 18, 22, 15)]
    turns = [
        first,
        [first[0] + rng.integers(3, 512, 5).tolist(), first[1] + rng.integers(3, 512, 4).tolist()],
    ]
    turns.append(
        [turns[1][0] + rng.integers(3, 512, 3).tolist(), turns[1][1] + rng.integers(3, 512, 6).tolist()]
    )
    flags = [f"--{k.replace('_', '-').replace('max-slots', 'slots')}={v}" for k, v in ENGINE.items()]
    store = tmp_path / "store"

    def serve(prompts, run):
        path = tmp_path / f"prompts{run}.jsonl"
        path.write_text("\n".join(json.dumps({"prompt_ids": p, "max_tokens": 4}) for p in prompts))

        def cmd(i: int, port: int) -> list[str]:
            return [
                sys.executable, "-m", "serve.cli", "generate", "--config=tiny",
                *([f"--prompts-file={path}"] if i == 0 else []),
                "--ignore-eos", "--logprobs", "--json", f"--mesh={MESH}", *flags, f"--store-dir={store}",
                "--device-cache-mb=0",  # every checkpoint goes to the host tier: each process's shards
                f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}",
            ]  # fmt: skip

        (rc0, out0, err0), (rc1, _, err1) = run_two(cmd, tmp_path, compile_cache)
        assert rc0 == 0 and rc1 == 0, (err0 + err1)[-3000:]
        return [json.loads(x) for x in out0.splitlines()]

    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = serve(turns[0] + turns[1], 0)  # 4 slots: the two follow-ups are admitted after a slot frees
    want = [r.token_ids for r in engine.generate(turns[0] + turns[1], params)]
    assert [g["token_ids"] for g in got] == want
    for prompt, g in zip(turns[0] + turns[1], got, strict=True):
        assert_matches_full_pass(full_pass, prompt, g["token_ids"], g["logprobs"])
    assert [g["stats"]["prefix_hit_tokens"] for g in got[4:]] == [len(first[0]), len(first[1])]
    assert any((store / ns).is_dir() for ns in [p.name for p in store.iterdir()])
    got = serve(turns[2], 1)  # both processes restarted: nothing in memory
    assert [g["token_ids"] for g in got] == [r.token_ids for r in engine.generate(turns[2], params)]
    for prompt, g in zip(turns[2], got, strict=True):  # resumed from the disk tier's sharded states
        assert_matches_full_pass(full_pass, prompt, g["token_ids"], g["logprobs"])
    assert [g["stats"]["prefix_hit_tokens"] for g in got] == [len(p) for p in turns[1]]  # from disk


def start_two_servers(tmp_path: Path, cache: Path, http_port: int, shutdown_timeout: float = 3.0):
    """Two `jaxhybrid serve` processes on one mesh (process 0 serves HTTP); returns both, healthy."""
    import httpx

    port = free_port()
    env = process_env(cache, 4)
    flags = [f"--{k.replace('_', '-').replace('max-slots', 'slots')}={v}" for k, v in ENGINE.items()]
    procs = []
    for i in range(2):
        cmd = [sys.executable, "-m", "serve.cli", "serve", "--config=tiny", f"--mesh={MESH}", *flags]
        cmd += ["--no-prefix-cache", f"--port={http_port}", f"--shutdown-timeout={shutdown_timeout}"]
        cmd += [f"--coordinator=127.0.0.1:{port}", "--num-processes=2", f"--process-id={i}"]
        log = open(tmp_path / f"serve{i}.txt", "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    url = f"http://127.0.0.1:{http_port}"
    wait_healthy(
        url,
        lambda: all(p.poll() is None for p in procs),
        lambda: (tmp_path / "serve0.txt").read_text()[-3000:],
        timeout=TIMEOUT_S,
    )
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    return procs, url


@pytest.mark.slow
def test_when_a_peer_dies_the_survivor_reports_it_and_exits(tmp_path, compile_cache):
    """kill -9 of the follower: the leader answers 503 at once and exits on SIGTERM without the distributed
    shutdown (which would wait for the dead peer: its log says so); kill -9 of the leader: the follower exits
    too."""
    import httpx

    procs, url = start_two_servers(tmp_path, compile_cache, free_port())
    try:
        procs[1].kill()
        procs[1].wait()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:  # the next idle step finds it
            assert time.monotonic() < deadline, "the leader did not notice its follower died"
            time.sleep(0.2)
        procs[0].send_signal(signal.SIGTERM)
        assert procs[0].wait(timeout=60) == 1  # non-zero: it lost a peer
        assert "exiting without the distributed shutdown" in (tmp_path / "serve0.txt").read_text()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    procs, url = start_two_servers(tmp_path, compile_cache, free_port())
    try:
        procs[0].kill()
        procs[0].wait()
        assert procs[1].wait(timeout=60) != 0  # JAX's distributed client ends a follower whose leader died
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_follower_replaying_the_log_keeps_the_leaders_engine_state():
    """In one process: a second engine fed only the leader's broadcast messages (adds with the seed the
    leader resolved, aborts, forgets) takes the leader's decisions step by step, sampled requests too."""
    from serve.engine.replicated import ReplicatedEngine, StepLog

    engine, follower_engine = (
        Engine(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)), EngineConfig(**ENGINE, prefix=None))
        for _ in range(2)
    )
    leader, follower = ReplicatedEngine(engine), ReplicatedEngine(follower_engine)
    follower.is_leader = False
    sent: list[dict] = []
    exchange = leader._exchange
    leader._exchange = lambda: StepLog.from_json(
        sent.append(json.loads(json.dumps(exchange().to_json()))) or sent[-1]
    )
    follower._exchange = lambda: StepLog.from_json(sent[-1])
    rng = np.random.default_rng(2)
    sampled = SamplingParams(max_tokens=5, temperature=0.8, top_k=20, ignore_eos=True)  # engine-drawn seed
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for step in range(30):
        if step in (0, 2):
            leader.add_request(rng.integers(3, 512, 21).tolist(), sampled)
            leader.add_request(rng.integers(3, 512, 6).tolist(), greedy)
        if step == 3:
            leader.abort(next(iter(engine.scheduler.running)).id)
        for out in leader.step():
            if out.finished:
                leader.forget(out.request_id)
        follower.step()
        assert [(r.id, r.num_computed, r.generated) for r in engine.scheduler.running] == [
            (r.id, r.num_computed, r.generated) for r in follower_engine.scheduler.running
        ]
        if not leader.has_unfinished():
            break
    leader.close()
    leader.step(), follower.step()
    assert leader.closed and follower.closed and not sent[-1]["log"]
    assert set(engine.requests) == set(follower_engine.requests)  # finished ones forgotten on both
    assert sum(op[0] == "add" for m in sent for op in m["log"]) == 4


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-processes=2"], "no coordinator address"),
        (["--coordinator=127.0.0.1:1", "--num-processes=2"], "also set the number of processes"),
        (["--coordinator=127.0.0.1:1", "--num-processes=2", "--process-id=2"], "outside 0..1"),
        (["--coordinator=localhost", "--num-processes=2", "--process-id=0"], "host:port"),
    ],
)
def test_bad_multihost_flags_are_one_error_line(capsys, flags, message):
    rc = main(["generate", "--config=tiny", "--prompt-ids=1,2", *flags])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
