"""`jaxhybrid bench serve`: an end-to-end benchmark of a running `jaxhybrid serve` (as `vllm bench serve`).

Sends `--num-prompts` streamed /v1/completions at `--request-rate` requests/s (Poisson arrivals, or evenly
spaced with `--arrivals fixed`; `inf` sends all at once), each generating exactly its `max_tokens`
(`ignore_eos`). Prompts are seeded random token ids (`--input-len`; `--shared-prefix-len` of them the same
in every prompt) or the lines of `--dataset FILE.jsonl` (`{"prompt": text or ids, "max_tokens": n}`).
Several rates (`--request-rate 1,4`) run one pass each, with the same prompts. Each pass sends its requests
with its own `cache_salt`, so a pass never reuses the prefixes of an earlier one.

Per request: TTFT (to the first token), TPOT ((end - TTFT) / (tokens - 1)), and the inter-token latencies
(gaps between streamed chunks); per pass their mean / p50 / p90 / p99, request and output-token throughput,
failures, and the prefix-cache reuse the server counted (its /metrics before and after). The server's
settings are its own: to compare the prefix cache on and off, run the server twice (the second time with
`--no-prefix-cache`), the bench against each with `--out`, then `jaxhybrid bench compare A.json B.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import platform
import sys
import time
import uuid
from typing import Any

from serve.bench.client import ServerError, completion_body, probe, server_counters, stream_completion
from serve.bench.common import emit
from serve.bench.latency import summarize
from serve.bench.workload import (
    Arrivals,
    BenchRequest,
    WorkloadError,
    arrival_times,
    parse_rates,
    read_dataset,
    synthetic,
)
from serve.report import print_table

DEFAULT_VOCAB = 256  # synthetic ids stay below this when the server does not report its vocabulary


@dataclasses.dataclass(frozen=True)
class PassSettings:
    """How one pass sends its requests."""

    rate: float
    arrivals: Arrivals
    seed: int
    max_concurrency: int | None
    temperature: float
    cache_salt: str


def rate_label(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


async def run_pass(client: Any, model: str, requests: list[BenchRequest], s: PassSettings, progress: Any):
    """Send every request at its arrival time; (results in request order, wall seconds of the pass)."""
    times = arrival_times(len(requests), s.rate, s.arrivals, s.seed)
    gate = asyncio.Semaphore(s.max_concurrency) if s.max_concurrency else None
    t0 = time.perf_counter()

    async def one(req: BenchRequest, at: float):
        await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
        body = completion_body(model, req, s.temperature, s.cache_salt)
        if gate is None:
            res = await stream_completion(client, body)
        else:
            async with gate:
                res = await stream_completion(client, body)
        progress.update(1)
        if not res.ok:
            progress.set_postfix_str("failed", refresh=False)
        return res

    results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, times, strict=True)))
    return list(results), time.perf_counter() - t0


def summary_row(rate: float, arrivals: Arrivals, results: list, duration: float, before: dict, after: dict):
    """One pass as a row of the result: counts, throughputs and latency percentiles (ms)."""
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    row: dict[str, Any] = {
        "request_rate": rate_label(rate),
        "arrivals": arrivals.value,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in done)) / duration,
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in done),
    }
    for name in ("hit_tokens", "lookups", "hits", "recomputed_tokens"):
        row[f"prefix_{name}"] = after[name] - before.get(name, 0.0) if name in after else None
    for name in ("windows", "draft_tokens", "accepted_tokens"):  # speculative decoding's
        key = f"spec_{name}"
        row[key] = after[key] - before.get(key, 0.0) if key in after else None
    drafted, windows = row["spec_draft_tokens"], row["spec_windows"]
    row["spec_acceptance"] = row["spec_accepted_tokens"] / drafted if drafted else None
    row["spec_mean_accepted"] = row["spec_accepted_tokens"] / windows if windows else None
    row.update(summarize([r.ttft_s for r in done if r.ttft_s is not None]).fields("ttft"))
    row.update(summarize([r.tpot_s for r in done if r.tpot_s is not None]).fields("tpot"))
    row.update(summarize([x for r in done for x in r.itl_s]).fields("itl"))
    row.update(summarize([r.e2e_s for r in done]).fields("e2e"))
    return row


def build_requests(args: argparse.Namespace, info: Any) -> list[BenchRequest]:
    if args.dataset:
        reqs = read_dataset(args.dataset, args.num_prompts, args.output_len)
    else:
        vocab = info.vocab_size or DEFAULT_VOCAB
        reqs = synthetic(
            args.num_prompts, args.input_len, args.output_len, vocab, args.shared_prefix_len, args.seed
        )
    limit = info.max_model_len
    for req in reqs:
        n = req.prompt_tokens
        if limit is not None and n is not None and n + req.max_tokens > limit:
            raise WorkloadError(
                f"a prompt of {n} tokens + {req.max_tokens} to generate exceeds the server's context "
                f"({limit} tokens)"
            )
    return reqs


async def bench(args: argparse.Namespace, rates: list[float]) -> dict[str, Any]:
    import httpx
    from tqdm import tqdm

    quiet = args.quiet or not sys.stderr.isatty()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=timeout, limits=limits) as client:
        told: list[bool] = []

        def waiting(health: dict) -> None:
            if not told and not args.quiet:
                w = health.get("warmup", {})
                done, total = w.get("compiled"), w.get("total")
                print(f"the server is warming up ({done}/{total} compiled): waiting for it", file=sys.stderr)
                told.append(True)

        info = await probe(client, args.ready_timeout, waiting)
        requests = build_requests(args, info)
        run_id = uuid.uuid4().hex[:12]
        # one request first (its own cache_salt, not timed): checks the workload is accepted as a whole
        first = await stream_completion(
            client, completion_body(info.model, requests[0], args.temperature, f"bench-{run_id}-probe")
        )
        if not first.ok:
            raise ServerError(f"the server refused the first request: {first.error}")
        rows, errors = [], []
        for i, rate in enumerate(rates):
            settings = PassSettings(
                rate,
                Arrivals(args.arrivals),
                args.seed + i,
                args.max_concurrency,
                args.temperature,
                f"bench-{run_id}-{i}",
            )
            before = await server_counters(client)
            with tqdm(
                total=len(requests),
                desc=f"rate {rate_label(rate)}",
                disable=quiet,
                file=sys.stderr,
                leave=False,
                unit="req",
            ) as bar:
                results, duration = await run_pass(client, info.model, requests, settings, bar)
            after = await server_counters(client)
            rows.append(summary_row(rate, settings.arrivals, results, duration, before, after))
            errors += [r.error for r in results if not r.ok][: 5 - len(errors)]
    on = info.prefix_cache
    return {
        "bench": "serve",
        "base_url": args.base_url,
        "model": info.model,
        "config": info.model,
        "label": None if on is None else f"prefix cache {'on' if on else 'off'}",
        "server": {"prefix_cache": on, "health": info.health, "max_model_len": info.max_model_len},
        "workload": {
            "num_prompts": len(requests),
            "dataset": args.dataset,
            "input_len": None if args.dataset else args.input_len,
            "output_len": None if args.dataset else args.output_len,
            "shared_prefix_len": None if args.dataset else args.shared_prefix_len,
            "arrivals": args.arrivals,
            "seed": args.seed,
            "max_concurrency": args.max_concurrency,
            "temperature": args.temperature,
        },
        "environment": {
            "client_host": platform.node(),
            "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "rows": rows,
        "errors": errors,
    }


TABLE = (
    ("request_rate", None),
    ("completed", None),
    ("failed", None),
    ("request_throughput", "{:.2f}"),
    ("output_throughput", "{:.1f}"),
    ("ttft_p50_ms", "{:.1f}"),
    ("ttft_p90_ms", "{:.1f}"),
    ("ttft_p99_ms", "{:.1f}"),
    ("tpot_p50_ms", "{:.1f}"),
    ("tpot_p99_ms", "{:.1f}"),
    ("itl_p50_ms", "{:.1f}"),
    ("itl_p99_ms", "{:.1f}"),
    ("prefix_hit_tokens", "{:.0f}"),
    ("spec_accepted_tokens", "{:.0f}"),
    ("spec_acceptance", "{:.2f}"),
)


def print_rows(rows: list[dict[str, Any]], label: str | None) -> None:
    cells = [
        {k: "-" if r.get(k) is None else (fmt.format(r[k]) if fmt else r[k]) for k, fmt in TABLE}
        for r in rows
    ]
    if label:
        print(f"bench serve ({label}):", file=sys.stderr)
    print_table(cells, [k for k, _ in TABLE], file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    try:
        rates = parse_rates(args.request_rate)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise WorkloadError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
        if not args.timeout > 0 or not args.ready_timeout >= 0:
            raise WorkloadError("--timeout must be > 0 and --ready-timeout >= 0")
        result = asyncio.run(bench(args, rates))
    except (WorkloadError, ServerError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    print_rows(result["rows"], result["label"])
    if result["errors"]:
        print(f"failed requests, first errors: {result['errors']}", file=sys.stderr)
    emit(result, args)
    return 0 if any(r["completed"] for r in result["rows"]) else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="end-to-end benchmark of a running `jaxhybrid serve`: TTFT, TPOT, ITL, throughput under load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per pass (default 32)")
    p.add_argument(
        "--request-rate",
        default="inf",
        help="requests/s, or inf for all at once; comma-separated for one pass per rate (default inf)",
    )
    p.add_argument(
        "--arrivals",
        choices=[a.value for a in Arrivals],
        default="poisson",
        help="poisson (seeded exponential gaps) or fixed (evenly spaced); default poisson",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--input-len", type=int, default=128, help="synthetic prompt tokens (default 128)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="leading prompt tokens every synthetic prompt shares (default 0)",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help='JSONL prompts instead: {"prompt": text or [ids], "max_tokens": n} per line',
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrivals (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=900.0,
        help="seconds to wait while the server says it is warming up (0: do not wait; default 900)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--out", help="also write the JSON result to this file (for `jaxhybrid bench compare`)")
    p.set_defaults(func=run)
