"""Parameter and cache-byte counts from shapes only, checked against hand computations."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jaxhybrid.cache import cache_bytes_per_sequence, init_cache
from jaxhybrid.config import load_config
from jaxhybrid.counting import count_params, named_shapes
from serve.cli import main


def test_kimi_linear_48b_parameter_count_without_allocation():
    counts = count_params(load_config("kimi-linear-48b-a3b"))
    # The figure the reference implementation reports for this shape (router bias is a buffer, not a param).
    assert counts["total_params"] == 49_122_675_072
    assert 3.4e9 < counts["active_params"] < 3.6e9
    # hand count of the routed experts: 26 MoE layers x 256 experts x 3 matrices of 2304 x 1024
    assert counts["routed_expert_params"] == 26 * 256 * 3 * 2304 * 1024
    assert counts["active_params"] == counts["total_params"] - 26 * (256 - 8) * 3 * 2304 * 1024


def test_tiny_names_and_shapes_follow_the_checkpoint():
    cfg = load_config("tiny")
    shapes = {k: tuple(v.shape) for k, v in named_shapes(cfg).items()}
    H, d, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
    expect = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "lm_head.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
        "model.layers.0.input_layernorm.weight": (D,),
        "model.layers.0.self_attn.q_proj.weight": (H * d, D),
        "model.layers.0.self_attn.q_conv1d.weight": (H * d, 1, 4),
        "model.layers.0.self_attn.A_log": (1, 1, H, 1),
        "model.layers.0.self_attn.dt_bias": (H * d,),
        "model.layers.0.self_attn.f_a_proj.weight": (d, D),
        "model.layers.0.self_attn.f_b_proj.weight": (H * d, d),
        "model.layers.0.self_attn.b_proj.weight": (H, D),
        "model.layers.0.self_attn.g_b_proj.weight": (H * d, d),
        "model.layers.0.self_attn.o_norm.weight": (d,),
        "model.layers.0.mlp.gate_proj.weight": (cfg.intermediate_size, D),
        "model.layers.3.self_attn.q_proj.weight": (cfg.num_attention_heads * cfg.qk_head_dim, D),
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (cfg.latent_dim, D),
        "model.layers.3.self_attn.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "model.layers.3.self_attn.kv_b_proj.weight": (
            cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
            cfg.kv_lora_rank,
        ),
        "model.layers.3.block_sparse_moe.gate.weight": (cfg.num_experts, D),
        "model.layers.3.block_sparse_moe.gate.e_score_correction_bias": (cfg.num_experts,),
        "model.layers.3.block_sparse_moe.experts.w1": (cfg.num_experts, cfg.moe_intermediate_size, D),
        "model.layers.3.block_sparse_moe.experts.w2": (cfg.num_experts, D, cfg.moe_intermediate_size),
        "model.layers.3.block_sparse_moe.shared_experts.down_proj.weight": (D, cfg.moe_intermediate_size),
    }
    for name, shape in expect.items():
        assert shapes.get(name) == shape, name
    assert "model.layers.0.block_sparse_moe.gate.weight" not in shapes  # layer 0 is dense


@pytest.mark.parametrize("dtype, size", [(jnp.bfloat16, 2), (jnp.float32, 4)])
def test_cache_bytes_hand_computed(dtype, size):
    cfg = load_config("kimi-linear-48b-a3b")
    T = 1_048_576
    got = cache_bytes_per_sequence(cfg, T, dtype)
    assert got["kv_bytes"] == 7 * T * (512 + 64) * size
    assert got["recurrent_state_bytes"] == 20 * 32 * 128 * 128 * 4
    assert got["conv_state_bytes"] == 20 * 3 * 4096 * 3 * size
    # and it matches the arrays init_cache really allocates (tiny, one sequence)
    tiny = load_config("tiny")
    arrays = init_cache(tiny, 1, 100, dtype)
    allocated = sum(a.size * a.dtype.itemsize for c in arrays for a in c if a.ndim > 1)
    want = cache_bytes_per_sequence(tiny, 100, dtype)
    assert allocated == want["kv_bytes"] + want["state_bytes"]


def test_info_cli_json(capsys):
    assert main(["info", "--config", "tiny", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_params"] == count_params(load_config("tiny"))["total_params"]
    assert 0 < out["active_params"] < out["total_params"]
    assert main(["info", "--config", "no-such-thing"]) == 2
    assert "no config named" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["tiny", "tiny-grouped", "tiny-k3"])
def test_per_kind_count_equals_whole_model_count(name):
    """count_params traces one layer per kind; the whole abstract model must give the same total."""
    cfg = load_config(name)
    shapes = named_shapes(cfg)
    whole = sum(int(np.prod(v.shape)) for k, v in shapes.items() if not k.endswith("e_score_correction_bias"))
    assert count_params(cfg)["total_params"] == whole


def test_kimi_k3_parameter_count_from_k3_md_shapes():
    """Kimi K3 (shared/K3.md), summed by hand from the tensor shapes, equals count_params (eval_shape)."""
    D, V, vocab_tables = 7168, 163840, 2  # embed_tokens + untied lm_head
    H, d, conv = 96, 128, 4  # KDA
    HD = H * d
    kda = (
        3 * HD * D  # q/k/v_proj
        + 3 * HD * conv  # q/k/v_conv1d [HD, 1, 4]
        + d * D  # f_a_proj
        + HD * d  # f_b_proj
        + HD  # dt_bias
        + 128  # A_log, stored with 128 entries (96 used)
        + H * D  # b_proj
        + HD * D  # g_proj (full rank output gate)
        + d  # o_norm
        + D * HD  # o_proj
    )
    q_rank, kv_rank, nope, rope, vd = 1536, 512, 128, 64, 128  # MLA, 96 heads
    mla = (
        q_rank * D  # q_a_proj
        + q_rank  # q_a_layernorm
        + H * (nope + rope) * q_rank  # q_b_proj
        + (kv_rank + rope) * D  # kv_a_proj_with_mqa
        + kv_rank  # kv_a_layernorm
        + H * (nope + vd) * kv_rank  # kv_b_proj
        + H * vd * D  # g_proj (output gate)
        + D * H * vd  # o_proj
    )
    E, F, L, shared = 896, 3072, 3584, 2 * 3072
    routed = E * 3 * F * L  # experts.E.w1/w3 [3072, 3584], w2 [3584, 3072]
    moe = (
        E * D  # router gate.weight (the e_score_correction_bias is a buffer)
        + routed
        + 3 * shared * D  # shared_experts gate/up/down_proj
        + L * D  # routed_expert_down_proj
        + D * L  # routed_expert_up_proj
        + L  # routed_expert_norm
    )
    dense = 3 * 33792 * D  # layer 0 mlp
    per_layer = 2 * D + 4 * D  # input/post_attention_layernorm + self_attention_res_{norm,proj} + mlp_res_*
    head = vocab_tables * V * D + D + 2 * D  # embeddings, model.norm, output_attn_res_{norm,proj}
    total = head + 93 * per_layer + 69 * kda + 24 * mla + dense + 92 * moe
    assert total == 2_779_484_395_776

    counts = count_params(load_config("kimi-k3"))
    assert counts["total_params"] == total and not counts["approximate"]
    assert counts["routed_expert_params"] == 92 * routed
    assert counts["active_params"] == total - 92 * (E - 16) * 3 * F * L
    assert counts["buffer_elements"] == 92 * E  # the router biases
