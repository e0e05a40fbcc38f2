"""`serve` / `generate` keep the checkpoint's dtype unless `--dtype` says otherwise, except a bfloat16 one on
a CPU, served in float32 when that fits in half the memory (`--config` random weights: float32), and `info`
/ `memory` count the dtype `serve` would allocate and say which."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_weights import random_model

from jaxhybrid.config import load_config
from jaxhybrid.weights import load_pretrained, save_hf
from serve import models
from serve.cli import build_parser, main
from serve.cli.generate import engine_config
from serve.models import (
    DtypeChoice,
    ModelSettings,
    checkpoint_file_bytes,
    load_on_mesh,
    resolve_model,
    serving_dtype,
)

CFG = load_config("tiny").replace(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A checkpoint stored in bfloat16 (the model's fp32 parts, A_log, dt_bias and the router, stay fp32)."""
    out = tmp_path_factory.mktemp("bf16")
    fp32 = tmp_path_factory.mktemp("fp32")
    save_hf(random_model(CFG), fp32)
    save_hf(load_pretrained(fp32, dtype=jnp.bfloat16, progress=False), out)
    return out


def loaded(argv):
    """What `serve` / `generate` load for `argv`: (model, the engine's settings, the model's settings as
    resolved)."""
    args = build_parser().parse_args(argv)
    settings = resolve_model(ModelSettings.from_flags(vars(args)))
    model, _ = load_on_mesh(settings, multi=False)
    return model, engine_config(args, settings), settings


def param_bytes(model) -> int:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bf16_checkpoint_serves_in_float32_on_a_cpu_unless_dtype_says_otherwise(bf16_dir, command):
    assert jax.default_backend() == "cpu"
    model, engine, _ = loaded([command, "--model", str(bf16_dir)])
    want = load_pretrained(bf16_dir, progress=False)  # its own dtype
    assert want.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    got = model.model.layers[0].self_attn.q_proj.weight[...]
    assert model.model.embed_tokens.weight[...].dtype == got.dtype == jnp.float32
    np.testing.assert_array_equal(  # the stored values, widened exactly
        np.asarray(got), np.asarray(want.model.layers[0].self_attn.q_proj.weight[...], np.float32)
    )
    assert engine.kv_dtype == "float32"  # the KV cache follows the weights
    model, engine, _ = loaded([command, "--model", str(bf16_dir), "--dtype", "bfloat16"])
    assert model.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert engine.kv_dtype == "bfloat16"
    model, _, settings = loaded([command, "--config", "tiny"])  # random weights: the model's own default
    assert model.model.embed_tokens.weight[...].dtype == jnp.float32 and settings.dtype == "float32"


def test_a_bf16_checkpoint_keeps_its_dtype_off_the_cpu_or_when_float32_would_not_fit(bf16_dir, monkeypatch):
    assert serving_dtype(None, bf16_dir, backend="tpu") == DtypeChoice("bfloat16", "the checkpoint's dtype")
    assert serving_dtype(None, bf16_dir, backend="cpu").dtype == "float32"
    # info / memory guess the backend without starting it: JAX_PLATFORMS, else "cpu" without accelerator
    # plugins (none here)
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    assert serving_dtype(None, bf16_dir).dtype == "bfloat16"
    monkeypatch.delenv("JAX_PLATFORMS")
    assert serving_dtype(None, bf16_dir).dtype == "float32"
    widened = checkpoint_file_bytes(bf16_dir) * 2  # every stored byte, at twice the width
    monkeypatch.setattr(models, "physical_memory", lambda: 2 * widened)  # exactly half: still fits
    assert serving_dtype(None, bf16_dir, backend="cpu").dtype == "float32"
    monkeypatch.setattr(models, "physical_memory", lambda: 2 * widened - 1)
    kept = serving_dtype(None, bf16_dir, backend="cpu")
    assert kept.dtype == "bfloat16" and "over half of this machine's" in kept.reason
    assert serving_dtype("bfloat16", bf16_dir, backend="cpu") == DtypeChoice("bfloat16", "--dtype")


@pytest.mark.slow
def test_generate_runs_a_bf16_checkpoint_end_to_end(bf16_dir, capsys):
    argv = ["generate", "--model", str(bf16_dir), "--prompt-ids", "5,6,7", "--max-tokens", "3"]
    assert main([*argv, "--ignore-eos", "--json", "--max-model-len", "32", "--slots", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]) == 3


