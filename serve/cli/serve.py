"""`jaxhybrid serve`: the OpenAI-compatible HTTP server (see serve/server.py for the endpoints).

With no arguments it serves an embedded default on 127.0.0.1:8000: the shipped model (stdlib-small trained
on Python source, package data in `jaxhybrid/assets/stdlib-small/`) with its BPE tokenizer. `--model DIR`
serves a checkpoint, `--config NAME` any config (random weights).
SIGTERM / Ctrl-C shut down gracefully: running requests get `--shutdown-timeout` seconds to finish, then
are cancelled; pending prefix-store saves are flushed before the process exits.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.config import ConfigError
from jaxhybrid.tokenizer import TokenizerError, load_tokenizer
from serve.cli.common import (
    add_compile_cache_arg,
    add_config_arg,
    add_engine_args,
    add_kernels_arg,
    add_prefix_args,
    build_kernels_meanwhile,
    load_draft_model,
    setup_compile_cache,
    setup_logging,
)
from serve.cli.generate import engine_config
from serve.engine.engine import Engine
from serve.engine.replicated import ReplicatedEngine, check_engine_config
from serve.engine.warmup import Warmup, WarmupLevel
from serve.http.kv_events import EventPublisher
from serve.models import (
    DTYPE_HELP,
    ModelSettings,
    UsageError,
    add_dequantize_experts_arg,
    add_weight_dtype_arg,
    load_on_mesh,
    resolve_model,
)
from serve.report import DTYPES
from sharding import multihost
from sharding.mesh import add_mesh_argument, describe
from sharding.multihost import MultihostSettings

log = logging.getLogger("jaxhybrid.serve")
IDLE_WAIT_S = 0.05  # several processes: an idle leader steps (and wakes the followers) this often


def model_name(args: argparse.Namespace, settings: ModelSettings) -> str:
    """The name the API gives the model: --served-model-name, else the checkpoint directory's or config's."""
    if args.served_model_name:
        return args.served_model_name
    if settings.model:
        return Path(settings.model.rstrip("/")).name or "model"
    if settings.config:
        path = Path(settings.config)
        return path.stem if path.suffix in (".yaml", ".yml", ".json") else path.name
    return "tiny"


def _server_class() -> type:
    import asyncio
    import signal
    import threading

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server with a graceful shutdown that ends every response properly: running requests
        get `grace` seconds to finish, then the engine cancels them (streams end with finish_reason
        'abort' and `data: [DONE]`); uvicorn's own cancellation is only the backstop. SIGTERM / SIGINT
        end in a clean exit (status 0) instead of uvicorn re-raising the signal once it is done."""

        def __init__(self, config: Any, engine_loop: Any, grace: float):
            super().__init__(config)
            self.engine_loop, self.grace = engine_loop, grace

        async def shutdown(self, sockets: Any = None) -> None:
            timer = asyncio.get_running_loop().call_later(self.grace, self.engine_loop.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def serve_replicated(args: argparse.Namespace, settings: ModelSettings, engine: Any, tokenizer: Any) -> int:
    """Several processes: every process runs the engine in lockstep (`serve.engine.replicated`). Process 0
    serves HTTP and owns the intake; the others follow until process 0 shuts down. When a peer died, the
    collectives and JAX's distributed shutdown would wait for it: the exit is bounded by
    `--shutdown-timeout` instead (a follower whose leader died is ended by JAX at once)."""
    rep = ReplicatedEngine(engine, idle_wait_s=IDLE_WAIT_S)
    status, failed = 1, None
    try:
        if not rep.is_leader:
            log.info("process %d of %d: following process 0", rep.process_index, rep.process_count)
            rep.follow()
            rep.engine.close()  # this process's part of the prefix store's pending saves
            status = 0
            return 0
        if args.warmup != "none":
            log.info("warm-up is off with several processes: each program compiles on first use")
        status, failed = serve_http(args, settings, rep, tokenizer)

        def release_followers() -> None:
            if not rep.closed:  # the engine thread has stopped: tell the followers (with its last aborts)
                rep.close()
                rep.step()
            rep.engine.close()

        if failed is None and not multihost.run_bounded(release_followers, args.shutdown_timeout):
            failed = "the followers did not answer"
        if failed is not None:
            status = status or 1
        return status
    except Exception as exc:  # a broken process group (a peer died): leave without waiting for it
        failed = f"{type(exc).__name__}: {exc}"
        log.error("process %d: the process group failed: %s", rep.process_index, failed)
        status = 1
        return status
    finally:
        timeout = 0.0 if failed is not None else args.shutdown_timeout
        if not multihost.shutdown(timeout=timeout):
            log.warning("a peer process is gone (%s): exiting without the distributed shutdown", failed)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status or 1)


