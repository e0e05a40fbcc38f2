"""Checkpoints kept in bfloat16 (`--checkpoint-dtype`): their bytes are the hand-counted half of the
recurrent state in the ledger, `memory` and `plan` (the simulator's: tests/test_prefix_simulate.py); a
request resumed from one stays within the stated drift of the full causal pass; the disk tier keeps them in
bfloat16 and an exact store never reads them."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import FullPass, assert_matches_full_pass, log_softmax

from jaxhybrid.cache import kda_state_bytes, memory_report, narrowed
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.plan import Planner, PlanRequest
from serve.prefix.files import MANIFEST
from serve.prefix.store import PrefixStoreConfig

BS = 8
# Per-token logprobs of a request resumed from a bfloat16 checkpoint vs the full causal pass, on `tiny`: the
# state is rounded once (relative 2^-8, bfloat16's unit roundoff) and the error then decays with the KDA
# gates; measured up to 3.3e-3 (mean 2.7e-4) over 64 tokens after the resume. Not derived: how far a
# rounded state moves the logits is the model's sensitivity to it, which no rounding count bounds.
BF16_DRIFT_TOL = 1e-2


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def engine(model, **prefix):
    config = PrefixStoreConfig(**prefix)
    return Engine(
        model, EngineConfig(max_slots=2, block_size=BS, prefill_chunk=32, max_model_len=512, prefix=config)
    )


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)


def drift(full_pass, prompt, res) -> np.ndarray:
    """|engine logprob - full pass logprob| of each generated token (whatever tokens were generated)."""
    seq = list(prompt) + list(res.token_ids)
    want = log_softmax(full_pass(seq[:-1])[len(prompt) - 1 :])[np.arange(len(res.token_ids)), res.token_ids]
    return np.abs(np.asarray(res.logprobs) - want)


def test_narrowed_never_widens():
    assert narrowed(jnp.float32, "bfloat16") == np.dtype(jnp.bfloat16)
    assert narrowed(jnp.bfloat16, "float32") == np.dtype(jnp.bfloat16)
    assert narrowed(jnp.float32, None) == np.dtype(np.float32)


def test_bf16_checkpoint_bytes_hand_count(model):
    cfg = model.config
    eng = engine(model, checkpoint_interval=16, sequence_end_checkpoints=False, checkpoint_dtype="bfloat16")
    eng.generate([list(range(3, 40))], greedy(1))  # 37 tokens: checkpoints at 16, 32 and the prompt end 37
    state = 3 * (2 * 16 * 16 * 2 + 3 * 32 * 3 * 2)  # KDA layers x (H x d x d + conv 3*H*d x (K-1)), 2 bytes
    assert state == kda_state_bytes(cfg, jnp.float32, "bfloat16")["total"]
    assert 2 * state == kda_state_bytes(cfg, jnp.float32)["total"]  # fp32 KV: the conv window halves too
    block = BS * cfg.latent_dim * 4 * cfg.num_mla_layers  # the partial block's KV stays in the KV dtype
    ledger = eng.ledger().prefix
    assert ledger.checkpoints.device == 3
    assert ledger.checkpoint_bytes.device == 3 * state + block
    for ck in eng.store.checkpoints:  # what is held is what is counted
        held = sum(a.nbytes for pair in ck.states for a in pair)
        assert held == state and {a.dtype for pair in ck.states for a in pair} == {np.dtype(jnp.bfloat16)}
    assert eng.memory().state_bytes_per_slot == 2 * state  # the live state stays fp32


def test_analytic_reports_count_bf16_checkpoints():
    k3 = load_config("kimi-k3")
    fp32 = memory_report(k3, 131072, 8192, jnp.bfloat16)
    bf16 = memory_report(k3, 131072, 8192, jnp.bfloat16, checkpoint_dtype="bfloat16")
    recurrent = k3.num_kda_layers * k3.kda_num_heads * k3.kda_head_dim**2
    assert fp32["checkpoint_recurrent_bytes"] == 16 * recurrent * 4
    assert bf16["checkpoint_recurrent_bytes"] == 16 * recurrent * 2
    assert fp32["checkpoint_bytes"] - bf16["checkpoint_bytes"] == 16 * recurrent * 2  # the bf16 conv stays
    assert bf16["state_bytes"] == fp32["state_bytes"] and bf16["kv_bytes"] == fp32["kv_bytes"]
    planner = Planner(load_config("tiny"))
    request = dict(chips=1, hbm_bytes=10**9, context=256, dtype="float32", checkpoint_interval=64)
    plans = [
        planner.mesh_plan(PlanRequest(**request, checkpoint_dtype=d), 1, 1, slots=2)
        for d in ("float32", "bfloat16")
    ]
    per_checkpoint = 3 * (2 * 16 * 16 + 3 * 32 * 3)  # elements of one tiny state (see above)
    # 2 sequences x 256 / 64 checkpoints each, 4 bytes an element in fp32 and 2 in bf16
    assert plans[0].bytes.checkpoints == 8 * per_checkpoint * 4
    assert plans[1].bytes.checkpoints == 8 * per_checkpoint * 2


def test_a_request_resumed_from_a_bf16_checkpoint_stays_within_the_stated_drift(model, full_pass):
    rng = np.random.default_rng(0)
    system = rng.integers(3, 512, 90).tolist()
    prompts = [system + rng.integers(3, 512, n).tolist() for n in (5, 13, 21)]
    exact = engine(model, checkpoint_interval=16)
    rounded = engine(model, checkpoint_interval=16, checkpoint_dtype="bfloat16")
    worst = {}
    for name, eng in (("float32", exact), ("bfloat16", rounded)):
        eng.generate([system], greedy(2))
        got = eng.generate(prompts, greedy(32))
        assert all(r.stats["prefix_hit_tokens"] >= 80 for r in got)  # every one resumed from a checkpoint
        worst[name] = max(drift(full_pass, p, r).max() for p, r in zip(prompts, got, strict=True))
        if name == "float32":  # exact checkpoints stay exact: within two fp32 evaluations' logprob bound
            for p, r in zip(prompts, got, strict=True):
                assert_matches_full_pass(full_pass, p, r.token_ids, r.logprobs)
    assert worst["bfloat16"] < BF16_DRIFT_TOL
    assert worst["bfloat16"] > 10 * worst["float32"]  # the rounding is real (the test measures something)


def test_the_disk_tier_keeps_bf16_checkpoints_and_an_exact_store_never_reads_them(model, full_pass, tmp_path):
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 512, 29).tolist()
    rounded = dict(checkpoint_interval=1024, sequence_end_checkpoints=False, store_dir=str(tmp_path))
    a = engine(model, **rounded, checkpoint_dtype="bfloat16")
    a.generate([prompt], greedy(2))
    a.flush()
    (manifest,) = tmp_path.glob(f"*/*/{MANIFEST}")
    arrays = json.loads(manifest.read_text())["arrays"]
    assert {v[1] for k, v in arrays.items() if k.startswith(("conv_", "state_"))} == {"bfloat16"}
    exact = engine(model, **rounded)  # another namespace: nothing to read
    assert exact.ledger().prefix.checkpoints.disk == 0
    assert exact.generate([prompt + [7]], greedy(2))[0].stats["prefix_hit_tokens"] == 0
    b = engine(model, **rounded, checkpoint_dtype="bfloat16")  # a restart reads them back
    res = b.generate([prompt + [7, 8]], greedy(16))[0]
    assert res.stats["prefix_hit_tokens"] == len(prompt) and b.ledger().prefix.disk.restores == 1
    assert drift(full_pass, prompt + [7, 8], res).max() < BF16_DRIFT_TOL


def test_an_unknown_checkpoint_dtype_is_refused():
    with pytest.raises(ValueError, match="checkpoint dtype"):
        PrefixStoreConfig(checkpoint_dtype="float16").validate(BS)
