"""What a model with MXFP4 experts kept packed holds: `jaxhybrid info --model` (text and JSON) and the
server's `jaxhybrid_model_bytes` gauge report the bytes of its arrays, which equal `info`'s analytic count
(4.25 bits per routed weight) and differ from the dequantized model's by the hand-computed amount; the prefix
store's fingerprint covers the packed bytes."""

from __future__ import annotations

import json
import re

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from servers import uvicorn_thread

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM, held_bytes
from jaxhybrid.tokenizer import ByteTokenizer
from jaxhybrid.weights import load_pretrained, save_hf
from serve.cli import main as cli_main
from serve.engine.engine import Engine, EngineConfig
from serve.http.app import create_app
from serve.prefix.fingerprint import model_fingerprint

CFG = load_config("tiny-k3").replace(expert_quant="mxfp4")
# tiny-k3: 13 MoE layers x 8 experts x (w1, w3 [32, 64] + w2 [64, 32]) routed weights
ROUTED = 13 * 8 * 3 * 32 * 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("k3-mxfp4")
    save_hf(HybridLM(CFG, rngs=nnx.Rngs(0)), path)
    return path


def info(path, *flags, capsys) -> dict:
    assert cli_main(["info", "--model", str(path), "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)["model"]


def test_info_model_reports_held_bytes_against_the_analytic_count(checkpoint, capsys):
    packed = info(checkpoint, capsys=capsys)
    dense = info(checkpoint, "--dequantize-experts", capsys=capsys)
    assert packed["packed_experts"] and not dense["packed_experts"] and packed["dtype"] == "float32"
    for m in (packed, dense):
        assert abs(m["held_bytes"] / m["analytic_bytes"] - 1) < 0.01
    # fp32 dense experts hold 4 bytes per routed weight, packed ones 1/2 + 1/32
    assert dense["held_bytes"] - packed["held_bytes"] == ROUTED * 4 - (ROUTED // 2 + ROUTED // 32)
    assert packed["held_bytes"] == held_bytes(load_pretrained(checkpoint))
    assert cli_main(["info", "--model", str(checkpoint)]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"model holds \(packed experts\) +{packed['held_bytes']:,} ", text)
    assert "analytic count" in text


def test_metrics_gauge_reports_the_model_bytes(checkpoint):
    model = load_pretrained(checkpoint)
    engine = Engine(model, EngineConfig(max_slots=1, block_size=16, max_model_len=32, prefix=None))
    app = create_app(engine, ByteTokenizer(CFG.vocab_size), "k3-mxfp4")
    with uvicorn_thread(app) as url:
        text = httpx.get(f"{url}/metrics", timeout=60).text
    (value,) = re.findall(r"^jaxhybrid_model_bytes (\S+)$", text, re.M)
    assert float(value) == held_bytes(model) == engine.memory().model_bytes


def test_fingerprint_covers_the_packed_bytes(checkpoint):
    """One packed byte of one expert changed: another fingerprint."""
    model = load_pretrained(checkpoint)
    before = model_fingerprint(model)
    ex = model.model.layers[5].block_sparse_moe.experts
    ex.w2_packed.set_value(ex.w2_packed[...].at[3, 7, 2].add(jnp.uint8(1)))
    assert model_fingerprint(model) != before
    assert np.asarray(ex.w2_packed[...]).dtype == np.uint8


def test_bench_decode_compares_packed_with_dequantized(tmp_path, capsys):
    """`bench decode --compare-dequantized`: both variants of tiny with MXFP4 experts, each row with the bytes
    its model holds (they differ by the routed weights' 4 bytes against 17/32 of a byte, counted by hand:
    3 MoE layers x 8 experts x 3 x 32 x 64) and the ratio of their tokens/s."""
    import yaml

    from jaxhybrid.config import configs_dir

    raw = yaml.safe_load((configs_dir() / "tiny.yaml").read_text())
    (tmp_path / "tiny-mx.yaml").write_text(yaml.safe_dump({**raw, "expert_quant": "mxfp4"}))
    args = ["bench", "decode", "--config", str(tmp_path / "tiny-mx.yaml"), "--compare-dequantized"]
    assert cli_main([*args, "--contexts", "16", "--repeats", "2", "--block-size", "8"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["variant"].rsplit("-", 1)[-1]: r for r in result["rows"]}
    routed = 3 * 8 * 3 * 32 * 64
    assert (
        rows["dequantized"]["model_bytes"] - rows["packed"]["model_bytes"] == routed * 4 - routed * 17 // 32
    )
    assert rows["packed"]["bytes_per_step"] < rows["dequantized"]["bytes_per_step"]
    speed = result["packed_over_dequantized_tokens_per_s"]["16"]
    assert speed == rows["packed"]["tokens_per_s"] / rows["dequantized"]["tokens_per_s"]
    assert cli_main(["bench", "decode", "--config", "tiny", "--compare-dequantized"]) == 2
