"""`jaxhybrid generate`: run prompts through the serving engine and print the generated tokens."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jaxhybrid.config import ConfigError
from jaxhybrid.tokenizer import load_tokenizer
from serve.cli.common import (
    add_compile_cache_arg,
    add_config_arg,
    add_engine_args,
    add_kernels_arg,
    add_prefix_args,
    build_kernels_meanwhile,
    load_draft_model,
    prefix_config,
    setup_compile_cache,
    speculation,
)
from serve.engine.engine import Engine, EngineConfig, RequestError
from serve.engine.replicated import ReplicatedEngine, check_engine_config
from serve.engine.sampling import SamplingError, SamplingParams
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
from sharding.mesh import add_mesh_argument
from sharding.multihost import MultihostSettings

REQUEST_FIELDS = ("prompt_ids", "cache_salt")
SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise UsageError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 to stderr for a while: gloo (the CPU collectives of several processes)
    prints its connection lines to stdout from C++, which would mix with the results (`--json`)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_replicated(
    args: argparse.Namespace, settings: ModelSettings, model: Any, mesh: Any, tokenizer: Any
) -> list[Any] | None:
    """Several processes (`--coordinator/--num-processes/--process-id`): every process runs the engine on
    the same requests in lockstep (`serve.engine.replicated`); process 0 reads the prompts and gets the
    results, the others follow, print one summary line to stderr and return None."""
    load_draft_model(args, settings, multi=True)  # refused: one device only
    rep = ReplicatedEngine(Engine(model, check_engine_config(engine_config(args, settings)), mesh=mesh))
    if not rep.is_leader:
        steps = rep.follow()
        rep.engine.close()  # this process's part of the prefix store's pending saves
        print(
            f"process {rep.process_index} of {rep.process_count}: followed process 0 for {steps} steps",
            file=sys.stderr,
        )
        return None
    try:
        requests = collect_requests(args, tokenizer)
    except Exception:
        rep.close()  # release the followers before reporting the error
        rep.step()
        raise
    try:
        return rep.generate(requests)
    finally:
        rep.engine.close()


def engine_config(args: argparse.Namespace, settings: ModelSettings) -> Any:
    """The engine's settings from the engine and prefix-cache flags; its KV cache in the model's resolved
    dtype."""
    return EngineConfig(
        max_slots=args.slots,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_memory_bytes=None if args.kv_memory_mb is None else int(args.kv_memory_mb * 2**20),
        prefill_chunk=args.prefill_chunk,
        prefill_rows=args.prefill_rows,
        max_model_len=args.max_model_len,
        kv_dtype=settings.dtype,
        seed=settings.seed,
        speculative=speculation(args),
        prefix=prefix_config(args),
    )


def sampling_from(args: argparse.Namespace, overrides: dict[str, Any], where: str) -> Any:
    unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
    if unknown:
        raise UsageError(
            f"{where}: unknown field '{unknown[0]}' (allowed: {', '.join(REQUEST_FIELDS + SAMPLING_FIELDS)})"
        )
    fields: dict[str, Any] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "seed": args.sampling_seed,
        "ignore_eos": args.ignore_eos,
        "logprobs": args.logprobs,
        "stop_token_ids": tuple(parse_ids(args.stop_ids)) if args.stop_ids else (),
    }
    fields.update(overrides)
    if isinstance(fields["stop_token_ids"], list):
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    return SamplingParams(**fields)


def collect_requests(args: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], Any, str | None]]:
    given = [x is not None for x in (args.prompt_ids, args.prompt, args.prompts_file)]
    if sum(given) != 1:
        raise UsageError("give exactly one of --prompt-ids, --prompt, --prompts-file")
    if args.prompt_ids is not None:
        return [(parse_ids(args.prompt_ids), sampling_from(args, {}, "command line"), args.cache_salt)]
    if args.prompt is not None:
        return [(tokenizer.encode(args.prompt), sampling_from(args, {}, "command line"), args.cache_salt)]
    path = Path(args.prompts_file)
    if not path.exists():
        raise UsageError(f"--prompts-file {path}: no such file")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON: {exc}") from None
        if not isinstance(obj, dict) or "prompt_ids" not in obj:
            raise UsageError(f"{where}: expected an object with 'prompt_ids'")
        ids = obj.pop("prompt_ids")
        salt = obj.pop("cache_salt", args.cache_salt)
        if not isinstance(ids, list):
            raise UsageError(f"{where}: 'prompt_ids' must be a list of token ids")
        if salt is not None and not isinstance(salt, str):
            raise UsageError(f"{where}: 'cache_salt' must be a string")
        out.append((ids, sampling_from(args, obj, where), salt))
    if not out:
        raise UsageError(f"{path}: no prompts")
    return out


def run(args: argparse.Namespace) -> int:
    """Generate from token ids, text (byte-level tokenizer for random-weight configs) or a JSON-lines file."""
    import jax

    setup_compile_cache(args.compile_cache)
    multi = False
    quiet = contextlib.ExitStack()
    try:
        multi = multihost.initialize(MultihostSettings.from_flags(vars(args))) and jax.process_count() > 1
        build_kernels_meanwhile()
        if multi:
            quiet.enter_context(stdout_to_stderr())
        settings = resolve_model(ModelSettings.from_flags(vars(args)))
        model, mesh = load_on_mesh(settings, multi)
        tokenizer = load_tokenizer(settings.model, model.config)
        if args.prompt is not None and tokenizer is None:
            raise UsageError(
                "--prompt needs a tokenizer; this config's vocabulary is too small: use --prompt-ids"
            )
        if multi:
            results = run_replicated(args, settings, model, mesh, tokenizer)
            if results is None:  # a follower: process 0 prints the results
                return 0
        else:
            requests = collect_requests(args, tokenizer)
            draft = load_draft_model(args, settings)
            engine = Engine(model, engine_config(args, settings), mesh=mesh, draft_model=draft)
            try:
                for prompt, params, _ in requests:  # validate every line before serving any
                    engine.validate(prompt, params)
                ids = [engine.add_request(p, params, cache_salt=salt) for p, params, salt in requests]
                while engine.has_unfinished():
                    engine.step()
                results = [engine.result(i) for i in ids]
            finally:
                engine.close()  # pending prefix-store saves land on disk; the store directory is free again
    except (UsageError, ConfigError, RequestError, SamplingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if multi:
            multihost.shutdown()
        quiet.close()
    for res in results:
        text = tokenizer.decode(res.token_ids) if tokenizer else None
        if args.json:
            obj = {
                "token_ids": res.token_ids,
                "text": text,
                "finish_reason": res.finish_reason,
                "stats": res.stats,
            }
            if res.logprobs is not None:
                obj["logprobs"] = res.logprobs
            print(json.dumps(obj))
        else:
            print(text if text is not None else " ".join(map(str, res.token_ids)))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate tokens for one or more prompts", description=run.__doc__)
    add_config_arg(p)
    p.add_argument("--model", help="a checkpoint directory: Hugging Face safetensors or converted Orbax")
    add_dequantize_experts_arg(p)
    add_weight_dtype_arg(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and of per-request seeds")
    p.add_argument("--dtype", choices=DTYPES, default=None, help=DTYPE_HELP)
    src = p.add_argument_group("prompts (exactly one)")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--prompt", help="text, encoded with the model's tokenizer")
    src.add_argument(
        "--prompts-file",
        help='JSON lines, each {"prompt_ids": [...]} with optional sampling fields '
        f"({', '.join(SAMPLING_FIELDS)}); served on one engine, results printed in order",
    )
    s = p.add_argument_group("sampling (defaults for every prompt)")
    s.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off)")
    s.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request sampling seed (default: from --seed)"
    )
    s.add_argument("--stop-ids", help="comma-separated token ids that end a sequence")
    s.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    s.add_argument("--logprobs", action="store_true", help="report the log-probability of each chosen token")

    add_mesh_argument(add_engine_args(p))
    s.add_argument(
        "--cache-salt", help="prefix-cache isolation key: requests only reuse prefixes of the same salt"
    )
    add_prefix_args(p)
    multihost.add_arguments(p)
    add_compile_cache_arg(p)
    add_kernels_arg(p)
    p.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt: token_ids, text, stats"
    )
    p.set_defaults(func=run)
