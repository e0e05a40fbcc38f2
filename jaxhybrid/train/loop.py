"""The training run: corpus and tokenizer, model and optimizer, the step loop with validation, Orbax
checkpoints (saved asynchronously every `save_every` steps, resumed automatically from `out/checkpoints`),
and at the end the exported model (`out/model`, loadable with `load_pretrained` / `--model`), a JSON log
and a loss-curve PNG.

A checkpoint holds the fp32 parameters, the buffers (router biases), the optimizer state and the step;
its JSON metadata holds the data position (seed and step fully determine every batch, see `data`), the
loss history and a fingerprint of the run's settings, checked when resuming.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from jaxhybrid.train import copies as C
from jaxhybrid.train import data as D
from jaxhybrid.train import edits as E
from jaxhybrid.train.bpe import encode_batch, train_bpe
from jaxhybrid.train.schedule import lr_schedule, make_optimizer
from jaxhybrid.train.step import make_steps, split_model
from jaxhybrid.weights import load_pretrained, read_model_config, save_orbax

CHECKPOINT_DIR = "checkpoints"
TOKENIZER_DIR = "tokenizer"
MODEL_DIR = "model"
TRAINING_INFO = "training.json"


class TrainError(ValueError):
    """Bad training input (config, data, settings, or a checkpoint from different settings)."""


@dataclass
class TrainConfig:
    """Everything a run depends on; the fingerprint of the fields marked below must match when resuming."""

    config: str = "stdlib-small"
    data: tuple[str, ...] = (D.STDLIB_ALIAS,)
    out: str = "runs/train"
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 100
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    bias_rate: float = 1e-3
    seed: int = 0
    compute_dtype: str = "float32"
    tokenizer: str = "bpe"  # "bpe" (trained on the train split) or "byte"
    val_fraction: float = 0.05
    val_every: int = 100
    val_batches: int = 8
    save_every: int = 100
    export_dtype: str = "float32"
    progress: bool = True
    stop_after: int | None = None  # stop early (checkpointed), as if interrupted; not part of the fingerprint
    init: str | None = None  # a model directory to start from (its config, weights and tokenizer)
    edit_share: float = 0.0  # share of each batch's sequences that are edit documents (`edits`)
    copy_share: float = 0.0  # share of each batch's sequences that are copy documents (`copies`)
    copy_alphabet: int = 0  # > 0: half the random copy spans draw from a few ids (`copies.copy_span`)
    copy_longest: int = C.MAX_SPAN  # the longest copy span, in tokens

    def fingerprint(self) -> dict[str, Any]:
        keys = (
            "config",
            "data",
            "steps",
            "batch_size",
            "seq_len",
            "lr",
            "warmup_steps",
            "final_lr_fraction",
            "weight_decay",
            "clip_norm",
            "bias_rate",
            "seed",
            "compute_dtype",
            "tokenizer",
            "val_fraction",
            "init",
            "edit_share",
            "copy_share",
            "copy_alphabet",
            "copy_longest",
        )
        d = asdict(self)
        return {k: list(d[k]) if isinstance(d[k], tuple) else d[k] for k in keys}


def _check(cfg: TrainConfig) -> None:
    for name in ("steps", "batch_size", "seq_len", "val_every", "val_batches", "save_every"):
        if getattr(cfg, name) < 1:
            raise TrainError(
                f"--{name.replace('_', '-')} must be a positive integer, got {getattr(cfg, name)}"
            )
    if not cfg.lr > 0:
        raise TrainError(f"--lr must be positive, got {cfg.lr}")
    if cfg.compute_dtype not in ("float32", "bfloat16"):
        raise TrainError(f"--compute-dtype must be float32 or bfloat16, got {cfg.compute_dtype}")
    if cfg.tokenizer not in ("bpe", "byte"):
        raise TrainError(f"--tokenizer must be bpe or byte, got {cfg.tokenizer}")
    if not cfg.data:
        raise TrainError("--data needs at least one path (or 'stdlib')")
    for name in ("edit_share", "copy_share"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise TrainError(f"--{name.replace('_', '-')} must lie in [0, 1], got {getattr(cfg, name)}")
    shares = (cfg.edit_share, cfg.copy_share)
    if sum(D.share_rows(cfg.batch_size, s) for s in shares) > cfg.batch_size:
        raise TrainError(
            f"--edit-share {cfg.edit_share} and --copy-share {cfg.copy_share} together take more than the "
            f"{cfg.batch_size} rows of a batch"
        )
    if cfg.copy_alphabet and cfg.copy_alphabet < C.MIN_ALPHABET:
        raise TrainError(f"--copy-alphabet must be 0 or at least {C.MIN_ALPHABET}, got {cfg.copy_alphabet}")
    if cfg.copy_longest < C.MIN_SPAN:
        raise TrainError(f"--copy-longest must be at least {C.MIN_SPAN}, got {cfg.copy_longest}")
    if cfg.init is not None and not (Path(cfg.init) / "config.json").exists():
        raise TrainError(f"--init {cfg.init}: not a model directory (no config.json)")


def _tokenizer(cfg: TrainConfig, vocab_size: int, train_texts: list[str], out: Path) -> Any:
    """The run's tokenizer: a BPE trained on the train split (reused from `out/tokenizer` when resuming),
    or the byte-level one."""
    if cfg.tokenizer == "byte":
        if vocab_size < 259:
            raise TrainError(f"the byte-level tokenizer needs vocab_size >= 259, the config has {vocab_size}")
        return ByteTokenizer(vocab_size)
    directory = out / TOKENIZER_DIR
    if (directory / "tokenizer.json").exists():
        tok = HFTokenizer.from_dir(directory)
        if tok.vocab_size > vocab_size:
            raise TrainError(f"{directory}: {tok.vocab_size} ids do not fit the config's vocab_size")
        return tok
    if vocab_size < 259:
        raise TrainError(f"a byte-level BPE needs vocab_size >= 259, the config has {vocab_size}")
    return train_bpe(train_texts, vocab_size, directory)


def _encode(tok: Any, texts: list[str]) -> list[list[int]]:
    if hasattr(tok, "tokenizer"):
        return encode_batch(tok, texts)
    return [tok.encode(t) for t in texts]


@dataclass(frozen=True)
class Corpus:
    """The documents of `--data`, split into train and validation by file, with their texts."""

    docs: list[D.Document]
    train_docs: list[D.Document]
    val_docs: list[D.Document]
    train_texts: list[str]
    val_texts: list[str]


def load_corpus(data: tuple[str, ...] | list[str], val_fraction: float) -> Corpus:
    """Read and split the corpus as `train` does (DataError / TrainError when there is nothing to read), so
    anyone can evaluate on a run's validation split: same `data` and `val_fraction`, same files."""
    docs = D.collect_documents(data)
    if not docs:
        raise TrainError("the corpus is empty: no files")
    texts = dict(zip((d.name for d in docs), D.read_texts(docs), strict=True))  # DataError if all blank
    train_docs, val_docs = D.split_documents(docs, val_fraction)
    return Corpus(
        docs, train_docs, val_docs, [texts[d.name] for d in train_docs], [texts[d.name] for d in val_docs]
    )


