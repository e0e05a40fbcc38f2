"""`jaxhybrid train`: next-token training of a config on a text corpus (default: the Python standard
library's own source), with Orbax checkpoints that a rerun with the same settings resumes from."""

from __future__ import annotations

import argparse
import json
import sys

from jaxhybrid.config import ConfigError
from jaxhybrid.tokenizer import TokenizerError
from jaxhybrid.train import TrainConfig, TrainError, train
from jaxhybrid.train.data import DataError
from jaxhybrid.train.step import cpu_workaround_flags
from jaxhybrid.weights.safetensors import CheckpointError
from serve.cli.common import add_config_arg


def run(args: argparse.Namespace) -> int:
    """Train a model; writes OUT/model (an Orbax model directory for --model), OUT/log.json, OUT/loss.png."""
    cpu_workaround_flags()  # before JAX starts its backend

    cfg = TrainConfig(
        config=args.config,
        data=tuple(args.data),
        out=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        clip_norm=args.clip_norm,
        bias_rate=args.bias_rate,
        seed=args.seed,
        compute_dtype=args.compute_dtype,
        tokenizer=args.tokenizer,
        val_fraction=args.val_fraction,
        val_every=args.val_every,
        val_batches=args.val_batches,
        save_every=args.save_every,
        export_dtype=args.export_dtype,
        progress=not args.no_progress,
        stop_after=args.stop_after,
        init=args.init,
        edit_share=args.edit_share,
        copy_share=args.copy_share,
        copy_alphabet=args.copy_alphabet,
        copy_longest=args.copy_longest,
    )
    try:
        summary = train(cfg)
    except (TrainError, DataError, ConfigError, TokenizerError, CheckpointError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    brief = {k: v for k, v in summary.items() if k not in ("history", "val_history", "settings")}
    print(json.dumps(brief, indent=1))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a model on a text corpus (CPU is fine)", description=run.__doc__)
    add_config_arg(p)
    p.set_defaults(config="stdlib-small")
    p.add_argument(
        "--data",
        nargs="+",
        default=["stdlib"],
        help="'stdlib' (the standard library's .py files, default), text files, or directories",
    )
    p.add_argument(
        "--out", default="runs/train", help="run directory: checkpoints, model, log (default runs/train)"
    )
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (default 1000)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warmup steps (default 100)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    p.add_argument("--clip-norm", type=float, default=1.0, help="global gradient-norm clip (default 1.0)")
    p.add_argument(
        "--bias-rate",
        type=float,
        default=1e-3,
        help="router bias update rate of the aux-loss-free load balancing (0 = off; default 1e-3)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the batches")
    p.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--tokenizer",
        choices=("bpe", "byte"),
        default="bpe",
        help="bpe: a byte-level BPE of the config's vocab_size trained on the train split (default); "
        "byte: the byte-level tokenizer",
    )
    p.add_argument("--val-fraction", type=float, default=0.05, help="share of files held out (default 0.05)")
    p.add_argument("--val-every", type=int, default=100, help="validation loss every N steps (default 100)")
    p.add_argument("--val-batches", type=int, default=8, help="validation batches (default 8)")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps (default 100)")
    p.add_argument(
        "--export-dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="dtype of the exported model's matrices (default float32)",
    )
    p.add_argument(
        "--init",
        default=None,
        metavar="MODEL_DIR",
        help="start from this model's weights, config and tokenizer (fine-tuning; --config and --tokenizer "
        "are then not used)",
    )
    p.add_argument(
        "--edit-share",
        type=float,
        default=0.0,
        help="share of each batch's sequences that are edit documents: a function of the corpus, a request "
        "to write it again (unchanged or with an argument renamed) and the result (default 0)",
    )
    p.add_argument(
        "--copy-share",
        type=float,
        default=0.0,
        help="share of each batch's sequences that are copy documents: a span (random ids, or corpus text "
        "with random ids substituted), the request to write it again, and the span again; teaches a small "
        "model to copy what its context shows (default 0)",
    )
    p.add_argument(
        "--copy-alphabet",
        type=int,
        default=0,
        metavar="N",
        help="with --copy-share: half the random spans draw from 4 to N ids, whose short n-grams recur, so "
        "that a copy is found by a longer match (default 0: every random span from the whole vocabulary)",
    )
    p.add_argument(
        "--copy-longest",
        type=int,
        default=360,
        metavar="N",
        help="with --copy-share: the longest span in tokens (also at most half a sequence; default 360)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="stop (checkpointed) after this step, as if interrupted; a rerun resumes",
    )
    p.set_defaults(func=run)
