"""The scanned form of the model (`jaxhybrid.scan`): the same logits and caches as the unrolled layers, and
the engine running it serves the full pass's tokens and logprobs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err
from flax import nnx
from oracles import FullPass, assert_matches_full_pass

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, pure_fn
from jaxhybrid.scan import ScanLayout, forward_scanned, scan_layout, split_for_scan
from serve.engine.config import AUTO_SCAN_MIN_GROUPS, scan_mode
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams


def deep_tiny(layers: int):
    """`tiny` widths at another depth, every 4th layer MLA (1 dense lead layer)."""
    kda = tuple(i for i in range(1, layers + 1) if i % 4)
    mla = tuple(i for i in range(1, layers + 1) if i % 4 == 0)
    return load_config("tiny").replace(num_hidden_layers=layers, kda_layers=kda, full_attn_layers=mla)


@pytest.fixture(scope="module")
def model():
    return HybridLM(deep_tiny(10), rngs=nnx.Rngs(0))


def test_layout_scans_the_repeated_groups(model):
    # layer 0 dense (lead), layers 1-8 two groups of K K M K, layer 9 the partial group (tail)
    assert scan_layout(model) == ScanLayout(num_layers=10, start=1, period=4, groups=2)
    assert scan_layout(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0))) is None  # one group: nothing to scan
    k3 = nnx.eval_shape(lambda: HybridLM(load_config("tiny-k3"), rngs=nnx.Rngs(0)))
    assert scan_layout(k3) is None  # attention residuals: not scanned


# The same layers, compiled as one loop body or unrolled: another evaluation order, so each output (logits,
# every cache) within two float32 evaluations' bound of the model, relative to its largest entry
# (`bounds.float32_network_bound`; 1.5e-3 for these 10 layers, where a wrong layer's weights are O(1)).


@pytest.mark.slow  # compiles both forms of a 10-layer model (about 20 s); "auto" scans only deeper models
def test_scanned_forward_equals_forward_cached(model):
    defs, params = split_for_scan(model, scan_layout(model))
    cached, state = pure_fn(model, "forward_cached")
    scanned = jax.jit(lambda p, *a: forward_scanned(defs, p, *a))
    tokens = jax.random.randint(jax.random.key(1), (2, 24), 3, 512)
    lengths = jnp.array([24, 13])
    want, want_cache = cached(state, tokens, model.init_cache(2, 32), lengths)
    got, got_cache = scanned(params, tokens, model.init_cache(2, 32), lengths)
    bound = float32_network_bound(model.config, tokens.shape[1] + 1)
    assert rel_err(got, want) < bound
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        assert a.shape == b.shape and rel_err(a, b) < bound
    step = tokens[:, :1]  # one decode step on those caches
    got_step, want_step = scanned(params, step, got_cache, None)[0], cached(state, step, want_cache, None)[0]
    assert rel_err(got_step, want_step) < bound


@pytest.mark.slow  # compiles 10-layer engine programs (about 30 s quiet, 100 s loaded)
def test_scanning_engine_serves_the_full_pass(model):
    config = EngineConfig(max_slots=2, block_size=8, prefill_chunk=16, max_model_len=40, scan_layers="all")
    eng = Engine(model, config)
    assert eng.runner.programs.run_scanned is not None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, 21).tolist()]  # two prefill chunks (16 + 5), then decode
    greedy = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=True)
    full = FullPass(model, pad=32)
    for prompt, res in zip(prompts, eng.generate(prompts, greedy), strict=True):
        assert_matches_full_pass(full, prompt, res.token_ids, res.logprobs)


def test_scan_setting_is_checked():
    with pytest.raises(ValueError, match="scan_layers"):
        EngineConfig(scan_layers="yes").validate()


def test_auto_scans_deep_models_only():
    # the default: every program scanned from AUTO_SCAN_MIN_GROUPS groups on, nothing below; a model with
    # fewer than two groups has nothing to scan whatever the setting
    assert EngineConfig().scan_layers == "auto"
    assert scan_mode("auto", AUTO_SCAN_MIN_GROUPS) == "all"
    assert scan_mode("auto", AUTO_SCAN_MIN_GROUPS - 1) == "off"
    assert scan_mode("prefill", 2) == "prefill" and scan_mode("all", 1) == "off"
    layers = 1 + 4 * AUTO_SCAN_MIN_GROUPS  # the shallowest K K K M model "auto" scans (Kimi K3's 92 do too)
    deep = nnx.eval_shape(lambda: HybridLM(deep_tiny(layers), rngs=nnx.Rngs(0)))
    assert scan_layout(deep).groups == AUTO_SCAN_MIN_GROUPS
    small = nnx.eval_shape(lambda: HybridLM(load_config("small"), rngs=nnx.Rngs(0)))
    assert scan_layout(small) is None  # small stays unrolled
