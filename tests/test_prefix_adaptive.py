"""The adaptive checkpoint policy: in-batch sharing, junction checkpoints and value-aware eviction, each
against a hand count and against the full causal pass (the generated-workload property test with both
policies is in tests/test_prefix_store.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.prefix.junctions import common_prefix
from serve.prefix.policies import ValueAware
from serve.prefix.store import PrefixStoreConfig
from serve.prefix.types import Checkpoint, CheckpointKind, Tier

BS = 8


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def engine(model, policy, interval=1024, prefill_chunk=32, **kw):
    prefix = PrefixStoreConfig(checkpoint_policy=policy, checkpoint_interval=interval, **kw)
    config = EngineConfig(
        max_slots=4, block_size=BS, prefill_chunk=prefill_chunk, max_model_len=256, prefix=prefix
    )
    return Engine(model, config)


GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True)


def prompts_sharing(system_len: int, suffix: int, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts: one system prompt, then suffixes that differ from their first token on."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 400, system_len).tolist()
    return [system + [400 + i] + rng.integers(3, 400, suffix - 1).tolist() for i in range(n)]


def computed(results) -> int:
    return sum(r.stats["prefill_tokens_computed"] for r in results)


def test_requests_that_wait_together_compute_a_shared_prefix_once(model, full_pass):
    """4 requests submitted together behind a 75-token system prompt (off the block boundary), suffixes of
    6: adaptive computes 75 + 4 x 6 prompt tokens (one request computes the prefix, the others wait for its
    checkpoint at 75 and resume there); fixed (no checkpoint due inside 81 tokens) computes all 4 x 81.
    Tokens and logprobs are the full pass's either way."""
    prompts = prompts_sharing(75, 6, 4)
    fixed = engine(model, "fixed").generate(prompts, GREEDY)
    eng = engine(model, "adaptive")
    adaptive = eng.generate(prompts, GREEDY)
    assert all(r.stats["prefix_hit_tokens"] == 0 for r in fixed)
    assert computed(fixed) >= 4 * 80  # (a prompt's last token may go with the decode rows)
    assert computed(adaptive) == 75 + 4 * 6
    assert [r.stats["prefix_hit_tokens"] for r in adaptive] == [0, 75, 75, 75]
    assert eng.ledger().prefix.checkpoints_by_kind["junction"].device == 1
    for prompt, res in zip(prompts, adaptive, strict=True):
        assert_matches_full_pass(full_pass, prompt, res.token_ids, res.logprobs)
    assert [r.token_ids for r in adaptive] == [r.token_ids for r in fixed]


def test_a_prompt_that_leaves_cached_blocks_checkpoints_its_junction(model, full_pass):
    """One after another, three prompts behind the same 75-token prefix: the second finds the first's blocks
    but no state there. With the adaptive policy the first's blocks were indexed with their tokens, so the
    second sees the shared part end at token 75 (inside the tenth block), computes from 0 and checkpoints
    there (a junction); the third resumes at 75. With the fixed policy only the 9 full blocks (72 tokens)
    match, and the third computes everything again."""
    prompts = prompts_sharing(75, 6, 3, seed=1)
    for policy, shared, third_hit in (("fixed", 72, 0), ("adaptive", 75, 75)):
        eng = engine(model, policy)
        results = [eng.generate([p], GREEDY)[0] for p in prompts]
        assert [r.stats["prefix_hit_tokens"] for r in results] == [0, 0, third_hit]
        assert results[2].stats["prefill_tokens_computed"] == 81 - third_hit
        assert results[1].stats["recomputed_tokens"] == shared  # matched cached tokens, resumed from none
        junctions = eng.ledger().prefix.checkpoints_by_kind["junction"].device
        assert junctions == (1 if policy == "adaptive" else 0)
        for prompt, res in zip(prompts, results, strict=True):
            assert_matches_full_pass(full_pass, prompt, res.token_ids, res.logprobs)


def test_common_prefix():
    a = list(range(3000))
    assert common_prefix(a, a) == 3000
    assert common_prefix(a, a[:1500]) == 1500
    assert common_prefix(a, a[:2100] + [-1] + a[2101:]) == 2100
    assert common_prefix([], a) == 0
    assert common_prefix([1, 2], [2, 1]) == 0


def _ck(key: bytes, position: int, kind: CheckpointKind, parent: bytes | None = None, nbytes: int = 100):
    return Checkpoint(key, position, None, None, nbytes, Tier.DEVICE, kind, parent=parent)


