"""Training: the loss goes down, a resumed run equals an uninterrupted one, the router-bias update balances
load, and the shipped model beats the unigram baseline on held-out standard-library source.

Training runs go through the `jaxhybrid train` command in a subprocess: that process sets the XLA:CPU
flag the training step needs (see `jaxhybrid.train.step.CPU_XLA_FLAG`) before JAX starts. The gradient
check of the chunked KDA form against the recurrent one (q, k, v, g, beta, initial state; fp32, rel err
< 1e-4) is `tests/test_ops_kda.py::test_kda_gradients_chunked_match_recurrent`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import gamma
from conftest import subprocess_xla_flags

from jaxhybrid.ops.moe import route
from jaxhybrid.train.data import is_validation
from jaxhybrid.train.step import bias_delta, load_imbalance
from serve.cli import main

REPO = Path(__file__).resolve().parent.parent

# The `tiny` config (4 layers KDA, KDA, KDA, MLA; 8 experts top-2 + 1 shared) with the byte-level
# tokenizer (vocab 512). A smaller cut of tiny wedged XLA:CPU's training step even with the scheduler flag.
VOCAB = 512
BATCH, SEQ = 4, 32
STEPS, HALF = 60, 30
BIAS_RATE = 1e-3
WORDS = ("alpha", "beta", "gamma", "delta", "value", "result", "index", "count", "total", "item")


def make_corpus(root: Path, files: int = 40) -> Path:
    """Deterministic Python-like files with learnable structure."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True)
    for i in range(files):
        lines = []
        for j in range(40):
            a, b = rng.choice(WORDS, 2)
            lines.append(f"def {a}_{j}(x):\n    return x.{b} + {j}\n")
        (root / f"mod_{i:02d}.py").write_text("\n".join(lines))
    return root


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("train")
    make_corpus(d / "corpus")
    return d


def run_train(workdir: Path, out: str, *extra: str) -> dict:
    """`jaxhybrid train` on tiny and the corpus in a subprocess; returns OUT/log.json (or {})."""
    cmd = [
        sys.executable,
        "-m",
        "serve.cli",
        "train",
        "--config",
        "tiny",
        "--data",
        str(workdir / "corpus"),
        "--out",
        str(workdir / out),
        "--steps",
        str(STEPS),
        "--batch-size",
        str(BATCH),
        "--seq-len",
        str(SEQ),
        "--lr",
        "1e-2",
        "--warmup-steps",
        "10",
        "--val-every",
        "20",
        "--val-batches",
        "4",
        "--save-every",
        "20",
        "--val-fraction",
        "0.2",
        "--bias-rate",
        str(BIAS_RATE),
        "--tokenizer",
        "byte",
        "--no-progress",
        *extra,
    ]
    env = {**os.environ, "XLA_FLAGS": subprocess_xla_flags()}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = workdir / out / "log.json"
    return json.loads(log.read_text()) if log.exists() else {}


@pytest.fixture(scope="module")
def full_run(workdir: Path) -> dict:
    return run_train(workdir, "full")


def byte_ids(text: str) -> list[int]:
    """The byte-level tokenizer, written out: byte b is id b + 3; documents are [bos=1] + ids + [eos=2]."""
    return [1, *(b + 3 for b in text.encode("utf-8")), 2]


