"""Serving engine: greedy output equals the full causal pass under batching, preemption and bad requests."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.blocks import BlockAllocator, OutOfBlocks
from serve.engine.config import EngineShape, ProgramShape
from serve.engine.engine import Engine, EngineConfig, RequestError
from serve.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def prompts(lengths, seed=0, vocab=512):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def test_continuous_batching_changes_no_token(model, full_pass):
    # 2 slots, 5 requests of different lengths (two over the prefill chunk), admitted at different steps.
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32))
    ps = prompts([5, 70, 17, 1, 40])
    ids = [eng.add_request(p, GREEDY) for p in ps[:2]]
    for _ in range(3):
        eng.step()
    ids += [eng.add_request(p, GREEDY) for p in ps[2:]]
    while eng.has_unfinished():
        eng.step()
    for rid, p in zip(ids, ps, strict=True):
        res = eng.result(rid)
        assert res.finish_reason == "length" and len(res.token_ids) == GREEDY.max_tokens
        assert_matches_full_pass(full_pass, p, res.token_ids, res.logprobs)
    assert_only_the_store_holds_blocks(eng)
    assert sorted(eng.scheduler.free_slots) == [0, 1]


def test_decode_padding_rows_leave_a_prefilling_request_alone(model, full_pass):
    """3 requests decode on 4 slots (a 4-row program: one padding row) while the 4th slot's request is
    prefilled in chunks: the padding row may sit on that slot and must leave its partial state untouched."""
    eng = Engine(model, EngineConfig(max_slots=4, block_size=8, prefill_chunk=16, max_batched_tokens=20))
    ps = prompts([3, 6, 9, 90], seed=4)
    ids = [eng.add_request(p, GREEDY) for p in ps[:3]]
    for _ in range(2):
        eng.step()
    ids.append(eng.add_request(ps[3], GREEDY))
    while eng.has_unfinished():
        eng.step()
    assert eng.shape.decode_rows(3) == 4
    for rid, p in zip(ids, ps, strict=True):
        res = eng.result(rid)
        assert_matches_full_pass(full_pass, p, res.token_ids, res.logprobs)


def test_decode_steps_update_the_state_pools_in_place(model, full_pass):
    """On the CPU with the native kernels a one-token step writes its rows' KDA states and conv windows
    into their slots of the pools themselves: the pools keep their buffers from step to step, prefill chunks
    (whose rows' write updates them in place) and decode steps alike (no copy of a pool, no second program),
    and the tokens are the full pass's."""
    from jaxhybrid.ops.kda import steps_into_pools

    if not steps_into_pools(jax.devices()[0].platform):
        pytest.skip("no native kernels here: the rows' write program updates the pools")
    eng = Engine(model, EngineConfig(max_slots=4, block_size=8))
    kda = [i for i, kind in enumerate(model.config.layer_types) if kind == "kda"]

    def where():
        return [
            (
                eng.runner.pools[i].state.unsafe_buffer_pointer(),
                eng.runner.pools[i].conv.unsafe_buffer_pointer(),
            )
            for i in kda
        ]

    before = where()
    ps = prompts([5, 12], seed=9)
    ids = [eng.add_request(p, GREEDY) for p in ps]
    while eng.has_unfinished():
        eng.step()
        assert where() == before
    for rid, p in zip(ids, ps, strict=True):
        assert_matches_full_pass(full_pass, p, eng.result(rid).token_ids, eng.result(rid).logprobs)


def test_short_prompts_share_one_prefill_call(model, full_pass, monkeypatch):
    """Short prompts admitted in one step are prefilled in one call of `prefill_rows` rows. The first pair's
    padding rows sit on idle slots, the second pair's on the two decoding requests' slots, whose state and
    cache they must leave alone: every request still equals the full pass, tokens and logprobs."""
    eng = Engine(model, EngineConfig(max_slots=4, block_size=8, prefill_chunk=32))
    calls = []
    run = eng.runner.run_program

    def spy(tokens, *args):
        calls.append(tokens.shape)
        return run(tokens, *args)

    monkeypatch.setattr(eng.runner, "run_program", spy)
    ps = prompts([6, 25, 11, 3], seed=5)
    ids = [eng.add_request(p, GREEDY) for p in ps[:2]]
    for _ in range(2):
        eng.step()
    ids += [eng.add_request(p, GREEDY) for p in ps[2:]]
    while eng.has_unfinished():
        eng.step()
    assert eng.shape.prefill_rows == 4
    assert [c for c in calls if c[1] > 1] == [(4, 32), (4, 32)]  # two prefill calls in all
    for rid, p in zip(ids, ps, strict=True):
        res = eng.result(rid)
        assert_matches_full_pass(full_pass, p, res.token_ids, res.logprobs)


def test_what_packs_and_its_programs():
    """Short chunks of short sequences pack, into one of two program lengths at the table of 256 tokens; a
    long chunk or a chunk of a long sequence runs alone; nothing packs at prefill_rows 1."""
    cfg = load_config("small")
    shape = EngineShape.resolve(EngineConfig(block_size=16), cfg)
    assert shape.prefill_rows == 4 and shape.pack_width == 16 and shape.pack_lengths == (32, 128)
    assert shape.packs(128, 16) and shape.packs(1, 1)
    assert not shape.packs(129, 16) and not shape.packs(16, 17) and not shape.packs(0, 1)
    assert [shape.packed(n).length for n in (1, 32, 33, 128)] == [32, 32, 128, 128]
    programs = shape.prefill_programs()
    assert [p for p in programs if p.rows > 1] == [ProgramShape(4, 32, 16), ProgramShape(4, 128, 16)]
    single = EngineShape.resolve(EngineConfig(block_size=16, prefill_rows=1), cfg)
    assert not single.packs(16, 1) and all(p.rows == 1 for p in single.prefill_programs())
    assert len(single.prefill_programs()) == len(programs) - 2
    assert EngineShape.resolve(EngineConfig(max_slots=2), cfg).prefill_rows == 2
    assert EngineShape.resolve(EngineConfig(prefill_chunk=64), cfg).pack_lengths == (32, 64)


def assert_only_the_store_holds_blocks(eng):
    """After every request ended, the only blocks in use are the prefix store's, each held once."""
    held = eng.store.held_blocks if eng.store is not None else []
    assert eng.allocator.num_used == len(held)
    assert all(eng.allocator.refcount(b) == 1 for b in held)


def test_preempted_request_gives_the_same_tokens(model, full_pass):
    ps = prompts([30, 28, 26], seed=1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True)
    # 3 slots but only 13 usable blocks of 8: three sequences of ~40 tokens need 15, so someone is preempted.
    small = Engine(model, EngineConfig(max_slots=3, block_size=8, num_blocks=14, prefill_chunk=32))
    res = small.generate(ps, params)
    assert sum(r.stats["preemptions"] for r in res) > 0
    for p, r in zip(ps, res, strict=True):
        assert_matches_full_pass(full_pass, p, r.token_ids, r.logprobs)
    # sampled (seeded) requests too: preemption does not change them (each alone is never preempted; the
    # same engine, so no program compiles again)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    together = small.generate(ps, sampled)
    assert sum(r.stats["preemptions"] for r in together) > 0
    alone = [small.generate([p], sampled)[0] for p in ps]
    assert all(r.stats["preemptions"] == 0 for r in alone)
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_seeds_reproduce_and_differ(model):
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32))
    p = prompts([9], seed=2)[0]
    mk = lambda seed: SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
    a1, a2, b = (r.token_ids for r in eng.generate([p, p, p], [mk(1), mk(1), mk(2)]))
    assert a1 == a2
    assert a1 != b


