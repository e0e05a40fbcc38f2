"""`jaxhybrid bench slots`: decode tokens/s through the whole engine (scheduler, program, sampling) for R
running requests on an engine of S slots.

The question: what do idle slots cost? A server is configured for its peak batch, and most of the time runs
fewer requests than it has slots. Each point runs its requests twice on one engine (the first pass compiles
every shape the second meets) and times the decode steps of the second pass. `vs_1_slot` is each point's
per-request rate over that of one request on a one-slot engine, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.report import Table, report
from jaxhybrid.config import ConfigError
from serve.bench.common import add_model_args, add_out_arg, environment, load_bench_model
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.models import UsageError


def _points(text: str) -> list[tuple[int, int]]:
    """`S:R,...` -> [(slots, running requests)], each 1 <= R <= S."""
    points = []
    for item in text.split(","):
        slots, _, running = item.strip().partition(":")
        try:
            s, r = int(slots), int(running or 1)
        except ValueError:
            raise ValueError(f"--points takes SLOTS:REQUESTS pairs, got {item!r}") from None
        if not 1 <= r <= s:
            raise ValueError(f"--points: need 1 <= requests <= slots, got {item!r}")
        points.append((s, r))
    return points


def measure_point(model, slots: int, running: int, prompt_len: int, new_tokens: int) -> dict:
    """Decode tokens/s of `running` greedy requests on an engine of `slots` slots (store off)."""
    import numpy as np

    engine = Engine(
        model, EngineConfig(max_slots=slots, max_model_len=prompt_len + new_tokens + 16, prefix=None)
    )
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for rep in range(2):  # rep 0 compiles every shape rep 1 meets
        rng = np.random.default_rng(rep)
        ids = {
            engine.add_request(rng.integers(3, model.config.vocab_size, prompt_len).tolist(), params)
            for _ in range(running)
        }
        started: set[str] = set()
        while started != ids:  # until every request has its first token: prefill done
            started |= {o.request_id for o in engine.step() if o.new_token_ids}
        steps, t0 = 0, time.perf_counter()
        while engine.has_unfinished():
            engine.step()
            steps += 1
        elapsed = time.perf_counter() - t0
    return {
        "slots": slots,
        "requests": running,
        "decode_steps": steps,
        "step_ms": 1e3 * elapsed / steps,
        "tokens_per_s": running * steps / elapsed,
        "per_request_tokens_per_s": steps / elapsed,
    }


def run(args: argparse.Namespace) -> int:
    try:
        points = _points(args.points)
        if args.new_tokens < 2 or args.prompt_len < 1:
            raise ValueError("--new-tokens must be at least 2 and --prompt-len at least 1")
        if args.config is None and args.model is None:
            args.config = "small"
        model = load_bench_model(args)
    except (UsageError, ConfigError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = measure_point(model, 1, 1, args.prompt_len, args.new_tokens)
    rows = [measure_point(model, s, r, args.prompt_len, args.new_tokens) for s, r in points]
    for row in rows:
        row["vs_1_slot"] = row["per_request_tokens_per_s"] / base["per_request_tokens_per_s"]
        row["aggregate_vs_1_slot"] = row["tokens_per_s"] / base["tokens_per_s"]
    result = {
        "bench": "slots",
        "config": model.config.name,
        "model_dir": args.model,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "environment": environment(),
        "one_slot": base,
        "points": rows,
    }
    table = Table(
        [{**r, "per_request_vs_1_slot": r["vs_1_slot"]} for r in rows],
        ["slots", "requests", "step_ms", "tokens_per_s", "per_request_vs_1_slot", "aggregate_vs_1_slot"],
        {
            "step_ms": ".1f",
            "tokens_per_s": ".1f",
            "per_request_vs_1_slot": ".2f",
            "aggregate_vs_1_slot": ".2f",
        },
    )
    return report(result, args, table)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "slots",
        help="decode tokens/s through the engine for R requests on S slots: what idle slots cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_args(p)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights dtype")
    p.add_argument(
        "--points",
        default="1:1,4:1,16:1,4:4,16:16",
        help="SLOTS:REQUESTS pairs (default 1:1,4:1,16:1,4:4,16:16)",
    )
    p.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt (default 32)")
    p.add_argument("--new-tokens", type=int, default=48, help="tokens generated per request (default 48)")
    add_out_arg(p)
    p.set_defaults(func=run)
