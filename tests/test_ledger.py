"""A live engine's byte ledger agrees with the analytic `memory_report`, and both with the bytes of the arrays
the engine actually holds (pools and the prefix store's checkpoints)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhybrid.cache import KDACache, memory_report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.prefix.store import PrefixStoreConfig


def _array_bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def _pool_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of one KV block over all MLA layers, bytes of one slot's KDA states), from the pool arrays."""
    kv_pools = [p for p in engine.runner.pools if not isinstance(p, KDACache)]
    state_pools = [p for p in engine.runner.pools if isinstance(p, KDACache)]
    block_bytes = sum(p.nbytes for p in kv_pools) // kv_pools[0].shape[0]
    slot_bytes = sum(p.conv.nbytes + p.state.nbytes for p in state_pools) // engine.config.max_slots
    return block_bytes, slot_bytes


def test_live_ledger_matches_the_analytic_report():
    cfg, kv_dtype = load_config("tiny"), "float32"
    bs, interval, context = 16, 64, 192  # 12 full blocks; interval checkpoints at 64, 128 and 192
    engine = Engine(
        HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(kv_dtype)),
        EngineConfig(
            max_slots=2,
            block_size=bs,
            prefill_chunk=128,
            max_model_len=256,
            kv_dtype=kv_dtype,
            prefix=PrefixStoreConfig(
                checkpoint_interval=interval, prompt_end_checkpoints=False, sequence_end_checkpoints=False
            ),
        ),
    )
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size, context).tolist()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    req = engine.requests[rid]
    while req.num_computed < context:
        engine.step()
    assert req.num_computed == context and req.status == "running"  # prefilled, first token sampled

    block_bytes, slot_bytes = _pool_bytes(engine)  # what the engine's arrays really take
    checkpoints = list(engine.store.checkpoints)
    held = sum(
        _array_bytes(ck.states) + (0 if ck.tail_kv is None else _array_bytes(ck.tail_kv))
        for ck in checkpoints
    )

    ledger, memory = engine.ledger(), engine.memory()
    report = memory_report(cfg, context, interval, jnp.dtype(kv_dtype))
    assert ledger["live_kv_bytes"] == memory["requests"][rid]["kv_bytes"] == 12 * block_bytes
    assert ledger["live_state_bytes"] == memory["state_bytes_live"] == slot_bytes
    assert ledger["checkpoints"]["device"] == len(checkpoints) == report["num_checkpoints"] == 3
    assert sorted(ck.position for ck in checkpoints) == [64, 128, 192]
    assert ledger["checkpoint_bytes"]["device"] == held
    for measured, analytic in (
        (ledger["live_kv_bytes"], report["kv_bytes"]),
        (ledger["live_state_bytes"], report["state_bytes"]),
        (ledger["checkpoint_bytes"]["device"], report["checkpoint_bytes"]),
    ):
        assert measured == pytest.approx(analytic, rel=0.01)

    # Decoding past a block boundary: the ledger counts whole allocated blocks, the report counts tokens;
    # they differ only by the unfilled part of the last block.
    while len(req.generated) < 3:
        engine.step()
    n = req.num_computed
    assert n == context + 2
    kv_now = engine.ledger()["live_kv_bytes"]
    assert kv_now == -(-n // bs) * block_bytes
    assert kv_now == memory_report(cfg, -(-n // bs) * bs, interval, jnp.dtype(kv_dtype))["kv_bytes"]


def test_bf16_pools_match_the_analytic_split():
    """With a bf16 cache the conv state and latent KV are bf16 and the recurrent state stays fp32: the
    engine's per-slot and per-block figures, its pool arrays and the report agree on that split."""
    cfg, bs = load_config("tiny"), 16
    engine = Engine(
        HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16),
        EngineConfig(max_slots=3, block_size=bs, max_model_len=64, kv_dtype="bfloat16", prefix=None),
    )
    block_bytes, slot_bytes = _pool_bytes(engine)
    report = memory_report(cfg, bs, None, jnp.bfloat16)
    assert engine.block_bytes == block_bytes == report["kv_bytes"] == 1 * bs * (32 + 8) * 2
    assert engine.state_bytes_per_slot == slot_bytes == report["state_bytes"]
    assert report["state_bytes"] == 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 2)  # fp32 recurrent, bf16 conv