def test_value_counts_the_tokens_from_the_nearest_checkpoint_held_on_the_chain():
    """a (64) <- b (80) <- c (200): c saves 120 tokens while b is held, 136 once b is gone, 200 once a is gone
    too; the deepest, with the most saved and nothing held below it, is the last to go."""
    p = ValueAware()
    a, b = _ck(b"a", 64, CheckpointKind.INTERVAL), _ck(b"b", 80, CheckpointKind.INTERVAL, b"a")
    c = _ck(b"c", 200, CheckpointKind.INTERVAL, b"b")
    for ck in (a, b, c):
        p.inserted(ck)
    assert [p.saved_tokens(x) for x in (a, b, c)] == [64, 16, 120]
    assert list(p.order())[-1] == b"c"
    p.removed(b"b")
    assert p.saved_tokens(c) == 136
    p.removed(b"a")
    assert p.saved_tokens(c) == 200


def test_value_of_a_checkpoint_just_above_another_is_the_tokens_between_them():
    """An interval checkpoint at 96 and a junction at 100 on its chain (prompts leave at 100): the interval
    one saves 96 tokens but serves only the prompts that leave the chain in 96..99, so it is worth the 4
    tokens to the junction (96 x 4 / 96), as the junction is (100 - 96), and the older of the two goes
    first; without it the junction saves all 100."""
    p = ValueAware()
    a = _ck(b"a", 96, CheckpointKind.INTERVAL)
    p.inserted(a)
    p.looked_up()
    j = _ck(b"j", 100, CheckpointKind.JUNCTION, b"a")
    p.inserted(j)
    rate = p.reuse_rate(CheckpointKind.INTERVAL)
    assert rate == p.reuse_rate(CheckpointKind.JUNCTION)
    assert p.value(a, below=4) == pytest.approx(4 * rate / (1 + 1 / ValueAware.MIN_HORIZON) / 100)
    assert p.value(j) == pytest.approx(4 * rate / 100)
    assert list(p.order()) == [b"a", b"j"]
    p.removed(b"a")
    assert p.value(j) == pytest.approx(100 * rate / 100)


def test_a_lookup_that_would_have_resumed_from_a_dropped_checkpoint_counts_for_its_kind():
    """A ghost: the kind of a dropped checkpoint that a lookup passed gains a hit (once), so a kind that is
    always dropped before its reuse still shows that it is reused."""
    p = ValueAware()
    ends = [_ck(bytes([i]), 32, CheckpointKind.SEQUENCE_END) for i in range(4)]
    for ck in ends:
        p.inserted(ck)
    before = p.reuse_rate(CheckpointKind.SEQUENCE_END)
    p.removed(ends[0].key)
    assert p.dropped(ends[0].key) and not p.dropped(ends[1].key)
    p.missed(ends[0].key)
    p.missed(ends[0].key)  # counted once
    assert p.reuse_rate(CheckpointKind.SEQUENCE_END) == pytest.approx((1 + 1) / (4 + 2))
    assert before == ValueAware.MIN_RATE
    assert not p.dropped(ends[0].key)


def test_value_keeps_the_kind_that_gets_reused():
    """Sequence ends that were resumed from outrank interval checkpoints that never were, at equal saved
    tokens and bytes: the kinds' rates are (2 + 1) / (4 + 2) = 0.5 and 1 / 6, clamped to 0.25; the two ends
    that were hit are also the most recent."""
    p = ValueAware()
    ends = [_ck(bytes([i]), 32, CheckpointKind.SEQUENCE_END) for i in range(4)]
    intervals = [_ck(bytes([10 + i]), 32, CheckpointKind.INTERVAL) for i in range(4)]
    for ck in ends + intervals:
        p.inserted(ck)
    p.looked_up()
    for ck in ends[:2]:
        p.hit(ck.key)
    assert p.reuse_rate(CheckpointKind.SEQUENCE_END) == 0.5
    assert p.reuse_rate(CheckpointKind.INTERVAL) == ValueAware.MIN_RATE
    order = list(p.order())
    assert set(order[:4]) == {ck.key for ck in intervals}
    assert set(order[-2:]) == {ck.key for ck in ends[:2]}
    # 8 held (the horizon): 4 lookups after its last use a checkpoint is worth 1 / (1 + 4 / 8) of one just
    # resumed from
    for _ in range(4):
        p.looked_up()
    p.hit(ends[0].key)
    assert p.value(ends[1]) == pytest.approx(p.value(ends[0]) * 2 / 3, rel=1e-12)


