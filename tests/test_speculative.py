"""Speculative decoding: drafted tokens verified in the decode batch change no token (greedy), keep the
sampled distribution, and leave every state, checkpoint and block as a run that never speculated."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import assert_within, float32_log_softmax_bound, gamma
from conftest import rel_err
from flax import nnx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from oracles import FullPass, assert_matches_full_pass, assert_same_greedy_tokens, log_softmax
from scipy import stats

from jaxhybrid.cache import kda_state_bytes, mla_kv_bytes
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, held_bytes
from jaxhybrid.ops.conv import causal_conv1d, causal_conv1d_windows
from jaxhybrid.ops.kda import kda_recurrent, kda_recurrent_states
from serve.engine.config import ProgramShape
from serve.engine.engine import Engine, EngineConfig, RequestError
from serve.engine.sampling import SamplingParams, batch_arrays, sample, verify
from serve.engine.speculative import (
    Acceptance,
    DraftMethod,
    Joined,
    NgramIndex,
    Offer,
    PromptLookup,
    RowDrafting,
    Speculation,
    SpeculationError,
    StepCosts,
    draft_lengths,
    truncate_at_stop,
)
from serve.engine.warmup import WarmupLevel, warmup_plan
from serve.prefix.store import PrefixStoreConfig

NGRAM = Speculation(DraftMethod.NGRAM, 4)
VOCAB = 512  # tiny's


def greedy(n=12, spec=NGRAM, **kw):
    return SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, speculative=spec, **kw
    )


@pytest.fixture(scope="module")
def model():
    return HybridLM(load_config("tiny"), rngs=nnx.Rngs(0), dtype=jnp.float32)


@pytest.fixture(scope="module")
def full_pass(model):
    return FullPass(model)


def engine(model, drafter=None, prefix=None, **kw):
    """An engine whose steps verify whatever is drafted (`StepCosts(retry=0)`: not whether it pays here)."""
    args = dict(max_slots=4, block_size=8, prefill_chunk=32, max_model_len=256)
    args.update(kw)
    return Engine(model, EngineConfig(prefix=prefix, **args), drafter=drafter, step_costs=StepCosts(retry=0))


class Continuations:
    """Drafts from known continuations (the model drafting for itself, when they are its own greedy tokens):
    for tokens that extend one of `sequences`, the next k tokens of it, with every `wrong`-th drafted token
    replaced (0: none). Counts what it proposed."""

    def __init__(self, sequences, wrong=0):
        self.sequences, self.wrong, self.proposed = [list(s) for s in sequences], wrong, 0

    def propose(self, req, k):
        tokens = req.tokens
        for seq in self.sequences:
            if len(seq) > len(tokens) and seq[: len(tokens)] == list(tokens):
                out = seq[len(tokens) : len(tokens) + k]
                break
        else:
            return []
        drafted = []
        for t in out:
            self.proposed += 1
            drafted.append((t + 1) % VOCAB if self.wrong and self.proposed % self.wrong == 0 else t)
        return drafted


class FixedCosts(StepCosts):
    """A verify step costs `verify_cost` plain ones, whatever the clock says."""

    def __init__(self, verify_cost, retry=1000):
        super().__init__(retry=retry, margin=1.0)
        self.verify_cost = verify_cost

    def observe(self, verify, rows, seconds, compiled=False):
        super().observe(verify, rows, self.verify_cost if verify else 1.0, compiled)


def priced_engine(model, drafter, verify_cost):
    """One slot, no prefix store, verifying drafts only where `FixedCosts(verify_cost)` says it pays."""
    config = EngineConfig(max_slots=1, block_size=8, prefill_chunk=32, max_model_len=256, prefix=None)
    return Engine(model, config, drafter=drafter, step_costs=FixedCosts(verify_cost))


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


# --- the ops ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 6])
def test_recurrent_states_are_the_state_after_each_prefix(t):
    rng = np.random.default_rng(t)
    b, h, d = 2, 2, 4
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for _ in range(3))
    g = -jnp.asarray(rng.uniform(0, 2, size=(b, t, h, d)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0, 1, size=(b, t, h)), jnp.float32)
    s0 = jnp.asarray(rng.normal(size=(b, h, d, d)), jnp.float32)
    o, states = kda_recurrent_states(q, k, v, g, beta, s0)
    o_ref, _ = kda_recurrent(q, k, v, g, beta, s0)
    # two float32 recurrences: a token's step chains gamma(d + 4) (decay, k^T S, the delta, the update) and
    # passes the state's error on through I - beta k k^T, which these unnormalized keys may stretch by up to
    # |1 - beta |k|^2| a token; then q^T S (d terms). Relative to the largest entry, on two sides.
    stretch = np.maximum(1.0, np.abs(1 - np.asarray(beta) * np.sum(np.square(np.asarray(k)), -1)))
    grow = np.cumprod(stretch, axis=1).max(axis=(0, 2))  # [t]: the most a token's error grows by then
    bound = [2 * (float(grow[i]) * (i + 1) * gamma(d + 4) + gamma(d)) for i in range(t)]
    assert rel_err(o, o_ref) < bound[-1]
    for i in range(t):
        head = (x[:, : i + 1] for x in (q, k, v, g, beta))
        _, s_i = kda_recurrent(*head, s0)
        assert rel_err(states[:, i], s_i) < bound[i]


def test_conv_windows_are_the_state_after_each_valid_prefix():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
    s = jnp.asarray(rng.normal(size=(3, 6, 3)), jnp.float32)
    lengths = jnp.asarray([5, 2, 0])
    y, windows = causal_conv1d_windows(x, w, s, lengths)
    np.testing.assert_array_equal(y, causal_conv1d(x, w, s, lengths)[0])
    for t in range(5):
        _, want = causal_conv1d(x, w, s, jnp.minimum(t + 1, lengths))
        np.testing.assert_array_equal(windows[:, t], want)


VERIFY, SAMPLE = jax.jit(verify), jax.jit(sample)


def _verify_inputs(logits, settings, seed=0):
    b, t, _ = logits.shape
    params = [p for p in settings for _ in range(t)]
    steps = [i for _ in settings for i in range(t)]
    return batch_arrays(params, [seed + j // t for j in range(b * t)], steps)


@settings(max_examples=20, deadline=None)
@given(
    temperature=st.sampled_from([0.0, 0.7, 1.0]),
    top_k=st.sampled_from([0, 3]),
    top_p=st.sampled_from([1.0, 0.6]),
    seed=st.integers(0, 2**31 - 1),
)
def test_verify_without_drafts_is_sample(temperature, top_k, top_p, seed):
    """A row without drafts takes exactly `sample`'s token at its first position (same key, same draw)."""
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(2, 3, 16)) * 3, jnp.float32)
    p = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    args = _verify_inputs(logits, [p, p], seed % 1000)
    tokens, logps, accepted = VERIFY(logits, jnp.zeros((2, 2), jnp.int32), jnp.zeros(2, jnp.int32), *args)
    want, want_logp = SAMPLE(logits.reshape(6, 16), *args)
    np.testing.assert_array_equal(accepted, [0, 0])
    np.testing.assert_array_equal(tokens[:, 0], np.asarray(want).reshape(2, 3)[:, 0])
    # the same log-softmax of the same (tempered) logits, perhaps fused otherwise: two float32 evaluations
    scaled = np.asarray(logits) / min(temperature or 1.0, 1.0)
    bound = float32_log_softmax_bound(scaled, sides=2)[:, 0].max(-1)
    assert_within(logps[:, 0], np.asarray(want_logp).reshape(2, 3)[:, 0], bound)


