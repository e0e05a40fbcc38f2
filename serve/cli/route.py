"""`jaxhybrid route --backend URL[,events=ENDPOINT[,replay=ENDPOINT]] ... [--policy state-aware]`."""

from __future__ import annotations

import argparse
import sys

from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.config import load_config
from jaxhybrid.tokenizer import load_tokenizer
from serve.cli.common import setup_logging
from serve.route.backends import Backend, BackendSpec
from serve.route.policies import LOAD_WEIGHT, Chooser, Policy


def run(args: argparse.Namespace) -> int:
    """An OpenAI-compatible front over several `jaxhybrid serve` replicas: each request goes to the replica
    that could resume the most of its prompt from a state checkpoint (from the replicas' prefix-store events,
    `serve --kv-events-endpoint`), weighed against the work queued there; `--policy kv-only` weighs cached KV
    blocks alone, `round-robin` takes turns. A replica that fails before answering is drained and the
    request retried on the next; health checks re-admit it. The tokenizer (--model or --config, as the
    replicas were started) lets the router see prompts as token ids."""
    setup_logging(args.log_level)

    try:
        specs = [BackendSpec.parse(text) for text in args.backend]
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.load_weight >= 0:
        print(f"error: --load-weight must be >= 0, got {args.load_weight}", file=sys.stderr)
        return 2
    if not args.health_interval > 0:
        print(f"error: --health-interval must be > 0, got {args.health_interval}", file=sys.stderr)
        return 2
    tokenizer = _tokenizer(args)
    import uvicorn

    # the HTTP stack (fastapi, starlette, pydantic) loads when a server starts, not with the CLI
    from serve.route.app import create_router_app

    backends = [Backend(spec) for spec in specs]
    app = create_router_app(
        backends,
        Chooser(backends, Policy(args.policy), args.load_weight),
        tokenizer,
        health_interval=args.health_interval,
    )
    print(
        f"routing ({args.policy}) over {len(backends)} replica(s) on http://{args.host}:{args.port}",
        file=sys.stderr,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


def _tokenizer(args: argparse.Namespace):
    model = args.model or (None if args.config else shipped_model_dir())
    cfg = load_config(str(model) if model else (args.config or "tiny"))
    return load_tokenizer(model, cfg)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "route", help="an OpenAI-compatible router over several serve replicas", description=run.__doc__
    )
    p.add_argument(
        "--backend",
        action="append",
        required=True,
        metavar="URL[,events=ENDPOINT[,replay=ENDPOINT]]",
        help="a replica: its URL and, for state-aware routing, its --kv-events-endpoint and "
        "--kv-events-replay-endpoint as seen from here (e.g. http://127.0.0.1:8001,events=tcp://127.0.0.1:5557,"
        "replay=tcp://127.0.0.1:5558); repeat for each",
    )
    p.add_argument("--policy", choices=[x.value for x in Policy], default=Policy.STATE_AWARE.value)
    p.add_argument(
        "--load-weight",
        type=float,
        default=LOAD_WEIGHT,
        help="what a token of work queued at a replica weighs against a prompt token it must compute "
        f"({LOAD_WEIGHT})",
    )
    p.add_argument("--health-interval", type=float, default=1.0, help="seconds between health checks (1)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model", help="the replicas' model directory (its tokenizer; default: the shipped model)"
    )
    src.add_argument("--config", help="the replicas' config, for its tokenizer (random-weight replicas)")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)
