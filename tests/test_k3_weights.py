"""The released Kimi K3 checkpoint layout (shared/K3.md): tensors under `language_model.`, the vision tower
skipped and reported, MXFP4 routed experts dequantized exactly (`dequantize_experts=True`; kept packed they
are tested in test_packed_model.py), config.json with `text_config` and a
compressed-tensors `quantization_config`, fp32 tensors of a bf16 checkpoint kept fp32.

The checkpoints here are written by hand from K3.md's description (names, nibble order, E8M0 scales),
independently of jaxhybrid.weights; the expert weights are built from E2M1 codes and exponents, so MXFP4
holds them exactly and the loaded model's logits must equal the original's bit for bit.
"""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from oracles import assert_same_arrays
from safetensors.numpy import save_file
from test_mxfp4 import K3_E2M1, pack_row
from test_weights import published_tensors, random_model

from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.weights import CheckpointError, load_pretrained, save_hf
from jaxhybrid.weights.safetensors import scan_checkpoint
from serve.cli import main as cli_main

MXFP4_QUANT = {
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"format": "mxfp4-pack-quantized", "weights": {"group_size": 32}}},
}
VISION = {
    "vision_tower.encoder.blocks.0.attn.qkv.weight": np.ones((12, 4), np.float32),
    "vision_tower.encoder.blocks.0.attn.qkv.bias": np.ones((12,), np.float32),
    "vision_tower.patch_embed.proj.weight": np.ones((4, 3, 2, 2), np.float32),
    "mm_projector.proj.0.weight": np.ones((64, 16), np.float32),
    "mm_projector.proj.2.weight": np.ones((64, 64), np.float32),
}


def is_routed_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name


