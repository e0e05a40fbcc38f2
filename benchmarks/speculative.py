"""`jaxhybrid bench speculative`: decode with and without speculative decoding, on the same requests in the
same run.

Workloads, held out by default: the shipped model was trained on the Python standard library alone (its
source files, edit and copy documents built from them), and was never tuned on these:
- `edit`: eight functions of installed third-party packages whose versions the project pins (jax, flax,
  optax, orbax-checkpoint), one from each of `HELD_OUT_FILES`, the first of its 8-30-line functions by the
  SHA-256 of its code (so nobody picked them), each followed by a request to write it again unchanged and
  its first line (`jaxhybrid.train.edits.unchanged_prompt`, the phrasing of the training's edit documents:
  the completion rewrites code the prompt holds, and ends at its end-of-sequence token);
- `continue`: the first lines of those files (free completion, `--new-tokens` each);
- `prose`: the long descriptions (PyPI pages) of those packages, in Markdown;
- `edit-repo`: the former `edit`, three functions of this repository, which the model's copy tuning was
  judged on: not held out.
Each row serves its workload's prompts on `--batch` slots (each prompt once, cycled through up to `--batch`
requests: at batch 1, every prompt alone, one after another) greedily, first without speculation and then
with prompt-lookup drafts (`ngram`), in one engine each (prefix store off, so both prefill the same), after a
warm-up pass that compiles; it reports tokens/s of the decode steps, their ratio, whether the tokens are
identical, drafted and accepted tokens, and where the time of the speculating pass went: drafting (host),
the verify program (which also keeps the state of the last accepted token: there is no separate rollback)
and plain decode steps (steps in which no row had drafts).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import importlib.metadata
import math
import os.path
import site
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.report import Table, report
from jaxhybrid.tokenizer import ByteTokenizer, load_tokenizer
from jaxhybrid.train.edits import functions, unchanged_completion, unchanged_prompt
from jaxhybrid.weights import load_pretrained
from serve.bench.common import add_model_args, add_out_arg, environment, load_bench_model
from serve.engine.config import EngineShape
from serve.engine.engine import Engine, EngineConfig, draft_source
from serve.engine.sampling import SamplingParams
from serve.engine.speculative import PromptLookup, Speculation
from serve.engine.warmup import Warmup, WarmupLevel

REPO = Path(__file__).resolve().parents[2]
# (file, function) pairs of the `edit-repo` workload, all from this repository
REPO_EDIT_SOURCES = (
    ("serve/engine/speculative.py", "truncate_at_stop"),
    ("serve/engine/blocks.py", None),
    ("jaxhybrid/ops/conv.py", "causal_conv1d"),
)
# Files of packages pinned in pyproject.toml (so the same code everywhere), relative to site-packages: the
# held-out workloads' sources.
HELD_OUT_FILES = (
    "optax/_src/transform.py",
    "optax/_src/linesearch.py",
    "flax/nnx/rnglib.py",
    "jax/_src/util.py",
    "orbax/checkpoint/_src/path/step.py",
    "flax/linen/summary.py",
    "optax/_src/utils.py",
    "jax/_src/tree_util.py",
)
HELD_OUT_PACKAGES = ("jax", "flax", "optax")  # whose descriptions are the `prose` workload
HELD_OUT_LINES = (8, 30)  # a held-out function's length in lines, signature to last line
WORKLOADS = ("edit", "continue", "prose", "edit-repo")


def _function(path: str, name: str | None) -> str:
    """The source of function `name` in `path` (the file's first function when None), docstring included."""
    text = (REPO / path).read_text()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (name is None or node.name == name):
            lines = text.splitlines()[node.lineno - 1 : node.end_lineno]
            indent = len(lines[0]) - len(lines[0].lstrip())
            return "\n".join(line[indent:] for line in lines)
    raise ValueError(f"no function {name!r} in {path}")


def held_out_file(relative: str) -> Path:
    """`relative` (a HELD_OUT_FILES entry) in the installed packages."""
    for root in site.getsitepackages():
        if (Path(root) / relative).is_file():
            return Path(root) / relative
    raise FileNotFoundError(f"{relative} is not in site-packages (is the package installed?)")


def held_out_functions() -> list[str]:
    """The `edit` workload's functions: of each HELD_OUT_FILES file, the first function of HELD_OUT_LINES
    lines by the SHA-256 of its code."""
    lo, hi = HELD_OUT_LINES
    out = []
    for relative in HELD_OUT_FILES:
        found = [f.code for f in functions(held_out_file(relative).read_text())]
        found = [code for code in found if lo <= len(code.splitlines()) <= hi]
        if not found:
            raise ValueError(f"no function of {lo}-{hi} lines in {relative}")
        out.append(min(found, key=lambda code: hashlib.sha256(code.encode()).hexdigest()))
    return out


def edit_functions(workload: str) -> list[str]:
    """The functions an edit workload asks to write again."""
    if workload == "edit":
        return held_out_functions()
    return [_function(path, name) for path, name in REPO_EDIT_SOURCES]


def prompts(workload: str, context: int) -> list[str]:
    """The prompt texts of `workload` (at most `context` characters each)."""
    if workload in ("edit", "edit-repo"):
        return [unchanged_prompt(code)[-context:] for code in edit_functions(workload)]
    if workload == "prose":
        return [importlib.metadata.metadata(p).get_payload()[:context] for p in HELD_OUT_PACKAGES]
    return [held_out_file(relative).read_text()[:context] for relative in HELD_OUT_FILES]


def expected(workload: str) -> list[str] | None:
    """What a completion of each edit prompt should be: the function after its first line (None for free
    completion, which has no right answer)."""
    if workload not in ("edit", "edit-repo"):
        return None
    return [unchanged_completion(code) for code in edit_functions(workload)]


def copied(texts: list[str], wanted: list[str]) -> float:
    """The mean share of each wanted text that its completion reproduces before the first difference."""
    shares = [len(os.path.commonprefix([t, w])) / len(w) for t, w in zip(texts, wanted, strict=True)]
    return sum(shares) / len(shares)


@contextlib.contextmanager
def timing(obj: Any, name: str, totals: dict[str, float]) -> Iterator[None]:
    """Add the wall time of every call of `obj.name` (blocking on its result) to totals[name]."""
    import jax

    fn = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kwargs))
        totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        return out

    setattr(obj, name, timed)
    try:
        yield
    finally:
        setattr(obj, name, fn)


