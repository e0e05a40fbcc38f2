"""Checkpoint loading: the HF layout written here from our own params in the published names and shapes
loads back with identical logits; so does our Orbax directory from `convert`; broken checkpoints fail
with errors that name the problem."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err
from flax import nnx
from safetensors.numpy import save_file

import jaxhybrid
from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.layers.basic import Buffer
from jaxhybrid.model import HybridLM
from jaxhybrid.weights import CheckpointError, load_pretrained, save_hf
from jaxhybrid.weights.hf import named_arrays
from jaxhybrid.weights.safetensors import scan_checkpoint
from serve.cli import main as cli_main

# tiny: hidden 64, vocab 512, KDA H=2 d=16 conv 4, MLA 2 heads (16 nope + 8 rope, v 16, rank 32),
# layer 0 dense (128), layers 1-3 MoE (8 experts of 32, one shared), layer 3 is MLA.
PUBLISHED = {
    "model.embed_tokens.weight": (512, 64),
    "lm_head.weight": (512, 64),
    "model.norm.weight": (64,),
    "model.layers.0.input_layernorm.weight": (64,),
    "model.layers.0.post_attention_layernorm.weight": (64,),
    "model.layers.0.self_attn.q_proj.weight": (32, 64),
    "model.layers.0.self_attn.k_proj.weight": (32, 64),
    "model.layers.0.self_attn.v_proj.weight": (32, 64),
    "model.layers.0.self_attn.q_conv1d.weight": (32, 1, 4),
    "model.layers.0.self_attn.k_conv1d.weight": (32, 1, 4),
    "model.layers.0.self_attn.v_conv1d.weight": (32, 1, 4),
    "model.layers.0.self_attn.f_a_proj.weight": (16, 64),
    "model.layers.0.self_attn.f_b_proj.weight": (32, 16),
    "model.layers.0.self_attn.dt_bias": (32,),
    "model.layers.0.self_attn.A_log": (1, 1, 2, 1),
    "model.layers.0.self_attn.b_proj.weight": (2, 64),
    "model.layers.0.self_attn.g_a_proj.weight": (16, 64),
    "model.layers.0.self_attn.g_b_proj.weight": (32, 16),
    "model.layers.0.self_attn.o_norm.weight": (16,),
    "model.layers.0.self_attn.o_proj.weight": (64, 32),
    "model.layers.0.mlp.gate_proj.weight": (128, 64),
    "model.layers.0.mlp.up_proj.weight": (128, 64),
    "model.layers.0.mlp.down_proj.weight": (64, 128),
    "model.layers.3.self_attn.q_proj.weight": (48, 64),
    "model.layers.3.self_attn.kv_a_proj_with_mqa.weight": (40, 64),
    "model.layers.3.self_attn.kv_a_layernorm.weight": (32,),
    "model.layers.3.self_attn.kv_b_proj.weight": (64, 32),
    "model.layers.3.self_attn.o_proj.weight": (64, 32),
    "model.layers.1.block_sparse_moe.gate.weight": (8, 64),
    "model.layers.1.block_sparse_moe.gate.e_score_correction_bias": (8,),
    "model.layers.1.block_sparse_moe.experts.0.w1.weight": (32, 64),
    "model.layers.1.block_sparse_moe.experts.7.w1.weight": (32, 64),
    "model.layers.1.block_sparse_moe.experts.7.w2.weight": (64, 32),
    "model.layers.1.block_sparse_moe.experts.7.w3.weight": (32, 64),
    "model.layers.3.block_sparse_moe.shared_experts.gate_proj.weight": (32, 64),
    "model.layers.3.block_sparse_moe.shared_experts.up_proj.weight": (32, 64),
    "model.layers.3.block_sparse_moe.shared_experts.down_proj.weight": (64, 32),
}


def published_tensors(model) -> dict[str, np.ndarray]:
    """Our params under the published checkpoint names (written independently of jaxhybrid.weights)."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Any(nnx.Param, Buffer))):
        name = ".".join(str(p) for p in path)
        arr = np.asarray(var.get_value())
        head, _, proj = name.rpartition(".")
        if head.endswith("block_sparse_moe.experts"):
            for e in range(arr.shape[0]):
                out[f"{head}.{e}.{proj}.weight"] = arr[e]
        else:
            out[name] = arr
    return out


