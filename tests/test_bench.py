"""Benchmark commands run end to end on tiny and report what they claim (not timings)."""

import json

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
