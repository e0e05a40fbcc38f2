"""Warm start and `jaxhybrid bench serve` (issue 18).

Pure parts (latency summaries, arrivals, prompts, the warm-up plan and its state machine) are tested
without a model; one in-process server (tiny cut to one KDA and one MLA layer, 1 slot, context 64 in one
64-token block: two model programs) warms up behind a gate, so /health is seen "warming" and then "ok",
and then serves the bench.
"""

import asyncio
import dataclasses
import json
import math
import threading
import time
from concurrent.futures import Future

import httpx
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from servers import free_port, uvicorn_thread
from tqdm import tqdm

from benchmarks.compare import KINDS, read_results, table_rows
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer
from serve.bench.client import probe
from serve.bench.common import compile_watch
from serve.bench.latency import summarize
from serve.bench.serve import PassSettings, run_pass
from serve.bench.workload import Arrivals, WorkloadError, arrival_times, read_dataset, synthetic
from serve.cli import main
from serve.engine.config import EngineConfig, EngineShape, ProgramShape
from serve.engine.engine import Engine
from serve.engine.executables import Tier
from serve.engine.warmup import Helpers, Quick, Warmup, WarmupLevel, WarmupState, warmup_plan
from serve.http.app import create_app

# --- latency summaries, arrivals, prompts -----------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0, 1e3, allow_nan=False), max_size=200))
def test_summary_is_numpys_percentiles(values):
    s = summarize(values)
    assert s.count == len(values)
    if not values:
        assert s.mean is s.p50 is s.p99 is s.max is None
        return
    want = np.percentile(values, [50, 90, 99])
    assert [s.p50, s.p90, s.p99] == pytest.approx(want.tolist(), rel=1e-12, abs=1e-12)
    assert min(values) <= s.p50 <= s.p90 <= s.p99 <= s.max == max(values)
    assert min(values) - 1e-9 <= s.mean <= max(values) + 1e-9
    fields = s.fields("ttft")
    assert fields["ttft_p90_ms"] == pytest.approx(1e3 * s.p90) and set(fields) == {
        f"ttft_{k}_ms" for k in ("mean", "p50", "p90", "p99", "max")
    }


def test_arrivals():
    assert arrival_times(5, math.inf, Arrivals.POISSON) == [0.0] * 5
    assert arrival_times(4, 2.0, Arrivals.FIXED) == pytest.approx([0.0, 0.5, 1.0, 1.5])
    poisson = arrival_times(4000, 5.0, Arrivals.POISSON, seed=3)
    assert (
        poisson
        == arrival_times(4000, 5.0, Arrivals.POISSON, seed=3)
        != arrival_times(4000, 5.0, Arrivals.POISSON)
    )
    assert poisson[0] == 0.0 and all(b >= a for a, b in zip(poisson, poisson[1:], strict=False))
    assert poisson[-1] / 3999 == pytest.approx(0.2, rel=0.08)  # mean gap 1 / rate
    with pytest.raises(WorkloadError):
        arrival_times(3, 0.0, Arrivals.FIXED)


def test_synthetic_prompts_and_dataset(tmp_path):
    reqs = synthetic(5, 20, 7, vocab=50, shared_prefix_len=12, seed=1)
    assert reqs == synthetic(5, 20, 7, vocab=50, shared_prefix_len=12, seed=1)
    assert all(len(r.prompt) == 20 and r.max_tokens == 7 and all(3 <= t < 50 for t in r.prompt) for r in reqs)
    assert len({tuple(r.prompt[:12]) for r in reqs}) == 1 and len({tuple(r.prompt) for r in reqs}) == 5
    with pytest.raises(WorkloadError, match="shared-prefix-len"):
        synthetic(2, 4, 1, vocab=50, shared_prefix_len=5)
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "hello", "max_tokens": 3}\n\n{"prompt": [5, 6]}\n')
    got = read_dataset(str(path), 3, default_output_len=9)
    assert [(r.prompt, r.max_tokens) for r in got] == [("hello", 3), ([5, 6], 9), ("hello", 3)]
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(WorkloadError, match=r"d.jsonl:1"):
        read_dataset(str(path), 1, 4)


# --- the warm-up plan and its state machine -----------------------------------------------------------------


