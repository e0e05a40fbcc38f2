"""`bench prefix --simulate` agrees with the engine: on small workloads served by the real engine and by the
simulator (fed the engine's own answers, so both meet the same tokens), every request's prefix hit,
recomputed and prefilled tokens and the ledger's checkpoint counts and bytes per tier and per kind after
every turn are equal, for several store settings, including budgets that demote and drop checkpoints and a
KV pool small enough to evict cached blocks; with long prompts across many chunks whose chunks run alone
beside short ones packed into one call (`prefill_rows` 2), and with a request that fails. Both serve each
turn's requests concurrently; the simulator is the engine's own step loop over a runner with no model."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.cli import main
from serve.engine.engine import Engine, EngineConfig
from serve.engine.speculative import DraftMethod, Speculation, StepCosts
from serve.prefix.store import PrefixStoreConfig
from serve.sim.cost import CostModel
from serve.sim.engine import SimEngine
from serve.sim.replay import replay
from serve.sim.runner import AnswerDrafts
from serve.sim.workloads import ChatWorkload, Round

CFG = load_config("tiny")
WORKLOAD = ChatWorkload(
    seed=3, conversations=5, turns=3, system_len=8, user_min=2, user_max=5, max_tokens=2, branch_prob=0.5
)
REQUEST_KEYS = ("prefix_hit_tokens", "recomputed_tokens", "prefill_tokens_computed", "generated_tokens")
# One engine shape for every case (its few programs compile once): 2 slots, blocks of 8, 32 tokens at most
# (block tables of 1, 2 or 4), a pool of 8 usable blocks (two requests of up to 31 tokens hold 8 at once), so
# cached blocks are evicted between turns.
SHAPE = dict(max_slots=2, block_size=8, prefill_chunk=16, max_model_len=32, num_blocks=9)
NO_ENDS = dict(prompt_end_checkpoints=False, sequence_end_checkpoints=False)
CASES = {
    "interval 8": dict(checkpoint_interval=8, **NO_ENDS),
    "interval 16": dict(checkpoint_interval=16, **NO_ENDS),
    "ends + interval 16": dict(checkpoint_interval=16),
    "ends + interval 8, budgets that demote and drop": dict(
        checkpoint_interval=8, device_bytes=25_000, host_bytes=45_000
    ),
    "ends + interval 8 in bfloat16, budgets that demote and drop": dict(
        checkpoint_interval=8, device_bytes=12_500, host_bytes=22_500, checkpoint_dtype="bfloat16"
    ),
}


@pytest.fixture(scope="module")
def model():
    return HybridLM(CFG, rngs=nnx.Rngs(0), dtype=jnp.float32)


class Recorder:
    """The engine, remembering every answer by its prompt (greedy: an answer is a function of its prompt)."""

    def __init__(self, engine):
        self.engine, self.answers = engine, {}

    def generate(self, prompts, params):
        results = self.engine.generate(prompts, params)
        for prompt, res in zip(prompts, results, strict=True):
            self.answers[tuple(int(t) for t in prompt)] = res.token_ids
        return results

    def ledger(self):
        return self.engine.ledger()


@pytest.mark.parametrize("name", list(CASES))
def test_the_simulator_agrees_with_the_engine(model, name):
    config = EngineConfig(**SHAPE, prefix=PrefixStoreConfig(**CASES[name]))
    engine = Recorder(Engine(model, config))
    real = replay(engine, WORKLOAD, CFG.vocab_size)
    answers = lambda prompt, n: engine.answers[tuple(prompt)]  # noqa: E731
    sim = replay(SimEngine(CFG, config, answers, CostModel.of(CFG, 0.0)), WORKLOAD, CFG.vocab_size)
    assert [[s[k] for k in REQUEST_KEYS] for s in sim.stats] == [
        [s[k] for k in REQUEST_KEYS] for s in real.stats
    ]
    assert sim.ledgers == real.ledgers  # checkpoints per tier and per kind, hits, saves, demotions, evictions
    last = real.ledgers[-1]
    assert sum(s["prefix_hit_tokens"] for s in real.stats) > 0 and last["evicted_blocks"] > 0
    if "budgets" in name:
        assert last["demotions"] > 0 and last["dropped_checkpoints"] > 0


SPECULATING = ChatWorkload(
    seed=5, conversations=4, turns=2, system_len=8, user_min=2, user_max=5, max_tokens=9, branch_prob=0.5
)


def test_the_simulator_agrees_with_the_engine_when_requests_speculate(model):
    """Drafts from the seeded acceptance model (`AnswerDrafts`: each drafted token right with probability
    0.7) in both; the engine verifies them with the model, the simulator against the answers: the same
    windows, accepted tokens, checkpoints (interval 8: windows stop at checkpoint positions) and ledgers."""
    shape = dict(SHAPE, max_model_len=64, num_blocks=17)
    spec = Speculation(DraftMethod.NGRAM, 3)
    config = EngineConfig(**shape, prefix=PrefixStoreConfig(checkpoint_interval=8), speculative=spec)
    plain = Recorder(Engine(model, dataclasses.replace(config, speculative=Speculation())))
    replay(plain, SPECULATING, CFG.vocab_size)  # the answers (greedy: the same with drafts)
    drafts = AnswerDrafts(lambda req: plain.answers[tuple(req.prompt)], 0.7, CFG.vocab_size, seed=1)
    engine = Recorder(Engine(model, config, drafter=drafts, step_costs=StepCosts(retry=0)))
    real = replay(engine, SPECULATING, CFG.vocab_size)
    answers = lambda prompt, n: plain.answers[tuple(prompt)]  # noqa: E731
    sim_engine = SimEngine(CFG, config, answers, CostModel.of(CFG, 0.0), draft_acceptance=0.7, seed=1)
    sim = replay(sim_engine, SPECULATING, CFG.vocab_size)
    keys = (*REQUEST_KEYS, "drafted_tokens", "accepted_tokens")
    assert [[s[k] for k in keys] for s in sim.stats] == [[s[k] for k in keys] for s in real.stats]
    assert sim.ledgers == real.ledgers
    assert engine.answers == plain.answers
    counts = engine.engine.speculation_stats()
    assert sim_engine.speculation_stats() == counts
    assert 0 < counts.accepted < counts.drafted


def fail_at(store, prompt, position):
    """Make the store raise once `prompt`'s request has computed `position` tokens: that request fails alone
    (finish reason "error", its slot and blocks freed), the others go on."""
    on_computed = store.on_computed

    def failing(seq, source, logits=None):
        if list(seq.prompt) == prompt and seq.num_computed >= position:
            raise RuntimeError("injected")
        return on_computed(seq, source, logits)

    store.on_computed = failing


def test_the_simulator_agrees_with_the_engine_when_a_request_fails(model):
    config = EngineConfig(**SHAPE, prefix=PrefixStoreConfig(checkpoint_interval=8))
    prompt = next(WORKLOAD.rounds(CFG.vocab_size)).prompts[2].tolist()  # round 0's third: it waits for a slot
    engine = Recorder(Engine(model, config))
    fail_at(engine.engine.store, prompt, 8)
    real = replay(engine, WORKLOAD, CFG.vocab_size)
    # the failed request's answer is empty, but its one prefill call samples a token before the store raises
    answers = lambda prompt, n: (engine.answers[tuple(prompt)] + [3] * n)[:n]  # noqa: E731
    sim_engine = SimEngine(CFG, config, answers, CostModel.of(CFG, 0.0))
    fail_at(sim_engine.store, prompt, 8)
    sim = replay(sim_engine, WORKLOAD, CFG.vocab_size)
    keys = (*REQUEST_KEYS, "finish_reason")
    assert [[s[k] for k in keys] for s in sim.stats] == [[s[k] for k in keys] for s in real.stats]
    assert sim.ledgers == real.ledgers
    assert [s["finish_reason"] for s in real.stats].count("error") == 1


@dataclasses.dataclass(frozen=True)
class MixedLengths:
    """Prompts on both sides of the 256 tokens a packed prefill call's block table holds, behind one system
    prompt: in one step a long request's chunk runs alone and before the short ones packed together (the
    engine's order, not the plan's), and long prompts cross many chunks and checkpoints. Round 1 sends each
    round-0 sequence back with a few new tokens (hits), and a new long prompt."""

    lengths: tuple[int, ...] = (270, 40, 300, 30, 180)
    max_tokens: int = 2
    name: str = "mixed"

    def rounds(self, vocab):
        rng = np.random.default_rng(7)
        system = rng.integers(3, vocab, 24).astype(np.int32)
        tokens = lambda n: rng.integers(3, vocab, n).astype(np.int32)  # noqa: E731
        sequences = yield Round([np.concatenate([system, tokens(n - 24)]) for n in self.lengths])
        yield Round(
            [np.concatenate([s, tokens(3)]) for s in sequences] + [np.concatenate([system, tokens(250)])]
        )


# 2 slots, so prefill_rows 2; 312 tokens at most (tables of 39 blocks: wider than the 32 a packed call holds);
# a pool of 64 usable blocks (the two longest requests hold 78 at once: one is preempted and recomputed)
LONG_SHAPE = dict(max_slots=2, block_size=8, prefill_chunk=16, max_model_len=312, num_blocks=65)
LONG_CASES = {
    "interval 16": dict(checkpoint_interval=16, **NO_ENDS),
    "ends + interval 32, budgets that demote and drop": dict(
        checkpoint_interval=32, device_bytes=40_000, host_bytes=60_000
    ),
}


@pytest.mark.parametrize("name", list(LONG_CASES))
def test_the_simulator_agrees_with_the_engine_on_long_prompts_run_alone_and_packed(model, name):
    config = EngineConfig(**LONG_SHAPE, prefix=PrefixStoreConfig(**LONG_CASES[name]))
    engine = Recorder(Engine(model, config))
    assert engine.engine.shape.prefill_rows == 2
    calls = []
    calls_of = engine.engine.runner.prefill_rows
    engine.engine.runner.prefill_rows = lambda reqs, ns: calls.append(len(reqs)) or calls_of(reqs, ns)
    workload = MixedLengths()
    real = replay(engine, workload, CFG.vocab_size)
    assert 1 in calls and 2 in calls  # chunks ran alone and packed
    answers = lambda prompt, n: engine.answers[tuple(prompt)]  # noqa: E731
    sim = replay(SimEngine(CFG, config, answers, CostModel.of(CFG, 0.0)), workload, CFG.vocab_size)
    assert [[s[k] for k in REQUEST_KEYS] for s in sim.stats] == [
        [s[k] for k in REQUEST_KEYS] for s in real.stats
    ]
    assert sim.ledgers == real.ledgers
    assert sum(s["prefix_hit_tokens"] for s in real.stats) > 0


def test_bench_prefix_simulate_runs_the_k3_shape_in_seconds(capsys):
    """No weights exist: the K3 shape at 8K-token contexts, its KV pool sized from --hbm."""
    args = [
        "bench",
        "prefix",
        "--simulate",
        "--config",
        "kimi-k3",
        "--intervals",
        "4096",
        "--conversations",
        "8",
        "--checkpoint-policy",
        "fixed",
    ]
    args += ["--turns", "3", "--system-len", "4096", "--user-min", "512", "--user-max", "2048"]
    args += ["--max-tokens", "64", "--slots", "4", "--block-size", "64", "--chunk", "4096"]
    args += ["--max-model-len", "32768", "--dtype", "bfloat16", "--hbm", "95", "--device-cache-mb", "8192"]
    assert main(args) == 0
    result = json.loads(capsys.readouterr().out.strip())
    rows = {r["setting"]: r for r in result["rows"]}
    ends = rows["prompt/sequence-end + interval 4096"]
    assert result["simulated"] and result["state_bytes"] > 4e8  # a K3 state checkpoint: ~0.45 GB
    assert rows["off"]["hit_tokens"] == 0 and ends["hit_rate"] > rows["interval 4096"]["hit_rate"] > 0
    assert ends["sequences_fit"] < ends["sequences_fit_without_checkpoints"]
    assert ends["prefill_flops"] < rows["off"]["prefill_flops"]


def test_a_request_that_preempts_itself_at_admission_ends_the_admissions_of_that_step():
    """A 5-block pool (4 usable) and a prefix hit: the admitted request needed more blocks than could be
    freed, preempted itself, went back to the front of the queue with its slot free, and `_admit` took it
    again, forever, inside one `schedule()` (found with the simulator; the engine runs the same scheduler).
    Now admission stops for that step, and every request is served."""
    import threading

    from serve.sim.runner import random_answers

    workload = ChatWorkload(
        seed=3, conversations=4, turns=3, system_len=8, user_min=2, user_max=5, max_tokens=2, branch_prob=0.5
    )
    shape = {**SHAPE, "num_blocks": 5}
    config = EngineConfig(**shape, prefix=PrefixStoreConfig(checkpoint_interval=8, **NO_ENDS))
    sim = SimEngine(CFG, config, random_answers(CFG.vocab_size, 0), CostModel.of(CFG, 0.0))
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=replay(sim, workload, CFG.vocab_size)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the scheduler did not return"
    assert len(out["r"].stats) == 12


def test_a_long_replay_reports_each_round_on_stderr_and_a_short_one_stays_quiet(capsys):
    """`replay`'s progress: called after every round with the requests served so far (5 chats x 3 turns);
    `RoundProgress` prints only once its threshold has gone by, and never on stdout (the JSON's)."""
    from benchmarks.common import RoundProgress
    from serve.sim.runner import random_answers

    config = EngineConfig(**SHAPE, prefix=PrefixStoreConfig(checkpoint_interval=8))
    calls = []
    replay(
        SimEngine(CFG, config, random_answers(CFG.vocab_size, 0), CostModel.of(CFG, 0.0)),
        WORKLOAD,
        CFG.vocab_size,
        lambda *a: calls.append(a),
    )
    assert calls == [(1, 5), (2, 10), (3, 15)]
    RoundProgress("chat, adaptive")(1, 5)
    RoundProgress("chat, adaptive", 3, after_s=0.0)(2, 12_000)
    out = capsys.readouterr()
    assert out.out == "" and out.err == "  chat, adaptive: round 2 of 3 served (12,000 requests, 0 s)\n"