def write_checkpoint(directory, tensors: dict[str, np.ndarray], cfg, shards: int = 3) -> None:
    """config.json + `shards` safetensors files + model.safetensors.index.json, as HF exports them."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], **cfg.to_hf_dict()}
    (directory / "config.json").write_text(json.dumps(config))
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def random_model(cfg, seed: int = 0) -> HybridLM:
    """A model with random values in every parameter and buffer (norms, biases and A_log included), made
    in numpy and filled into the abstract model: no per-op compiles, so it is quick on a busy CPU."""
    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)))
    for path, var in nnx.to_flat_state(state):
        sds, name = var.get_value(), str(path[-1])
        if name == "A_log":
            value = np.log(rng.uniform(1.0, 16.0, sds.shape))
        elif len(sds.shape) >= 2:
            value = rng.normal(size=sds.shape) / np.sqrt(sds.shape[-1])
        elif name == "weight":  # norms
            value = 1.0 + 0.1 * rng.normal(size=sds.shape)
        else:  # dt_bias, the router's score correction bias
            value = 0.1 * rng.normal(size=sds.shape)
        var.set_value(jax.device_put(np.asarray(value, sds.dtype), jax.devices()[0]))
    return nnx.merge(graphdef, state)


@pytest.fixture(scope="module")
def model():
    return random_model(load_config("tiny"))


@pytest.fixture(scope="module")
def logits_of():
    """model(tokens) for any model of tiny's structure, compiled once for all of them (by graph)."""
    fwd = nnx.jit(lambda m, tokens: m(tokens))
    return lambda m, tokens: np.asarray(fwd(m, tokens))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(3), (2, 21), 0, 512, jnp.int32)


@pytest.fixture(scope="module")
def reference(model, tokens, logits_of):
    return logits_of(model, tokens)


@pytest.fixture(scope="module")
def hf_dir(model, tmp_path_factory):
    d = tmp_path_factory.mktemp("hf") / "tiny-hf"
    write_checkpoint(d, published_tensors(model), model.config)
    return d


@pytest.fixture
def broken(hf_dir, tmp_path):
    """A fresh copy of the checkpoint to damage."""
    d = tmp_path / "copy"
    shutil.copytree(hf_dir, d)
    return d


def rewrite(directory, change) -> None:
    """Apply change(tensors dict) to every shard of a copied checkpoint (and keep the index in step)."""
    from safetensors import safe_open

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "np") as f:
            tensors = {n: f.get_tensor(n) for n in f.keys()}
        change(tensors)
        save_file(tensors, str(path))
        for n in list(index["weight_map"]):
            if index["weight_map"][n] == path.name and n not in tensors:
                del index["weight_map"][n]
        index["weight_map"].update(dict.fromkeys(tensors, path.name))
    index_path.write_text(json.dumps(index))


def test_published_names_and_shapes(model, hf_dir):
    tensors = scan_checkpoint(hf_dir)
    for name, shape in PUBLISHED.items():
        assert tensors[name].shape == shape, name
    # save_hf writes exactly the names and shapes the test wrote independently
    ours = {n: t.shape for n, t in published_tensors(model).items()}
    assert {n: t.shape for n, t in tensors.items()} == ours
    assert sum(".experts." in n and ".shared_experts." not in n for n in ours) == 3 * 3 * 8


def test_hf_round_trip_identical_logits(hf_dir, tokens, reference, logits_of):
    loaded = jaxhybrid.load_pretrained(hf_dir, progress=False)
    leaf = loaded.model.layers[1].block_sparse_moe.experts.w2[...]
    assert leaf.shape == (8, 64, 32) and leaf.dtype == jnp.float32
    assert loaded.model.layers[1].block_sparse_moe.gate.e_score_correction_bias[...].dtype == jnp.float32
    np.testing.assert_array_equal(logits_of(loaded, tokens), reference)


