"""MXFP4 routed experts kept packed, model level: a packed model (uint8 codes + E8M0 scales, dequantized
inside the expert computation) against the same checkpoint loaded with `dequantize_experts=True` (the
NumPy reference dequantizes at load: the oracle). Full pass, prefill + decode, and the serving engine."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err
from flax import nnx
from oracles import FullPass, assert_matches_full_pass, assert_same_arrays

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, pure_fn
from jaxhybrid.weights import CheckpointError, load_pretrained, save_hf, save_orbax
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.prefix.store import PrefixStoreConfig

LEN = 40
# Packed vs dequantized: the same weights (MXFP4 dequantizes exactly), the same products, but XLA may fuse the
# dequantization into them and sum in another order; scanned vs unrolled layers: another evaluation order.
# Both within two float32 evaluations' bound of the model (`bounds.float32_network_bound`, sides 2).


def k3_mxfp4():
    return load_config("tiny-k3").replace(expert_quant="mxfp4")


def wide_mxfp4():
    """Experts dominate the bytes: hidden 256, 128 experts of width 512 (top 4) in both of 2 layers."""
    return load_config("tiny").replace(
        name="wide-mxfp4",
        hidden_size=256,
        num_hidden_layers=2,
        kda_layers=(1,),
        full_attn_layers=(2,),
        first_k_dense_replace=0,
        num_experts=128,
        num_experts_per_token=4,
        moe_intermediate_size=512,
        num_shared_experts=1,
        num_expert_group=1,
        topk_group=1,
        expert_quant="mxfp4",
    )


def tokens(cfg, batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, cfg.vocab_size, (batch, LEN)).astype(np.int32)


def checkpoint(tmp_path_factory, cfg, name: str):
    """(random packed model, the same checkpoint loaded packed, and dequantized)."""
    model = HybridLM(cfg, rngs=nnx.Rngs(3), dtype=jnp.float32)
    path = tmp_path_factory.mktemp(name)
    save_hf(model, path)  # a packed model writes its bytes as MXFP4 tensors
    return model, path, load_pretrained(path), load_pretrained(path, dequantize_experts=True)


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return checkpoint(tmp_path_factory, k3_mxfp4(), "k3")


def test_random_init_quantizes_and_round_trips(k3):
    """The random packed model holds uint8 codes and scales with the dense weight's logical axes; save_hf
    writes them as they are (a checkpoint with quantization_config) and load_pretrained reads them back."""
    model, path, packed, dense = k3
    ex = model.model.layers[1].block_sparse_moe.experts
    cfg = model.config
    E, F, L = cfg.num_experts, cfg.moe_intermediate_size, cfg.expert_dim
    assert ex.w1_packed[...].shape == (E, F, L // 2) and ex.w1_scale[...].shape == (E, F, L // 32)
    assert ex.w2_packed[...].shape == (E, L, F // 2) and ex.w2_scale[...].shape == (E, L, F // 32)
    assert ex.w2_packed[...].dtype == jnp.uint8 and not hasattr(ex, "w1")
    assert ex.w2_scale.get_metadata()["out_sharding"] == ("experts", "moe_latent", "expert_mlp")
    assert load_config(path).expert_quant == "mxfp4" and packed.packed_experts and not dense.packed_experts
    got = packed.model.layers[1].block_sparse_moe.experts
    for n in ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale"):
        np.testing.assert_array_equal(np.asarray(getattr(got, n)[...]), np.asarray(getattr(ex, n)[...]))


@pytest.fixture
def xla_expert_products(monkeypatch):
    """The dequantized twin's experts through XLA's loop, as the packed experts run: with AVX-512 a prompt's
    float32 experts would take the kernels' blocked product, whose float32 sums go in another order."""
    import jaxhybrid.ops.native as native

    monkeypatch.setattr(native, "gemm_rows", lambda: 0)