def test_verify_greedy_accepts_the_argmax_prefix():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(3, 5, 32)), jnp.float32)
    best = np.asarray(logits.argmax(-1))
    drafts = best[:, :4].copy()
    drafts[0, 2] = (drafts[0, 2] + 1) % 32  # row 0: two accepted, then the argmax
    drafts[2, 0] = (drafts[2, 0] + 1) % 32  # row 2: none accepted
    num = jnp.asarray([4, 4, 3])
    args = _verify_inputs(logits, [SamplingParams(temperature=0.0)] * 3)
    tokens, logps, accepted = verify(logits, jnp.asarray(drafts, jnp.int32), num, *args)
    np.testing.assert_array_equal(accepted, [2, 4, 0])
    for row, a in enumerate([2, 4, 0]):
        np.testing.assert_array_equal(tokens[row, : a + 1], best[row, : a + 1])
    want = log_softmax(np.asarray(logits, np.float64))
    bound = float32_log_softmax_bound(np.asarray(logits))[1, np.arange(5), np.asarray(tokens[1])]
    assert_within(logps[1], want[1, np.arange(5), np.asarray(tokens[1])], bound)
    # beside a sampled row (the step's other branch) the greedy rows come out the same
    mixed = jnp.concatenate([logits, logits[:1]])
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(temperature=0.9)]
    out = verify(
        mixed,
        jnp.asarray(np.concatenate([drafts, drafts[:1]]), jnp.int32),
        jnp.asarray([4, 4, 3, 4]),
        *_verify_inputs(mixed, params),
    )
    np.testing.assert_array_equal(out[2][:3], accepted)
    for row, a in enumerate([2, 4, 0]):
        np.testing.assert_array_equal(out[0][row, : a + 1], tokens[row, : a + 1])
        bound = float32_log_softmax_bound(np.asarray(logits), sides=2)[row, : a + 1].max(-1)
        assert_within(out[1][row, : a + 1], logps[row, : a + 1], bound)


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (4, 1.0), (0, 0.7)])
def test_verify_keeps_the_distribution(top_k, top_p):
    """Many draws of one row with a draft at each position: the token at position 0 (accepted draft or the
    redraw after a rejection) and at position 1 (after an accepted draft) follow the filtered, tempered
    distribution exactly (chi-square against it)."""
    V, n = 6, 4000
    rng = np.random.default_rng(top_k)
    row = rng.normal(size=(2, V)) * 1.5
    logits = jnp.asarray(np.broadcast_to(row, (n, 2, V)), jnp.float32)
    p = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
    args = _verify_inputs(logits, [p] * n)
    draft = int(np.argsort(row[0])[-2])  # the second most likely token: accepted part of the time
    drafts = jnp.full((n, 1), draft, jnp.int32)
    tokens, _, accepted = VERIFY(logits, drafts, jnp.ones(n, jnp.int32), *args)
    tokens, accepted = np.asarray(tokens), np.asarray(accepted)
    for pos, rows in ((0, np.ones(n, bool)), (1, accepted == 1)):
        scaled = _filtered(row[pos] / 0.8, top_k, top_p)
        want = np.exp(scaled - scaled.max())
        want /= want.sum()
        counts = np.bincount(tokens[rows, pos], minlength=V)
        keep = want > 0
        assert counts[~keep].sum() == 0
        expected = want[keep] * rows.sum()
        assert stats.chisquare(counts[keep], expected).pvalue > 1e-3
    assert 0 < accepted.mean() < 1


def _filtered(scaled, top_k, top_p):
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled.max())
    probs /= probs.sum()
    keep = np.ones(len(scaled), bool)
    if top_k:
        keep[top_k:] = False
    p = np.where(keep, probs, 0.0)
    p /= p.sum()
    before = np.cumsum(p) - p
    keep &= (before < top_p) | (np.arange(len(p)) == 0)
    out = np.full(len(scaled), -np.inf)
    out[order[keep]] = scaled[order[keep]]
    return out


# --- drafts and their length --------------------------------------------------------------------------


def test_prompt_lookup_takes_the_latest_longest_match():
    lookup = PromptLookup(min_n=1, max_n=3).lookup
    assert lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3], 2) == [7, 8]  # [2, 3] latest at 5
    assert lookup([1, 2, 3, 4, 9, 9, 1, 2, 3], 3) == [4, 9, 9]  # the 3-gram wins
    assert lookup([5, 6, 7], 4) == []
    assert lookup([4, 5, 4], 4) == [5, 4]  # the 1-gram, up to the end
    assert PromptLookup(min_n=2).lookup([4, 5, 4], 4) == []


