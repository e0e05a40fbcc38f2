"""Argument groups and logging shared by the subcommands."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from jaxhybrid.ops import native, registry
from jaxhybrid.weights import load_pretrained
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.engine.config import engine_default
from serve.engine.speculative import MAX_SPECULATIVE_TOKENS, DraftMethod, Speculation, SpeculationError
from serve.models import ModelSettings, UsageError, add_checkpoint_dtype_arg
from serve.prefix.store import PrefixStoreConfig

log = logging.getLogger("jaxhybrid.cli")


def add_config_arg(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument(
        "--config",
        required=required,
        help="a name in jaxhybrid/configs/ (tiny, small, kimi-linear-48b-a3b, kimi-k3, ...), a YAML path, "
        "or a Hugging Face config.json / model directory",
    )


def add_prefix_args(p: argparse.ArgumentParser) -> None:
    """Prefix-store flags shared by `generate` and `serve` (the prefix cache is on by default); defaults are
    PrefixStoreConfig's."""
    default = PrefixStoreConfig()
    g = p.add_argument_group("prefix cache")
    g.add_argument("--no-prefix-cache", action="store_true", help="turn the prefix store off")
    g.add_argument(
        "--checkpoint-interval",
        type=int,
        default=default.checkpoint_interval,
        help="keep a KDA state checkpoint every N tokens, rounded to a multiple of --block-size "
        f"(default {default.checkpoint_interval})",
    )
    g.add_argument(
        "--checkpoint-policy",
        choices=("fixed", "adaptive"),
        default=default.checkpoint_policy,
        help="fixed: a checkpoint every --checkpoint-interval tokens and at prompt / sequence ends, least "
        "recently used evicted first; adaptive: --checkpoint-interval is the finest spacing, junctions where "
        "prompts leave a shared prefix are added, requests sharing a prefix being computed wait for its "
        "checkpoint, and what saves the least prefill per byte is evicted first "
        f"(default {default.checkpoint_policy})",
    )
    g.add_argument(
        "--eviction",
        choices=("lru", "value"),
        default=None,
        help="checkpoint eviction order (default: lru with --checkpoint-policy fixed, value with adaptive)",
    )
    add_checkpoint_dtype_arg(g)
    g.add_argument(
        "--no-prompt-end-checkpoints",
        action="store_true",
        help="do not checkpoint the state at the end of every prompt",
    )
    g.add_argument(
        "--no-sequence-end-checkpoints",
        action="store_true",
        help="do not checkpoint the state at the end of every finished sequence",
    )
    g.add_argument(
        "--device-cache-mb",
        type=float,
        default=default.device_bytes / 2**20,
        help="byte budget of checkpoints kept in device memory, MiB "
        f"(default {default.device_bytes / 2**20:g})",
    )
    g.add_argument(
        "--host-cache-mb",
        type=float,
        default=default.host_bytes / 2**20,
        help="byte budget of checkpoints demoted to host memory, MiB "
        f"(default {default.host_bytes / 2**20:g})",
    )
    g.add_argument(
        "--store-dir",
        default=None,
        help="directory of the disk (Orbax) tier: checkpoints are written through and reused after a restart",
    )
    g.add_argument(
        "--disk-cache-mb",
        type=float,
        default=default.disk_bytes / 2**20,
        help=f"disk tier budget, MiB (default {default.disk_bytes / 2**20:g})",
    )


def prefix_config(args: argparse.Namespace) -> PrefixStoreConfig | None:
    if args.no_prefix_cache:
        if args.store_dir:
            raise ValueError("--store-dir needs the prefix cache (drop --no-prefix-cache)")
        return None
    return PrefixStoreConfig(
        store_dir=args.store_dir,
        disk_bytes=int(args.disk_cache_mb * 2**20),
        checkpoint_interval=args.checkpoint_interval,
        checkpoint_policy=args.checkpoint_policy,
        checkpoint_dtype=args.checkpoint_dtype,
        events=bool(getattr(args, "kv_events_endpoint", None)),  # serve's publisher wants them
        eviction=args.eviction,
        prompt_end_checkpoints=not args.no_prompt_end_checkpoints,
        sequence_end_checkpoints=not args.no_sequence_end_checkpoints,
        device_bytes=int(args.device_cache_mb * 2**20),
        host_bytes=int(args.host_cache_mb * 2**20),
    )