def test_logprobs_and_stop_tokens(model, full_pass):
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32))
    p = prompts([12], seed=3)[0]
    res = eng.generate([p], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, ignore_eos=True))[0]
    assert_matches_full_pass(full_pass, p, res.token_ids, res.logprobs)
    # stopping on the third generated token
    stop = res.token_ids[2]
    first = res.token_ids.index(stop)
    stop_params = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=(stop,), ignore_eos=True)
    res2 = eng.generate([p], stop_params)
    assert res2[0].token_ids == res.token_ids[: first + 1] and res2[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], GREEDY, "empty"),
        ([5, 512], GREEDY, "outside the vocabulary"),
        ([5, -1], GREEDY, "outside the vocabulary"),
        ([5] * 100, SamplingParams(max_tokens=100), "exceeds the context"),
        ([5], SamplingParams(max_tokens=0), "max_tokens"),
        ([5], SamplingParams(temperature=-0.5), "temperature"),
        ([5], SamplingParams(top_p=0.0), "top_p"),
        ([5], SamplingParams(top_p=1.5), "top_p"),
    ],
)
def test_bad_requests_raise_and_corrupt_nothing(model, full_pass, prompt, params, match):
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32, max_model_len=128))
    good = prompts([20], seed=4)[0]
    rid = eng.add_request(good, GREEDY)
    eng.step()
    before = (
        eng.allocator.num_free,
        list(eng.scheduler.free_slots),
        len(eng.scheduler.waiting),
        len(eng.scheduler.running),
    )
    with pytest.raises(RequestError, match=match):
        eng.add_request(prompt, params)
    assert (
        eng.allocator.num_free,
        list(eng.scheduler.free_slots),
        len(eng.scheduler.waiting),
        len(eng.scheduler.running),
    ) == before
    while eng.has_unfinished():
        eng.step()
    res = eng.result(rid)
    assert_matches_full_pass(full_pass, good, res.token_ids, res.logprobs)