def _latest_match(tokens, k, sizes=range(2, 5)):
    """The oracle: the latest earlier occurrence of the longest suffix, by brute force."""
    for n in reversed(sizes):
        if len(tokens) <= n:
            continue
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == tokens[len(tokens) - n :]]
        if starts:
            return tokens[starts[-1] + n : starts[-1] + n + k]
    return []


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=60),
    st.integers(1, 5),
    st.lists(st.integers(1, 6), min_size=1, max_size=60),
    st.integers(0, 60),
)
def test_the_ngram_index_kept_up_to_date_finds_the_latest_match(tokens, k, steps, prompt):
    """As a request grows (by a token, a verified window, or several steps between lookups), read as its
    prompt and what it generated (`Joined`)."""
    index, end = NgramIndex(range(2, 5)), 0
    for step in steps:
        end = min(end + step, len(tokens))
        view = Joined(tokens[: min(prompt, end)], tokens[min(prompt, end) : end])
        assert index.lookup(view, k) == _latest_match(tokens[:end], k)


def test_drafts_stop_before_a_stop_token():
    assert truncate_at_stop([5, 6, 2, 7], frozenset({2})) == [5, 6]
    assert truncate_at_stop([5, 6], frozenset({2})) == [5, 6]


@pytest.mark.parametrize("method", list(DraftMethod)[1:])
def test_a_row_keeps_its_most_drafts_and_pauses_while_they_miss(method):
    """A row may draft its most after a miss (how many it drafts is the step's choice, from what they cost);
    drafts that keep missing pause it, a pause that doubles and resets once a draft stands."""
    k = RowDrafting(4, method)
    assert k.limit() == 4
    k.record(4, 1)
    assert k.limit() == 4
    misses = 0
    while not k.paused and misses < 10:
        k.record(4, 0)
        misses += 1
    assert k.paused and k.limit() == 0
    paused = 1 + sum(1 for _ in range(100) if k.limit() == 0)
    assert paused == 8 and k.pause == 16
    for _ in range(10):
        k.record(1, 1)
    assert k.pause == 8 and k.limit() == 4


def test_a_row_drafts_again_after_a_window_that_missed(model):
    """Where a verify step costs 1.6 plain ones, one window whose drafts all miss does not end a row's
    drafting (at k = 1 even drafts that all stand would not pay, and the row decoded plainly to its end)."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(40, spec=None))[0].token_ids

    class MissOnce(Continuations):
        """The model's own tokens, but the third drafting all wrong."""

        calls = 0

        def propose(self, req, k):
            out, self.calls = super().propose(req, k), self.calls + 1
            return [(t + 1) % VOCAB for t in out] if self.calls == 3 else out

    eng = priced_engine(model, MissOnce([p + want]), verify_cost=1.6)
    assert eng.generate([p], greedy(40))[0].token_ids == want
    assert eng.speculation_stats().windows >= 6


def test_step_costs_verify_only_what_pays():
    costs = StepCosts(retry=5, margin=1.0)
    assert costs.pays(1, 1.0)  # nothing measured: try drafts
    costs.observe(True, 1, 9.0)  # the first of a kind compiled: not counted
    assert costs.pays(1, 1.0)
    costs.observe(True, 1, 2.0)  # a verify step costs 2
    assert not costs.pays(1, 5.0)  # no plain step measured yet: take one
    costs.observe(False, 1, 9.0)
    costs.observe(False, 1, 1.0)  # a plain step costs 1
    assert costs.pays(1, 2.0) and not costs.pays(1, 1.9)  # 2 tokens in 2 s against 1 in 1 s
    for _ in range(2):
        costs.observe(False, 1, 1.0)
    assert not costs.pays(1, 1.9) and costs.pays(4, 1.0)  # another row count: its own account
    costs.observe(False, 1, 1.0)
    assert costs.pays(1, 1.0)  # `retry` plain steps since drafts were last verified: try again
    assert StepCosts(retry=0).pays(1, 0.0)


def test_what_drafting_costs_is_measured_by_method_and_length():
    """A row's drafting: the median of its recent ones at a length; a line through the lengths measured
    for another (through 0 while one is); nothing before any. A drafting that compiled, and the first at
    each length (a request's first reads its whole prompt), are not counted."""
    costs = StepCosts()
    draft = DraftMethod.DRAFT
    assert costs.draft_seconds(draft, 4) == 0.0
    costs.drafted(draft, 4, 100.0)  # the first at 4
    costs.drafted(draft, 4, 1000.0, compiled=True)
    assert costs.draft_seconds(draft, 4) == 0.0
    for seconds in (2.0, 2.0, 50.0):
        costs.drafted(draft, 4, seconds)
    assert costs.draft_seconds(draft, 4) == 2.0 and costs.draft_seconds(draft, 2) == 1.0
    assert costs.draft_seconds(DraftMethod.NGRAM, 4) == 0.0  # each method its own
    for seconds in (0.0, 0.8, 0.8):  # 2 tokens cost 0.8 and 4 cost 2: the line 0.6 n - 0.4
        costs.drafted(draft, 2, seconds)
    assert costs.draft_seconds(draft, 1) == pytest.approx(0.2) and costs.draft_seconds(draft, 8) == 4.4