class Setup:
    """One engine serving the row's requests greedily with speculation `method` (`draft`: the draft model of
    method "draft"), compiled by a first pass; `stop`: a request ends at its end-of-sequence token."""

    def __init__(
        self,
        model: Any,
        ids: list[list[int]],
        args: argparse.Namespace,
        method: str,
        draft: Any,
        stop: bool,
        slots: int,
    ):
        spec = Speculation.parse(method, args.num_speculative_tokens)
        longest = max(len(p) for p in ids) + args.new_tokens + 1
        config = EngineConfig(
            max_slots=slots, max_model_len=longest, prefix=None, speculative=spec, kv_dtype=args.dtype
        )
        if method == "draft":
            self.drafter = draft_source(draft, model.config, EngineShape.resolve(config, model.config))
        else:
            self.drafter = PromptLookup()
        self.engine = Engine(model, config, drafter=self.drafter)
        self.ids = ids
        self.params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=not stop)
        # every decode step and verify window at every batch size and table width (the server's warm-up:
        # a timed pass may meet one the first pass did not), then the prefill chunks of a first pass
        warmup = Warmup(self.engine, WarmupLevel.DECODE, timeout_s=math.inf)
        while warmup.step():
            pass
        self.engine.generate(ids, self.params)
        self.best: dict[str, Any] | None = None

    def timed_pass(self) -> None:
        """Serve the requests once more; keep the fastest pass (the machine's other work only slows one)."""
        engine, totals = self.engine, {}
        engine.execution.speculation = type(engine.execution.speculation)()  # this pass's counts only
        with (
            timing(engine.runner, "prefill_rows", totals),
            timing(engine.runner, "decode", totals),
            timing(engine.runner, "verify", totals),
            timing(self.drafter, "propose", totals),
        ):
            t0 = time.perf_counter()
            results = engine.generate(self.ids, self.params)
            wall = time.perf_counter() - t0
        decode_s = wall - totals.get("prefill_rows", 0.0)
        out = {
            "tokens": [r.token_ids for r in results],
            "decode_tokens_per_s": sum(len(r.token_ids) - 1 for r in results) / decode_s,
            "decode_s": decode_s,
            "draft_s": totals.get("propose", 0.0),
            "verify_s": totals.get("verify", 0.0),
            "plain_decode_s": totals.get("decode", 0.0),
            **{f"spec_{k}": v for k, v in engine.speculation_stats().to_json().items()},
        }
        if self.best is None or out["decode_s"] < self.best["decode_s"]:
            self.best = out