def _bos_eos(tok: Any, model_cfg: Any) -> tuple[int, int]:
    """The tokenizer's bos / eos, else the config's."""
    bos = tok.bos_token_id if tok.bos_token_id is not None else model_cfg.bos_token_id
    eos = tok.eos_token_id if tok.eos_token_id is not None else model_cfg.eos_token_id
    return bos, eos


def encode_stream(tok: Any, texts: list[str], model_cfg: Any) -> np.ndarray:
    """`[bos] + ids + [eos]` of every text, concatenated."""
    return D.token_stream(texts, lambda t: _encode(tok, t), *_bos_eos(tok, model_cfg))


def _corpus_fingerprint(docs: list[D.Document], train: np.ndarray, val: np.ndarray) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(d.name.encode() + b"\0")
    h.update(f"{len(train)}:{len(val)}".encode())
    return h.hexdigest()[:16]


def _checkpoint_manager(directory: Path, keep: int = 2) -> Any:
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def _evaluate(eval_step: Any, params: Any, rest: Any, batches: list[np.ndarray]) -> float:
    total, count = 0.0, 0.0
    for b in batches:
        s, n = eval_step(params, rest, jnp.asarray(b))
        total, count = total + float(s), count + float(n)
    return total / count


def save_plot(history: list[dict[str, Any]], val: list[dict[str, Any]], baseline: float, path: Path) -> None:
    """Training and validation loss vs step, with the unigram baseline, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], lw=0.8, label="train")
    if val:
        ax.plot([v["step"] for v in val], [v["loss"] for v in val], "o-", label="validation")
    ax.axhline(baseline, color="gray", ls="--", label=f"unigram baseline ({baseline:.2f})")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("next-token loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def export_model(
    model: Any, graphdef: Any, params: Any, rest: Any, out: Path, dtype: str, tok_dir: Path | None
) -> Path:
    """The trained model as our Orbax checkpoint directory (`out/model`), parameters in `dtype`."""
    cast = jax.tree.map(lambda p: p.astype(dtype) if p.dtype == jnp.float32 and p.ndim >= 2 else p, params)
    return save_orbax(nnx.merge(graphdef, cast, rest), out / MODEL_DIR, tokenizer_dir=tok_dir, overwrite=True)


@dataclass(frozen=True)
class Start:
    """What a run starts from: the model (fresh from the config, or `--init`'s weights), its tokenizer, and
    the directory whose tokenizer files the exported model gets (None: the byte-level tokenizer)."""

    model: Any
    tokenizer: Any
    tokenizer_dir: Path | None


def _model_config(cfg: TrainConfig) -> Any:
    """The run's model config: `cfg.config`'s (ConfigError for a bad name), or `cfg.init`'s."""
    return load_config(cfg.config) if cfg.init is None else read_model_config(cfg.init)


def _start(cfg: TrainConfig, model_cfg: Any, train_texts: list[str], out: Path) -> Start:
    """A fresh model of `model_cfg` with the run's tokenizer, or `cfg.init`'s model and tokenizer."""
    if cfg.init is None:
        tok = _tokenizer(cfg, model_cfg.vocab_size, train_texts, out)
        model = HybridLM(model_cfg, rngs=nnx.Rngs(cfg.seed))
        return Start(model, tok, out / TOKENIZER_DIR if cfg.tokenizer == "bpe" else None)
    tok = load_tokenizer(cfg.init, model_cfg)
    if tok is None:
        raise TrainError(f"--init {cfg.init}: no tokenizer files, and the vocabulary is too small for bytes")
    model = load_pretrained(cfg.init, dtype=jnp.float32, progress=False)
    return Start(model, tok, Path(cfg.init))


@dataclass(frozen=True)
class EditData:
    """The edit documents (`edits`) of both splits, encoded: training draws whole ones, validation reads
    their concatenation as it reads the corpus's."""

    train: list[np.ndarray]
    val: list[np.ndarray]
    rows: int  # of each training batch

    @staticmethod
    def build(cfg: TrainConfig, corpus: Corpus, tok: Any, model_cfg: Any) -> EditData | None:
        if cfg.edit_share <= 0:
            return None
        bos, eos = _bos_eos(tok, model_cfg)
        encoded = []
        for texts in (corpus.train_texts, corpus.val_texts):
            ids = _encode(tok, E.edit_documents(texts))
            encoded.append(
                [np.asarray([bos, *x, eos], np.int32) for x in ids if len(x) + 2 <= cfg.seq_len + 1]
            )
        if not encoded[0] or not encoded[1]:
            raise TrainError(
                f"--edit-share: the corpus has no function of {E.MIN_LINES}-{E.MAX_LINES} lines whose edit "
                f"document fits --seq-len {cfg.seq_len} in both splits"
            )
        return EditData(encoded[0], encoded[1], D.share_rows(cfg.batch_size, cfg.edit_share))

    def val_batches(self, cfg: TrainConfig) -> list[np.ndarray]:
        return list(D.val_batches(np.concatenate(self.val), cfg.batch_size, cfg.seq_len, cfg.val_batches))


@dataclass(frozen=True)
class CopyData:
    """What copy documents (`copies`) are built from: their frame in the tokenizer's ids and the vocabulary
    random ids are drawn from."""

    frame: C.CopyFrame
    vocab: int
    rows: int  # of each training batch
    alphabet: int = 0
    longest: int = C.MAX_SPAN

    @staticmethod
    def build(cfg: TrainConfig, tok: Any, model_cfg: Any, corpus_tokens: int) -> CopyData | None:
        if cfg.copy_share <= 0:
            return None
        frame = C.CopyFrame.encode(tok, *_bos_eos(tok, model_cfg))
        try:
            C.span_bound(frame, corpus_tokens, cfg.seq_len, cfg.copy_longest)
        except ValueError as exc:
            raise TrainError(f"--copy-share: {exc}") from None
        vocab = min(model_cfg.vocab_size, getattr(tok, "vocab_size", model_cfg.vocab_size))
        rows = D.share_rows(cfg.batch_size, cfg.copy_share)
        return CopyData(frame, vocab, rows, cfg.copy_alphabet, cfg.copy_longest)


def _batch(
    cfg: TrainConfig,
    stream: np.ndarray,
    edits: EditData | None,
    step: int,
    copies: CopyData | None = None,
) -> np.ndarray:
    """Batch `step`: windows of the corpus, then with `--edit-share` rows of whole edit documents, then with
    `--copy-share` rows of copy documents."""
    special = (0 if edits is None else edits.rows) + (0 if copies is None else copies.rows)
    rows = cfg.batch_size - special
    parts = [D.train_batch(stream, rows, cfg.seq_len, cfg.seed, step)] if rows else []
    if edits is not None:
        parts.append(E.edit_rows(edits.train, edits.rows, cfg.seq_len, cfg.seed, step))
    if copies is not None:
        args = (copies.frame, stream, copies.vocab, copies.rows, cfg.seq_len, cfg.seed, step)
        parts.append(C.copy_rows(*args, alphabet=copies.alphabet, longest=copies.longest))
    return np.concatenate(parts)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) a training run; returns the summary that is also written to `out/log.json`."""
    import orbax.checkpoint as ocp
    from tqdm import tqdm

    _check(cfg)
    model_cfg = _model_config(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    corpus = load_corpus(cfg.data, cfg.val_fraction)
    docs, train_docs, val_docs = corpus.docs, corpus.train_docs, corpus.val_docs
    begin = _start(cfg, model_cfg, corpus.train_texts, out)
    tok, model = begin.tokenizer, begin.model
    train_stream = encode_stream(tok, corpus.train_texts, model_cfg)
    val_stream = encode_stream(tok, corpus.val_texts, model_cfg)
    val_data = list(D.val_batches(val_stream, cfg.batch_size, cfg.seq_len, cfg.val_batches))
    D.train_batch(train_stream, 1, cfg.seq_len, cfg.seed, 0)  # DataError if the split is too short
    edits = EditData.build(cfg, corpus, tok, model_cfg)
    val_edits = None if edits is None else edits.val_batches(cfg)
    copies = CopyData.build(cfg, tok, model_cfg, len(train_stream))
    counts = D.unigram_counts(train_stream, model_cfg.vocab_size)
    val_targets = np.concatenate([b[:, 1:].reshape(-1) for b in val_data])
    unigram = D.unigram_cross_entropy(counts, val_targets)
    fingerprint = {**cfg.fingerprint(), "corpus": _corpus_fingerprint(docs, train_stream, val_stream)}

    graphdef, params, rest = split_model(model)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    schedule = lr_schedule(cfg.lr, cfg.warmup_steps, cfg.steps, cfg.final_lr_fraction)
    tx = make_optimizer(schedule, weight_decay=cfg.weight_decay, clip_norm=cfg.clip_norm)
    opt_state = tx.init(params)
    train_step, eval_step = make_steps(
        graphdef, tx, bias_rate=cfg.bias_rate, compute_dtype=jnp.dtype(cfg.compute_dtype)
    )

    mngr = _checkpoint_manager(out / CHECKPOINT_DIR)
    start, history, val_history = 0, [], []
    latest = mngr.latest_step()
    if latest is not None:
        tree = {"params": params, "rest": rest, "opt_state": opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        restored = mngr.restore(
            latest,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()),
        )
        meta = restored["meta"]
        if meta["fingerprint"] != fingerprint:
            diff = sorted(k for k in fingerprint if meta["fingerprint"].get(k) != fingerprint[k])
            raise TrainError(
                f"{out / CHECKPOINT_DIR}: the checkpoint was written with different settings "
                f"({', '.join(diff)}); use another --out or the same settings"
            )
        state = restored["state"]
        params, rest, opt_state = state["params"], state["rest"], state["opt_state"]
        start, history, val_history = int(meta["step"]), meta["history"], meta["val_history"]

    def save(step: int, force: bool = False) -> None:
        meta = {
            "step": step,
            "data": {"seed": cfg.seed, "next_batch": step},
            "fingerprint": fingerprint,
            "history": history,
            "val_history": val_history,
        }
        # Host copies: the background write then never touches device buffers (an async save of live
        # jax arrays deadlocked XLA:CPU's next step here), and the step may move on at once.
        tree = jax.device_get({"params": params, "rest": rest, "opt_state": opt_state})
        mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    tokens_per_step = cfg.batch_size * cfg.seq_len
    timed_tokens, timed_seconds = 0, 0.0
    bar = tqdm(total=cfg.steps, initial=start, desc="train", unit="step", disable=not cfg.progress)
    end = cfg.steps if cfg.stop_after is None else max(start, min(cfg.steps, cfg.stop_after))
    for step in range(start, end):
        batch = jnp.asarray(_batch(cfg, train_stream, edits, step, copies))
        t0 = time.perf_counter()
        params, rest, opt_state, metrics = train_step(params, rest, opt_state, batch)
        loss = float(metrics["loss"])
        dt = time.perf_counter() - t0
        if step > start:  # the first step of a process compiles
            timed_tokens, timed_seconds = timed_tokens + tokens_per_step, timed_seconds + dt
        if not math.isfinite(loss):
            raise TrainError(f"step {step + 1}: the loss is {loss}; lower --lr")
        record = {
            "step": step + 1,
            "loss": loss,
            "lr": float(schedule(step)),
            "grad_norm": float(metrics["grad_norm"]),
            "imbalance": float(metrics["imbalance"]),
            "load": np.asarray(metrics["load"]).tolist(),  # tokens per expert, [MoE layer][expert]
        }
        history.append(record)
        done = step + 1
        if done % cfg.val_every == 0 or done == cfg.steps:
            val_history.append({"step": done, "loss": _evaluate(eval_step, params, rest, val_data)})
            if val_edits is not None:
                val_history[-1]["edit_loss"] = _evaluate(eval_step, params, rest, val_edits)
        tok_s = timed_tokens / timed_seconds if timed_seconds else 0.0
        postfix = {"loss": f"{loss:.3f}", "tok/s": f"{tok_s:.0f}"}
        if val_history:
            postfix["val"] = f"{val_history[-1]['loss']:.3f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if done % cfg.save_every == 0 or done in (cfg.steps, end):
            save(done, force=done in (cfg.steps, end))
    bar.close()
    mngr.wait_until_finished()
    mngr.close()
    if end < cfg.steps:
        return {"stopped_at": end, "steps": cfg.steps, "history": history, "val_history": val_history}

    export_model(model, graphdef, params, rest, out, cfg.export_dtype, begin.tokenizer_dir)
    final_val = val_history[-1]["loss"] if val_history else float("nan")
    summary = {
        "config": cfg.config if cfg.init is None else model_cfg.name,
        "init": cfg.init,
        "parameters": int(n_params),
        "steps": cfg.steps,
        "resumed_from": start,
        "tokens_per_step": tokens_per_step,
        "train_tokens_seen": tokens_per_step * cfg.steps,
        "corpus": {
            "data": list(cfg.data),
            "files": len(docs),
            "train_files": len(train_docs),
            "val_files": len(val_docs),
            "train_tokens": int(len(train_stream)),
            "val_tokens": int(len(val_stream)),
            "val_tokens_evaluated": int(val_targets.size),
            "edit_documents": None if edits is None else {"train": len(edits.train), "val": len(edits.val)},
        },
        "final_train_loss": history[-1]["loss"] if history else float("nan"),
        "final_val_loss": final_val,
        "final_val_edit_loss": val_history[-1].get("edit_loss") if val_history else None,
        "unigram_val_loss": unigram,
        "tokens_per_second": timed_tokens / timed_seconds if timed_seconds else None,
        "wall_seconds": time.perf_counter() - t_start,
        "settings": asdict(cfg),
        "history": history,
        "val_history": val_history,
    }
    (out / "log.json").write_text(json.dumps(summary, indent=1) + "\n")
    info = {
        "val_fraction": cfg.val_fraction,
        "split": "sha256 of the path relative to the corpus root < val_fraction * 2**64 -> validation",
        "data": list(cfg.data),
        "init": cfg.init,
        "edit_share": cfg.edit_share,
        "copy_share": cfg.copy_share,
        "copy_alphabet": cfg.copy_alphabet,
        "copy_longest": cfg.copy_longest,
        "final_val_loss": final_val,
        "unigram_val_loss": unigram,
        "train_unigram_counts": counts.tolist(),
    }
    (out / MODEL_DIR / TRAINING_INFO).write_text(json.dumps(info) + "\n")
    save_plot(history, val_history, unigram, out / "loss.png")
    return summary
