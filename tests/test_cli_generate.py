"""`jaxhybrid generate`: JSON output, prompts files in order, and clear errors instead of tracebacks."""

import json

import pytest

from serve.cli import main

ARGS = [
    "generate",
    "--config",
    "tiny",
    "--max-tokens",
    "4",
    "--ignore-eos",
    "--slots",
    "2",
    "--block-size",
    "8",
    "--prefill-chunk",
    "32",
]


def run(capsys, *extra):
    rc = main([*ARGS, *extra])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_generate_json_and_prompts_file(capsys, tmp_path):
    rc, out, _ = run(capsys, "--prompt-ids", "5,6,7", "--json")
    assert rc == 0
    single = json.loads(out)
    assert len(single["token_ids"]) == 4 and single["stats"]["prompt_tokens"] == 3
    assert single["stats"]["prefill_time_s"] > 0 and single["stats"]["decode_time_s"] > 0
    lines = [
        {"prompt_ids": [9, 8, 7, 6, 5]},
        {"prompt_ids": [5, 6, 7]},
        {"prompt_ids": [1] * 40, "max_tokens": 2},
    ]
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc, out, _ = run(capsys, "--prompts-file", str(f), "--json")
    assert rc == 0
    results = [json.loads(line) for line in out.strip().splitlines()]
    assert [r["stats"]["prompt_tokens"] for r in results] == [5, 3, 40]
    assert len(results[2]["token_ids"]) == 2
    assert results[1]["token_ids"] == single["token_ids"]  # same prompt, greedy: same tokens in a batch


def test_generate_text_prompt(capsys):
    rc, out, _ = run(capsys, "--prompt", "héllo", "--json")
    assert rc == 0 and json.loads(out)["stats"]["prompt_tokens"] == len("héllo".encode())


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--prompt-ids", "1,2,x"], "comma-separated integers"),
        (["--prompt-ids", "1,99999"], "outside the vocabulary"),
        (["--prompt-ids", ""], "empty"),
        (["--prompt-ids", "1", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1", "--top-p", "2"], "top_p"),
        (["--prompt-ids", "1", "--max-tokens", "0"], "max_tokens"),
        (["--prompt-ids", "1", "--max-model-len", "3"], "exceeds the context"),
        ([], "exactly one of"),
        (["--prompts-file", "/no/such/file"], "no such file"),
    ],
)
def test_generate_errors(capsys, extra, match):
    rc, _, err = run(capsys, *extra)
    assert rc == 2 and match in err and "Traceback" not in err


def test_prompts_file_errors_name_the_line(capsys, tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1], "temprature": 1}\n')
    rc, _, err = run(capsys, "--prompts-file", str(f))
    assert rc == 2 and "bad.jsonl:2" in err and "temprature" in err


def test_prefix_cache_flags(capsys, tmp_path):
    shared = list(range(10, 40))
    f = tmp_path / "p.jsonl"
    f.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"prompt_ids": shared},
                {"prompt_ids": shared + [5, 6]},
                {"prompt_ids": shared + [5, 6], "cache_salt": "t2"},
            ]
        )
        + "\n"
    )
    rc, out, _ = run(capsys, "--prompts-file", str(f), "--json", "--slots", "1", "--checkpoint-interval", "8")
    stats = [json.loads(line)["stats"] for line in out.strip().splitlines()]
    assert rc == 0
    assert [s["prefix_hit_tokens"] for s in stats] == [0, 30, 0]  # prompt-end hit; another salt never hits
    rc, out, _ = run(capsys, "--prompts-file", str(f), "--json", "--slots", "1", "--no-prefix-cache")
    assert rc == 0 and all(json.loads(x)["stats"]["prefix_hit_tokens"] == 0 for x in out.strip().splitlines())
    # an interval off the blocks is rounded (tests/test_prefix_store.py); one below a block is an error
    rc, _, err = run(capsys, "--prompt-ids", "1", "--checkpoint-interval", "0")
    assert rc == 2 and "positive multiple of the block size" in err


def generate_in_process(home, *flag):
    """`jaxhybrid generate` of tiny in a fresh process (JAX opens its cache once) with the user's cache
    directory at `home`; its stdout."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XDG_CACHE_HOME": str(home)}
    cmd = [sys.executable, "-m", "serve.cli", *ARGS, "--prompt-ids", "5,6,7", "--max-tokens", "2"]
    cmd += ["--slots", "1", "--prefill-chunk", "16", "--max-model-len", "32", "--no-prefix-cache", *flag]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def files_under(d):
    return [p for p in d.rglob("*") if p.is_file()] if d.exists() else []


def test_compile_cache_dir_is_honoured(tmp_path):
    """`--compile-cache DIR` writes the compiled programs to DIR, nothing to the default directory."""
    chosen, home = tmp_path / "chosen", tmp_path / "home"
    generate_in_process(home, "--compile-cache", str(chosen))
    assert files_under(chosen) and not files_under(home)


@pytest.mark.slow
def test_compile_cache_off_writes_nothing(tmp_path):
    generate_in_process(tmp_path, "--compile-cache", "off")
    assert not files_under(tmp_path)


def test_default_compile_cache_is_under_the_user_cache_dir(tmp_path, monkeypatch):
    import jax

    from serve.cli.common import default_compile_cache_dir, setup_compile_cache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    assert default_compile_cache_dir() == tmp_path / "jaxhybrid" / "xla"
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    saved = {n: getattr(jax.config, n) for n in names}
    try:
        assert setup_compile_cache(None) == tmp_path / "jaxhybrid" / "xla"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "jaxhybrid" / "xla")
        monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
        assert setup_compile_cache(None) == tmp_path / "env"
        assert setup_compile_cache("off") is None and not jax.config.jax_enable_compilation_cache
    finally:
        for n, v in saved.items():
            jax.config.update(n, v)


def test_generate_closes_the_engine_when_serving_raises(capsys, monkeypatch):
    """Issue 27.2: a step that raises still closes the engine (its prefix store's saves land, its store
    directory's lock is released) before the error propagates."""
    from serve.engine.engine import Engine

    closed = []
    monkeypatch.setattr(Engine, "close", lambda self: closed.append(self))

    def broken(self, events=None):
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(Engine, "step", broken)
    with pytest.raises(RuntimeError, match="injected"):
        main([*ARGS, "--prompt-ids", "1,2,3"])
    assert len(closed) == 1