def brute_force(offers, running, verify, plain, draft_s, scale=1.0):
    """The best tokens per second a verify step can give over every choice of lengths (0 for none)."""
    import itertools

    best = 0.0
    for choice in itertools.product(*((0, *o.lengths) for o in offers)):
        tokens = running + scale * sum(o.expected(n) for o, n in zip(offers, choice, strict=True))
        seconds = verify + sum(draft_s(o.method, n) for o, n in zip(offers, choice, strict=True))
        best = max(best, tokens / seconds)
    return best


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), min_size=1, max_size=3),  # each row's q
    st.lists(st.sampled_from(list(DraftMethod)[1:]), min_size=3, max_size=3),
    st.floats(1.0, 4.0),  # a verify step, in plain steps
    st.floats(0.0, 1.0),  # a draft model's drafting: a fixed part, in plain steps
    st.floats(0.0, 1.5),  # and each drafted token's
    st.integers(1, 8),  # most drafts
)
def test_each_row_drafts_the_length_that_gives_the_most_tokens_per_second(
    qs, methods, ratio, fixed, per, most
):
    """A draft model's drafted token costs a step of it: each row drafts the length (among those its
    programs have) that gives the verify step the most tokens per second, counting the rows' drafting, and
    no drafts where the best does not beat a plain step by the margin. Oracle: every choice of lengths."""
    costs = StepCosts(margin=1.2)
    for verified, seconds in ((True, 0.0), (True, ratio), (False, 0.0), (False, 1.0)):
        costs.observe(verified, 4, seconds)
    for n in (1, 2):
        for _ in range(2):
            costs.drafted(DraftMethod.DRAFT, n, fixed + per * n)
    offers = []
    for q, method in zip(qs, methods, strict=False):
        lengths = (most,) if method is DraftMethod.NGRAM else tuple(x for x in draft_lengths(most))
        offers.append(Offer(method, lambda n, q=q: sum(q**j for j in range(1, n + 1)), lengths))
    running = len(offers)
    chosen = costs.lengths(4, running, offers)
    best = brute_force(offers, running, ratio, 1.0, costs.draft_seconds)
    if best < 1.2 * running * (1 - 1e-9):
        assert chosen is None
        return
    assert chosen is not None
    tokens = running + sum(o.expected(n) for o, n in zip(offers, chosen, strict=True))
    seconds = ratio + sum(costs.draft_seconds(o.method, n) for o, n in zip(offers, chosen, strict=True))
    assert tokens / seconds == pytest.approx(best, rel=1e-9)


def test_drafts_that_do_not_pay_are_not_verified(model):
    """On an engine whose verify steps cost more than the tokens drafts give, the drafter's drafts are
    verified only while it measures both kinds of step (and when it tries again), the tokens unchanged."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(40, spec=None))[0].token_ids
    drafter = Continuations([p + want], wrong=1)  # every draft wrong: a verify step gives one token

    eng = priced_engine(model, drafter, verify_cost=3.0)
    assert eng.generate([p], greedy(40))[0].token_ids == want
    assert 2 <= eng.speculation_stats().windows <= 4 < drafter.proposed


def test_a_step_that_compiled_a_program_does_not_count_as_what_verifying_costs(model):
    """A verify step that first runs a program (here the wider block table a request grows into halfway)
    spends its time compiling: that time is not what a verify step costs, and drafts that stand go on being
    verified after it. Clock: a plain step costs 1, a verify step 1.2, a step that compiled 1000 more."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(110, spec=None))[0].token_ids
    now = [0.0]
    config = EngineConfig(max_slots=1, block_size=8, prefill_chunk=32, max_model_len=256, prefix=None)
    eng = Engine(model, config, drafter=Continuations([p + want]), clock=lambda: now[0])
    for program in eng.shape.decode_programs():  # the warm-up's, where requests do not speculate by default
        eng.compile_program(program)
    runner = eng.runner

    def timed(real, cost):
        def step(*args):
            before = runner.compiled_programs()
            out = real(*args)
            now[0] += cost + (1000.0 if runner.compiled_programs() != before else 0.0)
            return out

        return step

    runner.decode, runner.verify = timed(runner.decode, 1.0), timed(runner.verify, 1.2)
    assert eng.generate([p], greedy(110))[0].token_ids == want
    widths = {x.width for x in runner.compiled_programs() if x.verify}
    assert len(widths) >= 2  # a verify program compiled after the first one (counted before the fix)
    # every draft stands (k = 4): about 110 / 5 windows; with the compile counted, speculation stopped there
    spec = eng.speculation_stats()
    assert spec.windows >= 18 and spec.accepted == spec.drafted


def test_a_draft_model_compiling_does_not_count_as_what_verifying_costs(model):
    """The draft model's programs compile when first run too (its run-ahead at each wider block table a
    request grows into): that time is not what drafting costs a step, and drafts that stand go on being
    verified. Clock: a plain step 1, a verify step 1.2, drafting 0.01, and 1000 more for a drafting that
    compiled (JAX's own trace events say when)."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(110, spec=None))[0].token_ids
    now, traces, charged = [0.0], [0], [0]

    def listen(event, *args, **kwargs):  # a program traced: run for the first time (compiled or loaded)
        traces[0] += event == "/jax/core/compile/jaxpr_trace_duration"

    config = EngineConfig(max_slots=1, block_size=8, prefill_chunk=32, max_model_len=256, prefix=None)
    eng = Engine(model, config, draft_model=model, clock=lambda: now[0])
    for program in eng.shape.decode_programs():
        eng.compile_program(program)
    runner, draft = eng.runner, eng.draft

    def timed(real, cost, charge_compiles=False):
        def call(*args):
            before = traces[0]
            out = real(*args)
            compiled = charge_compiles and traces[0] != before
            now[0] += cost + 1000.0 * compiled
            charged[0] += compiled
            return out

        return call

    runner.decode, runner.verify = timed(runner.decode, 1.0), timed(runner.verify, 1.2)
    draft.propose = timed(draft.propose, 0.01, charge_compiles=True)
    spec = greedy(110, spec=Speculation(DraftMethod.DRAFT, 4))
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        assert eng.generate([p], spec)[0].token_ids == want
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert charged[0] >= 2  # the draft ran a program for the first time after its first drafting
    # every draft stands (the model drafts for itself): about 110 / 5 windows; with a compile counted,
    # speculation stopped there
    spec = eng.speculation_stats()
    assert spec.windows >= 18 and spec.accepted == spec.drafted


def priced_draft_engine(model, per_token):
    """One slot, the model drafting for itself, on a clock where a plain step costs 1, a verify step 1.2,
    and each drafted token one step of the draft model, `per_token` (its catch-up, then each run-ahead
    step). Returns (engine, clock, the lengths its run-ahead ran at)."""
    now, lengths = [0.0], []
    config = EngineConfig(max_slots=1, block_size=8, prefill_chunk=32, max_model_len=256, prefix=None)
    eng = Engine(model, config, draft_model=model, clock=lambda: now[0])
    for program in eng.shape.decode_programs():
        eng.compile_program(program)

    def charged(real, cost):
        def call(*args):
            out = real(*args)
            now[0] += cost(*args)
            return out

        return call

    runner, draft = eng.runner, eng.draft
    runner.decode = charged(runner.decode, lambda *a: 1.0)
    runner.verify = charged(runner.verify, lambda *a: 1.2)
    draft.runner.prefill_rows = charged(draft.runner.prefill_rows, lambda *a: per_token)
    draft.runner.run_ahead = charged(
        draft.runner.run_ahead, lambda view, first, steps: lengths.append(steps + 1) or per_token * steps
    )
    return eng, now, lengths


@pytest.mark.parametrize(
    "per_token, least, windows",
    [
        (1.0, 0.95, (1, 6)),  # as costly as the model: (1 + n) / (1.2 + n) < 1 for any n: drafting stops
        (0.05, 2.5, (18, 30)),  # cheap, and every draft stands: its most, 5 tokens in 1.4
    ],
)
def test_a_draft_model_drafts_only_what_pays_for_its_steps(model, per_token, least, windows):
    """A drafted token costs a step of the draft model (its run-ahead has a program per length, so a
    shorter draft runs fewer steps): a window drafts the length that gives the most tokens per second
    (`StepCosts.lengths`), and none where no length beats a plain step. `least`: the tokens a second the
    request must reach (a plain step gives 1)."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(110, spec=None))[0].token_ids
    eng, now, lengths = priced_draft_engine(model, per_token)
    out = eng.generate([p], greedy(110, spec=Speculation(DraftMethod.DRAFT, 4)))[0]
    assert out.token_ids == want
    assert 110 / now[0] >= least and windows[0] <= eng.speculation_stats().windows <= windows[1]
    assert set(lengths) <= set(draft_lengths(4))


