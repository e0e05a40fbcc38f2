"""Benchmark commands run end to end on tiny and report what they claim (not timings)."""

import json

import pytest

from serve.cli import main


def test_bench_decode_reports_both_variants(capsys, tmp_path):
    out = tmp_path / "decode.json"
    assert (
        main(
            [
                "bench",
                "decode",
                "--config",
                "tiny",
                "--contexts",
                "16,64",
                "--repeats",
                "2",
                "--block-size",
                "8",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip()) == result
    assert {(r["variant"], r["context"]) for r in result["rows"]} == {
        ("tiny", 16),
        ("tiny", 64),
        ("tiny-kda-only", 16),
        ("tiny-kda-only", 64),
    }
    assert all(r["step_ms"] > 0 for r in result["rows"])


def test_bench_ttft_hit_arithmetic(capsys):
    assert (
        main(
            [
                "bench",
                "ttft",
                "--config",
                "tiny",
                "--prompt-len",
                "40",
                "--suffix",
                "5",
                "--interval",
                "16",
                "--block-size",
                "8",
                "--chunk",
                "32",
            ]
        )
        == 0
    )
    rows = {r["variant"]: r for r in json.loads(capsys.readouterr().out.strip())["rows"]}
    assert (rows["cold"]["hit_tokens"], rows["cold"]["prefilled_tokens"]) == (0, 45)
    assert (rows["interval"]["hit_tokens"], rows["interval"]["recomputed_tokens"]) == (32, 8)
    assert (rows["prompt_end"]["hit_tokens"], rows["prompt_end"]["prefilled_tokens"]) == (40, 5)
    assert rows["prompt_end"]["checkpoint_bytes"] > rows["interval"]["checkpoint_bytes"] > 0


def test_bench_prefix_recompute_falls_and_bytes_rise_as_the_interval_shrinks(capsys):
    assert (
        main(
            [
                "bench",
                "prefix",
                "--config",
                "tiny",
                "--intervals",
                "8,32",
                "--conversations",
                "3",
                "--turns",
                "3",
                "--system-len",
                "40",
                "--user-min",
                "4",
                "--user-max",
                "12",
                "--max-tokens",
                "4",
                "--block-size",
                "8",
                "--chunk",
                "32",
                "--max-model-len",
                "256",
                "--checkpoint-policy",
                "fixed",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out.strip())["rows"]
    names = [r["setting"] for r in rows]
    assert names == ["off", "interval 32", "interval 8", "prompt/sequence-end + interval 8"]
    recompute = [r["recomputed_tokens"] for r in rows[1:]]
    ckpt = [r["peak_checkpoint_bytes"]["device"] for r in rows[1:3]]
    assert recompute[0] >= recompute[1] >= recompute[2] and recompute[2] == min(recompute)
    assert ckpt[0] < ckpt[1]
    assert rows[0]["hit_tokens"] == 0 and rows[3]["hit_rate"] >= rows[2]["hit_rate"] > 0
    # the warm-up replay compiled every shape the measured replays meet (JAX's own compile events)
    assert all(r["compiles_while_timed"] == 0 for r in rows)


def test_bench_slots_counts_the_decode_steps_and_its_ratios_follow_from_the_rates(capsys):
    """Each point times exactly the decode steps after every request's first token (new_tokens - 1), and its
    ratios are its rates over the one-slot point's."""
    assert main(["bench", "slots", "--config", "tiny", "--points", "2:1,2:2", "--new-tokens", "4"]) == 0
    result = json.loads(capsys.readouterr().out.strip())
    base = result["one_slot"]
    assert (base["slots"], base["requests"], base["decode_steps"]) == (1, 1, 3)
    points = [(p["slots"], p["requests"], p["decode_steps"]) for p in result["points"]]
    assert points == [(2, 1, 3), (2, 2, 3)]
    for p in result["points"]:
        assert p["tokens_per_s"] == pytest.approx(p["requests"] * p["per_request_tokens_per_s"], rel=1e-12)
        base_rate = base["per_request_tokens_per_s"]
        assert p["vs_1_slot"] == pytest.approx(p["per_request_tokens_per_s"] / base_rate)
    assert main(["bench", "slots", "--config", "tiny", "--points", "2:3"]) == 2
    assert "requests <= slots" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--model", "/nonexistent"], ["--make-small", "/tmp/unused"]])
def test_bench_reference_without_transformers_is_one_error_line(capsys, monkeypatch, argv):
    """Without the optional extra (hidden here: CI installs it) the command says what to install; nothing is
    written."""
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # `import torch` raises ImportError
    assert main(["bench", "reference", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and ".[reference]" in err[0]


def test_bench_reference_needs_a_model_or_make_small(capsys):
    assert main(["bench", "reference"]) == 2
    assert "--model DIR" in capsys.readouterr().err


def test_bench_speculative_reports_what_each_method_drafted_and_the_same_tokens(tmp_path):
    """On tiny (float32): each method's tokens are those without speculation; the model drafting for itself
    has every draft it verified accepted (the step gate may have stopped it drafting: it costs what it saves);
    the counts add up."""
    out = tmp_path / "spec.json"
    argv = ["bench", "speculative", "--config", "tiny", "--workloads", "edit", "--new-tokens", "12"]
    argv += ["--repeats", "1", "--prompt-chars", "300", "--draft-model", "self", "--out", str(out)]
    assert main(argv) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"ngram", "draft"} and all(r["identical"] for r in rows.values())
    draft = rows["draft"]
    assert draft["accepted"] == draft["drafted"]
    assert all(0.0 <= r["copied"] <= 1.0 for r in rows.values())
    windows = draft["windows"]
    assert draft["mean_accepted"] == (round(draft["accepted"] / windows, 2) if windows else 0)


def test_copied_is_the_share_reproduced_before_the_first_difference():
    from benchmarks.speculative import copied, expected, prompts

    assert copied(["abcx", "abcd and more", "z"], ["abcd", "abcd", "ab"]) == (0.75 + 1.0 + 0.0) / 3
    for prompt, want in zip(prompts("edit", 100_000), expected("edit"), strict=True):
        assert not prompt.endswith("\n") and prompt.startswith("# Original:\n" + prompt.splitlines()[-1])
        assert prompt.split("# Original:\n")[1].startswith(prompt.splitlines()[-1] + want)
    assert expected("continue") is None


def test_the_held_out_workloads_share_nothing_with_what_the_shipped_model_learned():
    """The shipped model learned from the standard library alone (its files, and edit and copy documents
    built from them): no held-out function or prose text is in any of those files, nor any of their first
    lines, and the sources lie outside the standard library. The repository's own functions (`edit-repo`)
    are not part of the default workloads."""
    from benchmarks.speculative import HELD_OUT_FILES, held_out_file, held_out_functions, prompts, register
    from jaxhybrid.assets import SHIPPED_DIR
    from jaxhybrid.train.data import stdlib_documents, stdlib_root

    assert json.loads((SHIPPED_DIR / "training.json").read_text())["data"] == ["stdlib"]
    functions = held_out_functions()
    assert len(functions) == len(HELD_OUT_FILES) == len(set(functions))
    firsts = [code.splitlines()[0] for code in functions]
    assert all(len(line) > 12 for line in firsts)  # a line long enough to name one function
    prose = [text[200:400] for text in prompts("prose", 4000)]
    root = stdlib_root()
    for relative in HELD_OUT_FILES:
        assert not held_out_file(relative).resolve().is_relative_to(root.resolve())
    for doc in stdlib_documents():
        text = doc.path.read_text(errors="replace")
        assert not [f for f in functions if f in text], doc.name
        assert not [line for line in firsts if line in text], doc.name
        assert not [p for p in prose if p in text], doc.name
    import argparse

    sub = argparse.ArgumentParser().add_subparsers()
    register(sub)
    defaults = sub.choices["speculative"].parse_args([])
    assert "edit-repo" not in defaults.workloads and "edit" in defaults.workloads
