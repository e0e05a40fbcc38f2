"""Engine reliability: preemption under a small pool, EOS, and faults confined to the request that caused
them. The oracle is the same requests on an amply provisioned engine (or the full causal pass)."""

import jax.numpy as jnp
import numpy as np
import pytest
from faults import lose_pools_on_continued_prefill
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracles import FullPass, assert_matches_full_pass, assert_same_greedy_tokens, logprob_bounds

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.engine import Engine, EngineConfig, RequestError
from serve.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)


def run(eng, requests):
    """Serve (prompt, params) requests that all arrive at step 0; per request (tokens, logprobs)."""
    ids = [eng.add_request(p, s) for p, s in requests]
    while eng.has_unfinished():
        eng.step()
    return [(eng.result(i).token_ids, eng.result(i).logprobs) for i in ids]


def engine(model, **kw):
    cfg = dict(max_slots=2, block_size=16, prefill_chunk=16, max_model_len=512, prefix=None)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def assert_same(full_pass, prompts, got, want):
    """Same tokens (up to a near-tie of the full pass), and logprobs within two fp32 evaluations' bound
    (tests/oracles.py `logprob_bounds`): a preempted request recomputes its tokens with the chunked prefill
    form instead of one decode step at a time, which re-associates sums."""
    for prompt, (g_ids, g_lp), (w_ids, w_lp) in zip(prompts, got, want, strict=True):
        assert_same_greedy_tokens(full_pass, prompt, g_ids, w_ids)
        same = next((i for i, (a, b) in enumerate(zip(g_ids, w_ids, strict=True)) if a != b), len(w_ids))
        seq = list(prompt) + list(w_ids)
        rows = full_pass(seq[:-1])[len(prompt) - 1 :]
        _, tol = logprob_bounds(full_pass.model.config, rows, w_ids, len(seq))
        assert np.all(np.abs(np.subtract(g_lp, w_lp))[:same] <= tol[:same])


def test_preempted_and_readmitted_in_one_step_is_not_also_decoded(model, full_pass):
    """The issue's reproduction: a 256-token prompt admitted before a short decoding request, 18 blocks.
    B is preempted by A's prefill and readmitted in the same step; it must not be decoded in that step."""
    rng = np.random.default_rng(0)
    a = (rng.integers(3, 512, 256).tolist(), greedy(1))
    b = (rng.integers(3, 512, 5).tolist(), greedy(40))
    small = engine(model, num_blocks=18)
    ids = [small.add_request(*a)]
    small.step()
    ids.append(small.add_request(*b))
    while small.has_unfinished():
        small.step()
    got = [(small.result(i).token_ids, small.result(i).logprobs) for i in ids]
    assert small.requests[ids[1]].preemptions >= 1  # the case is exercised
    # against the full causal pass (what an ample pool gives, with no engine shape compiled a second time):
    # both requests' tokens and logprobs
    for (prompt, _), (tokens, logprobs) in zip((a, b), got, strict=True):
        assert_matches_full_pass(full_pass, prompt, tokens, logprobs)


@pytest.mark.slow  # the default run keeps the explicit reproduction above and the model-free scheduler test
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    num_blocks=st.sampled_from([16, 18]),
    long_prompt=st.integers(180, 236),
    long_new=st.integers(1, 4),
    short_prompts=st.lists(st.integers(1, 14), min_size=1, max_size=2),
    short_new=st.integers(12, 40),
    arrivals=st.lists(st.integers(1, 4), min_size=2, max_size=2),
    seed=st.integers(0, 2**16),
)
def test_any_pool_size_gives_the_tokens_of_an_ample_pool(
    model, full_pass, num_blocks, long_prompt, long_new, short_prompts, short_new, arrivals, seed
):
    """A long chunked prompt next to short requests that decode while it is prefilled, on pools that force
    preemptions (15 or 17 usable blocks of 16 for up to 240 + 2 x 54 tokens): greedy tokens and logprobs equal
    an ample pool's. (Two pool sizes only: each compiles its own programs.)"""
    rng = np.random.default_rng(seed)
    reqs = [(rng.integers(3, 512, long_prompt).tolist(), greedy(long_new))]
    reqs += [(rng.integers(3, 512, n).tolist(), greedy(short_new)) for n in short_prompts]
    when = [0, *arrivals[: len(short_prompts)]]

    def serve(eng):
        ids: dict[int, str] = {}
        step = 0
        while len(ids) < len(reqs) or eng.has_unfinished():
            for i, (p, s) in enumerate(reqs):
                if when[i] == step:
                    ids[i] = eng.add_request(p, s)
            eng.step()
            step += 1
        return [(eng.result(ids[i]).token_ids, eng.result(ids[i]).logprobs) for i in range(len(reqs))]

    prompts = [p for p, _ in reqs]
    assert_same(full_pass, prompts, serve(engine(model, num_blocks=num_blocks)), serve(engine(model)))