def shape_of(slots=4, block=16, chunk=128, max_len=4096) -> EngineShape:
    cfg = EngineConfig(max_slots=slots, block_size=block, prefill_chunk=chunk, max_model_len=max_len)
    return EngineShape.resolve(cfg, load_config("tiny"))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([4, 8, 16]),
    st.sampled_from([16, 32, 64]),
    st.sampled_from([64, 200, 512]),
    st.lists(st.integers(1, 400), min_size=1, max_size=8),
)
def test_prefill_plan_holds_every_chunk_the_engine_runs(block, chunk, max_len, prompt_lens):
    """Chunking a prompt as the scheduler does (chunks of at most `chunk` tokens, blocks for what is
    computed) only meets programs in the plan, and the plan has every decode shape."""
    shape = shape_of(2, block, chunk, max_len)
    plan = set(shape.prefill_programs())
    for n in prompt_lens:
        n, done = min(n, max_len - 1), 0
        while done < n:
            step = min(chunk, n - done)
            bucket = next(b for b in shape.buckets if b >= step)
            width = shape.table_width(math.ceil((done + step) / block))
            assert ProgramShape(1, bucket, width) in plan
            done += step
    decode = shape.decode_programs()
    assert {(p.rows, p.width) for p in decode} == {
        (r, w) for r in shape.decode_buckets for w in shape.table_buckets
    }


def test_warmup_plan_puts_what_a_first_request_needs_first():
    """The README's first request (a prompt of a few tokens, 16 generated) meets the one-row helpers, the
    one-row decode step and the smallest prefill chunk at the narrowest table (64 tokens: 4 blocks of 16):
    those are the first items, before any batched program; every program is planned once."""
    shape = shape_of()
    plan = warmup_plan(shape, WarmupLevel.ALL)
    programs = [p for p in plan if isinstance(p, ProgramShape)]
    assert len(programs) == len(set(programs)) == len(shape.decode_programs()) + len(shape.prefill_programs())
    assert plan[:4] == [
        Helpers((1,), slot_programs=True),
        ProgramShape(1, 1, 4),
        ProgramShape(1, 16, 4),
        ProgramShape(1, 32, 4),
    ]
    # the first request's programs, whatever its prompt: one row, short contexts (narrow tables) first
    first_batched = next(i for i, p in enumerate(programs) if p.rows > 1)
    assert all(p.rows == 1 for p in programs[:first_batched])
    assert all(p.rows > 1 for p in programs[first_batched:])
    assert plan[first_batched + 1] == Helpers((4,), slot_programs=False)  # before the batched programs
    for part in (programs[:first_batched], programs[first_batched:]):
        assert [p.width for p in part] == sorted(p.width for p in part)
        at_width = {}
        for p in part:  # at each width the decode step first, then prefill chunks shortest first
            at_width.setdefault(p.width, []).append(p.length)
        assert all(lengths == sorted(lengths) and lengths[0] == 1 for lengths in at_width.values())
    decode_only = warmup_plan(shape, WarmupLevel.DECODE)
    assert all(p.is_decode for p in decode_only if isinstance(p, ProgramShape))
    assert decode_only[:3] == [Helpers((1,), True), ProgramShape(1, 1, 4), ProgramShape(1, 1, 8)]
    assert not warmup_plan(shape, WarmupLevel.NONE)


class FakeEngine:
    def __init__(self, fail_at=None):
        self.shape, self.done, self.fail_at = shape_of(2, 16, 32, 64), [], fail_at

    def compile_helpers(self, rows=None, slot_programs=True):
        self.done.append(Helpers(rows, slot_programs))

    def compile_program(self, program):
        if len(self.done) == self.fail_at:
            raise RuntimeError("boom")
        self.done.append(program)
        return True


def test_warmup_steps_timeout_and_failure():
    now = [0.0]
    eng = FakeEngine()
    w = Warmup(eng, WarmupLevel.DECODE, timeout_s=10, clock=lambda: now[0])
    total = len(warmup_plan(eng.shape, WarmupLevel.DECODE))
    assert total == 2 + len(eng.shape.decode_programs())  # helpers of 1 row, then of 2
    assert w.progress().state is WarmupState.WARMING and w.progress().total == total
    while w.step():
        now[0] += 1.0
    assert w.state is WarmupState.DONE and eng.done == warmup_plan(eng.shape, WarmupLevel.DECODE)
    assert w.progress().last == "decode, 2 rows, a block table of 64 tokens"
    assert w.progress().compiled == total and w.progress().elapsed_s == pytest.approx(total - 1)

    now[0], eng = 0.0, FakeEngine()
    w = Warmup(eng, WarmupLevel.ALL, timeout_s=2.5, clock=lambda: now[0])
    while w.step():
        now[0] += 1.0
    assert w.state is WarmupState.TIMED_OUT and len(eng.done) == 3 and not w.step()

    w = Warmup(FakeEngine(fail_at=2), WarmupLevel.ALL, timeout_s=100)
    while w.step():
        pass
    assert w.state is WarmupState.FAILED and w.progress().compiled == 2
    assert Warmup(FakeEngine(), WarmupLevel.NONE, 1).state is WarmupState.DONE