def test_value_forgets_the_lineage_of_checkpoints_no_held_one_walks_through():
    """Issue 27.5: a removed checkpoint's lineage stays only while a held descendant's saved tokens walk
    through it; with every checkpoint gone none is left (the policy does not grow with the store's
    history), and what a held checkpoint saves is the same as with the whole lineage kept."""
    p = ValueAware()
    chains = []
    for i in range(50):  # 50 chains a <- b <- c, each removed as the tiers would drop it
        a = _ck(b"a%d" % i, 64, CheckpointKind.INTERVAL)
        b = _ck(b"b%d" % i, 80, CheckpointKind.INTERVAL, a.key)
        c = _ck(b"c%d" % i, 200, CheckpointKind.INTERVAL, b.key)
        for ck in (a, b, c):
            p.inserted(ck)
        chains.append((a, b, c))
    a, b, c = chains[0]
    p.removed(b.key)
    p.removed(a.key)
    assert p.saved_tokens(c) == 200  # walks through b and a, both removed
    for a, b, c in chains:
        for ck in (c, a, b):
            p.removed(ck.key)
    assert len(p._lineage) == 0


def test_adaptive_decode_hashes_each_block_once(model, monkeypatch):
    """Issue 27.5: while a sequence decodes, the adaptive policy indexes only the blocks completed since the
    last call, so a sequence of L tokens costs O(L) block hashes (counted), not its whole chain at every
    block boundary (O(L^2)). The count: the lookup at admission hashes the prompt's blocks, decoding hashes
    each new block once, plus the root and the checkpoint keys at the prompt's and the sequence's end."""
    import serve.prefix.index as index

    calls = []
    sha256 = index.hashlib.sha256

    def counting(data=b""):
        calls.append(len(data))
        return sha256(data)

    eng = engine(model, "adaptive")
    bs = eng.shape.block_size
    prompt, new = list(range(10, 10 + 2 * bs)), 14 * bs  # 2 blocks of prompt, 14 decoded
    monkeypatch.setattr(index, "hashlib", type("H", (), {"sha256": staticmethod(counting)}))
    eng.generate([prompt], SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    blocks = (len(prompt) + new) // bs
    assert len(calls) <= 2 * blocks + 8, len(calls)


def test_a_prefill_chunk_ending_on_a_checkpoint_still_indexes_its_blocks_tails(model, full_pass):
    """A 32-token prompt whose every prefill chunk ends on a checkpoint (interval 16: at 16 and at 32, its
    end) still records each full block's tokens, so a prompt leaving it at token 20, inside a block, finds the
    exact token: it is cut and checkpointed there (a junction at 20, not the block boundary 16), and the next
    prompt leaving at 20 resumes at 20."""
    rng = np.random.default_rng(7)
    first = rng.integers(3, 400, 32).tolist()
    second = first[:20] + rng.integers(400, 450, 6).tolist()
    third = first[:20] + rng.integers(450, 500, 6).tolist()
    eng = engine(model, "adaptive", interval=16, prefill_chunk=16)
    results = [eng.generate([p], GREEDY)[0] for p in (first, second, third)]
    assert [r.stats["prefix_hit_tokens"] for r in results] == [0, 16, 20]
    assert eng.ledger().prefix.checkpoints_by_kind["junction"].device == 1
    for prompt, res in zip((first, second, third), results, strict=True):
        assert_matches_full_pass(full_pass, prompt, res.token_ids, res.logprobs)


ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def small_pool(model, eviction: str, blocks: int) -> Engine:
    """One slot over a pool of `blocks` usable blocks, the adaptive policy with prompt-end checkpoints only
    and the eviction order `eviction` (value: joint eviction of blocks and checkpoints; lru: independent)."""
    prefix = PrefixStoreConfig(
        checkpoint_policy="adaptive",
        checkpoint_interval=1024,
        eviction=eviction,
        prompt_end_checkpoints=True,
        sequence_end_checkpoints=False,
    )
    config = EngineConfig(
        max_slots=1, block_size=BS, prefill_chunk=64, max_model_len=64, num_blocks=blocks + 1, prefix=prefix
    )
    return Engine(model, config)


def test_the_pool_gives_up_blocks_no_checkpoint_needs_before_a_checkpoints_blocks(model, full_pass):
    """Joint eviction on a pool of 10 blocks of 8. X (16 tokens) keeps a prompt-end checkpoint at 16 over its
    2 blocks; Y, later, leaves 4 cached blocks of which only the first is under its checkpoint (at 15; its
    generated tokens have none). Z needs 3 of them: LRU alone takes the oldest, X's 2 blocks and Y's last,
    and X's checkpoint resumes nothing; joint eviction takes Y's 3 blocks no checkpoint needs, and X's
    continuation resumes at 16."""
    rng = np.random.default_rng(11)
    x, y, z = (rng.integers(3, 400, n).tolist() for n in (16, 15, 50))
    for eviction, x_hit in (("lru", 0), ("value", 16)):
        eng = small_pool(model, eviction, blocks=10)
        eng.generate([x], ONE)
        eng.generate([y], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        assert eng.ledger().prefix.cached_kv_blocks == 6
        eng.generate([z], ONE)
        assert eng.ledger().prefix.memory.evicted_blocks == 3
        res = eng.generate([x + [7, 8, 9]], GREEDY)[0]
        assert res.stats["prefix_hit_tokens"] == x_hit, eviction
        assert_matches_full_pass(full_pass, x + [7, 8, 9], res.token_ids, res.logprobs)


def test_when_every_cached_block_is_needed_a_checkpoint_goes_with_its_blocks(model, full_pass):
    """A pool of 6 blocks: X and then Y (16 tokens each) keep prompt-end checkpoints over their 2 blocks; Z
    (30 tokens) needs 4 blocks, so 2 cached ones go. LRU evicts X's blocks and keeps X's checkpoint, which
    resumes nothing now but still holds its bytes; joint eviction gives up X's checkpoint (the least
    valuable: the older) with its blocks. Either way Y still resumes at 16 and X at nothing."""
    rng = np.random.default_rng(12)
    x, y, z = (rng.integers(3, 400, n).tolist() for n in (16, 16, 30))
    for eviction, held in (("lru", 3), ("value", 2)):
        eng = small_pool(model, eviction, blocks=6)
        for p in (x, y, z):
            eng.generate([p], ONE)
        ledger = eng.ledger().prefix
        assert ledger.memory.evicted_blocks == 2 and ledger.checkpoints.device == held, eviction
        assert ledger.memory.dropped_checkpoints == 3 - held
        for p, hit in ((y, 16), (x, 0)):
            res = eng.generate([p + [5, 6]], GREEDY)[0]
            assert res.stats["prefix_hit_tokens"] == hit, eviction
            assert_matches_full_pass(full_pass, p + [5, 6], res.token_ids, res.logprobs)


@pytest.mark.parametrize("states", [12, 60, 10_000])
def test_adaptive_interval_checkpoints_take_a_share_of_the_budget(states):
    """The adaptive policy's interval is its finest spacing doubled until a prompt's interval checkpoints
    number at most 1/6 of the states the budget holds (the simulator: the store's own decisions, no model):
    a 390-token prompt under 12 states is checkpointed every 256 tokens (1 interval checkpoint), under 60
    every 64 (6), with room for 10,000 at every 16 (24)."""
    from serve.engine.config import EngineShape
    from serve.sim.cost import CostModel
    from serve.sim.engine import SimEngine
    from serve.sim.runner import random_answers

    cfg = load_config("tiny")
    probe = EngineConfig(max_slots=1, block_size=16, prefill_chunk=64, max_model_len=512)
    state = EngineShape.resolve(probe, cfg).state_bytes
    prefix = PrefixStoreConfig(
        checkpoint_policy="adaptive", checkpoint_interval=16, device_bytes=states * state, host_bytes=0
    )
    config = EngineConfig(max_slots=1, block_size=16, prefill_chunk=64, max_model_len=512, prefix=prefix)
    sim = SimEngine(cfg, config, random_answers(cfg.vocab_size), CostModel.of(cfg, 1e15))
    sim.generate([list(range(3, 393))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    spacing = 16
    while 390 > states / 6 * spacing:
        spacing *= 2
    intervals = sim.ledger().prefix.checkpoints_by_kind["interval"]
    assert intervals.device == 390 // spacing == {12: 1, 60: 6, 10_000: 24}[states]


def test_a_queued_request_finds_a_state_where_it_leaves_a_running_one():
    """Queued requests are known future lookups: with one slot, the second of two prompts sharing 200 tokens
    is admitted only after the first has computed past them, and still resumes at exactly the shared length
    (the first was cut there while the second waited), so it computes only its own part."""
    from serve.sim.cost import CostModel
    from serve.sim.engine import SimEngine
    from serve.sim.runner import random_answers

    cfg = load_config("tiny")
    prefix = PrefixStoreConfig(checkpoint_policy="adaptive", checkpoint_interval=1024)
    config = EngineConfig(max_slots=1, block_size=16, prefill_chunk=64, max_model_len=512, prefix=prefix)
    sim = SimEngine(cfg, config, random_answers(cfg.vocab_size), CostModel.of(cfg, 1e15))
    shared = list(range(3, 203))
    prompts = [shared + [300] * 37, shared + [301] * 21]
    results = sim.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert common_prefix(*prompts) == 200
    assert [r.stats["prefix_hit_tokens"] for r in results] == [0, 200]
    assert results[1].stats["prefill_tokens_computed"] == len(prompts[1]) - 200
