"""Kimi K3 additions, each against a naive NumPy float64 reference written from shared/K3.md
(tests/numpy_reference.py): SiTU (and every expert implementation taking it), attention residuals, latent MoE,
MLA output gate, full-rank and bounded KDA gates with a padded A_log; then tiny-k3 as a whole: full pass vs
the reference, prefill + decode through the caches, and the serving engine's greedy output.

Tolerances (relative error max|a-b| / max|b|), derived in tests/bounds.py, none measured: an fp32 module
against the float64 reference within the sums it chains (`float32_sums_bound`; a whole layer: one layer of
`float32_network_bound`); the 14-layer model against the reference within `float32_network_bound` (one side);
cached decode against the full pass within it on two sides (two fp32 evaluation orders of the same model:
recurrent vs chunked KDA, absorbed vs expanded MLA).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import ACTIVATION_ROUNDINGS, float32_network_bound, float32_sums_bound, gamma
from conftest import rel_err
from flax import nnx
from numpy_reference import NumpyReference, attn_res_mix, situ
from oracles import assert_matches_full_pass, randomize

from jaxhybrid.config import load_config
from jaxhybrid.layers.basic import gated_activation
from jaxhybrid.layers.kda import KimiDeltaAttention
from jaxhybrid.layers.mla import MultiHeadLatentAttention
from jaxhybrid.layers.moe import MoE
from jaxhybrid.model import HybridLM, pure_fn
from jaxhybrid.ops.activations import SILU, GatedActivation, gated_act
from jaxhybrid.ops.attn_res import attn_res_mix as attn_res_mix_jax
from jaxhybrid.ops.moe import moe_experts_blocked, moe_experts_dense, moe_experts_dropless, moe_experts_ragged
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from sharding.expert_parallel import make_expert_parallel_fn
from sharding.mesh import make_mesh

SITU_TOL = float32_sums_bound(ACTIVATION_ROUNDINGS)
K3_SITU = GatedActivation("situ", 4.0, 25.0)
FULL_LEN = 72  # the full-pass length every model test uses (one compiled shape); crosses a KDA chunk (64)


def cfg_k3():
    return load_config("tiny-k3")


@nnx.jit
def call(module: nnx.Module, x: jax.Array):
    """A module's __call__, compiled (eager dispatch of the many small ops is the slow part on the CPU)."""
    return module(x)


def prefixed(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}.{k}": v for k, v in params.items()}


# --- SiTU ------------------------------------------------------------------------------------------------
def test_situ_activation_matches_formula():
    rng = np.random.default_rng(0)
    gate, up = (rng.normal(0, 20, (64, 40)).astype(np.float32) for _ in range(2))  # large: the caps bind
    got = gated_act(jnp.asarray(gate), jnp.asarray(up), K3_SITU)
    assert got.dtype == jnp.float32
    assert rel_err(got, situ(gate.astype(np.float64), up.astype(np.float64), 4.0, 25.0)) < SITU_TOL
    no_cap = gated_act(jnp.asarray(gate), jnp.asarray(up), GatedActivation("situ", 4.0, None))
    assert rel_err(no_cap, situ(gate.astype(np.float64), up.astype(np.float64), 4.0, None)) < SITU_TOL
    # gate and up are not interchangeable, and SiLU is unchanged
    assert rel_err(gated_act(jnp.asarray(up), jnp.asarray(gate), K3_SITU), got) > 0.1
    np.testing.assert_array_equal(gated_act(jnp.asarray(gate), jnp.asarray(up), SILU), jax.nn.silu(gate) * up)
    # bf16 in, bf16 out (computed in fp32 inside)
    assert (
        gated_act(jnp.asarray(gate, jnp.bfloat16), jnp.asarray(up, jnp.bfloat16), K3_SITU).dtype
        == jnp.bfloat16
    )
    # the config's activation
    assert gated_activation(cfg_k3()) == K3_SITU
    assert gated_activation(load_config("tiny")) == SILU
    assert gated_activation(cfg_k3().replace(activation_situ_beta=None)) == GatedActivation("situ", 1.0, 25.0)


