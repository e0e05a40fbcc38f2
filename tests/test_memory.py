"""`jaxhybrid memory`: analytic bytes equal hand computations; the published K3 figures are reproduced."""

import json

import jax.numpy as jnp
import pytest

from jaxhybrid.cache import layout_report, memory_report, with_layout
from jaxhybrid.config import load_config
from serve.cli import main
from serve.prefix.ledger import Chat, CheckpointPolicy, chat_checkpoints, chat_report
from serve.prefix.types import CheckpointKind


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
    """By hand from jaxhybrid/configs/kimi-k3.yaml (24 MLA layers of latent 512 + rope 64; 69 KDA layers of
    96 heads of 128), bf16 KV and conv state, fp32 recurrent state: exact bytes, then the rounded figures
    K3.md quotes."""
    T = 1_048_576
    rep = memory_report(load_config("kimi-k3"), T, 8192, jnp.bfloat16)
    kv = 24 * T * (512 + 64) * 2
    recurrent = 69 * 96 * 128 * 128 * 4
    conv = 69 * (3 * 96 * 128) * 3 * 2  # q, k, v channels x the last 3 inputs
    assert (rep["kv_bytes"], rep["all_mla_kv_bytes"]) == (kv, 93 * T * 576 * 2)
    assert (rep["recurrent_state_bytes"], rep["conv_state_bytes"]) == (recurrent, conv)
    assert rep["num_checkpoints"] == T // 8192 == 128
    assert rep["checkpoint_recurrent_bytes"] == 128 * recurrent
    assert rep["checkpoint_bytes"] == 128 * (recurrent + conv)
    # "about 29 GB", "against 112 GB for all-MLA", 434 MB per snapshot, "checkpoints add about 56 GB"
    # (recurrent state; 57.5 GB with the conv state)
    assert [round(rep[k] / 1e9) for k in ("kv_bytes", "all_mla_kv_bytes", "checkpoint_recurrent_bytes")] == [
        29,
        112,
        56,
    ]
    assert (round(recurrent / 1e6), round(rep["checkpoint_bytes"] / 1e9, 1)) == (434, 57.5)


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


# --- `memory --turns`: a chat's checkpoints by kind -------------------------------------------------------


def test_chat_checkpoints_by_kind_equal_a_hand_count():
    """3 turns of 40 tokens, replies of 8, blocks of 16, interval 32: prompts end at 32 (on the interval:
    an interval checkpoint), 72 (a partial block) and 112 (a block boundary); sequences end at 39, 79, 119
    (partial blocks); interval checkpoints at 32, 64, 96."""
    cfg, chat = load_config("tiny"), Chat(turns=3, turn_tokens=40, reply_tokens=8)
    policy = CheckpointPolicy(interval=32, block_size=16)
    state = 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)  # 3 KDA layers, fp32
    block = 1 * 16 * (32 + 8) * 4  # one block's latent KV over the 1 MLA layer
    assert chat_checkpoints(chat, policy) == {
        32: CheckpointKind.INTERVAL,
        64: CheckpointKind.INTERVAL,
        96: CheckpointKind.INTERVAL,
        72: CheckpointKind.PROMPT_END,
        112: CheckpointKind.PROMPT_END,
        39: CheckpointKind.SEQUENCE_END,
        79: CheckpointKind.SEQUENCE_END,
        119: CheckpointKind.SEQUENCE_END,
    }
    rep = chat_report(cfg, chat, policy, jnp.float32, hbm_bytes=10**6)
    assert rep["checkpoints_by_kind"] == {"interval": 3, "prompt_end": 2, "sequence_end": 3, "junction": 0}
    assert rep["checkpoint_tails_by_kind"] == {
        "interval": 0,
        "prompt_end": 1,
        "sequence_end": 3,
        "junction": 0,
    }
    by_kind = {
        "interval": 3 * state,
        "prompt_end": 2 * state + block,
        "sequence_end": 3 * (state + block),
        "junction": 0,
    }
    assert rep["checkpoint_bytes_by_kind"] == by_kind
    checkpoints = 8 * state + 4 * block
    assert (rep["num_checkpoints"], rep["checkpoint_bytes"], rep["checkpoint_tail_kv_bytes"]) == (
        8,
        checkpoints,
        4 * block,
    )
    kv = 120 * 40 * 4
    assert (rep["context"], rep["kv_bytes"], rep["total_bytes"]) == (120, kv, kv + state + checkpoints)
    assert rep["sequences_fit"] == 10**6 // (kv + state + checkpoints)