def run(args: argparse.Namespace) -> int:
    """Serve a model over HTTP with an OpenAI-compatible API."""
    setup_logging(args.log_level)
    for name, value in (("--slots", args.slots), ("--block-size", args.block_size)):
        if value < 1:
            print(f"error: {name} must be a positive integer, got {value}", file=sys.stderr)
            return 2
    if not 0 <= args.port <= 65535:
        print(f"error: --port must be in [0, 65535], got {args.port}", file=sys.stderr)
        return 2
    if args.max_waiting is not None and args.max_waiting < 0:
        print(f"error: --max-waiting must be >= 0, got {args.max_waiting}", file=sys.stderr)
        return 2
    if args.max_connections < 1:
        print(f"error: --max-connections must be >= 1, got {args.max_connections}", file=sys.stderr)
        return 2
    if not args.stall_timeout > 0:
        print(f"error: --stall-timeout must be > 0, got {args.stall_timeout}", file=sys.stderr)
        return 2
    if args.default_max_tokens < 1:
        print(f"error: --default-max-tokens must be >= 1, got {args.default_max_tokens}", file=sys.stderr)
        return 2
    if not args.warmup_timeout > 0:
        print(f"error: --warmup-timeout must be > 0, got {args.warmup_timeout}", file=sys.stderr)
        return 2
    if args.kv_events_endpoint and args.no_prefix_cache:
        print("error: --kv-events-endpoint needs the prefix cache (drop --no-prefix-cache)", file=sys.stderr)
        return 2
    if args.kv_events_replay_endpoint and not args.kv_events_endpoint:
        print("error: --kv-events-replay-endpoint needs --kv-events-endpoint", file=sys.stderr)
        return 2

    import jax
    import uvicorn  # noqa: F401  (fail here, before loading a model, when it is missing)

    setup_compile_cache(args.compile_cache)

    if not args.model and not args.config:
        if shipped_model_dir() is not None:
            log.info(
                "no --model or --config given: serving the embedded default, the shipped model %s "
                "(stdlib-small, trained on Python standard library source) with its tokenizer",
                shipped_model_dir(),
            )
        else:
            log.info(
                "no --model or --config given and no shipped model installed: serving the 'tiny' config "
                "with random weights (seed %d) and the byte-level tokenizer; its output is noise",
                args.seed,
            )
    multi = False
    try:
        multi = multihost.initialize(MultihostSettings.from_flags(vars(args))) and jax.process_count() > 1
        build_kernels_meanwhile()
        if multi and args.kv_events_endpoint:  # only process 0 would publish; the others' logs would grow
            raise UsageError("--kv-events-endpoint serves one process; it is not supported with several yet")
        settings = resolve_model(ModelSettings.from_flags(vars(args)))
        model, mesh = load_on_mesh(settings, multi)
        if mesh is not None:
            log.info("parameters sharded over the mesh %s", describe(mesh))
        tokenizer = load_tokenizer(settings.model, model.config)
        if tokenizer is None:
            log.warning("no tokenizer for this model: only token-id prompts on /v1/completions will work")
        cfg = engine_config(args, settings)
        if not multi:  # several processes run each program in lockstep: one tier, compiled where first needed
            cfg = dataclasses.replace(cfg, tiered_compile=True)
        if multi:
            cfg = check_engine_config(cfg)
        engine = Engine(model, cfg, mesh=mesh, draft_model=load_draft_model(args, settings, multi))
    except (UsageError, ConfigError, TokenizerError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if multi:
        return serve_replicated(args, settings, engine, tokenizer)

    warmup = Warmup(engine, WarmupLevel(args.warmup), args.warmup_timeout)
    return serve_http(args, settings, engine, tokenizer, warmup)[0]


def serve_http(
    args: argparse.Namespace, settings: ModelSettings, engine: Any, tokenizer: Any, warmup: Any = None
) -> tuple[int, str | None]:
    """Run the HTTP server on `engine` (an Engine, or a ReplicatedEngine on process 0) until shutdown,
    compiling `warmup`'s programs in the background; (exit status, why the engine went down or None)."""
    import uvicorn

    # the HTTP stack (fastapi, starlette, pydantic) loads when a server starts, not with the CLI
    from serve.http.app import create_app

    cfg = engine.config
    name = model_name(args, settings)
    events = None
    if args.kv_events_endpoint:
        events = EventPublisher(args.kv_events_endpoint, args.kv_events_replay_endpoint)
        replay = args.kv_events_replay_endpoint
        log.info("prefix-store events on %s (replay: %s)", args.kv_events_endpoint, replay)
    app = create_app(
        engine,
        tokenizer,
        name,
        max_waiting=args.max_waiting,
        default_max_tokens=args.default_max_tokens,
        stop_timeout=args.shutdown_timeout + 60.0,
        max_connections=args.max_connections,
        stall_timeout=args.stall_timeout,
        warmup=warmup,
        events=events,
    )
    log.info(
        "model '%s' in %s: %d slots, block size %d, context %d tokens, prefix cache %s; listening on http://%s:%d",
        name,
        f"{settings.dtype} ({settings.dtype_reason})",
        cfg.max_slots,
        cfg.block_size,
        engine.max_model_len,
        "off"
        if cfg.prefix is None
        else f"on ({cfg.prefix.checkpoint_policy} checkpoints, interval {cfg.prefix.checkpoint_interval})",
        args.host,
        args.port,
    )
    server = _server_class()(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="debug" if args.log_level == "debug" else "warning",  # our own line says we listen
            access_log=args.access_log,
            timeout_graceful_shutdown=args.shutdown_timeout + 5.0,
            # the app answers over-limit requests itself (JSON 503); this bounds idle connections too
            limit_concurrency=2 * args.max_connections + 16,
        ),
        app.state.server.loop,
        args.shutdown_timeout,
    )
    server.run()
    return (0 if server.started else 1), app.state.server.loop.failed


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already says it, or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics, ...)",
        description=(__doc__ or "").split("\n\n", 1)[1],
        formatter_class=_HelpFormatter,
    )
    m = p.add_argument_group("model (default: the shipped stdlib-small model and its tokenizer)")
    add_config_arg(m)
    m.add_argument("--model", help="a checkpoint directory: Hugging Face safetensors or converted Orbax")
    add_dequantize_experts_arg(m)
    add_weight_dtype_arg(m)
    m.add_argument("--served-model-name", help="the model id clients use (default: directory/config name)")
    m.add_argument("--seed", type=int, default=0, help="seed of random weights and of unseeded requests")
    m.add_argument("--dtype", choices=DTYPES, default=None, help=DTYPE_HELP)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument(
        "--max-waiting",
        type=int,
        default=64,
        help="requests that may wait for a free slot; one more gets HTTP 429",
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        help="max_tokens of a chat request that gives none (capped by what the context leaves)",
    )
    s.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="HTTP requests in progress at once (streams count until they end); one more gets HTTP 503",
    )
    s.add_argument(
        "--stall-timeout",
        type=float,
        default=300.0,
        help="seconds one engine step may run before /health answers 503 (stalled)",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds running requests get to finish on SIGTERM before they are cancelled",
    )
    s.add_argument(
        "--warmup",
        choices=("none", "decode", "all"),
        default="all",
        help="programs compiled at start-up, in the background while requests are served (/health says "
        "'warming' until done): none; decode (every decode step; prefill chunks compile on first use); "
        "all (every prefill chunk and decode step, short contexts first)",
    )
    s.add_argument(
        "--warmup-timeout",
        type=float,
        default=300.0,
        help="seconds the warm-up may take; what is left then compiles on first use",
    )
    add_compile_cache_arg(s)
    add_kernels_arg(s)
    s.add_argument(
        "--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log verbosity"
    )
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    s.add_argument(
        "--kv-events-endpoint",
        default=None,
        help="publish the prefix store's changes on this ZMQ PUB address (e.g. tcp://*:5557): KV blocks "
        "in vLLM's KV-events format under topic 'kv', state checkpoints under topic 'state' "
        "(docs/serving.md: 'Prefix-store events')",
    )
    s.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help="answer replay requests on this ZMQ ROUTER address (e.g. tcp://*:5558): a subscriber that "
        "missed batches, or started late, catches up",
    )
    e = add_engine_args(p)
    add_mesh_argument(e)
    add_prefix_args(p)

    multihost.add_arguments(p)
    p.set_defaults(func=run)