def expert_problem(seed: int = 0, n: int = 24, e: int = 8, k: int = 2, dim: int = 64, ffn: int = 32):
    ks = jax.random.split(jax.random.key(seed), 6)
    x = jax.random.normal(ks[0], (n, dim), jnp.float32)
    w1 = jax.random.normal(ks[1], (e, ffn, dim), jnp.float32)  # scale ~sqrt(dim): SiTU's caps bind
    w2 = jax.random.normal(ks[2], (e, dim, ffn), jnp.float32) * 0.1
    w3 = jax.random.normal(ks[3], (e, ffn, dim), jnp.float32) * 4.0
    ids = jax.vmap(lambda key: jax.random.permutation(key, e)[:k])(jax.random.split(ks[4], n)).astype(
        jnp.int32
    )
    weights = jax.random.uniform(ks[5], (n, k), jnp.float32)
    return x, w1, w2, w3, weights, ids


def experts_bound(x, w1, w2, w3, weights, ids) -> float:
    """The experts' chain: gate and up over `dim`, the activation, down over `ffn`, the weighted sum over the
    k picks (split over devices and psummed: another order of the same terms, which gamma(K) covers)."""
    dim, ffn, k = x.shape[1], w1.shape[1], ids.shape[1]
    return float32_sums_bound(dim, ACTIVATION_ROUNDINGS, ffn, k)


def experts_reference(x, w1, w2, w3, weights, ids, beta, linear_beta):
    x, w1, w2, w3, weights = (np.asarray(a, np.float64) for a in (x, w1, w2, w3, weights))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(np.asarray(ids[t])):
            out[t] += weights[t, j] * (w2[e] @ situ(w1[e] @ x[t], w3[e] @ x[t], beta, linear_beta))
    return out


@pytest.mark.parametrize(
    "impl",
    [moe_experts_dense, moe_experts_blocked, moe_experts_ragged, moe_experts_dropless],
    ids=lambda f: f.__name__,
)
def test_every_expert_implementation_takes_situ(impl):
    args = expert_problem()
    want = experts_reference(*args, 4.0, 25.0)
    got = jax.jit(functools.partial(impl, act=K3_SITU))(*args)
    assert rel_err(got, want) < experts_bound(*args)
    assert rel_err(jax.jit(impl)(*args), want) > 1e-2  # the SiLU default differs: the activation reached it


def test_expert_parallel_takes_situ():
    args = expert_problem(seed=1)
    mesh = make_mesh("expert=2,tensor=2", devices=jax.devices()[:4])
    got = jax.jit(functools.partial(make_expert_parallel_fn(mesh), act=K3_SITU))(*args)
    assert rel_err(got, experts_reference(*args, 4.0, 25.0)) < experts_bound(*args)


# --- attention residuals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("num_blocks", [1, 2, 9])
def test_attn_res_mix_matches_reference(num_blocks):
    rng = np.random.default_rng(num_blocks)
    D = 48
    blocks = [rng.normal(0, s, (2, 5, D)).astype(np.float32) for s in np.linspace(0.5, 4.0, num_blocks)]
    partial = rng.normal(0, 2.0, (2, 5, D)).astype(np.float32)
    norm_w = (1 + 0.3 * rng.uniform(-1, 1, D)).astype(np.float32)
    proj_w = rng.normal(0, 1.0, (1, D)).astype(np.float32)
    got = attn_res_mix_jax(jnp.asarray(partial), [jnp.asarray(b) for b in blocks], norm_w, proj_w, 1e-5)
    want = np.stack(
        [
            np.stack(
                [
                    attn_res_mix(partial[i, t], [b[i, t] for b in blocks], norm_w, proj_w, 1e-5)
                    for t in range(5)
                ]
            )
            for i in range(2)
        ]
    )
    assert got.shape == partial.shape and got.dtype == jnp.float32
    # the chain: each value's rms (D terms), its score (D terms), the softmax over the n + 1 values and their
    # weighted sum; a score's absolute error (gamma(2D) of its terms' magnitudes, |K_i| . |norm_w proj_w|)
    # is its weight's relative error, and reaches the output times the values' magnitude
    values = [*blocks, partial]
    w = np.abs(norm_w.astype(np.float64) * proj_w.astype(np.float64).reshape(-1))
    rms = [np.sqrt(np.mean(np.square(v.astype(np.float64)), -1, keepdims=True)) for v in values]
    scores = max(float(((np.abs(v) / r) @ w).max()) for v, r in zip(values, rms, strict=True))
    spread = max(float(np.abs(v).max()) for v in values) / np.abs(want).max()
    bound = float32_sums_bound(D, D, num_blocks + 1, num_blocks + 1) + 2 * gamma(2 * D) * scores * spread
    assert rel_err(got, want) < bound
    # the stream dtype is kept
    low = attn_res_mix_jax(
        jnp.asarray(partial, jnp.bfloat16),
        [jnp.asarray(b, jnp.bfloat16) for b in blocks],
        norm_w,
        proj_w,
        1e-5,
    )
    assert low.dtype == jnp.bfloat16 and rel_err(low, want) < 2e-2


