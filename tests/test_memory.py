"""`jaxhybrid memory`: analytic bytes equal hand computations; the published K3 figures are reproduced."""

import json

import jax.numpy as jnp
import pytest

from jaxhybrid.cache import memory_report
from jaxhybrid.config import load_config
from serve.cli import main


def test_tiny_hand_count():
    rep = memory_report(load_config("tiny"), 1000, 256, jnp.float32)
    kv = 1 * 1000 * (32 + 8) * 4  # 1 MLA layer x tokens x (kv_lora + rope) x fp32
    state = 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)  # 3 KDA layers x (recurrent fp32 + conv 3*H*d x (K-1))
    assert (rep["kv_bytes"], rep["state_bytes"], rep["num_checkpoints"]) == (kv, state, 3)
    assert rep["checkpoint_bytes"] == 3 * state
    assert rep["all_mla_kv_bytes"] == 4 * 1000 * 40 * 4
    assert rep["saving_pct"] == pytest.approx(
        100 * (4 * 1000 * 40 * 4 - kv - 4 * state) / (4 * 1000 * 40 * 4)
    )


def test_kimi_linear_48b_hand_count():
    T, interval = 1_048_576, 32_768
    rep = memory_report(load_config("kimi-linear-48b-a3b"), T, interval, jnp.bfloat16, hbm_bytes=80 * 10**9)
    kv = 7 * T * 576 * 2
    state = 20 * (32 * 128 * 128 * 4 + 3 * 4096 * 3 * 2)
    assert (rep["kv_bytes"], rep["state_bytes"]) == (kv, state)
    assert (rep["num_checkpoints"], rep["checkpoint_bytes"]) == (32, 32 * state)
    assert rep["all_mla_kv_bytes"] == 27 * T * 576 * 2
    assert rep["sequences_fit"] == 80 * 10**9 // (kv + 33 * state)


def test_kimi_k3_published_figures():
    rep = memory_report(load_config("kimi-k3"), 1_048_576, 8192, jnp.bfloat16)
    assert rep["kv_bytes"] / 1e9 == pytest.approx(29, rel=0.01)  # "about 29 GB"
    assert rep["all_mla_kv_bytes"] / 1e9 == pytest.approx(112, rel=0.01)  # "against 112 GB for all-MLA"
    assert rep["recurrent_state_bytes"] == 69 * 96 * 128 * 128 * 4  # 434 MB per sequence per snapshot
    assert rep["checkpoint_recurrent_bytes"] / 1e9 == pytest.approx(
        56, rel=0.01
    )  # "checkpoints add about 56 GB"
    assert rep["checkpoint_bytes"] / 1e9 == pytest.approx(56, rel=0.03)  # + conv state: 57.5 GB


def test_memory_cli(capsys):
    assert (
        main(["memory", "--config", "kimi-k3", "--context", "1048576", "--interval", "8192", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "kv_bytes",
        "state_bytes",
        "checkpoint_bytes",
        "num_checkpoints",
        "all_mla_kv_bytes",
        "saving_pct",
    ):
        assert key in out
    assert main(["memory", "--config", "tiny", "--context", "100", "--hbm", "1"]) == 0
    assert "sequences that fit" in capsys.readouterr().out
    assert main(["memory", "--config", "tiny", "--context", "0"]) == 2
    assert "context must be positive" in capsys.readouterr().err