def test_training_lowers_validation_loss_below_unigram(workdir: Path, full_run: dict) -> None:
    files = sorted((workdir / "corpus").glob("*.py"))
    train_files = [f for f in files if not is_validation(f.name, 0.2)]
    val_files = [f for f in files if is_validation(f.name, 0.2)]
    assert train_files and val_files
    # Unigram baseline from the train files' byte frequencies (add-one smoothed), on the validation stream.
    counts = np.bincount(np.concatenate([byte_ids(f.read_text()) for f in train_files]), minlength=VOCAB)
    val_stream = np.concatenate([byte_ids(f.read_text()) for f in val_files])
    n = full_run["corpus"]["val_tokens_evaluated"]
    targets = val_stream[: (n // SEQ) * (SEQ + 1)].reshape(-1, SEQ + 1)[:, 1:].reshape(-1)[:n]
    probs = (counts + 1.0) / (counts.sum() + VOCAB)
    unigram = float(-np.log(probs[targets]).mean())
    assert math.isclose(full_run["unigram_val_loss"], unigram, rel_tol=1e-9)

    history, val = full_run["history"], full_run["val_history"]
    assert abs(history[0]["loss"] - math.log(VOCAB)) < 1.0  # an untrained model is near uniform
    assert [v["step"] for v in val] == [20, 40, 60]
    first, last = val[0]["loss"], val[-1]["loss"]
    print(f"val loss {first:.3f} -> {last:.3f}; unigram {unigram:.3f}; log(V) {math.log(VOCAB):.3f}")
    assert last < first - 0.2
    assert last < unigram - 0.5
    out = workdir / "full"
    assert (out / "loss.png").stat().st_size > 0
    assert (out / "model" / "params").is_dir() and (out / "model" / "config.json").exists()


@pytest.mark.slow  # two more training runs in subprocesses
def test_resume_from_checkpoint_reproduces_the_uninterrupted_run(workdir: Path, full_run: dict) -> None:
    stopped = run_train(workdir, "resumed", "--stop-after", str(HALF))
    assert stopped == {}  # stopped early: no final log, no export
    assert not (workdir / "resumed" / "model").exists()
    assert (workdir / "resumed" / "checkpoints" / str(HALF)).is_dir()
    resumed = run_train(workdir, "resumed")
    assert resumed["resumed_from"] == HALF
    full_losses = [h["loss"] for h in full_run["history"]]
    resumed_losses = [h["loss"] for h in resumed["history"]]
    assert len(resumed_losses) == STEPS
    np.testing.assert_allclose(resumed_losses, full_losses, rtol=1e-6, atol=0)
    np.testing.assert_allclose(
        [v["loss"] for v in resumed["val_history"]], [v["loss"] for v in full_run["val_history"]], rtol=1e-6
    )
    from jaxhybrid.weights import load_pretrained

    a = load_pretrained(workdir / "full" / "model", progress=False)
    b = load_pretrained(workdir / "resumed" / "model", progress=False)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_router_bias_of_the_run_is_the_sum_of_its_sign_updates(workdir: Path, full_run: dict) -> None:
    """The exported router biases equal sum over steps of rate * sign(mean load - load), recomputed here from
    the per-step expert loads the run logged."""
    from jaxhybrid.weights import load_pretrained

    loads = np.asarray([h["load"] for h in full_run["history"]], np.float64)  # [steps, MoE layers, E]
    assert np.all(loads.sum(-1) == BATCH * SEQ * 2)  # every token routed to top-2 experts
    expected = (BIAS_RATE * np.sign(loads.mean(-1, keepdims=True) - loads)).sum(0)
    model = load_pretrained(workdir / "full" / "model", progress=False)
    routers = [layer.block_sparse_moe.gate for layer in model.model.layers if layer.is_moe]
    got = np.stack([np.asarray(r.e_score_correction_bias[...]) for r in routers])
    # float32 sums of +-rate over the steps: each addition rounds within u of a partial sum <= steps * rate
    steps = len(loads)
    np.testing.assert_allclose(got, expected, rtol=0, atol=gamma(steps) * steps * BIAS_RATE)


def test_bias_delta_signs_from_hand_counts() -> None:
    load = jnp.array([[10, 2, 4, 4], [5, 5, 5, 5]], jnp.int32)  # means 5 and 5
    rate = 0.01
    expected = np.array([[-rate, rate, rate, rate], [0.0, 0.0, 0.0, 0.0]], np.float32)
    np.testing.assert_allclose(np.asarray(bias_delta(load, rate)), expected, atol=0)
    # a mean over 4 experts, a max, a divide, a mean over 2 rows: within gamma(8)
    np.testing.assert_allclose(float(load_imbalance(load)), (10 / 5 + 1.0) / 2, rtol=gamma(8), atol=0)


def test_bias_update_balances_a_skewed_router() -> None:
    """Routing that favours high-numbered experts; repeated sign updates of the bias flatten the load."""
    rng = np.random.default_rng(0)
    n, d, e, k = 1024, 16, 8, 2
    x = rng.normal(size=(n, d)).astype(np.float32)
    x[:, 0] = np.abs(x[:, 0]) + 1.0
    w = (0.3 * rng.normal(size=(e, d))).astype(np.float32)
    w[:, 0] = np.linspace(-1.0, 1.0, e)  # expert e's score grows with e
    x, w = jnp.asarray(x), jnp.asarray(w)
    route_ids = jax.jit(lambda b: route(x, w, b, top_k=k)[1])

    def imbalance(bias: jax.Array) -> float:
        counts = np.bincount(np.asarray(route_ids(bias)).reshape(-1), minlength=e)  # independent recount
        return counts.max() / counts.mean()

    bias = jnp.zeros((e,), jnp.float32)
    before = imbalance(bias)
    for _ in range(300):
        ids = route_ids(bias)
        load = jnp.bincount(ids.reshape(-1), length=e)[None]
        bias = bias + bias_delta(load, 2e-3)[0]
    after = imbalance(bias)
    print(f"max/mean load: {before:.2f} without the bias update, {after:.2f} after 300 updates")
    assert before > 2.0
    assert after < 1.25
    assert float(bias[0]) > 0 > float(bias[-1])  # under-loaded experts pushed up, over-loaded down


def test_expert_load_output_leaves_logits_unchanged() -> None:
    from flax import nnx

    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM

    cfg = load_config("tiny")
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 24)), jnp.int32)
    logits = model(tokens)
    logits2, load = model(tokens, return_expert_load=True)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(logits2))
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    assert load.shape == (len(moe_layers), cfg.num_experts)
    assert np.all(np.asarray(load).sum(-1) == tokens.size * cfg.num_experts_per_token)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--data", "/nonexistent/corpus"], "no such file or directory"),
        (["--data", "EMPTY"], "the corpus is empty"),
        (["--config", "no-such-config"], "no config named 'no-such-config'"),
        (["--steps", "0"], "--steps must be a positive integer"),
    ],
)
def test_train_errors(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    message: str,
) -> None:
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.py").write_text("\n\n")
    (empty / "b.py").write_text("   \n")
    argv = [str(empty) if a == "EMPTY" else a for a in argv]
    base = ["train", "--config", "tiny", "--data", str(empty), "--out", str(tmp_path / "out")]
    assert main(base + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err


def test_shipped_model_is_the_default_and_beats_unigram() -> None:
    """`generate` / `serve` with no model arguments load the shipped model and its tokenizer (`--config tiny`
    still gives random weights); on a held-out standard-library file its loss is below the unigram
    baseline of the train split's token frequencies."""
    from jaxhybrid.assets import shipped_model_dir
    from jaxhybrid.tokenizer import HFTokenizer, load_tokenizer
    from jaxhybrid.train.data import stdlib_documents
    from jaxhybrid.train.step import next_token_loss
    from serve.models import ModelSettings, load_model, resolve_model

    shipped = shipped_model_dir()
    assert shipped is not None, "jaxhybrid/assets/stdlib-small is missing"
    settings = resolve_model(ModelSettings(dtype="float32"))
    model = load_model(settings)
    assert Path(settings.model) == shipped and model.config.vocab_size == 4096
    tok = load_tokenizer(settings.model, model.config)
    assert isinstance(tok, HFTokenizer) and tok.eos_token_id == 2 and tok.bos_token_id == 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(chat) == "user: hi\nassistant: "

    tiny = resolve_model(ModelSettings(config="tiny", dtype="float32"))
    assert load_model(tiny).config.vocab_size == 512 and tiny.model is None

    info = json.loads((shipped / "training.json").read_text())
    counts = np.asarray(info["train_unigram_counts"], np.float64)
    held_out = [d for d in stdlib_documents() if is_validation(d.name, info["val_fraction"])]
    held_out = [d for d in held_out if 4000 < d.path.stat().st_size < 40000]
    assert held_out, "no held-out standard-library file of a useful size on this machine"
    doc = held_out[0]
    ids = np.asarray([1, *tok.encode(doc.path.read_text(encoding="utf-8"))][:513], np.int32)
    logits = model(jnp.asarray(ids[None, :-1]))
    model_loss = float(next_token_loss(logits, jnp.asarray(ids[None, 1:])))
    probs = (counts + 1.0) / (counts.sum() + len(counts))
    unigram = float(-np.log(probs[ids[1:]]).mean())
    print(f"{doc.name}: model {model_loss:.3f} nats/token, unigram {unigram:.3f}")
    assert model_loss < unigram - 1.0