@pytest.mark.usefixtures("xla_expert_products")
def test_tiny_k3_packed_equals_dequantized(k3):
    _, _, packed, dense = k3
    toks = tokens(packed.config, 2, seed=1)
    want = np.asarray(pure_fn(dense)[0](pure_fn(dense)[1], jnp.asarray(toks)))
    fn, state = pure_fn(packed)
    got = np.asarray(fn(state, jnp.asarray(toks)))
    assert rel_err(got, want) < float32_network_bound(packed.config, toks.shape[1])
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow  # the experts-dominate variant of test_tiny_k3_packed_equals_dequantized (its own programs)
@pytest.mark.usefixtures("xla_expert_products")
def test_wide_model_packed_equals_dequantized_full_pass_and_decode(tmp_path_factory):
    """Hidden 256, 128 experts of width 512: full pass, and prefill then decode through the caches."""
    model, _, packed, dense = checkpoint(tmp_path_factory, wide_mxfp4(), "wide")
    del model
    toks = tokens(packed.config, 1, seed=2)
    full_d, state_d = pure_fn(dense)
    want = np.asarray(full_d(state_d, jnp.asarray(toks)))
    full_p, state_p = pure_fn(packed)
    assert rel_err(full_p(state_p, jnp.asarray(toks)), want) < float32_network_bound(packed.config, LEN)
    step, state = pure_fn(packed, "forward_cached")
    prompt = 36
    logits, cache = step(state, jnp.asarray(toks[:, :prompt]), packed.init_cache(1, LEN))
    got = [np.asarray(logits)]
    for t in range(prompt, LEN):
        logits, cache = step(state, jnp.asarray(toks[:, t : t + 1]), cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    dstep, dstate = pure_fn(dense, "forward_cached")
    dl, dcache = dstep(dstate, jnp.asarray(toks[:, :prompt]), dense.init_cache(1, LEN))
    wanted = [np.asarray(dl)]
    for t in range(prompt, LEN):
        dl, dcache = dstep(dstate, jnp.asarray(toks[:, t : t + 1]), dcache)
        wanted.append(np.asarray(dl))
    assert rel_err(got, np.concatenate(wanted, axis=1)) < float32_network_bound(packed.config, LEN)
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.slow  # tiny-k3's engine programs, packed; the model tests here check the packed products
def test_engine_on_packed_experts_serves_the_dequantized_full_pass(k3):
    """The engine on the packed model: two short prompts prefilled together in one call (packed prefill), a
    long one in chunks, then a prompt sharing the long one's prefix (a prefix-store hit), all decoded; every
    greedy token is the argmax of the dequantized model's full pass and every logprob its log-softmax."""
    _, _, packed, dense = k3
    full = FullPass(dense)
    config = EngineConfig(
        max_slots=4,
        block_size=16,
        prefill_chunk=32,
        max_model_len=64,  # one block-table width; every full pass below fits one 64-token program
        prefix=PrefixStoreConfig(checkpoint_interval=16),
    )
    eng = Engine(packed, config)
    rng = np.random.default_rng(5)
    vocab = packed.config.vocab_size
    long = rng.integers(3, vocab, 40).tolist()
    prompts = [rng.integers(3, vocab, n).tolist() for n in (12, 14)] + [long]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True)
    first = eng.generate(prompts, params)
    follow = long[:32] + rng.integers(3, vocab, 6).tolist()
    (second,) = eng.generate([follow], params)
    assert second.stats["prefix_hit_tokens"] >= 32
    for prompt, res in zip([*prompts, follow], [*first, second], strict=True):
        assert_matches_full_pass(full, prompt, res.token_ids, res.logprobs)


def test_orbax_saves_and_restores_packed_experts(k3, tmp_path):
    """An Orbax directory of packed experts restores packed, or with `dequantize_experts` dequantized after
    restoring: every array equals the Hugging Face checkpoint dequantized at load (the numpy table of
    `jaxhybrid.weights.mxfp4`), bit for bit."""
    _, _, packed, dense = k3
    save_orbax(packed, tmp_path / "orbax")
    back = load_pretrained(tmp_path / "orbax")
    assert back.packed_experts and back.config == packed.config  # the same arrays too: the same logits
    assert any(n.endswith(".experts.w1_packed") for n in assert_same_arrays(back, packed))
    dequantized = load_pretrained(tmp_path / "orbax", dequantize_experts=True)
    assert any(n.endswith(".experts.w1") for n in assert_same_arrays(dequantized, dense))


def test_packed_load_refuses_nan_scales(k3, tmp_path):
    """An E8M0 NaN scale (255) in one expert's weight_scale is refused when loading packed, as when
    dequantizing."""
    from safetensors.numpy import load_file, save_file

    _, path, _, _ = k3
    import shutil

    shutil.copytree(path, tmp_path / "bad")
    (file,) = (tmp_path / "bad").glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.2.block_sparse_moe.experts.5.w2.weight_scale"
    tensors[name][3, 0] = 255
    save_file(tensors, file, metadata={"format": "pt"})
    for dequantize in (False, True):
        with pytest.raises(CheckpointError, match=f"'{name}' holds the E8M0 NaN scale 255"):
            load_pretrained(tmp_path / "bad", dequantize_experts=dequantize)


@pytest.mark.slow  # compiles both forms of a 10-layer model (as tests/test_scan.py)
def test_scanned_layers_read_packed_experts_in_place():
    """The scanned layers (`jaxhybrid.scan`: each chosen expert read from the experts stacked over the
    groups, `moe_experts_dropless_stacked`) with packed experts equal the unrolled packed model."""
    import jax

    from jaxhybrid.scan import forward_scanned, scan_layout, split_for_scan

    kda = tuple(i for i in range(1, 11) if i % 4)
    cfg = load_config("tiny").replace(
        num_hidden_layers=10, kda_layers=kda, full_attn_layers=(4, 8), expert_quant="mxfp4"
    )
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    defs, params = split_for_scan(model, scan_layout(model))
    assert params.groups[1]["block_sparse_moe"]["experts"]["w1_packed"].get_value().dtype == jnp.uint8
    cached, state = pure_fn(model, "forward_cached")
    scanned = jax.jit(lambda p, *a: forward_scanned(defs, p, *a))
    toks = jnp.asarray(tokens(cfg, 2, seed=6)[:, :24])
    want, want_cache = cached(state, toks, model.init_cache(2, 32))
    got, got_cache = scanned(params, toks, model.init_cache(2, 32))
    # one loop body against unrolled layers: another evaluation order, within two evaluations' bound
    bound = float32_network_bound(cfg, toks.shape[1] + 1)
    assert rel_err(got, want) < bound
    step = toks[:, :1]
    assert rel_err(scanned(params, step, got_cache)[0], cached(state, step, want_cache)[0]) < bound
