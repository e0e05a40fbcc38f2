"""Config loading from our YAML files and from Hugging Face config.json, and validation errors."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxhybrid.config import ConfigError, available_configs, from_dict, load_config

HF_48B = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 9216,
    "head_dim": 72,
    "model_max_length": 1048576,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    # alias names, as some exports write them
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "moe_intermediate_size": 1024,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True,
    "routed_scaling_factor": 2.446,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "use_grouped_topk": True,
    "topk_group": 1,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "torch_dtype": "bfloat16",
}


def test_named_configs_load():
    names = available_configs()
    for required in ("tiny", "small", "kimi-linear-48b-a3b", "kimi-k3"):
        assert required in names
    tiny = load_config("tiny")
    assert tiny.layer_types == ("kda", "kda", "kda", "mla")
    assert tiny.num_experts == 8
    small = load_config("small")
    assert [i + 1 for i, t in enumerate(small.layer_types) if t == "mla"] == [4, 8]
    assert (small.hidden_size, small.kda_num_heads, small.kda_head_dim, small.num_experts) == (
        1024,
        8,
        128,
        32,
    )
    k3 = load_config("kimi-k3")
    assert (k3.num_kda_layers, k3.num_mla_layers) == (69, 24)
    assert k3.layer_types[-2:] == ("mla", "mla")
    assert k3.gate_lower_bound == -5.0
    assert k3.unimplemented == ()
    assert (k3.attn_res_block_size, k3.routed_expert_hidden_size, k3.hidden_act) == (12, 3584, "situ")
    assert (k3.activation_situ_beta, k3.activation_situ_linear_beta) == (4.0, 25.0)
    assert k3.latent_moe_use_norm and k3.mla_use_output_gate and k3.use_full_rank_gate
    assert (k3.a_log_size, k3.mla_lora_norm_eps, k3.expert_quant) == (128, 1e-6, "mxfp4")


def test_hf_config_with_aliases_equals_our_yaml(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(HF_48B))
    from_hf = load_config(path)
    ours = load_config("kimi-linear-48b-a3b")
    assert from_hf.replace(name=ours.name) == ours
    # a model directory works too, and the text_config wrapper of multimodal exports
    assert load_config(tmp_path).replace(name=ours.name) == ours
    wrapped = from_dict({"model_type": "kimi_k3", "text_config": HF_48B}, strict=False)
    assert wrapped.replace(name=ours.name) == ours


def test_round_trip_through_hf_dict():
    for name in ("tiny", "tiny-grouped", "kimi-k3", "tiny-k3"):
        cfg = load_config(name)
        assert from_dict(cfg.to_hf_dict(), strict=True, name=cfg.name) == cfg


def _bad(**changes):
    raw = load_config("tiny").to_hf_dict()
    for key, value in changes.items():
        if key.startswith("lin_"):
            raw["linear_attn_config"][key[4:]] = value
        else:
            raw[key] = value
    return raw


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"lin_full_attn_layers": [3]}, "kda_layers"),  # layer 4 in neither list; 3 in both
        ({"lin_kda_layers": [1, 2, 3]}, None),  # valid baseline, see below
        ({"lin_kda_layers": [0, 1, 2, 3]}, "kda_layers"),  # 0 is outside 1-indexed range
        ({"lin_full_attn_layers": [4, 5]}, "full_attn_layers"),
        ({"lin_kda_layers": [1, 2]}, "kda_layers"),  # layer 3 missing
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_attention_heads": -2}, "num_attention_heads"),
        ({"num_experts_per_token": 9}, "num_experts_per_token"),
        ({"num_expert_group": 3}, "num_expert_group"),
        ({"num_expert_group": 2, "topk_group": 3}, "topk_group"),
        ({"num_expert_group": 4, "topk_group": 1, "num_experts_per_token": 3}, "num_experts_per_token"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
        ({"lin_gate_lower_bound": 2.0}, "gate_lower_bound"),
        ({"lin_short_conv_kernel_size": 1}, "short_conv_kernel_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"first_k_dense_replace": 9}, "first_k_dense_replace"),
        ({"eos_token_id": 100000}, "eos_token_id"),
        ({"vocab_size": "512"}, "vocab_size"),
        ({"num_hiden_layers": 4}, "num_hiden_layers"),  # typo: unknown key in a strict (YAML) config
        ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
        ({"lin_unknown_thing": 1}, "linear_attn_config.unknown_thing"),
    ],
)
def test_invalid_configs_name_the_field(changes, field):
    raw = _bad(**changes)
    if field is None:
        from_dict(raw, strict=True)
        return
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        from_dict(raw, strict=True)


def test_missing_required_and_bad_files(tmp_path):
    raw = load_config("tiny").to_hf_dict()
    del raw["hidden_size"]
    with pytest.raises(ConfigError, match="hidden_size"):
        from_dict(raw, strict=True)
    with pytest.raises(ConfigError, match="no config named"):
        load_config("no-such-config")
    bad = tmp_path / "bad.yaml"
    bad.write_text("hidden_size: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    # Hugging Face files may carry keys we do not know: ignored, not an error.
    hf = dict(HF_48B, some_future_key=1)
    assert from_dict(hf, strict=False).num_experts == 256


def test_k3_released_config_json(tmp_path):
    """K3's config.json: the text model under text_config (with transformers' stray head_dim 74), a vision
    tower, and the compressed-tensors quantization_config at the top level or inside text_config."""
    k3 = load_config("kimi-k3")
    text = k3.to_hf_dict()
    for key in ("name", "expert_quant", "kda_a_log_size", "mla_lora_norm_eps"):  # not in K3's config.json
        del text[key]
    text.update(head_dim=74, model_type="kimi_k3_text", num_nextn_predict_layers=0, topk_method="noaux_tc")
    quant = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "weights": {"group_size": 32}}},
    }
    want = k3.replace(name="m", kda_a_log_size=None)
    top = {
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"x": 1},
        "quantization_config": quant,
    }
    assert from_dict(top, strict=False, name="m") == want
    inner = {"model_type": "kimi_k3", "text_config": dict(text, quantization_config=quant)}
    assert from_dict(inner, strict=False, name="m") == want
    groups_only = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"format": "mxfp4-pack-quantized"}},
    }
    assert (
        from_dict({"text_config": text, "quantization_config": groups_only}, strict=False).expert_quant
        == "mxfp4"
    )
    assert from_dict({"text_config": text}, strict=False).expert_quant is None
    (tmp_path / "config.json").write_text(json.dumps(top))
    assert load_config(tmp_path).replace(name="m") == want
    bad = [
        ({"quant_method": "fp8"}, "quant_method"),
        ({"quant_method": "compressed-tensors", "format": "int4-pack-quantized"}, "format"),
        (
            dict(
                quant, config_groups={"g": {"format": "mxfp4-pack-quantized", "weights": {"group_size": 16}}}
            ),
            "16",
        ),
    ]
    for qc, match in bad:
        with pytest.raises(ConfigError, match=match):
            from_dict({"text_config": text, "quantization_config": qc}, strict=False)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"activation_situ_beta": 0.0}, "activation_situ_beta"),
        ({"attn_res_block_size": 0}, "attn_res_block_size"),
        ({"routed_expert_hidden_size": None}, "latent_moe_use_norm"),
        ({"kda_a_log_size": 1}, "kda_a_log_size"),
        ({"mla_lora_norm_eps": 0}, "mla_lora_norm_eps"),
        ({"expert_quant": "nf4"}, "expert_quant"),
        ({"expert_quant": "mxfp4", "moe_intermediate_size": 48}, "moe_intermediate_size"),
        ({"expert_quant": "mxfp4", "routed_expert_hidden_size": 80}, "routed_expert_hidden_size"),
    ],
)
def test_invalid_k3_fields_name_the_field(changes, field):
    raw = load_config("tiny-k3").to_hf_dict()
    raw.update(changes)
    with pytest.raises(ConfigError, match=field):
        from_dict(raw, strict=True)


# Breaks of tiny's fields that leave every other field's constraints as they were: (key as written, its
# label in the error, a bad value).
INDEPENDENT_BREAKS = [
    ("hidden_size", "hidden_size", 0),
    ("intermediate_size", "intermediate_size", -1),
    ("num_attention_heads", "num_attention_heads", "4"),
    ("q_lora_rank", "q_lora_rank", 0),
    ("v_head_dim", "v_head_dim", 0),
    ("rms_norm_eps", "rms_norm_eps", -1e-5),
    ("mla_lora_norm_eps", "mla_lora_norm_eps", 0),
    ("hidden_act", "hidden_act", "gelu"),
    ("max_position_embeddings", "max_position_embeddings", 0),
    ("num_shared_experts", "num_shared_experts", -1),
    ("expert_quant", "expert_quant", "nf4"),
    ("mla_use_output_gate", "mla_use_output_gate", "yes"),
    ("activation_situ_beta", "activation_situ_beta", -1.0),
    ("lin_short_conv_kernel_size", "linear_attn_config.short_conv_kernel_size", 1),
    ("lin_gate_lower_bound", "linear_attn_config.gate_lower_bound", 0.5),
    ("lin_head_dim", "linear_attn_config.head_dim", 0),
    ("moe_router_activation_func", "moe_router_activation_func", "softmax"),
    ("an_unknown_key", "an_unknown_key", 1),
]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(INDEPENDENT_BREAKS), min_size=2, max_size=8, unique_by=lambda b: b[0]))
def test_one_error_names_every_broken_field(breaks):
    """A config with several fields broken independently is refused with one error that names each of
    them, and no other."""
    raw = _bad(**{key: value for key, _, value in breaks})
    with pytest.raises(ConfigError) as caught:
        from_dict(raw, strict=True, name="broken")
    assert sorted(p.field for p in caught.value.problems) == sorted(label for _, label, _ in breaks)
    for _, label, _ in breaks:
        assert f"'{label}'" in str(caught.value)


def test_a_dependent_field_is_judged_only_when_what_it_reads_is_valid():
    """A bad num_experts is reported once, not again through the fields checked against it (the group
    count it must divide, the experts a token may pick), and a directly built config lists its bad fields
    too."""
    with pytest.raises(ConfigError) as caught:
        from_dict(_bad(num_experts=-8, eos_token_id=512, vocab_size=1), strict=True)
    assert [p.field for p in caught.value.problems] == ["vocab_size", "num_experts"]
    with pytest.raises(ConfigError, match="2 invalid fields") as caught:
        load_config("tiny").replace(hidden_size=0, topk_group=3)
    assert [p.field for p in caught.value.problems] == ["hidden_size", "topk_group"]