def test_cache_salt_that_cannot_be_encoded_is_refused(model):
    eng = engine(model, prefix=EngineConfig().prefix)
    with pytest.raises(RequestError, match="cache_salt"):
        eng.add_request([5, 6, 7], greedy(2), cache_salt="\ud800")
    with pytest.raises(RequestError, match="cache_salt"):
        eng.add_request([5, 6, 7], greedy(2), cache_salt="x" * 257)
    assert not eng.has_unfinished() and not eng.requests
    assert run(eng, [([5, 6, 7], greedy(2))])[0][0]


def test_a_request_that_finished_in_a_failed_step_still_gets_its_final_output(model, monkeypatch):
    """Issue 27.1: A finishes by decoding in the step whose later prefill call (B's second chunk) loses the
    pools. The step raises; `recover` reports A's last token and its finish (not an error), and B's error:
    exactly one final output each. Oracle: A served alone."""
    short, long_ = [5, 6, 7], list(range(20, 60))
    want = engine(model).generate([short], greedy(2))[0].token_ids
    eng = engine(model)
    lose_pools_on_continued_prefill(monkeypatch, eng.runner)  # B's second chunk
    a = eng.add_request(short, greedy(2))
    b = eng.add_request(long_, greedy(2))
    first = eng.step()  # A's prompt and B's first chunk; A samples its first token
    assert [o.new_token_ids for o in first if o.request_id == a] == [want[:1]]
    with pytest.raises(RuntimeError, match="pools were lost"):
        eng.step()  # A decodes its last token, then B's second chunk fails
    outs = eng.recover("injected")
    final = {o.request_id: o for o in outs if o.finished}
    assert sorted(final) == sorted([a, b]) and len(outs) == 2
    assert final[a].new_token_ids == want[1:] and final[a].finish_reason == "length"
    assert final[a].error is None
    assert final[b].finish_reason == "error" and "injected" in final[b].error
    assert eng.result(a).token_ids == want and not eng.has_unfinished()
    assert eng.allocator.num_used == 0  # nothing leaked (no prefix store here)


def test_an_admission_that_raises_after_attach_unpins_the_checkpoint(model, monkeypatch):
    """Issue 27.2: if admitting a request raises after the store pinned its hit's checkpoint, the pin is
    released (a pinned checkpoint could never be evicted) and the request fails alone."""
    eng = engine(model, prefix=EngineConfig().prefix)
    prompt = list(range(10, 30))
    run(eng, [(prompt, greedy(1))])  # a checkpoint at the prompt's end
    store, attached = eng.store, []
    attach = store.attach

    allocate = eng.allocator.allocate

    def recording(hit, load=None):
        att = attach(hit, load)
        attached.append(att)
        return att

    def broken(n):
        if attached:  # the request's own copy of the hit's partial block
            raise RuntimeError("injected: admission failed after attach")
        return allocate(n)

    monkeypatch.setattr(store, "attach", recording)
    monkeypatch.setattr(eng.allocator, "allocate", broken)
    rid = eng.add_request(prompt + [3, 4, 5], greedy(2))
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [(rid, "error")]
    assert attached and attached[0].hit.checkpoint.holders == 0
    assert not eng.has_unfinished() and eng.allocator.num_used == len(store.held_blocks)


def test_generate_releases_each_finished_request(model):
    """Issue 27.5: `generate` returns the results and keeps no request's record (tokens, logprobs) for the
    engine's life; the results are unchanged."""
    eng = engine(model)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    first = eng.generate(prompts, greedy(3))
    assert eng.requests == {} and not eng.has_unfinished()
    assert [r.token_ids for r in eng.generate(prompts, greedy(3))] == [r.token_ids for r in first]
    assert eng.requests == {}