def test_info_and_memory_count_what_serve_allocates(bf16_dir, capsys):
    """`info --config DIR` counts the parameters at the dtype `serve --model DIR` holds them in (a bf16
    checkpoint on this CPU: float32), exactly its bytes; `memory` counts the KV in it too; a config alone
    counts float32, as `serve --config` does. Each says which dtype and why."""
    model, *_ = loaded(["serve", "--model", str(bf16_dir)])
    assert main(["info", "--config", str(bf16_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "float32" and info["dtype_reason"].startswith("a bfloat16 checkpoint on the CPU")
    assert info["param_bytes"] == param_bytes(model)
    assert main(["info", "--config", str(bf16_dir)]) == 0
    assert "counted in float32 (a bfloat16 checkpoint on the CPU" in capsys.readouterr().out
    argv = ["memory", "--config", str(bf16_dir), "--context", "64", "--json"]
    assert main(argv) == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["dtype"] == "float32" and mem["dtype_reason"] == info["dtype_reason"]
    assert main([*argv, "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] == mem["kv_bytes"]
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert 2 * json.loads(capsys.readouterr().out)["kv_bytes"] == mem["kv_bytes"]
    assert main(["memory", "--config", str(bf16_dir), "--context", "64"]) == 0
    assert "KV dtype float32 (a bfloat16 checkpoint on the CPU" in capsys.readouterr().out
    # a config alone: float32, as `serve --config tiny` allocates
    tiny, *_ = loaded(["serve", "--config", "tiny"])
    assert main(["info", "--config", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "float32" and info["param_bytes"] == param_bytes(tiny)
    assert main(["memory", "--config", "tiny", "--context", "64", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["dtype"] == "float32" and mem["dtype_reason"] == "random weights: the model's default"
    assert main(["info", "--config", "tiny", "--dtype", "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype_reason"] == "--dtype"


def test_info_of_a_model_directory_counts_what_serve_holds_and_allocates(bf16_dir, capsys):
    """`info --model DIR` loads the model as `serve --model DIR` does (a bf16 checkpoint on this CPU: in
    float32), so its one dtype is the one it counts and the one the model holds: the bytes it reports held are
    the bytes of the model `serve` loads (`model_bytes`, as /metrics reports them), and it counts one
    sequence's KV and KDA state at the model's own context (max_position_embeddings), as an engine of one
    slot at that length allocates them. It counted bf16 weights under a "float32" heading, and KV at 32,768
    tokens whatever the model's context."""
    from serve.engine.engine import Engine, EngineConfig

    model, *_ = loaded(["serve", "--model", str(bf16_dir)])
    assert main(["info", "--model", str(bf16_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    context = CFG.max_position_embeddings
    assert info["dtype"] == info["model"]["dtype"] == "float32" and info["context"] == context
    engine = Engine(model, EngineConfig(max_slots=1, max_model_len=context, prefix=None))
    try:
        memory = engine.memory()
        assert info["model"]["held_bytes"] == memory.model_bytes
        assert info["cache_per_sequence"]["kv_bytes"] == memory.kv_bytes_total
        assert info["cache_per_sequence"]["state_bytes"] == memory.state_bytes_per_slot
    finally:
        engine.close()
    assert main(["info", "--model", str(bf16_dir)]) == 0
    out = capsys.readouterr().out
    assert "parameter bytes (float32)" in out and f"MLA latent KV @ {context} tokens" in out


def test_float32_products_ask_for_float32_precision_and_bfloat16_ones_for_the_default():
    """JAX leaves a product's precision to the backend: a GPU runs float32 operands in TF32 and a TPU in one
    bfloat16 pass (TF32 on an H200 changed `small`'s greedy tokens against transformers'). Every product of
    a float32 model asks for HIGHEST (`jaxhybrid.ops.precision`); the projections of bfloat16 weights keep
    the default, the speed they are served for. The oracle is the lowered program of
    the forward pass: each product's precision and operand types, in both dtypes."""
    from jaxhybrid.model import HybridLM

    tokens = jnp.zeros((1, 8), jnp.int32)
    for dtype in (jnp.float32, jnp.bfloat16):
        model = HybridLM(CFG, rngs=nnx.Rngs(0), dtype=dtype)
        with jax.default_matmul_precision("default"):  # JAX's own default (conftest asks for "highest")
            text = jax.jit(lambda t, model=model: model(t)).lower(tokens).as_text()
        products = [line for line in text.splitlines() if "dot_general" in line]
        assert products, "the forward pass lowered without a matrix product"
        if dtype == jnp.float32:
            missing = [line for line in products if "HIGHEST" not in line]
            assert not missing, missing[0]
        else:  # the projections of bfloat16 weights keep the backend's default
            assert sum("HIGHEST" not in line for line in products) >= CFG.num_hidden_layers
