"""`jaxhybrid bench quant`: a model whose experts MXFP4 already holds exactly must come out identical to its
MXFP4 copy (zero loss difference, full agreement, zero KL, the same greedy tokens); random experts must not;
the loss it reports is the training code's validation loss on the split `jaxhybrid train` makes."""

import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from bounds import float32_log_softmax_bound, float32_network_bound, gamma
from test_weights import random_model

from jaxhybrid.config import load_config
from jaxhybrid.train import data as D
from jaxhybrid.train.step import make_steps, split_model
from jaxhybrid.weights import save_orbax
from jaxhybrid.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from serve.cli import main

# the quantization accuracy study (`benchmarks.quant`) end to end: slow, and nothing of the product's own
pytestmark = pytest.mark.lab

ARGS = ["--batch-size", "2", "--seq-len", "16", "--batches", "2", "--val-fraction", "0.5", "--greedy-tokens"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    for i in range(8):
        (root / f"m{i}.py").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}  # file {i}\n" * 6)
    return root


def as_mxfp4_values(model):
    """The model with every routed expert replaced by its MXFP4 round trip (then exact in MXFP4)."""
    for layer in model.model.layers:
        if layer.is_moe:
            experts = layer.block_sparse_moe.experts
            for w in (experts.w1, experts.w2, experts.w3):
                w.set_value(jnp.asarray(dequantize_mxfp4(*quantize_mxfp4(np.asarray(w[...])))))
    return model


def bench(capsys, model_dir, corpus, greedy):
    argv = ["bench", "quant", "--model", str(model_dir), "--data", str(corpus), *ARGS, str(greedy)]
    assert main([*argv, "--prompts", "ab", "cde"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_exact_experts_cost_nothing_and_the_loss_is_the_training_loss(tmp_path, corpus, capsys):
    model = as_mxfp4_values(random_model(load_config("tiny"), seed=5))
    model_dir = save_orbax(model, tmp_path / "exact")
    result = bench(capsys, model_dir, corpus, greedy=3)
    val = result["validation"]
    assert val["tokens"] == 2 * 2 * 16
    assert [c["agreed_tokens"] for c in result["completions"]] == [3, 3]

    # The oracle: `jaxhybrid train`'s evaluation step on the validation files' bytes (+3, bos 1, eos 2: the
    # byte-level tokenizer a model directory without tokenizer files gets), in the split's order.
    _, val_docs = D.split_documents(D.collect_documents([str(corpus)]), 0.5)
    texts = [d.path.read_text() for d in val_docs]
    stream = np.concatenate([[1, *(b + 3 for b in t.encode()), 2] for t in texts]).astype(np.int32)
    graphdef, params, rest = split_model(model)
    _, eval_step = make_steps(graphdef, optax.identity(), bias_rate=0.0)
    total = count = 0.0
    logits = []
    for b in D.val_batches(stream, 2, 16, 2):
        s, n = eval_step(params, rest, jnp.asarray(b))
        total, count = total + float(s), count + float(n)
        logits.append(np.asarray(model(jnp.asarray(b)), np.float64))
    # Two float32 evaluations of one model (the packed path dequantizes inside the expert loop; the bench
    # and the training step sum in other orders): their logits within the network bound times the largest
    # logit, so each token's logprob within twice that plus the log-softmax's roundings (`delta`), and a
    # mean of them, or the KL (an expectation of logprob differences), within delta and the mean's gamma(n).
    logits = np.concatenate(logits)
    err = float32_network_bound(model.config, 16) * np.abs(logits).max()
    delta = 2 * err + float(float32_log_softmax_bound(logits, sides=2).max())
    mean = gamma(int(count)) * val["dense"]
    assert abs(val["mxfp4"] - val["dense"]) <= delta + 2 * mean
    assert val["top1_agree"] == 1.0 and abs(val["kl"]) <= delta + mean
    assert abs(val["dense"] - total / count) <= delta + 2 * mean


def test_random_experts_change_the_loss(tmp_path, corpus, capsys):
    model_dir = save_orbax(random_model(load_config("tiny"), seed=6), tmp_path / "dense")
    val = bench(capsys, model_dir, corpus, greedy=0)["validation"]  # the same shapes: no new compile
    assert val["mxfp4"] != val["dense"] and val["kl"] > 0.0