# --- latent MoE, MLA output gate, KDA gates -----------------------------------------------------------------
def test_latent_moe_matches_reference():
    cfg = cfg_k3()
    moe = MoE(cfg, rngs=nnx.Rngs(3))
    params = prefixed(randomize(moe, 3), "moe")
    assert params["moe.experts.w1"].shape == (
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.routed_expert_hidden_size,
    )
    assert params["moe.gate.weight"].shape == (cfg.num_experts, cfg.hidden_size)  # the router sees x
    x = np.random.default_rng(3).normal(0, 1, (2, 9, cfg.hidden_size)).astype(np.float32)
    got = call(moe, jnp.asarray(x))
    want = NumpyReference(cfg, params).moe("moe", x.reshape(-1, cfg.hidden_size).astype(np.float64))
    assert rel_err(got.reshape(-1, cfg.hidden_size), want) < float32_network_bound(cfg, 9, sides=1, layers=1)


def test_mla_output_gate_matches_reference():
    cfg = cfg_k3()
    mla = MultiHeadLatentAttention(cfg, rngs=nnx.Rngs(4))
    params = prefixed(randomize(mla, 4), "attn")
    assert params["attn.g_proj.weight"].shape == (cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size)
    x = np.random.default_rng(4).normal(0, 1, (1, 11, cfg.hidden_size)).astype(np.float32)
    got, _ = call(mla, jnp.asarray(x))
    ref = NumpyReference(cfg, params)
    assert rel_err(got[0], ref.mla("attn", x[0].astype(np.float64))) < float32_network_bound(
        cfg, 11, 1, layers=1
    )
    ungated_ref = NumpyReference(cfg.replace(mla_use_output_gate=False), params)
    ungated = ungated_ref.mla("attn", x[0].astype(np.float64))
    assert rel_err(got[0], ungated) > 0.1
    assert not hasattr(MultiHeadLatentAttention(load_config("tiny"), rngs=nnx.Rngs(0)), "g_proj")


@pytest.mark.parametrize(
    "changes",
    [
        {},  # K3: full-rank gate, bounded forget gate, padded A_log
        {"use_full_rank_gate": False, "gate_lower_bound": None, "kda_a_log_size": None},  # Kimi Linear
    ],
    ids=["k3", "kimi-linear"],
)
def test_kda_gates_match_reference(changes):
    cfg = cfg_k3().replace(**changes)
    kda = KimiDeltaAttention(cfg, rngs=nnx.Rngs(5))
    params = prefixed(randomize(kda, 5), "attn")
    H, d = cfg.kda_num_heads, cfg.kda_head_dim
    assert params["attn.A_log"].shape == (1, 1, cfg.a_log_size, 1)
    assert ("attn.g_proj.weight" in params) == cfg.use_full_rank_gate
    assert ("attn.g_a_proj.weight" in params) != cfg.use_full_rank_gate
    x = np.random.default_rng(5).normal(0, 1, (1, 70, cfg.hidden_size)).astype(np.float32)
    got, _ = call(kda, jnp.asarray(x))
    layer_tol = float32_network_bound(cfg, 70, sides=1, layers=1)
    assert rel_err(got[0], NumpyReference(cfg, params).kda("attn", x[0].astype(np.float64))) < layer_tol
    # the forget gate itself, against K3.md's formula with the first H entries of A_log
    g = np.asarray(kda.forget_gate(jnp.asarray(x)))[0]
    raw = (
        x[0] @ params["attn.f_a_proj.weight"].T @ params["attn.f_b_proj.weight"].T + params["attn.dt_bias"]
    ).reshape(-1, H, d)
    a = np.exp(params["attn.A_log"].reshape(-1)[:H])[None, :, None]
    if cfg.gate_lower_bound is not None:
        want = -5.0 * (1 / (1 + np.exp(-a * raw)))
        assert np.all(g >= -5.0) and np.all(g <= 0.0)  # in (-5, 0), up to fp32 saturation of the sigmoid
    else:
        want = -a * np.logaddexp(0, raw)
    # two products (hidden, then the gate's rank), a bias, then exp(A_log) times a sigmoid or a softplus
    assert rel_err(g, want) < float32_sums_bound(cfg.hidden_size, cfg.hidden_size, ACTIVATION_ROUNDINGS)


