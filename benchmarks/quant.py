"""`jaxhybrid bench quant [--model DIR] [--scheme mxfp4|int8]`: the accuracy cost of MXFP4 routed experts,
or (`--scheme int8`) of `--weight-dtype int8`'s weight-only int8 linear layers and experts.

The model (default: the shipped one) is written with MXFP4 experts exactly as `jaxhybrid convert
--quantize-experts mxfp4` writes it (or `--quantized DIR` names such a directory) and both are loaded with
`load_pretrained`. On the validation split of the training corpus (`jaxhybrid.train`'s split by file and
its next-token loss; the first `--batches` x `--batch-size` x `--seq-len` tokens, docs/training.md's table) it
reports nats/token of each, the difference, how often the two models' most likely next token agrees
and the mean KL(dense || mxfp4) per token; then greedy completions of a few prompts through the engine,
and how many tokens each keeps before the two diverge.
"""

from __future__ import annotations

import argparse
import functools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.report import Table, report
from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.tokenizer import load_tokenizer
from jaxhybrid.train import data as D
from jaxhybrid.train.loop import encode_stream, load_corpus
from jaxhybrid.train.step import next_token_loss
from jaxhybrid.weights import load_pretrained, save_hf
from serve.bench.common import add_out_arg, environment
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams

# The prompts of docs/training.md's table of greedy completions.
PROMPTS = (
    "def fibonacci(n):",
    "def __init__(self",
    "import os\nimport sys\n",
    "class Queue:",
    "for i in range(",
    "Hello",
)


def validation_batches(model_dir: Path, cfg: Any, args: argparse.Namespace) -> list[Any]:
    """The validation windows `jaxhybrid train` evaluates on: same corpus split, tokenizer, batches."""
    corpus = load_corpus(args.data, args.val_fraction)
    stream = encode_stream(load_tokenizer(model_dir, cfg), corpus.val_texts, cfg)
    return list(D.val_batches(stream, args.batch_size, args.seq_len, args.batches))


