"""`bench prefix --simulate` agrees with the engine: on small workloads served by the real engine and by the
simulator (fed the engine's own answers, so both meet the same tokens), every request's prefix hit,
recomputed and prefilled tokens and the ledger's checkpoint counts and bytes per tier and per kind after
every turn are equal, for several store settings, including budgets that demote and drop checkpoints and a
KV pool small enough to evict cached blocks. Both serve each turn's requests concurrently: the simulator
runs the engine's scheduler step by step, so admission order, chunking and eviction are the same."""

import json

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.bench.simulate import CostModel, SimEngine
from serve.bench.workloads import ChatWorkload, replay
from serve.cli import main
from serve.engine.engine import Engine, EngineConfig
from serve.prefix.store import PrefixStoreConfig

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

    from serve.bench.simulate import random_answers

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