def test_replicated_engines_plan_alike_whatever_their_clocks_say(model):
    """Processes of a replicated engine must run the same programs in the same order: with `lockstep`
    costs, engines whose clocks disagree (one steady, one erratic) verify the same windows."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(80, spec=None))[0].token_ids
    rng = np.random.default_rng(0)
    runs = []
    for tick in (lambda: 1.0, lambda: float(rng.exponential(3.0))):
        now = [0.0]

        def clock(now=now, tick=tick):
            now[0] += tick()
            return now[0]

        config = EngineConfig(max_slots=1, block_size=8, prefill_chunk=32, max_model_len=256, prefix=None)
        eng = Engine(model, config, drafter=Continuations([p + want], wrong=3), clock=clock)
        eng.step_costs.lockstep()
        assert eng.generate([p], greedy(80))[0].token_ids == want
        runs.append(dataclasses.astuple(eng.speculation_stats()))
    assert runs[0] == runs[1] and runs[0][0] > 0


def test_the_warm_up_compiles_the_verify_programs_a_step_then_finds(model):
    """An engine whose requests speculate by default: the warm-up's plan holds its verify programs, compiled
    ahead of use they are the ones its steps run (found by key: nothing compiles during the requests)."""
    config = EngineConfig(max_slots=2, block_size=8, prefill_chunk=32, max_model_len=64, speculative=NGRAM)
    p = prompts([9], seed=3)[0]
    want = Engine(model, dataclasses.replace(config, speculative=Speculation())).generate(
        [p], greedy(12, None)
    )
    eng = Engine(model, config, drafter=Continuations([p + want[0].token_ids]), step_costs=StepCosts(retry=0))
    verify = [
        x for x in warmup_plan(eng.shape, WarmupLevel.DECODE) if isinstance(x, ProgramShape) and x.verify
    ]
    assert verify == eng.shape.verify_programs() and len(verify) == 2 * len(eng.shape.table_buckets)
    assert all(eng.compile_program(x) for x in verify)
    eng.compile_helpers()
    for x in eng.shape.decode_programs() + eng.shape.prefill_programs():
        eng.compile_program(x)
    before = eng.compiled_programs()
    assert eng.generate([p], greedy(12, None))[0].token_ids == want[0].token_ids
    assert eng.speculation_stats().windows > 0 and eng.compiled_programs() == before


def test_settings_are_checked():
    with pytest.raises(SpeculationError):
        Speculation.parse("medusa")
    with pytest.raises(SpeculationError):
        Speculation.parse("ngram", 0)
    with pytest.raises(SpeculationError):
        Speculation.parse("ngram", True)


def test_a_request_may_not_draft_more_than_the_server_verifies(model):
    eng = engine(model, speculative=Speculation(num_tokens=2))
    with pytest.raises(RequestError, match="at most 2"):
        eng.add_request([5, 6, 7], greedy(spec=Speculation(DraftMethod.NGRAM, 3)))


# --- the engine: greedy exactness ---------------------------------------------------------------------


@pytest.mark.parametrize("wrong", [0, 3])
def test_greedy_tokens_and_logprobs_are_those_without_speculation(model, full_pass, wrong):
    """The model drafting for itself (its own greedy tokens: every draft stands) and the same with every
    third drafted token wrong: the tokens of the engine without speculation, the logprobs of the full
    pass, in fewer steps."""
    ps = prompts([5, 30, 17], seed=wrong)
    off_engine = engine(model)
    off = off_engine.generate(ps, greedy(20, spec=None))
    drafter = Continuations([p + r.token_ids for p, r in zip(ps, off, strict=True)], wrong)
    on_engine = engine(model, drafter)
    verified, verify = [0], on_engine.runner.verify

    def counted(reqs, drafts):  # the drafted tokens the model checked
        verified[0] += sum(map(len, drafts))
        return verify(reqs, drafts)

    on_engine.runner.verify = counted
    on = on_engine.generate(ps, greedy(20))
    for p, a, b in zip(ps, off, on, strict=True):
        assert b.token_ids == a.token_ids
        assert_matches_full_pass(full_pass, p, b.token_ids, b.logprobs)
    counts = on_engine.speculation_stats()
    assert counts.drafted == verified[0] > 0
    assert (counts.accepted == counts.drafted) == (wrong == 0) and counts.accepted > 0
    assert on_engine.steps < off_engine.steps


DRAFT = Speculation(DraftMethod.DRAFT, 4)


def test_a_draft_model_changes_no_token(model, full_pass):
    """The model drafting for itself (every draft stands: a step gives k + 1 tokens) and another model with
    the same vocabulary (most drafts fall): the tokens of the engine without drafts, the full pass's
    logprobs; rows of both kinds, and rows without drafts, share steps; a pool that preempts makes the draft
    start over."""
    ps = prompts([5, 30, 17], seed=12)
    want = [r.token_ids for r in engine(model).generate(ps, greedy(20, spec=None))]
    other = HybridLM(load_config("tiny"), rngs=nnx.Rngs(7), dtype=jnp.float32)
    for draft, num_blocks in ((model, None), (other, None), (model, 9)):
        eng = Engine(
            model,
            EngineConfig(
                max_slots=4, block_size=8, prefill_chunk=32, max_model_len=256, num_blocks=num_blocks
            ),
            draft_model=draft,
            step_costs=StepCosts(retry=0),
        )
        params = [greedy(20, spec=DRAFT), greedy(20, spec=None), greedy(20, spec=NGRAM)]
        got = eng.generate(ps, params)
        assert [r.token_ids for r in got] == want
        for p, r in zip(ps, got, strict=True):
            assert_matches_full_pass(full_pass, p, r.token_ids, r.logprobs)
        stats = got[0].stats
        assert stats["drafted_tokens"] > 0
        # the draft's weights and pools: its states for 4 slots, its latent KV for the engine's blocks
        cfg = draft.config
        pools = 4 * kda_state_bytes(cfg, jnp.float32)["total"]
        pools += eng.shape.num_blocks * mla_kv_bytes(cfg, 8, jnp.float32)
        assert eng.memory().draft_model_bytes == held_bytes(draft) + pools
        if draft is model and num_blocks is None:
            assert stats["accepted_tokens"] == stats["drafted_tokens"] >= 12  # 19 tokens in windows of 5
        if num_blocks:
            assert sum(r.stats["preemptions"] for r in got) > 0


def test_draft_settings_need_a_draft_model(model):
    with pytest.raises(RequestError, match="no draft model"):
        engine(model).add_request([5, 6], greedy(spec=DRAFT))
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(model, EngineConfig(speculative=DRAFT))
    small_vocab = HybridLM(load_config("tiny").replace(vocab_size=256), rngs=nnx.Rngs(0), dtype=jnp.float32)
    with pytest.raises(ValueError, match="vocabulary"):
        Engine(model, EngineConfig(), draft_model=small_vocab)


def test_prompt_lookup_drafts_change_no_token(model, full_pass):
    """Prompt lookup on prompts that hold every token (each generated token matches somewhere): drafts at
    nearly every step, most of them wrong on a random model; rows with and without drafts share steps."""
    rng = np.random.default_rng(3)
    ps = [rng.permutation(np.arange(3, VOCAB)).tolist()[:200], prompts([9])[0]]
    off = engine(model).generate(ps, greedy(16, spec=None))
    eng = engine(model, PromptLookup(min_n=1, max_n=2))
    on = eng.generate(ps, greedy(16))
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    for p, r in zip(ps, on, strict=True):
        assert_matches_full_pass(full_pass, p, r.token_ids, r.logprobs)
    assert eng.speculation_stats().drafted > 0


def test_a_stop_token_ends_a_request_where_it_would_have(model):
    """The drafter proposes the tokens through the stop token: the request stops at that token, with the
    tokens and finish reason of the engine without speculation."""
    p = prompts([11], seed=5)[0]
    reference = engine(model).generate([p], greedy(16, spec=None))[0].token_ids
    stop = reference[6]
    want = engine(model).generate([p], greedy(16, spec=None, stop_token_ids=(stop,)))[0]
    eng = engine(model, Continuations([p + reference]))
    got = eng.generate([p], greedy(16, stop_token_ids=(stop,)))[0]
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason == "stop"
    assert eng.speculation_stats().drafted > 0


def test_abort_and_preemption_inside_speculation(model, full_pass):
    """A pool too small for every request preempts speculating requests (recomputed from their tokens), an
    abort in the middle leaves the others exact."""
    ps = prompts([20, 25, 30], seed=7)
    off = engine(model).generate(ps, greedy(24, spec=None))
    drafter = Continuations([p + r.token_ids for p, r in zip(ps, off, strict=True)], 4)
    eng = engine(model, drafter, num_blocks=12)
    ids = [eng.add_request(p, greedy(24)) for p in ps]
    for _ in range(4):
        eng.step()
    eng.abort(ids[1])
    while eng.has_unfinished():
        eng.step()
    for i in (0, 2):
        assert eng.result(ids[i]).token_ids == off[i].token_ids
    assert eng.result(ids[1]).finish_reason == "abort"
    assert sum(eng.requests[i].preemptions for i in ids) > 0


# --- the engine: sampling ------------------------------------------------------------------------------


def test_sampled_tokens_keep_the_model_distribution(model, full_pass):
    """Temperature 1 with top-k 3 on tiny, 600 seeds, drafts at every step (the most likely token, so some
    stand and some do not): the second and third tokens follow the model's own filtered distribution
    (chi-square against the marginal computed from the full pass), as without speculation."""
    p = prompts([10], seed=11)[0]
    top_k, n = 3, 600

    def filtered_probs(tokens):
        logits = full_pass(tokens)[-1]
        keep = np.argsort(-logits, kind="stable")[:top_k]
        probs = np.zeros(VOCAB)
        probs[keep] = np.exp(logits[keep] - logits[keep].max())
        return probs / probs.sum()

    class MostLikely:
        def propose(self, req, k):
            tokens = req.tokens
            out = list(tokens)
            for _ in range(k):
                out.append(int(full_pass(out)[-1].argmax()))
            return out[len(tokens) :]

    eng = engine(model, MostLikely(), max_slots=8)
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=s, speculative=NGRAM)
        for s in range(n)
    ]
    got = np.asarray([r.token_ids for r in eng.generate([p] * n, params)])
    spec = eng.speculation_stats()
    assert spec.accepted > 0 and spec.accepted < spec.drafted
    first = filtered_probs(p)
    marginal2, marginal3 = np.zeros(VOCAB), np.zeros(VOCAB)
    for t1 in np.flatnonzero(first):
        second = filtered_probs(p + [int(t1)])
        marginal2 += first[t1] * second
        for t2 in np.flatnonzero(second):
            marginal3 += first[t1] * second[t2] * filtered_probs(p + [int(t1), int(t2)])
    for pos, want in ((1, marginal2), (2, marginal3)):
        counts = np.bincount(got[:, pos], minlength=VOCAB)
        assert counts[want == 0].sum() == 0
        big = want * n >= 5  # chi-square bins with enough expected draws; the rest pooled
        observed = np.append(counts[big], counts[~big].sum())
        expected = np.append(want[big], want[~big].sum()) * n
        keep = expected > 0
        assert stats.chisquare(observed[keep], expected[keep]).pvalue > 1e-3


# --- the engine with the prefix store -----------------------------------------------------------------


def test_checkpoints_inside_a_window_are_never_needed(model, full_pass):
    """Interval checkpoints every 8 tokens while every draft stands: windows stop at each interval position,
    so the checkpoint there is the state at that position; a second turn that resumes from them gives the
    tokens of the engine without the store and without speculation."""
    p = prompts([13], seed=2)[0]
    off = engine(model)
    first = off.generate([p], greedy(30, spec=None))[0].token_ids
    follow = p + first + prompts([5], seed=4)[0]
    second = off.generate([follow], greedy(8, spec=None))[0].token_ids
    drafter = Continuations([p + first])
    eng = engine(model, drafter, PrefixStoreConfig(checkpoint_interval=8, sequence_end_checkpoints=False))
    windows = []
    step = eng.runner.verify

    def spy(reqs, drafts):
        windows.extend((r.num_computed, len(d)) for r, d in zip(reqs, drafts, strict=True) if d)
        return step(reqs, drafts)

    eng.runner.verify = spy
    assert eng.generate([p], greedy(30))[0].token_ids == first
    assert windows and all((n + 1 + k) // 8 == n // 8 or (n + 1 + k) % 8 == 0 for n, k in windows)
    res = eng.generate([follow], greedy(8))[0]
    assert res.token_ids == second
    assert res.stats["prefix_hit_tokens"] >= 8 * ((len(p) + len(first)) // 8) - 8
    assert_matches_full_pass(full_pass, follow, res.token_ids, res.logprobs)


# A round's requests: (which earlier sequence it continues, None for the shared system prompt; its new tokens)
TOKENS = st.lists(st.integers(3, VOCAB - 1), min_size=1, max_size=9)
TURNS = st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 20)), TOKENS), min_size=1, max_size=3)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rounds=st.lists(TURNS, min_size=1, max_size=3),
    interval=st.sampled_from([8, 16]),
    device_states=st.sampled_from([0, 1, 64]),
    num_blocks=st.sampled_from([None, 14]),
    policy=st.sampled_from(["fixed", "adaptive"]),
    wrong=st.sampled_from([0, 2, 3]),
)
# A near-tie (two logits 1.2e-6 apart at the third request's 8th token, under the tests' compile flags on an
# AMD EPYC) that the decode program and the verify program decided differently.
@example(
    rounds=[[(None, [3]), (None, [3]), (None, [500, 511, 107, 293, 269, 99, 15])]],
    interval=8,
    device_states=0,
    num_blocks=None,
    policy="fixed",
    wrong=0,
)
def test_speculation_on_equals_off_with_the_store(
    model, full_pass, rounds, interval, device_states, num_blocks, policy, wrong
):
    """Chats (a turn continues an earlier turn's whole sequence, so it resumes from checkpoints taken while
    that turn decoded with drafts), with interval, prompt-end, sequence-end and junction checkpoints, a
    device budget down to nothing and a pool that preempts: speculation on gives the tokens of speculation
    off with the same store (up to a near-tie of the full pass, `assert_same_greedy_tokens`)."""
    state = kda_state_bytes(model.config, jnp.float32)["total"]
    cfg = PrefixStoreConfig(
        checkpoint_policy=policy,
        checkpoint_interval=interval,
        prompt_end_checkpoints=True,
        sequence_end_checkpoints=True,
        device_bytes=device_states * state,
        host_bytes=0,
    )
    off = engine(model, None, cfg, num_blocks=num_blocks, max_slots=2)
    drafter = Continuations([], wrong)
    on = engine(model, drafter, cfg, num_blocks=num_blocks, max_slots=2)
    system, sequences = [7, 8, 9, 10, 11, 12, 13, 14, 15], []
    for turns in rounds:
        ps = [(system if i is None or not sequences else sequences[i % len(sequences)]) + t for i, t in turns]
        want = [r.token_ids for r in off.generate(ps, greedy(10, spec=None))]
        drafter.sequences = [p + t for p, t in zip(ps, want, strict=True)]
        for p, r, w in zip(ps, on.generate(ps, greedy(10)), want, strict=True):
            assert_same_greedy_tokens(full_pass, p, r.token_ids, w)
        sequences += drafter.sequences
    assert on.speculation_stats().drafted > 0


# --- what drafting is expected to give, and when to try again ------------------------------------------


def test_a_row_expects_the_tokens_a_geometric_acceptance_gives():
    """A row's next drafts stand one after another with probability q (each window: the accepted drafts are
    successes, a rejection one failure): q from its own windows, pulled toward the engine's prior while it has
    few; n drafts are expected to give q + q^2 + ... + q^n accepted tokens."""
    engine = Acceptance(prior=0.5)
    k = RowDrafting(4, DraftMethod.NGRAM, acceptance=Acceptance(base=engine))
    assert k.acceptance.q() == pytest.approx(0.5)
    assert k.expected(3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert k.expected(0) == 0.0
    for _ in range(20):  # every window accepts 3 of 4: q -> 3 / (3 + 1), from the prior's side
        k.record(4, 3)
    q = k.acceptance.q()
    assert 0.7 < q < 0.75 and 0.7 < engine.q() < 0.75
    assert k.expected(2) == pytest.approx(q + q * q)
    for _ in range(30):  # every draft stands: q -> 1
        k.record(4, 4)
    assert k.acceptance.q() > 0.95


def test_a_new_row_expects_what_the_engine_saw_drafts_do(model):
    """Where a verify step costs 3 plain ones and every draft misses, a second request of the same engine
    does not verify its drafts at all: it starts from the acceptance the engine measured, not from the
    belief that every draft stands (which cost it windows that gave one token each)."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(40, spec=None))[0].token_ids
    eng = priced_engine(model, Continuations([p + want], wrong=1), verify_cost=3.0)
    assert eng.generate([p], greedy(40))[0].token_ids == want
    first = eng.speculation_stats().windows
    assert first >= 1
    assert eng.generate([p], greedy(40))[0].token_ids == want
    assert eng.speculation_stats().windows == first


