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
from serve.prefix.accounts import TierCounts
from serve.prefix.ledger import Chat, CheckpointPolicy, chat_checkpoints, chat_report
from serve.prefix.store import PrefixStoreConfig
from serve.prefix.types import CheckpointKind


def _array_bytes(tree) -> int:
    return sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree))


def _pool_bytes(engine: Engine) -> tuple[int, int]:
    """(bytes of one KV block over all MLA layers, bytes of one slot's KDA states), from the pool arrays."""
    kv_pools = [p for p in engine.runner.pools if not isinstance(p, KDACache)]
    state_pools = [p for p in engine.runner.pools if isinstance(p, KDACache)]
    block_bytes = sum(p.nbytes for p in kv_pools) // kv_pools[0].shape[0]
    slot_bytes = sum(p.conv.nbytes + p.state.nbytes for p in state_pools) // engine.config.max_slots
    return block_bytes, slot_bytes


def _engine(cfg, prefix: PrefixStoreConfig) -> Engine:
    """fp32, blocks of 16: the shapes both ledger tests share (compiled once)."""
    return Engine(
        HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32),
        EngineConfig(
            max_slots=2,
            block_size=16,
            prefill_chunk=128,
            max_model_len=256,
            kv_dtype="float32",
            prefix=prefix,
        ),
    )


def test_live_ledger_matches_the_analytic_report():
    cfg, kv_dtype = load_config("tiny"), "float32"
    bs, interval, context = 16, 64, 192  # 12 full blocks; interval checkpoints at 64, 128 and 192
    engine = _engine(
        cfg,
        PrefixStoreConfig(
            checkpoint_interval=interval, prompt_end_checkpoints=False, sequence_end_checkpoints=False
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
    assert ledger.live_kv_bytes == memory.requests[rid].kv_bytes == 12 * block_bytes
    assert ledger.live_state_bytes == memory.state_bytes_live == slot_bytes
    assert ledger.prefix.checkpoints.device == len(checkpoints) == report["num_checkpoints"] == 3
    assert sorted(ck.position for ck in checkpoints) == [64, 128, 192]
    assert ledger.prefix.checkpoint_bytes.device == held
    for measured, analytic in (
        (ledger.live_kv_bytes, report["kv_bytes"]),
        (ledger.live_state_bytes, report["state_bytes"]),
        (ledger.prefix.checkpoint_bytes.device, report["checkpoint_bytes"]),
    ):
        assert measured == pytest.approx(analytic, rel=0.01)

    # Decoding past a block boundary: the ledger counts whole allocated blocks, the report counts tokens;
    # they differ only by the unfilled part of the last block.
    while len(req.generated) < 3:
        engine.step()
    n = req.num_computed
    assert n == context + 2
    kv_now = engine.ledger().live_kv_bytes
    assert kv_now == -(-n // bs) * block_bytes
    assert kv_now == memory_report(cfg, -(-n // bs) * bs, interval, jnp.dtype(kv_dtype))["kv_bytes"]


def test_chat_ledger_by_kind_matches_a_real_engine():
    """A 3-turn greedy chat (each prompt: the previous prompt + its reply + 63 new tokens) with prompt- and
    sequence-end checkpoints on and nothing evicted: the live ledger's checkpoints per kind (counts,
    positions, bytes; the bytes also against the arrays held) are exactly the analytic report's. Turn 1's
    reply ends on the interval (64), so does turn 2's prompt (128), turn 3's prefill passes it (192), and the
    other ends are off a block boundary (a partial KV block held). Most programs are the first test's."""
    cfg, chat = load_config("tiny"), Chat(turns=3, turn_tokens=65, reply_tokens=2)
    policy = CheckpointPolicy(interval=64, block_size=16)
    engine = _engine(cfg, PrefixStoreConfig(checkpoint_interval=64))
    rng, params = np.random.default_rng(1), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt: list[int] = []
    for turn in range(1, chat.turns + 1):
        prompt = prompt + rng.integers(3, cfg.vocab_size, chat.turn_tokens - chat.reply_tokens).tolist()
        (res,) = engine.generate([prompt], params)
        assert len(prompt) == chat.prompt_end(turn) and len(res.token_ids) == chat.reply_tokens
        # each turn resumes from the previous turn's sequence-end checkpoint
        assert res.stats["prefix_hit_tokens"] == (chat.sequence_end(turn - 1) if turn > 1 else 0)
        prompt = prompt + res.token_ids

    report = chat_report(cfg, chat, policy, jnp.float32)
    ledger = engine.ledger().prefix
    checkpoints = list(engine.store.checkpoints)
    assert {ck.position: ck.kind for ck in checkpoints} == chat_checkpoints(chat, policy)
    assert report["checkpoints_by_kind"] == {"interval": 3, "prompt_end": 2, "sequence_end": 2, "junction": 0}
    for kind in CheckpointKind:
        mine = [ck for ck in checkpoints if ck.kind is kind]
        held = sum(
            _array_bytes(ck.states) + (0 if ck.tail_kv is None else _array_bytes(ck.tail_kv)) for ck in mine
        )
        counts, nbytes = (
            ledger.checkpoints_by_kind[kind],
            ledger.checkpoint_bytes_by_kind[kind],
        )
        assert counts == TierCounts(device=len(mine))
        assert counts.device == report["checkpoints_by_kind"][kind.value]
        assert nbytes.device == held == report["checkpoint_bytes_by_kind"][kind.value]
        assert report["checkpoint_tails_by_kind"][kind.value] == sum(ck.tail_kv is not None for ck in mine)
    assert ledger.checkpoint_bytes.device == report["checkpoint_bytes"] > 0
    assert ledger.checkpoints.device == report["num_checkpoints"] == 7


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
    assert engine.shape.block_bytes == block_bytes == report["kv_bytes"] == 1 * bs * (32 + 8) * 2
    assert engine.shape.state_bytes == slot_bytes == report["state_bytes"]
    assert report["state_bytes"] == 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 2)  # fp32 recurrent, bf16 conv
