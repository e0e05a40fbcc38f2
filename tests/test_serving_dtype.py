"""`serve` / `generate` keep the checkpoint's dtype unless `--dtype` says otherwise (`--config` random
weights: float32), and `info` / `memory` count the dtype `serve` would allocate and say which."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_weights import random_model

from jaxhybrid.config import load_config
from jaxhybrid.weights import load_pretrained, save_hf
from serve.cli import build_parser, main
from serve.cli.generate import engine_config
from serve.models import load_on_mesh

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
    """What `serve` / `generate` load for `argv`: (model, parsed args after loading)."""
    args = build_parser().parse_args(argv)
    model, _ = load_on_mesh(args, multi=False)
    return model, args


def param_bytes(model) -> int:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in leaves)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_a_bf16_checkpoint_serves_in_bf16_unless_dtype_says_otherwise(bf16_dir, command):
    model, args = loaded([command, "--model", str(bf16_dir)])
    assert model.model.embed_tokens.weight[...].dtype == jnp.bfloat16
    assert model.model.layers[0].self_attn.q_proj.weight[...].dtype == jnp.bfloat16
    assert engine_config(args).kv_dtype == "bfloat16"  # the KV cache follows the weights
    model, args = loaded([command, "--model", str(bf16_dir), "--dtype", "float32"])
    assert model.model.embed_tokens.weight[...].dtype == jnp.float32
    assert engine_config(args).kv_dtype == "float32"
    model, args = loaded([command, "--config", "tiny"])  # random weights: the model's own default
    assert model.model.embed_tokens.weight[...].dtype == jnp.float32 and args.dtype == "float32"


@pytest.mark.slow
def test_generate_runs_a_bf16_checkpoint_end_to_end(bf16_dir, capsys):
    argv = ["generate", "--model", str(bf16_dir), "--prompt-ids", "5,6,7", "--max-tokens", "3"]
    assert main([*argv, "--ignore-eos", "--json", "--max-model-len", "32", "--slots", "1"]) == 0
    assert len(json.loads(capsys.readouterr().out.splitlines()[-1])["token_ids"]) == 3


def test_info_and_memory_count_what_serve_allocates(bf16_dir, capsys):
    """`info --config DIR` counts the parameters at the checkpoint's dtype: exactly the bytes `serve --model
    DIR` holds; `memory` counts the KV in it too; a config alone counts float32, as `serve --config` does.
    Each says which dtype and why."""
    model, _ = loaded(["serve", "--model", str(bf16_dir)])
    assert main(["info", "--config", str(bf16_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "bfloat16" and info["dtype_reason"] == "the checkpoint's dtype"
    assert info["param_bytes"] == param_bytes(model)
    assert main(["info", "--config", str(bf16_dir)]) == 0
    assert "counted in bfloat16 (the checkpoint's dtype)" in capsys.readouterr().out
    argv = ["memory", "--config", str(bf16_dir), "--context", "64", "--json"]
    assert main(argv) == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["dtype"] == "bfloat16" and mem["dtype_reason"] == "the checkpoint's dtype"
    assert main([*argv, "--dtype", "bfloat16"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] == mem["kv_bytes"]
    assert main(["memory", "--config", str(bf16_dir), "--context", "64"]) == 0
    assert "KV dtype bfloat16 (the checkpoint's dtype)" in capsys.readouterr().out
    # a config alone: float32, as `serve --config tiny` allocates
    tiny, _ = loaded(["serve", "--config", "tiny"])
    assert main(["info", "--config", "tiny", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["dtype"] == "float32" and info["param_bytes"] == param_bytes(tiny)
    assert main(["memory", "--config", "tiny", "--context", "64", "--json"]) == 0
    mem = json.loads(capsys.readouterr().out)
    assert mem["dtype"] == "float32" and mem["dtype_reason"] == "random weights: the model's default"
    assert main(["info", "--config", "tiny", "--dtype", "bfloat16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype_reason"] == "--dtype"