@functools.cache
def _sums() -> Any:
    """The jitted per-batch sums of `compare_on` (made once: both calls of a process share its programs)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @nnx.jit
    def sums(dense: Any, quant: Any, batch: jax.Array) -> dict[str, jax.Array]:
        x, y = batch[:, :-1], batch[:, 1:]
        logp = jax.nn.log_softmax(dense(x).astype(jnp.float32), axis=-1)
        logq = jax.nn.log_softmax(quant(x).astype(jnp.float32), axis=-1)
        n = y.size
        return {
            "dense": next_token_loss(logp, y) * n,
            "quant": next_token_loss(logq, y) * n,
            "top1_agree": (logp.argmax(-1) == logq.argmax(-1)).sum().astype(jnp.float32),
            "kl": (jnp.exp(logp) * (logp - logq)).sum(),
        }

    return sums


def compare_on(dense: Any, quant: Any, batches: list[Any], scheme: str = "mxfp4") -> dict[str, float]:
    """Summed over the batches: each model's next-token loss (the training loss; the quantized model's under
    the key `scheme`), top-1 agreement and KL(dense || quant), per target token."""
    import jax.numpy as jnp

    total: dict[str, float] = {}
    tokens = 0
    for batch in batches:
        for k, v in _sums()(dense, quant, jnp.asarray(batch)).items():
            total[k] = total.get(k, 0.0) + float(v)
        tokens += batch[:, 1:].size
    total[scheme] = total.pop("quant")
    return {k: v / tokens for k, v in total.items()} | {"tokens": tokens}


def greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(model, EngineConfig(max_slots=len(prompts), block_size=16))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in engine.generate(prompts, params)]


def agreed_prefix(a: list[int], b: list[int]) -> int:
    """Tokens two completions share before they first differ."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    model_dir = Path(args.model) if args.model else shipped_model_dir()
    if model_dir is None:
        print("error: give --model (the shipped model is not installed)", file=sys.stderr)
        return 2
    dtype = jnp.dtype(args.dtype)
    dense = load_pretrained(model_dir, dtype=dtype, progress=False)
    scheme = args.scheme
    if scheme == "int8":  # as `--weight-dtype int8` serves it
        quant = load_pretrained(model_dir, dtype=dtype, progress=False)
        quant.to_int8()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            quant_dir = Path(args.quantized) if args.quantized else Path(tmp) / "mxfp4"
            if not args.quantized:
                save_hf(dense, quant_dir, tokenizer_dir=model_dir, expert_quant="mxfp4")
            quant = load_pretrained(quant_dir, dtype=dtype, progress=False)
        if quant.config.expert_quant != "mxfp4":
            print(f"error: {quant_dir} has no MXFP4 routed experts", file=sys.stderr)
            return 2
    cfg = dense.config
    t0 = time.perf_counter()
    val = compare_on(dense, quant, validation_batches(model_dir, cfg, args), scheme)
    t1 = time.perf_counter()
    completions = []
    if args.greedy_tokens:
        tok = load_tokenizer(model_dir, cfg)
        prompts = [tok.encode(p) for p in args.prompts]
        outs = [greedy(m, prompts, args.greedy_tokens) for m in (dense, quant)]
        for text, a, b in zip(args.prompts, *outs, strict=True):
            completions.append(
                {
                    "prompt": text,
                    "agreed_tokens": agreed_prefix(a, b),
                    "same_positions": sum(x == y for x, y in zip(a, b, strict=True)),
                    "dense": tok.decode(a),
                    scheme: tok.decode(b),
                }
            )
    result = {
        "bench": "quant",
        "model": str(model_dir),
        "scheme": scheme,
        "quantized": (
            "int8 weights (--weight-dtype int8)"
            if scheme == "int8"
            else str(args.quantized)
            if args.quantized
            else "written by convert's writer (save_hf)"
        ),
        "dtype": str(dtype),
        "validation": {
            "data": list(args.data),
            "val_fraction": args.val_fraction,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "batches": args.batches,
            **val,
        },
        "delta_nats_per_token": val[scheme] - val["dense"],
        "validation_s": round(t1 - t0, 1),  # corpus, tokenizing, compiling and both forwards
        "greedy_s": round(time.perf_counter() - t1, 1),
        "greedy_tokens": args.greedy_tokens,
        "completions": completions,
        "environment": environment(),
    }
    rows = [
        {"model": "dense", "nats/token": f"{val['dense']:.4f}"},
        {
            "model": "mxfp4 experts" if scheme == "mxfp4" else "int8 weights",
            "nats/token": f"{val[scheme]:.4f}",
            "delta": f"{val[scheme] - val['dense']:+.4f}",
            "top-1 agree": f"{val['top1_agree']:.4f}",
            "KL nats": f"{val['kl']:.5f}",
        },
    ]
    parts: list[Table | str] = [
        f"validation: {val['tokens']} target tokens",
        Table(rows, ["model", "nats/token", "delta", "top-1 agree", "KL nats"]),
    ]
    if completions:
        agreed = [{"prompt": repr(c["prompt"]), "agreed": c["agreed_tokens"]} for c in completions]
        title = f"greedy, {args.greedy_tokens} tokens: equal before the first difference"
        parts.append(Table(agreed, ["prompt", "agreed"], title=title))
    return report(result, args, *parts)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quant",
        help="validation loss of a model dense vs with MXFP4 routed experts (or int8 weights)",
        description=__doc__,
    )
    p.add_argument("--model", help="a dense model directory (default: the shipped model)")
    p.add_argument(
        "--scheme",
        choices=["mxfp4", "int8"],
        default="mxfp4",
        help="mxfp4: MXFP4 routed experts (default); int8: --weight-dtype int8's weight-only int8",
    )
    p.add_argument(
        "--quantized",
        help="its MXFP4 copy from `jaxhybrid convert --quantize-experts mxfp4` (default: written here)",
    )
    p.add_argument("--data", nargs="+", default=["stdlib"], help="the training corpus (default stdlib)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="the run's validation fraction")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batches", type=int, default=8, help="validation batches (the first ones)")
    p.add_argument("--dtype", default="float32", help="dtype both models run in (default float32)")
    p.add_argument("--greedy-tokens", type=int, default=40, help="greedy tokens per prompt (0: none)")
    p.add_argument("--prompts", nargs="+", default=list(PROMPTS), help="prompts of the greedy comparison")
    add_out_arg(p)
    p.set_defaults(func=run)