def test_save_hf_single_file_round_trip(model, tmp_path, tokens, reference, logits_of):
    paths = save_hf(model, tmp_path / "one")
    assert [p.name for p in paths] == ["model.safetensors"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    np.testing.assert_array_equal(
        logits_of(load_pretrained(tmp_path / "one", progress=False), tokens), reference
    )


def test_load_as_bfloat16_keeps_fp32_parts(hf_dir, model):
    loaded = load_pretrained(hf_dir, dtype=jnp.bfloat16, progress=False)
    w = loaded.model.layers[2].block_sparse_moe.experts.w1[...]
    assert w.dtype == jnp.bfloat16
    want = model.model.layers[2].block_sparse_moe.experts.w1[...].astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(w), np.asarray(want))
    attn = loaded.model.layers[0].self_attn
    assert attn.A_log[...].dtype == jnp.float32 and attn.dt_bias[...].dtype == jnp.float32


def test_convert_to_orbax_round_trip(hf_dir, tmp_path, tokens, reference, logits_of, capsys):
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "[BOS]"}))
    out = tmp_path / "orbax"
    assert cli_main(["convert", str(hf_dir), str(out), "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["dtype"] == "float32" and summary["arrays"] > 0
    assert (out / "config.json").exists() and (out / "tokenizer_config.json").exists()
    assert load_config(out) == load_config(hf_dir)
    loaded = load_pretrained(out, progress=False)
    np.testing.assert_array_equal(logits_of(loaded, tokens), reference)
    # a second convert into the same directory needs --overwrite
    assert cli_main(["convert", str(hf_dir), str(out), "--no-progress"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_an_orbax_directory_loads_by_a_relative_path(
    hf_dir, tmp_path, tokens, reference, logits_of, monkeypatch
):
    """`--model runs/x/model` from the working directory (Orbax's metadata read wants an absolute path)."""
    out = tmp_path / "rel" / "orbax"
    assert cli_main(["convert", str(hf_dir), str(out), "--no-progress"]) == 0
    monkeypatch.chdir(tmp_path)
    loaded = load_pretrained("rel/orbax", progress=False)
    np.testing.assert_array_equal(logits_of(loaded, tokens), reference)


def test_convert_bfloat16(hf_dir, tmp_path, model):
    out = tmp_path / "bf16"
    assert cli_main(["convert", str(hf_dir), str(out), "--dtype", "bfloat16", "--no-progress"]) == 0
    loaded = load_pretrained(out, progress=False)
    w = loaded.model.embed_tokens.weight[...]
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(w), np.asarray(model.model.embed_tokens.weight[...].astype(w.dtype))
    )
    assert loaded.model.layers[3].block_sparse_moe.gate.weight[...].dtype == jnp.float32
    # loading a bf16 Orbax checkpoint as fp32 casts on restore
    assert load_pretrained(out, dtype="float32", progress=False).model.norm.weight[...].dtype == jnp.float32


def test_missing_tensor(broken):
    name = "model.layers.2.block_sparse_moe.experts.5.w3.weight"
    rewrite(broken, lambda t: t.pop(name, None))
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' is missing"):
        load_pretrained(broken, progress=False)


def test_wrong_shape(broken):
    name = "model.layers.0.self_attn.A_log"
    rewrite(broken, lambda t: t.update({name: np.zeros((2, 1), np.float32)}) if name in t else None)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[2, 1\].*needs \[1, 1, 2, 1\]"):
        load_pretrained(broken, progress=False)


def test_transformers_5_spellings_load_to_identical_logits(broken, tokens, reference, logits_of):
    """transformers 5.x names a dense layer's MLP `block_sparse_moe.*_proj`, and K3's A_log may be stored
    flat [N]: both load to the published checkpoint's logits; both MLP spellings at once are refused."""

    def respell(tensors):
        for name in list(tensors):
            if ".mlp." in name:
                tensors[name.replace(".mlp.", ".block_sparse_moe.")] = tensors.pop(name)
            elif name.endswith(".self_attn.A_log"):
                tensors[name] = tensors[name].reshape(-1)

    rewrite(broken, respell)
    names = scan_checkpoint(broken)
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names
    assert not any(".mlp." in n for n in names)
    assert names["model.layers.0.self_attn.A_log"].shape == (2,)
    np.testing.assert_array_equal(logits_of(load_pretrained(broken, progress=False), tokens), reference)

    def both(tensors):
        alt = "model.layers.0.block_sparse_moe.up_proj.weight"
        if alt in tensors:
            tensors["model.layers.0.mlp.up_proj.weight"] = tensors[alt]

    rewrite(broken, both)
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.up_proj.weight' is stored twice"):
        load_pretrained(broken, progress=False)


def test_unexpected_and_known_unused_tensors(broken, tokens, reference, logits_of):
    def add(tensors, name):
        if "model.embed_tokens.weight" in tensors:
            tensors[name] = np.zeros((4,), np.float32)

    rewrite(broken, lambda t: add(t, "model.layers.0.self_attn.rotary_emb.inv_freq"))
    np.testing.assert_array_equal(logits_of(load_pretrained(broken, progress=False), tokens), reference)
    rewrite(broken, lambda t: add(t, "model.layers.0.self_attn.extra.weight"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model.layers.0.self_attn.extra.weight'"):
        load_pretrained(broken, progress=False)


def test_truncated_file(broken):
    path = sorted(broken.glob("*.safetensors"))[1]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=rf"{path.name}: truncated safetensors file"):
        load_pretrained(broken, progress=False)
    path.write_bytes(data[:4])
    with pytest.raises(CheckpointError, match="truncated"):
        load_pretrained(broken, progress=False)


def test_missing_shard_file(broken):
    path = sorted(broken.glob("*.safetensors"))[0]
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"missing: \['{path.name}'\]"):
        load_pretrained(broken, progress=False)


def edit_config(directory, change) -> None:
    config = json.loads((directory / "config.json").read_text())
    change(config)
    (directory / "config.json").write_text(json.dumps(config))


def test_layer_lists_must_cover_every_layer(broken):
    edit_config(broken, lambda c: c["linear_attn_config"].update(kda_layers=[1, 2]))
    with pytest.raises(ConfigError, match=r"layers \[3\] are in neither kda_layers nor full_attn_layers"):
        load_pretrained(broken, progress=False)


@pytest.mark.parametrize("model_type", ["llama", None])
def test_unsupported_model_type(broken, model_type):
    edit_config(broken, lambda c: c.update(model_type=model_type) if model_type else c.pop("model_type"))
    with pytest.raises(ConfigError, match="only 'kimi_linear'"):
        load_pretrained(broken, progress=False)


def test_config_that_does_not_match_the_tensors(broken):
    edit_config(broken, lambda c: c.update(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.down_proj.weight' has shape \[64, 128\]"):
        load_pretrained(broken, progress=False)


def test_orbax_shape_mismatch_is_named(hf_dir, tmp_path):
    out = tmp_path / "orbax"
    assert cli_main(["convert", str(hf_dir), str(out), "--no-progress"]) == 0
    edit_config(out, lambda c: c.update(intermediate_size=96))
    with pytest.raises(CheckpointError, match=r"array 'model.layers.0.mlp.down_proj.weight' has shape"):
        load_pretrained(out, progress=False)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path, progress=False)
    write_checkpoint(tmp_path / "empty", {}, load_config("tiny"), shards=0)
    (tmp_path / "empty" / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointError, match="neither safetensors files nor an Orbax"):
        load_pretrained(tmp_path / "empty", progress=False)


def test_generate_with_model_dir_uses_its_tokenizer(hf_dir, tmp_path, capsys):
    from test_tokenizer import write_tiktoken_dir

    d = tmp_path / "with-tok"
    shutil.copytree(hf_dir, d)
    write_tiktoken_dir(d)
    argv = ["generate", "--model", str(d), "--prompt", "Hello world 你好", "--max-tokens", "3"]
    assert cli_main([*argv, "--ignore-eos", "--json", "--max-model-len", "64", "--slots", "1"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) == 3 and isinstance(out["text"], str)


def test_peak_rss_while_loading_stays_near_one_copy(tmp_path):
    """A 368 MiB fp32 checkpoint (`small` cut to 2 layers and 8 experts) in 32 MiB shards, loaded in a fresh
    process: peak RSS < 1.25 x N + 300 MiB (a second full copy would exceed it)."""
    from benchmarks.load import measure

    cfg = load_config("small").replace(
        name="small-2l", num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,), num_experts=8
    )
    files = save_hf(random_model(cfg), tmp_path / "ckpt", max_shard_bytes=32 << 20)
    assert len(files) >= 5
    result = measure(tmp_path / "ckpt", "auto", repeats=1)
    n = result["checkpoint_bytes"]
    assert n > 360 << 20
    assert result["model_bytes"] >= n - (1 << 20)
    assert result["within_limit"], result
    # beyond the one copy of the weights it returns, the loader holds only one parameter's read buffer (reads
    # go through pread into the destination, no mapped file pages)
    assert result["peak_over_baseline_bytes"] < n + (128 << 20), result


@pytest.mark.parametrize("fmt", ["hf", "orbax"])
def test_load_onto_a_mesh(model, hf_dir, tmp_path, tokens, reference, logits_of, fmt):
    from jax.sharding import NamedSharding

    from sharding.mesh import make_mesh
    from sharding.placement import load_pretrained_on_mesh

    source = hf_dir
    if fmt == "orbax":
        source = tmp_path / "orbax"
        assert cli_main(["convert", str(hf_dir), str(source), "--no-progress"]) == 0
    mesh = make_mesh("tensor=2", devices=jax.devices()[:2])
    loaded = load_pretrained_on_mesh(source, mesh, progress=False)
    w = loaded.model.layers[0].self_attn.q_proj.weight[...]
    assert isinstance(w.sharding, NamedSharding) and w.sharding.mesh.shape == mesh.shape
    assert len(w.sharding.device_set) == 2
    assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(nnx.state(loaded)))
    # every parameter arrives exactly; logits differ only by the sharded computation's summation order
    want = named_arrays(model)
    for name, arr in named_arrays(loaded).items():
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[name]), err_msg=name)
    bound = float32_network_bound(loaded.config, tokens.shape[1])  # two evaluations of one model
    assert rel_err(logits_of(loaded, tokens), reference) < bound


def test_a_load_reads_the_orbax_metadata_once_and_again_after_it_changes(hf_dir, tmp_path, monkeypatch):
    """The serving dtype and the arrays to restore both come from the stored metadata: one read per load
    (each Orbax metadata read costs about 0.4 s), and a checkpoint rewritten in place is read anew."""
    from jaxhybrid.weights import orbax_io

    out = tmp_path / "orbax"
    assert cli_main(["convert", str(hf_dir), str(out), "--no-progress"]) == 0
    reads, checkpointer = [], orbax_io.checkpointer

    def counting(*args, **kw):
        ck = checkpointer(*args, **kw)
        metadata = ck.metadata
        ck.metadata = lambda *a, **k: reads.append(1) or metadata(*a, **k)
        return ck

    monkeypatch.setattr(orbax_io, "checkpointer", counting)
    assert load_pretrained(out, progress=False).model.norm.weight[...].dtype == jnp.float32
    assert len(reads) == 1
    args = ["convert", str(hf_dir), str(out), "--dtype", "bfloat16", "--overwrite", "--no-progress"]
    assert cli_main(args) == 0
    assert load_pretrained(out, progress=False).model.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert len(reads) == 2