def test_chat_ends_that_coincide_are_one_checkpoint():
    """A reply of 1 token: the sequence ends where its prompt did (one checkpoint, the prompt end's, or the
    interval's where it falls on one); a kind switched off leaves the other."""
    chat, pos = Chat(turns=2, turn_tokens=33, reply_tokens=1), CheckpointKind
    assert (chat.prompt_end(1), chat.sequence_end(1), chat.prompt_end(2)) == (32, 32, 65)
    held = lambda **kw: chat_checkpoints(chat, CheckpointPolicy(block_size=16, **kw))
    assert held(interval=32) == {32: pos.INTERVAL, 64: pos.INTERVAL, 65: pos.PROMPT_END}
    assert held(interval=32, prompt_end=False) == {32: pos.INTERVAL, 64: pos.INTERVAL, 65: pos.SEQUENCE_END}
    assert held(interval=32, prompt_end=False, sequence_end=False) == {32: pos.INTERVAL, 64: pos.INTERVAL}
    assert held(interval=None) == {32: pos.PROMPT_END, 65: pos.PROMPT_END}
    with pytest.raises(ValueError, match="multiple of the block size"):
        CheckpointPolicy(interval=24, block_size=16)
    with pytest.raises(ValueError, match="reply tokens"):
        Chat(turns=2, turn_tokens=33, reply_tokens=33)


def test_memory_chat_cli(capsys):
    from serve.cli import build_parser

    help_text = build_parser()._subparsers._group_actions[0].choices["memory"].format_help()
    for flag in ("--turns", "--turn-tokens", "--reply-tokens", "--block-size", "--no-prompt-end-checkpoints"):
        assert flag in help_text, flag
    assert "--no-sequence-end-checkpoints" in help_text
    args = ["memory", "--config", "tiny", "--turns", "3", "--turn-tokens", "40", "--reply-tokens", "8"]
    assert main([*args, "--interval", "32", "--dtype", "float32", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["context"] == 120 and rep["num_checkpoints"] == 8
    assert rep["checkpoints_by_kind"] == {"interval": 3, "prompt_end": 2, "sequence_end": 3, "junction": 0}
    assert rep["chat"]["prompt_end_checkpoints"] and rep["chat"]["block_size"] == 16
    assert main([*args, "--interval", "32", "--no-sequence-end-checkpoints", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["checkpoints_by_kind"]["sequence_end"] == 0
    assert main([*args, "--interval", "32", "--no-prompt-end-checkpoints"]) == 0
    out = capsys.readouterr().out
    assert "prompt-end checkpoints (0;" in out and "sequence-end checkpoints (3; 3 hold" in out
    assert main(["memory", "--config", "tiny", "--turns", "3", "--turn-tokens", "40", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["chat"]["reply_tokens"] == 10  # T/4 by default
    for bad, message in (
        (["--turns", "3"], "--turns needs --turn-tokens"),
        ([*args[3:], "--context", "100"], "must be --turns x --turn-tokens"),
        ([*args[3:], "--interval", "24"], "multiple of the block size"),
        (["--context", "100", "--no-prompt-end-checkpoints"], "need --turns"),
    ):
        assert main(["memory", "--config", "tiny", *bad]) == 2
        assert message in capsys.readouterr().err, bad
    assert main(["memory", "--config", "tiny", "--context", "100", "--interval", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_checkpoints"] == 0  # 0 = no checkpoints, as documented