# --- tiny-k3 as a whole ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k3_model():
    model = HybridLM(cfg_k3(), rngs=nnx.Rngs(0), dtype=jnp.float32)
    params = randomize(model, 0)
    full, state = pure_fn(model)
    return model, params, lambda toks: np.asarray(full(state, jnp.asarray(toks, jnp.int32)))


def k3_tokens(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, cfg_k3().vocab_size, (batch, FULL_LEN)).astype(np.int32)


def test_tiny_k3_layout():
    cfg = cfg_k3()
    assert cfg.unimplemented == () and cfg.num_hidden_layers == 14
    assert [i + 1 for i, t in enumerate(cfg.layer_types) if t == "mla"] == [4, 8, 12, 13, 14]
    assert [i for i in range(14) if i % cfg.attn_res_block_size == 0] == [0, 12]  # two AttnRes blocks
    for width in (cfg.routed_expert_hidden_size, cfg.moe_intermediate_size):
        assert width % 32 == 0  # MXFP4 groups
    assert cfg.replace(expert_quant="mxfp4").expert_quant == "mxfp4"


def test_tiny_k3_full_pass_matches_reference(k3_model):
    model, params, full = k3_model
    toks = k3_tokens(2, seed=1)
    got = full(toks)
    assert got.shape == (2, FULL_LEN, model.config.vocab_size)
    ref = NumpyReference(model.config, params)
    bound = float32_network_bound(model.config, FULL_LEN, sides=1)
    assert rel_err(got[0], ref.forward(toks[0])) < bound  # 72 tokens: across a KDA chunk (64)


@pytest.mark.slow  # tiny-k3's cached forward at two shapes; the engine test below decodes tiny-k3 in default
def test_tiny_k3_prefill_then_decode_equals_full_pass(k3_model):
    model, _, full = k3_model
    toks = k3_tokens(2, seed=2)
    want = full(toks)
    step, state = pure_fn(model, "forward_cached")
    prompt = 66  # crosses the KDA chunk (64)
    logits, cache = step(state, jnp.asarray(toks[:, :prompt]), model.init_cache(2, FULL_LEN))
    got = [np.asarray(logits)]
    for t in range(prompt, FULL_LEN):
        logits, cache = step(state, jnp.asarray(toks[:, t : t + 1]), cache)
        got.append(np.asarray(logits))
    # prefill runs the full pass's algorithms (chunked KDA, expanded MLA) over a shorter, padded length: the
    # same sums, blocked alike but for XLA's tail tiles, so within two evaluations' bound
    assert rel_err(np.concatenate(got[:1], axis=1), want[:, :prompt]) < float32_network_bound(
        model.config, prompt
    )
    assert rel_err(np.concatenate(got, axis=1), want) < float32_network_bound(model.config, FULL_LEN)


def test_engine_greedy_on_tiny_k3_equals_the_full_pass(k3_model):
    """Greedy tokens are the full pass's argmax and their logprobs its log-softmax (within the bounds of
    tests/oracles.py `logprob_bounds`)."""
    model, _, full = k3_model
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)
    # Two prompts that are prefilled together in one bucket, then decoded together: two compiled programs.
    config = EngineConfig(max_slots=2, block_size=32, prefill_chunk=32, max_model_len=64, prefix=None)
    eng = Engine(model, config)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, model.config.vocab_size, n).tolist() for n in (12, 14)]
    results = eng.generate(prompts, params)

    def one_sequence(toks: list[int]) -> np.ndarray:
        """The fixture's full pass (its one compiled shape, [2, FULL_LEN]) over `toks`: [len, vocab]."""
        padded = np.zeros((2, FULL_LEN), np.int32)
        padded[:, : len(toks)] = toks
        return np.asarray(full(padded)[0, : len(toks)], np.float64)

    for prompt, res in zip(prompts, results, strict=True):
        assert_matches_full_pass(one_sequence, prompt, res.token_ids, res.logprobs, config=model.config)