class FakeTieredEngine(FakeEngine):
    """An engine with the tiered compile: model programs go to a background job the test finishes."""

    def __init__(self):
        super().__init__()
        self.shape = dataclasses.replace(self.shape, tiered_compile=True)
        self.jobs = []

    def compile_program(self, program):
        raise AssertionError("with the tiered compile model programs compile in the background")

    def compile_in_background(self, program, tier=Tier.OPTIMIZED):
        self.jobs.append((program, tier, Future()))
        return self.jobs[-1][2]


def test_tiered_warmup_compiles_the_first_decode_step_quick_in_the_background_helpers_meanwhile():
    eng = FakeTieredEngine()
    w = Warmup(eng, WarmupLevel.DECODE, timeout_s=100)
    first = ProgramShape(1, 1, eng.shape.table_buckets[0])
    assert w.items[:3] == [Quick(first), Helpers((1,), True), first]  # quick first, optimized after
    assert w.step(wait_s=0) and eng.jobs == [(first, Tier.QUICK, eng.jobs[0][2])] and eng.done == []
    assert w.step(wait_s=0) and eng.done == [Helpers((1,), True)]  # on this thread while the job runs
    assert w.step(wait_s=0) and len(eng.jobs) == 1  # the next program waits for the one in flight
    assert w.progress().compiled == 1
    eng.jobs[0][2].set_result(True)
    while w.pending:
        w.step(wait_s=0)
        if eng.jobs and not eng.jobs[-1][2].done():
            eng.jobs[-1][2].set_result(len(eng.jobs) != 2)  # one a request compiled first
    assert w.state is WarmupState.DONE and w.progress().compiled == len(w.items)
    assert [(p, t) for p, t, _ in eng.jobs] == [(first, Tier.QUICK)] + [
        (p, Tier.OPTIMIZED) for p in w.items if isinstance(p, ProgramShape)
    ]
    assert w.progress().last == "decode, 2 rows, a block table of 64 tokens"

    failing = FakeTieredEngine()
    w = Warmup(failing, WarmupLevel.DECODE, timeout_s=100)
    w.step(wait_s=0), w.step(wait_s=0)  # the quick job, then the helpers meanwhile
    failing.jobs[0][2].set_exception(RuntimeError("boom"))
    while w.step(wait_s=0):
        pass
    assert w.state is WarmupState.FAILED and w.progress().compiled == 1  # the helpers


# --- one in-process server, warmed behind a gate ------------------------------------------------------------


CUT = load_config("tiny").replace(
    num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,)
)  # compiles fast


class Warm:
    def __init__(self, url, engine, gate):
        self.url, self.engine, self.gate = url, engine, gate

    def ready(self, timeout=120.0) -> dict:
        self.gate.set()
        deadline = time.monotonic() + timeout
        while True:
            health = httpx.get(f"{self.url}/health", timeout=10).json()
            if health["status"] == "ok":
                return health
            assert time.monotonic() < deadline, health
            time.sleep(0.05)


@pytest.fixture(scope="module")
def warm():
    model = HybridLM(CUT, rngs=nnx.Rngs(0))
    engine = Engine(model, EngineConfig(max_slots=1, block_size=64, prefill_chunk=16, max_model_len=64))
    gate, helpers = threading.Event(), engine.compile_helpers

    def gated(*args, **kw):  # the warm-up waits until the test has seen it warming
        gate.wait(60)
        helpers(*args, **kw)

    engine.compile_helpers = gated
    app = create_app(engine, ByteTokenizer(512), "tiny", warmup=Warmup(engine, WarmupLevel.ALL, 300))
    with uvicorn_thread(app) as url:
        yield Warm(url, engine, gate)
        gate.set()