def measure(model: Any, tokenizer: Any, args: argparse.Namespace, draft: Any = None) -> list[dict[str, Any]]:
    """Per workload and batch: without speculation and with each method, passes taken in turn (so that the
    machine's other work falls on all alike), the fastest of each."""
    rows: list[dict[str, Any]] = []
    methods = ["ngram"] + (["draft"] if draft is not None else [])
    for workload in args.workloads:
        texts = prompts(workload, args.prompt_chars)
        for batch in args.batch:
            ids = [tokenizer.encode(texts[i % len(texts)]) for i in range(max(batch, len(texts)))]
            # an edit ends where the rewritten code does; free completion runs on
            stop = workload in ("edit", "edit-repo")
            setups = {m: Setup(model, ids, args, m, draft, stop, batch) for m in ["off", *methods]}
            for _ in range(args.repeats):
                for setup in setups.values():
                    setup.timed_pass()
            wanted, share = expected(workload), None
            if wanted is not None:  # the tokens are the off pass's (every method's when identical)
                texts_out = [tokenizer.decode(t) for t in setups["off"].best["tokens"]]
                share = round(copied(texts_out, [wanted[i % len(wanted)] for i in range(len(ids))]), 3)
            for method in methods:
                rows.append(row(workload, batch, ids, setups["off"].best, setups[method].best, method))
                if share is not None:
                    rows[-1]["copied"] = share
                print(f"{workload} batch {batch} {method}: ratio {rows[-1]['ratio']}", file=sys.stderr)
    return rows


def row(workload: str, batch: int, ids: list, off: dict, on: dict, method: str) -> dict[str, Any]:
    drafted = on["spec_drafted"]
    return {
        "workload": workload,
        "method": method,
        "batch": batch,
        "requests": len(ids),
        "prompt_tokens": sum(len(p) for p in ids) // len(ids),
        "new_tokens": len(off["tokens"][0]),
        "off_tokens_per_s": round(off["decode_tokens_per_s"], 1),
        "spec_tokens_per_s": round(on["decode_tokens_per_s"], 1),
        "ratio": round(on["decode_tokens_per_s"] / off["decode_tokens_per_s"], 3),
        "identical": on["tokens"] == off["tokens"],
        "drafted": drafted,
        "accepted": on["spec_accepted"],
        "acceptance": round(on["spec_accepted"] / drafted, 3) if drafted else None,
        "mean_accepted": round(on["spec_mean_accepted"], 2),
        "windows": on["spec_windows"],
        "draft_s": round(on["draft_s"], 4),
        "verify_s": round(on["verify_s"], 4),
        "plain_decode_s": round(on["plain_decode_s"], 4),
        "decode_s": round(on["decode_s"], 4),
        "off_decode_s": round(off["decode_s"], 4),
    }


COLUMNS = [
    "workload",
    "method",
    "batch",
    "requests",
    "prompt_tokens",
    "off_tokens_per_s",
    "spec_tokens_per_s",
    "ratio",
    "identical",
    "drafted",
    "accepted",
    "mean_accepted",
    "copied",
    "draft_s",
    "verify_s",
    "plain_decode_s",
    "decode_s",
]


def run(args: argparse.Namespace) -> int:
    model = load_bench_model(args)
    tokenizer = (
        load_tokenizer(args.model, model.config) if args.model else ByteTokenizer(model.config.vocab_size)
    )
    draft = None
    if args.draft_model == "self":
        draft = model
    elif args.draft_model:
        import jax.numpy as jnp

        draft = load_pretrained(args.draft_model, dtype=jnp.dtype(args.dtype), progress=None)
    rows = measure(model, tokenizer, args, draft)
    result = {
        "bench": "speculative",
        "model": args.model or args.config,
        "dtype": args.dtype,
        "num_speculative_tokens": args.num_speculative_tokens,
        "rows": rows,
        "environment": environment(),
    }
    return report(result, args, Table(rows, COLUMNS))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "speculative",
        help="decode tokens/s with and without speculative decoding (prompt lookup) on code workloads",
        description=__doc__,
    )
    add_model_args(p, default_config="the shipped model")
    p.add_argument(
        "--dtype",
        default="float32",
        help="weights and KV dtype (default float32: in bf16 greedy tokens depend on a program's shape)",
    )
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=WORKLOADS,
        default=["edit", "continue", "prose"],
        help="which (default: the held-out ones, edit continue prose)",
    )
    p.add_argument(
        "--batch",
        type=int,
        nargs="+",
        default=[1],
        help="slots: requests decoded together; each prompt of a workload is served once, and the prompts "
        "are cycled up to this many requests (default 1: every prompt alone, one after another)",
    )
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default 4)")
    p.add_argument("--prompt-chars", type=int, default=4000, help="longest prompt in characters")
    p.add_argument("--repeats", type=int, default=3, help="timed passes of each; the fastest counts (3)")
    p.add_argument(
        "--draft-model",
        metavar="DIR|self",
        default=None,
        help="also the draft model in DIR (the same vocabulary); self: the model drafting for itself (every "
        "draft stands: the most speculation can give here)",
    )
    add_out_arg(p)
    p.set_defaults(func=run)