def add_engine_args(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Engine-shape flags shared by `generate` and `serve` (defaults: EngineConfig's); returns the group for
    command-specific extras."""
    names = ("max_slots", "block_size", "prefill_chunk", "prefill_rows")
    slots, block, chunk, rows = map(engine_default, names)
    e = p.add_argument_group("engine")
    e.add_argument("--slots", type=int, default=slots, help=f"sequences decoded at once (default {slots})")
    e.add_argument("--block-size", type=int, default=block, help=f"tokens per KV block (default {block})")
    e.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="KV blocks in the pool (default: enough for every slot at full context)",
    )
    e.add_argument(
        "--kv-memory-mb", type=float, default=None, help="size the KV pool by a memory budget (MiB) instead"
    )
    e.add_argument(
        "--prefill-chunk", type=int, default=chunk, help=f"longest prefill piece in tokens (default {chunk})"
    )
    e.add_argument(
        "--prefill-rows",
        type=int,
        default=rows,
        help="short prefill chunks (up to 128 tokens of sequences up to 256) of different requests run "
        f"together in one call, this many at most (default {rows}; 1: one request per call)",
    )
    e.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default min(config, 4096))"
    )

    spec = engine_default("speculative")
    e.add_argument(
        "--speculative",
        metavar="off|ngram|draft:DIR",
        default=spec.method.value,
        help="speculative decoding for requests that do not choose (the API's 'speculative' field): ngram "
        "drafts the tokens that followed the latest earlier match of the last few tokens (prompt lookup), "
        "draft:DIR those of a smaller model with the same vocabulary (a checkpoint directory; requests may "
        "then also ask for 'draft'); the drafts are verified in the decode step, the same tokens as without "
        f"(default {spec.method.value})",
    )
    e.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=spec.num_tokens,
        help="the most tokens a request drafts per step, and what a request may ask for "
        f"(1-{MAX_SPECULATIVE_TOKENS}, default {spec.num_tokens}; fewer when drafts miss)",
    )
    return e


def speculation(args: argparse.Namespace) -> Any:
    """The engine's `Speculation` from --speculative / --num-speculative-tokens (UsageError when invalid)."""
    method = args.speculative.split(":", 1)[0] if args.speculative.startswith("draft:") else args.speculative
    if method == DraftMethod.DRAFT.value and args.speculative == method:
        raise UsageError("--speculative draft needs the draft model's directory: draft:DIR")
    try:
        return Speculation.parse(method, args.num_speculative_tokens)
    except SpeculationError as exc:
        raise UsageError(f"--speculative: {exc}") from None


def load_draft_model(args: argparse.Namespace, model: ModelSettings, multi: bool = False) -> Any:
    """The draft model `--speculative draft:DIR` names (in the `model`'s resolved dtype), or None."""
    if not args.speculative.startswith("draft:"):
        return None
    if multi or model.mesh:
        raise UsageError("--speculative draft:DIR runs on one device (not with --mesh or several processes)")
    import jax.numpy as jnp

    directory = args.speculative.split(":", 1)[1]
    if not Path(directory).is_dir():
        raise UsageError(f"--speculative draft:{directory}: no such directory")
    draft = load_pretrained(directory, dtype=jnp.dtype(model.dtype), progress=None)
    move_to_huge_pages(draft)  # as `serve.models` does the model's
    return draft


def setup_logging(level: str) -> None:
    """Our own loggers (`jaxhybrid.*`) at `level`, one line per event; libraries (absl/Orbax, JAX,
    uvicorn's access lines) at warnings, or at info with `debug`."""
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("jaxhybrid").setLevel(getattr(logging, level.upper()))
    libraries = logging.INFO if level == "debug" else logging.WARNING
    for name in ("absl", "jax", "orbax"):
        logging.getLogger(name).setLevel(libraries)


def default_compile_cache_dir() -> Path:
    """Where compiled programs are kept by default: `xla/` under the user's cache directory
    (`~/.cache/jaxhybrid/xla` on Linux, or under $XDG_CACHE_HOME)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("jaxhybrid")) / "xla"


def add_kernels_arg(p: argparse.ArgumentParser) -> None:
    """--kernels: which implementation of each op the programs hold (`jaxhybrid.ops.registry`)."""
    p.add_argument(
        "--kernels",
        choices=[m.value for m in registry.Mode],
        default=None,
        help="which implementation of each op runs: auto (the platform's kernels: native CPU kernels, then "
        "Pallas, then XLA's forms), pallas (Pallas kernels where an op has one, else xla), xla (XLA's forms, "
        "no CPU kernels), reference (the plain JAX references) (default: $JAXHYBRID_KERNELS, else auto)",
    )


def add_compile_cache_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compile-cache",
        metavar="DIR|off",
        default=None,
        help="JAX's persistent compilation cache, with the engine's model programs in DIR/executables: "
        "compiled programs are written to DIR and a later start reads them instead of compiling (the model "
        "programs without tracing them again) (default: $JAX_COMPILATION_CACHE_DIR when set, else "
        f"{default_compile_cache_dir()}); off: compile at every start",
    )


def _kernel_dir(directory: Path | None) -> None:
    """The native CPU kernels (`jaxhybrid.ops.native`) are built where a `--compile-cache DIR` keeps the
    compiled programs (DIR/kernels), or, with the cache off, in a temporary directory removed at exit; an
    explicit $JAXHYBRID_KERNEL_DIR stands."""
    if os.environ.get("JAXHYBRID_KERNEL_DIR"):
        return
    if directory is None:
        import atexit
        import shutil
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="jaxhybrid-kernels-"))
        atexit.register(shutil.rmtree, directory, True)
    os.environ["JAXHYBRID_KERNEL_DIR"] = str(directory)


def setup_compile_cache(setting: str | None) -> Path | None:
    """Turn JAX's persistent compilation cache on in the directory `setting` names (None: the default,
    `default_compile_cache_dir`, or $JAX_COMPILATION_CACHE_DIR) or off ("off"); the directory in use, or
    None. Every program is cached however small or quick to compile: a server's start compiles dozens of
    programs of a few seconds each. The engine keeps its model programs as serialized executables in
    `executables/` under the same directory (`serve.engine.executables`), off with it. Call it before the
    first compile: JAX opens its cache once."""
    import jax

    if setting == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        log.info("compilation cache off (--compile-cache off): every program compiles at this start")
        _kernel_dir(None)
        return None
    if setting:
        _kernel_dir(Path(setting) / "kernels")
    directory = Path(setting or os.environ.get("JAX_COMPILATION_CACHE_DIR") or default_compile_cache_dir())
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    log.info("compilation cache: %s (--compile-cache off to disable)", directory)
    return directory


def build_kernels_meanwhile() -> None:
    """Start building the CPU kernels (`jaxhybrid.ops.native`) on other threads while the model loads, where
    the programs run on CPUs: on a new machine their first build takes seconds, which the first trace
    would otherwise wait for (the first request on a new server). Call it after the backend may be
    initialized (after a multi-host set-up)."""
    import jax

    if jax.default_backend() == "cpu":
        native.build_in_background()