def test_health_warming_then_ok_and_the_first_request_compiles_nothing(warm):
    health = httpx.get(f"{warm.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "warming"
    assert health.json()["warmup"]["state"] == "warming" and health.json()["prefix_cache"] is True
    done = warm.ready()
    assert done["warmup"]["state"] == "done" and done["warmup"]["compiled"] == done["warmup"]["total"]
    shape = warm.engine.shape
    compiled = warm.engine.compiled_programs()
    assert compiled == set(shape.decode_programs()) | set(shape.prefill_programs())
    body = {"prompt": list(range(5, 25)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with (
        compile_watch() as seen
    ):  # prompt-end and sequence-end checkpoints, then a full hit on the same prompt
        for _ in range(2):
            r = httpx.post(f"{warm.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert seen["compiles"] == 0 and warm.engine.compiled_programs() == compiled


def test_bench_requests_are_timed_sanely(warm):
    warm.ready()

    async def go():
        async with httpx.AsyncClient(base_url=warm.url, timeout=60) as client:
            info = await probe(client, 10)
            assert (info.model, info.max_model_len, info.vocab_size, info.prefix_cache) == (
                "tiny",
                64,
                512,
                True,
            )
            reqs = synthetic(4, 20, 5, info.vocab_size, seed=1)
            s = PassSettings(40.0, Arrivals.FIXED, 0, None, 0.0, "test")
            with tqdm(total=4, disable=True) as bar:
                return await run_pass(client, info.model, reqs, s, bar)

    results, duration = asyncio.run(go())
    assert duration >= 3 / 40
    for r in results:
        assert r.ok and r.error is None and r.output_tokens == 5 and r.prompt_tokens == 20
        assert 0 < r.ttft_s <= r.e2e_s and 1 <= len(r.itl_s) <= 4
        assert sum(r.itl_s) <= r.e2e_s - r.ttft_s + 1e-6
        assert r.tpot_s == pytest.approx((r.e2e_s - r.ttft_s) / 4)


def test_bench_serve_command_and_compare(warm, tmp_path, capsys):
    warm.ready()
    out = tmp_path / "a.json"
    flags = [
        "--base-url",
        warm.url,
        "--num-prompts",
        "6",
        "--input-len",
        "20",
        "--output-len",
        "5",
        "--quiet",
    ]
    assert (
        main(
            [
                "bench",
                "serve",
                *flags,
                "--shared-prefix-len",
                "8",
                "--request-rate",
                "inf,50",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["bench"] == "serve" and result["label"] == "prefix cache on" and result["model"] == "tiny"
    assert [r["request_rate"] for r in result["rows"]] == ["inf", 50.0]
    for row in result["rows"]:
        assert (row["completed"], row["failed"], row["output_tokens"], row["prompt_tokens"]) == (
            6,
            0,
            30,
            120,
        )
        assert row["prefix_lookups"] == 6  # the server's counters, before and after the pass
        assert row["spec_draft_tokens"] == 0 and row["spec_acceptance"] is None  # the server does not draft
        for name in ("ttft", "tpot", "itl", "e2e"):
            values = [row[f"{name}_{s}_ms"] for s in ("p50", "p90", "p99", "max")]
            assert all(v is not None and v >= 0 for v in values) and values == sorted(values), name
        assert row["ttft_max_ms"] <= row["e2e_max_ms"] and row["output_throughput"] > 0
    assert "ttft_p50_ms" in capsys.readouterr().err  # the table
    kind, results = read_results([str(out), str(out)])
    rows, columns = table_rows(KINDS[kind][0][0], results)
    assert kind == "serve" and [r["B/A"] for r in rows] == ["1.00", "1.00"] and "ttft_p50_ms B" in columns

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "def f(x):", "max_tokens": 3}\n{"prompt": [7, 8, 9], "max_tokens": 2}\n')
    assert main(["bench", "serve", "--base-url", warm.url, "--dataset", str(data), "--num-prompts", "2",
                 "--quiet", "--out", str(out)]) == 0  # fmt: skip
    row = json.loads(out.read_text())["rows"][0]
    assert (row["completed"], row["output_tokens"], row["prompt_tokens"]) == (2, 5, 12)


def test_bench_serve_errors_are_one_line(warm, tmp_path, capsys):
    def err(*flags):
        assert main(["bench", "serve", "--quiet", *flags]) == 2
        text = capsys.readouterr().err
        assert text.startswith("error: ") and text.count("\n") == 1 and "Traceback" not in text, text
        return text

    assert "is `jaxhybrid serve` running" in err("--base-url", f"http://127.0.0.1:{free_port()}")
    assert "not an http(s) URL" in err("--base-url", "ftp://x")
    assert "--request-rate" in err("--request-rate", "fast")
    warm.ready()
    assert "context (64 tokens)" in err("--base-url", warm.url, "--input-len", "60", "--output-len", "10")
    assert main(["serve", "--warmup-timeout", "0"]) == 2