def with_mxfp4_experts(model, seed: int = 1):
    """`model` with every routed expert weight set to E2M1(code) * 2^(e - 127) (codes and exponents
    random, e in 119..123 so the values stay small), and {published name: (codes, exponents)}."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(model)
    codes_of = {}
    for path, var in nnx.to_flat_state(state):
        name = ".".join(str(p) for p in path)
        if not name.split(".")[-2:-1] == ["experts"]:
            continue
        n_exp, out, cols = var.get_value().shape
        codes = rng.integers(0, 16, size=(n_exp, out, cols))
        exps = rng.integers(119, 124, size=(n_exp, out, cols // 32))
        value = np.array(K3_E2M1)[codes] * np.exp2(np.repeat(exps, 32, axis=-1) - 127.0)
        var.set_value(jnp.asarray(value, var.get_value().dtype))
        head, _, proj = name.rpartition(".")
        for e in range(n_exp):
            codes_of[f"{head}.{e}.{proj}"] = (codes[e], exps[e])
    return nnx.merge(graphdef, state), codes_of


def released_tensors(model, codes_of, dtype=None, fp32_names=()) -> dict[str, np.ndarray]:
    """The released layout, by hand: `language_model.` + the published names, routed experts as
    weight_packed (K3.md's nibble order) + weight_scale, plus the vision tower. With `dtype`, every tensor
    is cast to it except those whose name ends with one of `fp32_names` (kept fp32, as K3 stores them)."""
    out = {}
    for name, arr in published_tensors(model).items():
        if is_routed_expert(name):
            base = name.removesuffix(".weight")
            codes, exps = codes_of[base]
            out[f"language_model.{base}.weight_packed"] = np.array(
                [pack_row(list(r)) for r in codes], np.uint8
            )
            out[f"language_model.{base}.weight_scale"] = exps.astype(np.uint8)
            continue
        if dtype is not None and not name.endswith(tuple(fp32_names)):
            arr = arr.astype(dtype)
        out[f"language_model.{name}"] = arr
    return {**out, **VISION}


def write_released(directory, tensors, cfg, quant_in_text_config: bool = True) -> None:
    """config.json as a multimodal wrapper (text model under text_config) + two safetensors shards."""
    directory.mkdir(parents=True, exist_ok=True)
    text = {"model_type": "kimi_linear", **cfg.to_hf_dict()}
    text.pop("expert_quant", None)
    # K3's config.json does not give A_log's padded size: the loader must read it off the checkpoint.
    text.pop("kda_a_log_size", None)
    text.get("linear_attn_config", {}).pop("kda_a_log_size", None)
    config = {"model_type": "some_vlm_wrapper", "text_config": text, "vision_config": {"depth": 1}}
    (text if quant_in_text_config else config)["quantization_config"] = MXFP4_QUANT
    (directory / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for k, part in enumerate((names[::2], names[1::2])):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.fixture(scope="module")
def tiny_mx():
    return with_mxfp4_experts(random_model(load_config("tiny")))


@pytest.fixture(scope="module")
def logits_of():
    fwd = nnx.jit(lambda m, tokens: m(tokens))
    return lambda m, tokens: np.asarray(fwd(m, tokens))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(5), (2, 13), 0, 512, jnp.int32)


@pytest.fixture(scope="module")
def released_dir(tiny_mx, tmp_path_factory):
    model, codes_of = tiny_mx
    d = tmp_path_factory.mktemp("k3") / "released"
    write_released(d, released_tensors(model, codes_of), model.config)
    return d


def test_released_layout_loads_to_identical_logits(tiny_mx, released_dir, tokens, logits_of):
    model, _ = tiny_mx
    report = {}
    loaded = load_pretrained(released_dir, progress=False, dequantize_experts=True, report=report)
    assert loaded.config.expert_quant == "mxfp4"
    got = loaded.model.layers[2].block_sparse_moe.experts.w2[...]
    assert got.shape == (8, 64, 32) and got.dtype == jnp.float32
    np.testing.assert_array_equal(got, model.model.layers[2].block_sparse_moe.experts.w2[...])
    np.testing.assert_array_equal(logits_of(loaded, tokens), logits_of(model, tokens))
    assert report["layout"] == "k3-released" and report["expert_quant"] == "mxfp4"
    assert report["skipped"] == len(VISION)
    assert report["skipped_summary"] == {"mm_projector": 2, "vision_tower": 3}
    assert set(report["skipped_names"]) == set(VISION)


def test_quantization_config_at_the_top_level(tiny_mx, tmp_path, tokens, logits_of):
    model, codes_of = tiny_mx
    write_released(
        tmp_path / "top", released_tensors(model, codes_of), model.config, quant_in_text_config=False
    )
    loaded = load_pretrained(tmp_path / "top", progress=False, dequantize_experts=True)
    np.testing.assert_array_equal(logits_of(loaded, tokens), logits_of(model, tokens))


def test_save_hf_released_layout_writes_the_same_tensors(tiny_mx, released_dir, tmp_path, tokens, logits_of):
    model, codes_of = tiny_mx
    out = tmp_path / "saved"
    save_hf(
        model, out, layout="k3-released", expert_quant="mxfp4", extra_tensors=VISION, max_shard_bytes=1 << 16
    )
    ours, theirs = scan_checkpoint(out), scan_checkpoint(released_dir)
    assert {n: (t.shape, t.dtype) for n, t in ours.items()} == {
        n: (t.shape, t.dtype) for n, t in theirs.items()
    }
    from safetensors import safe_open

    name = "language_model.model.layers.3.block_sparse_moe.experts.5.w1"
    with safe_open(str(ours[name + ".weight_packed"].file), "np") as f:
        packed = f.get_tensor(name + ".weight_packed")
    with safe_open(str(ours[name + ".weight_scale"].file), "np") as f:
        scale = f.get_tensor(name + ".weight_scale")
    codes, exps = codes_of[name.removeprefix("language_model.")]
    np.testing.assert_array_equal(packed, [pack_row(list(r)) for r in codes])
    np.testing.assert_array_equal(scale, exps)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["text_config"]["hidden_size"] == 64
    loaded = load_pretrained(out, progress=False, dequantize_experts=True)
    np.testing.assert_array_equal(logits_of(loaded, tokens), logits_of(model, tokens))


def test_bf16_checkpoint_keeps_its_fp32_tensors(tiny_mx, tmp_path):
    """K3 stores conv weights, A_log, dt_bias and o_norm in fp32 beside bf16: they stay fp32 (same values),
    the rest is bf16; a checkpoint stored entirely in fp32 still loads entirely as the dtype asked for."""
    model, codes_of = tiny_mx
    fp32 = ("_conv1d.weight", "A_log", "dt_bias", "o_norm.weight")
    tensors = released_tensors(model, codes_of, dtype=ml_dtypes.bfloat16, fp32_names=fp32)
    write_released(tmp_path / "bf16", tensors, model.config)
    report = {}
    loaded = load_pretrained(tmp_path / "bf16", progress=False, dequantize_experts=True, report=report)
    attn, want = loaded.model.layers[1].self_attn, model.model.layers[1].self_attn
    for part in ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm"):
        w = getattr(attn, part).weight[...]
        assert w.dtype == jnp.float32, part
        np.testing.assert_array_equal(w, getattr(want, part).weight[...])
    assert attn.A_log[...].dtype == jnp.float32 and attn.dt_bias[...].dtype == jnp.float32
    assert attn.q_proj.weight[...].dtype == jnp.bfloat16
    assert loaded.model.layers[1].block_sparse_moe.experts.w1[...].dtype == jnp.bfloat16
    assert "model.layers.0.self_attn.q_conv1d.weight" in report["kept_fp32"]
    assert not any("q_proj" in n for n in report["kept_fp32"])
    logits = nnx.jit(lambda m, t: m(t))(loaded, jnp.zeros((1, 5), jnp.int32))
    assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits.astype(jnp.float32)).all())


def test_convert_reports_skipped_tensors(released_dir, tmp_path, tiny_mx, tokens, logits_of, capsys):
    out = tmp_path / "orbax"
    assert (
        cli_main(["convert", str(released_dir), str(out), "--json", "--no-progress", "--dequantize-experts"])
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["skipped"] == len(VISION) and summary["expert_quant"] == "mxfp4"
    np.testing.assert_array_equal(
        logits_of(load_pretrained(out, progress=False, dequantize_experts=True), tokens),
        logits_of(tiny_mx[0], tokens),
    )


def rewrite_tensors(directory, change) -> None:
    from safetensors import safe_open

    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        change(tensors)
        save_file(tensors, str(path))


def copy_of(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_nan_scale_is_refused(released_dir, tmp_path):
    d = copy_of(released_dir, tmp_path / "nan")
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"

    def poison(t):
        if name in t:
            t[name] = t[name].copy()
            t[name][0, 0] = 255

    rewrite_tensors(d, poison)
    with pytest.raises(CheckpointError, match=r"experts.2.w3.weight_scale' holds the E8M0 NaN scale 255"):
        load_pretrained(d, progress=False)


def test_wrong_scale_shape_and_dtype(released_dir, tmp_path):
    d = copy_of(released_dir, tmp_path / "shape")
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"
    rewrite_tensors(d, lambda t: t.update({name: np.zeros((64, 2), np.uint8)}) if name in t else None)
    with pytest.raises(
        CheckpointError, match=r"experts.0.w2.weight_scale' has shape \[64, 2\].*needs \[64, 1\]"
    ):
        load_pretrained(d, progress=False)
    d = copy_of(released_dir, tmp_path / "dtype")
    name = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    rewrite_tensors(d, lambda t: t.update({name: t[name].astype(np.int8)}) if name in t else None)
    with pytest.raises(CheckpointError, match=r"experts.0.w1.weight_packed' has dtype I8, expected U8"):
        load_pretrained(d, progress=False)


def test_packed_experts_need_the_quantization_config(released_dir, tmp_path):
    d = copy_of(released_dir, tmp_path / "noquant")
    config = json.loads((d / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="weight_packed.*mxfp4-pack-quantized"):
        load_pretrained(d, progress=False)
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="nvfp4-pack-quantized"):
        load_pretrained(d, progress=False)


def test_a_wrapper_without_a_kimi_text_model_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava", "text_config": {"hidden_size": 8}})
    )
    with pytest.raises(ConfigError, match="Kimi Linear family text_config"):
        load_pretrained(tmp_path, progress=False)


def test_info_counts_mxfp4_checkpoint_bytes(tmp_path, capsys):
    """tiny with MXFP4 experts, counted by hand: 3 MoE layers x 8 experts x (w1, w2, w3) of 32 x 64 =
    147456 routed weights -> 147456 / 2 + 147456 / 32 = 78336 bytes. The other 303350 - 147456 = 155894
    parameters are bf16 except the fp32 ones: A_log (2) and dt_bias (32) in 3 KDA layers, the router
    (8 x 64) in 3 MoE layers = 1638; buffers: the router bias, 3 x 8 fp32."""
    import yaml

    from jaxhybrid.config import configs_dir

    raw = yaml.safe_load((configs_dir() / "tiny.yaml").read_text())
    (tmp_path / "tiny-mx.yaml").write_text(yaml.safe_dump({**raw, "expert_quant": "mxfp4"}))
    mx = str(tmp_path / "tiny-mx.yaml")
    assert cli_main(["info", "--config", mx, "--dtype", "bfloat16", "--json"]) == 0
    ckpt = json.loads(capsys.readouterr().out)["checkpoint"]
    other = (155894 - 1638) * 2 + 1638 * 4
    assert ckpt == {
        "expert_quant": "mxfp4",
        "routed_expert_bytes": 78336,
        "other_param_bytes": other,
        "buffer_bytes": 3 * 8 * 4,
        "total_bytes": 78336 + other + 96,
    }
    assert cli_main(["info", "--config", str(tmp_path / "tiny-mx.yaml"), "--dtype", "bfloat16"]) == 0
    table = capsys.readouterr().out
    assert "routed experts, MXFP4 (4.25 bit)" in table and f"{78336 + other + 96:,}" in table
    # without quantization the experts count at bf16
    assert cli_main(["info", "--config", "tiny", "--dtype", "bfloat16", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["checkpoint"]
    assert plain["expert_quant"] is None and plain["routed_expert_bytes"] == 147456 * 2


K3_FP32 = ("_conv1d.weight", "A_log", "dt_bias", "o_norm.weight")  # K3.md: stored fp32 beside bf16


@pytest.fixture(scope="module")
def tiny_k3_mx():
    return with_mxfp4_experts(random_model(load_config("tiny-k3")), seed=2)


def test_tiny_k3_released_layout_round_trip(tiny_k3_mx, tmp_path):
    """tiny-k3 (every K3 addition on: latent MoE, attention residuals, gates, padded A_log) in the released
    layout with MXFP4 experts and a vision tower, written by hand and by save_hf: the model's own arrays and
    config back (so its logits), bit for bit."""
    model, codes_of = tiny_k3_mx
    names = published_tensors(model)
    assert "model.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in names
    assert names["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (64, 32)
    write_released(tmp_path / "hand", released_tensors(model, codes_of), model.config)
    report = {}
    hand = load_pretrained(tmp_path / "hand", progress=False, dequantize_experts=True, report=report)
    assert report["skipped"] == len(VISION)
    # one config (expert_quant says only how the experts were stored) and the same arrays: the same logits
    assert hand.config == model.config.replace(expert_quant="mxfp4")
    assert_same_arrays(hand, model)
    save_hf(model, tmp_path / "saved", layout="k3-released", expert_quant="mxfp4", extra_tensors=VISION)
    ours, theirs = scan_checkpoint(tmp_path / "saved"), scan_checkpoint(tmp_path / "hand")
    assert {n: t.shape for n, t in ours.items()} == {n: t.shape for n, t in theirs.items()}
    reloaded = load_pretrained(tmp_path / "saved", progress=False, dequantize_experts=True)
    assert reloaded.config == hand.config
    assert_same_arrays(reloaded, hand)  # the hand-written checkpoint's arrays: the same logits


@pytest.mark.slow  # tiny-k3's form of test_bf16_checkpoint_keeps_its_fp32_tensors (compiles tiny-k3 in bf16)
def test_tiny_k3_bf16_checkpoint_with_fp32_parts(tiny_k3_mx, tmp_path):
    model, codes_of = tiny_k3_mx
    tensors = released_tensors(model, codes_of, dtype=ml_dtypes.bfloat16, fp32_names=K3_FP32)
    write_released(tmp_path / "bf16", tensors, model.config)
    report = {}
    loaded = load_pretrained(tmp_path / "bf16", progress=False, dequantize_experts=True, report=report)
    attn = loaded.model.layers[0].self_attn
    assert attn.A_log[...].shape == (1, 1, 8, 1)
    for part in (attn.q_conv1d.weight, attn.o_norm.weight, attn.A_log, attn.dt_bias):
        assert part[...].dtype == jnp.float32
    assert attn.g_proj.weight[...].dtype == jnp.bfloat16
    assert {n.rsplit(".", 2)[-2] for n in report["kept_fp32"] if "conv1d" in n} == {
        "q_conv1d",
        "k_conv1d",
        "v_conv1d",
    }
    logits = nnx.jit(lambda m, t: m(t))(loaded, jnp.zeros((1, 6), jnp.int32))
    assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits.astype(jnp.float32)).all())
