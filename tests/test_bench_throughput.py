"""`bench throughput` reports rates consistent with its own measured times and with hand counts of FLOPs and
bytes; `bench compare` puts two real results side by side, writes readable PNGs, and rejects bad input."""

import json
import re

import matplotlib.image
import pytest

from benchmarks.compare import build_figures, labels_for, read_results
from jaxhybrid.config import load_config
from jaxhybrid.counting import count_params
from serve.cli import main

TINY_ARGS = [
    "bench",
    "throughput",
    "--config",
    "tiny",
    "--prompt-lengths",
    "16,32",
    "--batch-sizes",
    "1,2",
    "--contexts",
    "16",
    "--block-size",
    "16",
    "--matmul-size",
    "128",
    "--read-mib",
    "4",
]


@pytest.fixture(scope="module")
def two_results(tmp_path_factory):
    """Two real tiny runs (same shapes, so the second reuses the compiled programs), written with --out."""
    d = tmp_path_factory.mktemp("tp")
    paths = []
    for name, repeats in (("a.json", "2"), ("b.json", "1")):
        path = d / name
        assert main([*TINY_ARGS, "--repeats", repeats, "--out", str(path)]) == 0
        paths.append(str(path))
    return paths


def test_throughput_rates_follow_from_times_and_hand_counts(two_results, capsys):
    res = json.loads(open(two_results[0]).read())
    cfg = load_config("tiny")
    env = res["environment"]
    assert res["bench"] == "throughput" and res["dtype"] == "float32"
    assert {"platform", "device_kind", "device_count", "jax_version"} <= env.keys()

    m = res["machine"]
    assert m["matmul_flop_per_s"] == pytest.approx(2 * 128**3 / m["matmul"]["median_s"], rel=1e-12)
    side = int((4 * 2**20 // 4) ** 0.5)  # a square fp32 array of 4 MiB
    assert m["read"]["bytes"] == side * side * 4
    rates = [m["read"]["bytes"] / m["read"][k]["median_s"] for k in ("sum", "gemv")]
    assert m["bandwidth_bytes_per_s"] == pytest.approx(max(rates), rel=1e-12)

    counts = count_params(cfg, "float32")
    assert res["model"]["active_params"] == pytest.approx(counts["active_params"], rel=1e-12)
    matmul_params = counts["active_params_without_embedding"]
    assert [r["prompt_len"] for r in res["prefill"]] == [16, 32]
    for r in res["prefill"]:
        T = r["prompt_len"]
        mla = 1 * 2 * 2 * (16 + 8 + 16) * T * (T + 1) / 2  # 1 MLA layer, 2 heads, qk 16+8, v 16, causal pairs
        kda = 3 * 6 * 2 * 16 * 16 * T  # 3 KDA layers, 2 heads of 16
        assert r["flops"] == pytest.approx(2 * matmul_params * T + mla + kda, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(T / r["median_s"], rel=1e-12)
        assert r["matmul_fraction"] == pytest.approx(r["flops"] / r["median_s"] / m["matmul_flop_per_s"])
        assert 0 < r["min_s"] <= r["median_s"]
        assert r["compiles_while_timed"] == 0  # warm-up calls compiled it; only the program is timed

    embed = cfg.vocab_size * cfg.hidden_size * 4
    routed = counts["routed_expert_params"] * 4
    state = 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 4)  # per row: 3 KDA layers x (fp32 recurrent + conv K-1 = 3)
    assert [(r["batch"], r["context"]) for r in res["decode"]] == [(1, 16), (2, 16)]
    for r in res["decode"]:
        B, ctx = r["batch"], r["context"]
        weights = counts["param_bytes"] - embed - routed + routed * (1 - (1 - 2 / 8) ** B)  # top-2 of 8
        kv = B * 1 * ctx * (32 + 8) * 4  # 1 MLA layer x latent (kv_lora 32 + rope 8) fp32
        assert r["bytes"] == pytest.approx(weights + kv + B * state, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(B / r["median_s"], rel=1e-12)
        assert r["compiles_while_timed"] == 0
        assert r["bandwidth_fraction"] == pytest.approx(
            r["bytes"] / r["median_s"] / m["bandwidth_bytes_per_s"]
        )

    capsys.readouterr()
    assert main(["bench", "compare", *two_results]) == 0  # without --out-dir: the table only
    out = capsys.readouterr().out
    assert "tokens_per_s A" in out and "tokens_per_s B" in out and "B/A" in out


def test_compare_writes_a_table_and_readable_plots(two_results, tmp_path, capsys):
    results = [json.loads(open(p).read()) for p in two_results]
    assert main(["bench", "compare", *two_results, "--out-dir", str(tmp_path / "plots")]) == 0
    out, err = capsys.readouterr()
    labels = labels_for(two_results, results)
    assert labels == ["cpu float32 tiny (a.json)", "cpu float32 tiny (b.json)"]  # same machine: file names
    assert f"A = {labels[0]}" in out and f"B = {labels[1]}" in out
    cells = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]  # columns are 2+ spaces apart
    header = next(c for c in cells if c[0] == "prompt_len")
    row = next(c for c in cells if c[0] == "32")
    got = dict(zip(header, row, strict=True))
    a, b = (next(r for r in res["prefill"] if r["prompt_len"] == 32) for res in results)
    assert float(got["tokens_per_s A"].replace(",", "")) == pytest.approx(a["tokens_per_s"], rel=1e-3)
    assert float(got["tokens_per_s B"].replace(",", "")) == pytest.approx(b["tokens_per_s"], rel=1e-3)
    assert float(got["B/A"]) == pytest.approx(b["tokens_per_s"] / a["tokens_per_s"], abs=0.006)

    names = ["prefill", "decode", "prefill_fraction", "decode_fraction"]
    for name in names:
        path = tmp_path / "plots" / f"throughput_{name}.png"
        assert str(path) in err and path.stat().st_size > 0
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100 and image.shape[2] in (3, 4)
        assert image.std() > 0  # something was drawn

    figures = build_figures("throughput", results, labels)
    assert sorted(figures) == sorted(names)
    ax = figures["prefill"].axes[0]
    assert ax.get_xlabel() == "prompt length (tokens)" and "tokens/s" in ax.get_ylabel() and ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
    for line, res in zip(ax.get_lines(), results, strict=True):  # the plotted points are the results' rows
        assert list(line.get_xdata()) == [16, 32]
        assert list(line.get_ydata()) == [r["tokens_per_s"] for r in res["prefill"]]
    ax = figures["decode"].axes[0]
    assert ax.get_xlabel() == "batch size (sequences)" and "tokens/s" in ax.get_ylabel()
    assert len(ax.get_lines()) == 2  # one context per file
    assert "%" in figures["decode_fraction"].axes[0].get_ylabel()


def _write(path, text):
    path.write_text(text)
    return str(path)


def test_compare_rejects_bad_input_with_a_clear_message(two_results, tmp_path, capsys):
    decode = _write(tmp_path / "decode.json", json.dumps({"bench": "decode", "rows": []}))
    cases = [
        ([str(tmp_path / "missing.json")], "no such result file"),
        ([_write(tmp_path / "bad.json", "{not json")], "is not valid JSON"),
        ([_write(tmp_path / "list.json", "[1, 2]")], "not a jaxhybrid bench result"),
        ([_write(tmp_path / "odd.json", json.dumps({"bench": "nope"}))], "cannot be compared"),
        ([_write(tmp_path / "norows.json", json.dumps({"bench": "throughput"}))], "needs a list of rows"),
        ([two_results[0], decode], "different bench kinds"),
    ]
    for files, message in cases:
        assert main(["bench", "compare", *files, "--out-dir", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # nothing written for a rejected comparison
    kind, _ = read_results([decode, decode])
    assert kind == "decode"