def test_abort_frees_slot_and_blocks(model):
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32))
    rid = eng.add_request(prompts([30])[0], SamplingParams(max_tokens=50, temperature=0.0))
    eng.step()
    assert eng.allocator.num_used > 0
    eng.abort(rid)
    assert_only_the_store_holds_blocks(eng)
    assert sorted(eng.scheduler.free_slots) == [0, 1]
    assert eng.result(rid).finish_reason == "abort" and not eng.has_unfinished()


def test_memory_account_hand_computed(model):
    cfg = model.config
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, num_blocks=41, prefill_chunk=32))
    # one block: 8 positions x (kv_lora 32 + rope 8) values x 4 bytes (fp32) x 1 MLA layer
    assert eng.memory().block_bytes == 8 * 40 * 4 * 1
    assert eng.memory().kv_bytes_total == 40 * 1280
    rid = eng.add_request(prompts([20])[0], SamplingParams(max_tokens=30, temperature=0.0))
    eng.step()  # prefill of 20 tokens -> 3 blocks
    mem = eng.memory()
    assert mem.used_blocks == 3 and mem.kv_bytes_used == 3 * 1280
    assert mem.requests[rid].kv_bytes == 3 * 1280
    # KDA state per slot: 3 layers x (2 heads x 16 x 16 fp32 + 3 x 32 channels x 3 taps fp32)
    assert mem.state_bytes_per_slot == 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)
    assert mem.state_bytes_live == mem.state_bytes_per_slot
    # a memory budget sizes the pool
    by_budget = Engine(model, EngineConfig(max_slots=2, block_size=8, kv_memory_bytes=10 * 1280 + 5))
    assert by_budget.memory().num_blocks == 9  # 10 blocks, one is the scratch block
    del cfg


def test_block_allocator_refcounts():
    alloc = BlockAllocator(5)
    a = alloc.allocate(2)
    assert 0 not in a and alloc.num_free == 2
    alloc.share(a[:1])
    alloc.release(a)
    assert alloc.num_free == 3 and alloc.refcount(a[0]) == 1
    alloc.release(a[:1])
    assert alloc.num_free == 4
    with pytest.raises(OutOfBlocks):
        alloc.allocate(5)
    assert alloc.num_free == 4
    with pytest.raises(ValueError):
        alloc.release(a[:1])


def test_programs_are_a_fixed_set(model):
    """Requests of many lengths reuse a bounded set of compiled programs (no compile per request)."""
    eng = Engine(model, EngineConfig(max_slots=2, block_size=8, prefill_chunk=32, max_model_len=128))
    eng.generate(prompts([3, 9, 17, 33, 50]), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    seen = eng.compiled_programs()
    eng.generate(
        prompts([4, 10, 20, 34, 49], seed=9), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert eng.compiled_programs() == seen  # same shape classes: nothing new compiled
    # prefill buckets + decode row buckets, per table width
    bound = (len(eng.shape.buckets) + len(eng.shape.decode_buckets)) * len(eng.shape.table_buckets)
    assert len(seen) <= bound