def test_retries_back_off_while_drafts_never_pay():
    """Drafts that never pay (a verify step costs 3 plain ones, a window gives 1.5 tokens) are tried again
    after `retry` plain steps, then after twice as many, and so on; a try that pays starts over."""
    costs = StepCosts(retry=4, margin=1.0)
    for verified in (True, True, False, False):  # the first of each kind is not counted
        costs.observe(verified, 1, 3.0 if verified else 1.0)
    tries = 0
    for _ in range(300):
        verified = costs.pays(1, 1.5)
        tries += verified
        costs.observe(verified, 1, 3.0 if verified else 1.0)
    assert 4 <= tries <= 7  # 4, 8, 16, 32, 64, 128: not 300 / 4
    assert costs.pays(1, 3.0)  # drafts that pay are verified, and the next retry comes after `retry` again
    costs.observe(True, 1, 3.0)
    steps = 0
    while not costs.pays(1, 1.5):
        costs.observe(False, 1, 1.0)
        steps += 1
    assert steps == 4


def test_a_row_whose_drafts_never_stand_soon_stops_drafting(model):
    """Every draft wrong, a verify step 1.6 plain ones: the row verifies a window or two, then drafts only
    now and then (its pause doubling), not every few steps."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(96, spec=None))[0].token_ids
    eng = priced_engine(model, Continuations([p + want], wrong=1), verify_cost=1.6)
    assert eng.generate([p], greedy(96))[0].token_ids == want
    assert 1 <= eng.speculation_stats().windows <= 4


def test_drafts_must_pay_by_a_margin_and_one_slow_step_moves_no_estimate():
    """A verify step must be expected to give `margin` times a plain step's tokens per second (breaking even
    gains nothing, and the estimates err); each cost is the median of the recent steps, so one step slowed
    by other work on the machine does not turn drafting on."""
    costs = StepCosts(margin=1.2)
    for verified, seconds in ((True, 0.0), (True, 2.0), (False, 0.0), (False, 1.0), (False, 1.0)):
        costs.observe(verified, 1, seconds)
    assert not costs.pays(1, 2.3) and costs.pays(1, 2.4)
    costs.observe(False, 1, 10.0)  # one plain step 10x slower: a mean would make drafts pay at 1.5 tokens
    assert costs.seconds(False, 1) == 1.0 and not costs.pays(1, 1.5)


def test_a_row_learns_that_its_drafts_stand_again_without_verifying_them(model):
    """Prompt-lookup drafts cost nothing to make: while a row decodes plainly its drafts are still compared
    with the tokens that come (a shadow window), so a row whose drafts missed at first and stand later
    verifies them again as soon as they do, not only when the step gate next tries (here never)."""
    p = prompts([9], seed=8)[0]
    want = engine(model).generate([p], greedy(80, spec=None))[0].token_ids

    class WrongAtFirst(Continuations):
        """The model's own tokens, all wrong for its first 16 generated tokens."""

        def propose(self, req, k):
            out = super().propose(req, k)
            return [(t + 1) % VOCAB for t in out] if len(req.tokens) < len(p) + 16 else out

    eng = priced_engine(model, WrongAtFirst([p + want]), verify_cost=2.0)
    assert eng.generate([p], greedy(80))[0].token_ids == want
    # verifying again within 16 tokens of the drafts' standing: of the last 48 tokens, 4 of each 5 drafted
    assert eng.speculation_stats().accepted >= 36


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 9), max_size=12),
    st.lists(st.integers(0, 9), max_size=12),
    st.integers(-30, 30),
    st.integers(-30, 30),
    st.sampled_from([None, 1, 2, -1]),
)
def test_joined_tokens_read_as_the_list_they_join(head, tail, i, j, step):
    joined, full = Joined(head, tail), head + tail
    assert len(joined) == len(full) and joined[i:j:step] == full[i:j:step]
    if -len(full) <= i < len(full):
        assert joined[i] == full[i]


