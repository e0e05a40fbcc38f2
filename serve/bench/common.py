"""What every benchmark records: the platform, and how results are written (JSON to stdout / --out)."""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from serve.models import (
    ModelSettings,
    add_dequantize_experts_arg,
    add_weight_dtype_arg,
    load_model,
    resolve_model,
)


def environment() -> dict[str, Any]:
    import jax

    devices = jax.devices()
    return {
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "jax_version": jax.__version__,
        "matmul_precision": jax.config.jax_default_matmul_precision or "default",
        "host": platform.node(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax.monitoring: one XLA compilation


@contextlib.contextmanager
def compile_watch() -> Iterator[dict[str, float]]:
    """Count the XLA compilations (and their seconds) made while the block runs, from JAX's own monitoring
    events: a timed region that shows any has timed a compile, not the program."""
    import jax.monitoring

    seen = {"compiles": 0, "compile_s": 0.0}

    def listener(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            seen["compiles"] += 1
            seen["compile_s"] += duration_secs

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def emit(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Write the JSON result to --out (if given) and print it as one JSON line."""
    text = json.dumps(result)
    if getattr(args, "out", None):
        Path(args.out).write_text(text + "\n")
    print(text)


def add_model_args(p: argparse.ArgumentParser, default_config: str = "small") -> None:
    """--config NAME (random weights from --seed) or --model DIR: the model a bench runs
    (--dequantize-experts: MXFP4 experts held dense)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument("--config", help=f"config name or path (default {default_config})")
    src.add_argument("--model", help="a checkpoint directory: Hugging Face safetensors or converted Orbax")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (--config)")
    add_dequantize_experts_arg(p)
    add_weight_dtype_arg(p)


def load_bench_model(args: argparse.Namespace) -> Any:
    """The model a bench's flags name (`serve.models.load_model` on their settings); the choices made are
    written back to `args.model` (the shipped model when none is given) and `args.dtype`, which the bench
    reports."""
    settings = resolve_model(ModelSettings.from_flags(vars(args)))
    args.model, args.dtype = settings.model, settings.dtype
    return load_model(settings)


def add_out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", help="also write the JSON result to this file")


def decode_step(engine: Any, batch: int, context: int, blocks_per_seq: int) -> Callable[[], float]:
    """A timer of the engine's decode program for `batch` rows whose caches hold `context` tokens.

    Row b owns the distinct blocks 1 + b * blocks_per_seq ..., as a real batch would; the block table is
    as wide as the engine's bucket for that context. Returns f() -> seconds of one step (blocking)."""
    import jax
    import numpy as np

    nblocks = -(-(context + 1) // engine.config.block_size)
    width = engine.shape.table_width(nblocks)
    tables = np.zeros((batch, width), np.int32)
    for b in range(batch):
        tables[b, :nblocks] = 1 + b * blocks_per_seq + np.arange(nblocks)
    # A distinct token per row: identical rows would all choose the same experts, and a step of B rows would
    # read the experts of one (what `decode_bytes` counts is the expected distinct experts of B rows).
    vocab = engine.model_config.vocab_size
    tokens = (3 + (np.arange(batch, dtype=np.int64) * 7919) % (vocab - 3)).astype(np.int32)[:, None]
    slots = np.arange(batch, dtype=np.int32)
    start, valid = np.full((batch,), context, np.int32), np.ones((batch,), np.int32)

    def step() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(engine.runner.run_program(tokens, slots, tables, start, valid))
        return time.perf_counter() - t0

    return step
