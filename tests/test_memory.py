"""`jaxhybrid memory`: analytic bytes equal hand computations; the published K3 figures are reproduced."""

import json

import jax.numpy as jnp
import pytest

from jaxhybrid.cache import layout_report, memory_report, with_layout
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


# --- `memory --ratios`: the layout what-if ----------------------------------------------------------------


def test_layouts_keep_depth_and_put_every_r_plus_1_th_layer_on_mla():
    cfg = load_config("small")  # 8 layers
    mla = {r: with_layout(cfg, r).full_attn_layers for r in (0, 1, 3, 7, None)}
    assert mla == {0: tuple(range(1, 9)), 1: (2, 4, 6, 8), 3: (4, 8), 7: (8,), None: ()}
    for r in mla:
        v = with_layout(cfg, r)
        assert sorted(v.kda_layers + v.full_attn_layers) == list(range(1, 9))
        assert (v.hidden_size, v.kv_lora_rank, v.kda_num_heads) == (cfg.hidden_size, 256, cfg.kda_num_heads)


def test_layout_bytes_equal_a_hand_count():
    cfg = load_config("small")
    contexts, interval, hbm = [1000, 70000], 16384, 10**9
    # by hand, bf16 KV / conv and fp32 recurrent state: small has 8 KDA heads of 128, kv_lora 256 + rope 64
    kda_layer = 8 * 128 * 128 * 4 + 3 * (8 * 128) * (4 - 1) * 2
    mla_token = (256 + 64) * 2
    rows = {(r["layout"], r["context"]): r for r in layout_report(cfg, contexts, interval, hbm_bytes=hbm)}
    mixes = {"config (6:2)": 2, "all-MLA": 8, "1:1": 4, "3:1": 2, "7:1": 1, "all-KDA": 0}
    assert {k[0] for k in rows} == set(mixes)
    for name, n_mla in mixes.items():
        n_kda = 8 - n_mla
        for ctx in contexts:
            r = rows[(name, ctx)]
            live = n_kda * kda_layer + n_mla * ctx * mla_token
            total = live + (ctx // interval) * n_kda * kda_layer
            assert (r["kda_layers"], r["mla_layers"]) == (n_kda, n_mla)
            assert r["bytes_without_checkpoints"] == live
            assert r["total_bytes"] == total
            assert r["all_mla_kv_bytes"] == 8 * ctx * mla_token
            assert r["sequences_fit"] == hbm // total
            assert r["sequences_fit_without_checkpoints"] == hbm // live


def test_memory_ratios_cli(capsys):
    assert main(["memory", "--config", "tiny", "--ratios", "--contexts", "512,4096", "--hbm", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "all-MLA" in out and "7:1" in out and "fit_0.01GB" in out
    assert main(["memory", "--config", "tiny", "--ratios", "--contexts", "512", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    layouts = ["config (3:1)", "all-MLA", "1:1", "3:1", "7:1", "all-KDA"]
    assert [r["layout"] for r in rep["layouts"]] == layouts
    assert main(["memory", "--config", "tiny", "--ratios", "--contexts", "a,b"]) == 2
    assert "--contexts must be comma-separated integers" in capsys.readouterr().err
    assert main(["memory", "--config", "tiny"]) == 2
    assert "--context is required" in capsys.readouterr().err