def test_the_gain_drafts_are_expected_to_give_is_scaled_by_what_they_gave():
    """Verify steps are taken where the estimate of their drafts' tokens ran high; the tokens drafts are
    expected to add are scaled by the ratio of what verified drafts added to what they were expected to. A
    step's plain tokens are its requests', not its program's rows."""
    costs = StepCosts(margin=1.0)
    for verified, seconds in ((True, 0.0), (True, 2.0), (False, 0.0), (False, 1.0)):
        costs.observe(verified, 1, seconds)
    assert costs.pays(1, 2.0) and costs.calibration() == 1.0
    for _ in range(30):  # expected 2 tokens (1 from drafts), given 1.5 (half a token from drafts)
        costs.expect(1, 2.0)
        costs.verified(1.5)
    assert costs.calibration() == pytest.approx(0.5, abs=0.03)
    assert not costs.pays(1, 2.0) and costs.pays(1, 3.2)
    costs.verified(10)  # no step was expected: nothing to compare
    assert costs.calibration() == pytest.approx(0.5, abs=0.03)
    eight = StepCosts(margin=1.0)  # 5 requests in a program of 8 rows: plain gives 5 tokens in 1 s
    for verified, seconds in ((True, 0.0), (True, 2.0), (False, 0.0), (False, 1.0)):
        eight.observe(verified, 8, seconds)
    assert eight.pays(8, 10.0, running=5) and not eight.pays(8, 9.9, running=5)


def test_a_verify_step_costs_its_ratio_to_the_plain_step_of_now():
    """Verify steps are measured rarely and a context that grows slows every step: a verify step's cost is
    the plain step's now times the ratio the verify steps had to the plain step of their time."""
    costs = StepCosts(margin=1.0)
    for verified, seconds in ((True, 0.0), (False, 0.0), (False, 1.0), (True, 3.0)):
        costs.observe(verified, 1, seconds)
    assert costs.seconds(True, 1) == 3.0
    for _ in range(9):  # the context grew: a plain step costs 2 now
        costs.observe(False, 1, 2.0)
    assert costs.seconds(True, 1) == 6.0 and not costs.pays(1, 2.9)
