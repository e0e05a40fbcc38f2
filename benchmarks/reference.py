"""`jaxhybrid bench reference`: this project vs transformers' `KimiLinearForCausalLM` on the same weights.

One Hugging Face directory is loaded into both (transformers in PyTorch, fp32, on CUDA when there is one,
else the CPU; this project through `load_pretrained`). In one process, in interleaved rounds, it times:

* prefill: a full causal pass over each `--prompt-lengths` (batch 1), and a `--engine-prompt`-token prompt
  through the engine on its default shape (time to the first token; transformers: one forward that fills
  its cache);
* decode of one request after a `--decode-prompt`-token prompt: `--decode-tokens` greedy steps, on an
  engine of one slot and on the default engine (transformers: one forward per token with its cache).

Each figure is the median over `--rounds`; each ratio is this project over transformers in the same run.
The machine's matmul rate and read bandwidth are measured in the same run (as in `bench throughput`), and
every figure of ours gets its fraction of them. The logits of both on the same prompt are compared
(`max_rel_err`), and the greedy tokens of the decode run.

`--against llama.cpp` adds llama.cpp on the same weights to the same rounds (`serve/bench/llamacpp.py`:
converted with its own `convert_hf_to_gguf.py` to f32 and quantized to q8_0): `llama-bench` with one
repetition per round for each prefill length and for the decode (`--decode-tokens` steps after a
`--decode-prompt`-token context), and `llama-completion`'s greedy tokens after `--greedy-prompt` beside
ours. `--llama-cpp DIR` names a built llama.cpp; `--build-llama-cpp DIR` builds one.

`--make-small DIR` writes the checkpoint: transformers' own model of a config (default `small`) with its
own random initialisation, saved by `save_pretrained`. Needs the optional extra `reference`
(`pip install -e ".[reference]"`: torch and transformers).
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.llamacpp import WEIGHT_TYPES as LLAMA_TYPES
from benchmarks.llamacpp import LlamaCppError, LlamaRuns, build, describe, locate
from benchmarks.report import Table, report
from jaxhybrid.config import ConfigError, load_config
from jaxhybrid.model import pure_fn
from jaxhybrid.tokenizer import ByteTokenizer
from jaxhybrid.weights import load_pretrained
from jaxhybrid.weights.pages import move_to_huge_pages
from jaxhybrid.weights.safetensors import CheckpointError
from serve.bench.common import add_out_arg, environment
from serve.bench.throughput import machine_rates
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.report import positive_ints
from serve.sim.cost import active_params, decode_bytes, param_bytes, prefill_flops

MISSING = (
    "bench reference needs torch and transformers (>= 5, with KimiLinearForCausalLM): "
    'pip install -e ".[reference]"'
)


def _transformers() -> Any:
    try:
        import torch
        import transformers
    except ImportError:
        raise RuntimeError(MISSING) from None
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        raise RuntimeError(f"transformers {transformers.__version__} has no KimiLinearForCausalLM; {MISSING}")
    # quiet: its load bars, and a notice per kernel that it uses its PyTorch fallback (what is compared here)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    return torch, transformers


# Fields transformers' Kimi Linear has no counterpart for (it ignores them and builds another model), with the
# value that means "off": Kimi K3's additions.
NOT_IN_TRANSFORMERS = {
    "gate_lower_bound": None,
    "use_full_rank_gate": False,
    "mla_use_output_gate": False,
    "attn_res_block_size": None,
    "routed_expert_hidden_size": None,
    "hidden_act": "silu",
    "expert_quant": None,
}


def make_small(directory: str, config: str, seed: int) -> Path:
    """Write transformers' KimiLinearForCausalLM for `config` (its own seeded init, fp32) to `directory`."""
    cfg = load_config(config)
    unsupported = [f"{k}={getattr(cfg, k)!r}" for k, v in NOT_IN_TRANSFORMERS.items() if getattr(cfg, k) != v]
    if unsupported:
        raise ValueError(f"transformers' Kimi Linear has no {', '.join(unsupported)} (config '{cfg.name}')")
    torch, transformers = _transformers()
    hf = transformers.KimiLinearConfig(**{**cfg.to_hf_dict(), "pad_token_id": 0})
    torch.manual_seed(seed)
    model = transformers.KimiLinearForCausalLM(hf).eval()
    out = Path(directory)
    model.save_pretrained(out)
    return out


class TorchModel:
    """The transformers model on its device, with timers that block until the device is done."""

    def __init__(self, directory: str):
        torch, transformers = _transformers()
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        model = transformers.KimiLinearForCausalLM.from_pretrained(directory, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        # transformers 5.2x names the cache argument and output `cache`; earlier 5.x `past_key_values`
        forward = inspect.signature(type(model).forward).parameters
        self.cache_name = "cache" if "cache" in forward else "past_key_values"

    def _sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def tensor(self, tokens: np.ndarray) -> Any:
        return self.torch.as_tensor(np.asarray(tokens, np.int64)[None], device=self.device)

    def logits(self, tokens: np.ndarray, use_cache: bool = False) -> tuple[np.ndarray, float]:
        """(logits [T, vocab] as float64, seconds) of one forward over `tokens`."""
        with self.torch.inference_mode():
            x = self.tensor(tokens)
            t0 = time.perf_counter()
            out = self.model(x, use_cache=use_cache)
            self._sync()
            elapsed = time.perf_counter() - t0
        return out.logits[0].double().cpu().numpy(), elapsed

    def decode(self, prompt: np.ndarray, steps: int) -> tuple[list[int], float]:
        """(greedy tokens, seconds of the `steps` decode forwards after the prompt's)."""
        with self.torch.inference_mode():
            out = self.model(self.tensor(prompt), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = [int(nxt)]
            self._sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                cache = {self.cache_name: getattr(out, self.cache_name)}
                out = self.model(nxt, use_cache=True, **cache)
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(nxt))
            self._sync()
            return tokens, time.perf_counter() - t0


class OurModel:
    """This project's model: a jitted full pass and engines on the default and the one-slot shape."""

    def __init__(self, directory: str, max_len: int, int8: bool = False):
        import jax.numpy as jnp

        self.model = load_pretrained(directory, dtype=jnp.float32, progress=False)
        if int8:  # as `--weight-dtype int8` serves it
            self.model.to_int8()
        move_to_huge_pages(self.model)  # as its engines do, before the full pass takes the weights too
        self.full, self.state = pure_fn(self.model)
        self.max_len = max_len

    def logits(self, tokens: np.ndarray) -> tuple[np.ndarray, float]:
        import jax.numpy as jnp

        x = jnp.asarray(np.asarray(tokens, np.int32)[None])
        t0 = time.perf_counter()
        out = self.full(self.state, x).block_until_ready()
        elapsed = time.perf_counter() - t0
        return np.asarray(out[0], np.float64), elapsed

    def engine(self, slots: int | None) -> Any:
        shape = {} if slots is None else {"max_slots": slots}
        return Engine(self.model, EngineConfig(max_model_len=self.max_len, prefix=None, **shape))

    def first_token(self, engine: Any, prompt: np.ndarray) -> float:
        """Seconds from adding `prompt` to its first token (prefill and one sample)."""
        t0 = time.perf_counter()
        engine.generate([prompt.tolist()], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t0

    def decode(self, engine: Any, prompt: np.ndarray, steps: int) -> tuple[list[int], float]:
        """(greedy tokens, seconds of the `steps` engine steps after the first token)."""
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        rid = engine.add_request(prompt.tolist(), params)
        while not engine.result(rid).token_ids:
            engine.step()
        t0 = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return engine.result(rid).token_ids, time.perf_counter() - t0


def _tokens(n: int, vocab: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, n).astype(np.int32)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def measure(
    args: argparse.Namespace,
    ours: OurModel,
    ref: TorchModel,
    llama: LlamaRuns | None = None,
    ours_int8: OurModel | None = None,
) -> dict[str, Any]:
    """Interleaved rounds of every timing; medians, ratios and the models' agreement. llama.cpp's figures are
    tokens/s as `llama-bench` reports them, stored as seconds for the same token counts. `ours_int8`: the
    same weights as `--weight-dtype int8`, timed as `ours` is (keys `int8_*`)."""
    vocab = ours.model.config.vocab_size
    prompts = {n: _tokens(n, vocab, n) for n in args.lengths}
    engine_prompt = _tokens(args.engine_prompt, vocab, 1)
    decode_prompt = _tokens(args.decode_prompt, vocab, 2)
    variants = {"ours": ours} | ({} if ours_int8 is None else {"int8": ours_int8})
    engines = {v: {"default": m.engine(None), "1_slot": m.engine(1)} for v, m in variants.items()}
    samples: dict[str, list[float]] = {}
    agreement: dict[str, Any] = {}

    def add(name: str, seconds: float) -> None:
        samples.setdefault(name, []).append(seconds)

    for rnd in range(args.rounds + 1):  # round 0 compiles and warms; it is not counted
        keep = add if rnd else (lambda name, seconds: None)
        for n, toks in prompts.items():
            want, t_ref = ref.logits(toks)
            keep(f"ref_prefill_{n}", t_ref)
            for v, model in variants.items():
                got, t_ours = model.logits(toks)
                keep(f"{v}_prefill_{n}", t_ours)
                agreement[f"logits_max_rel_err_{n}" + ("" if v == "ours" else f"_{v}")] = _rel_err(got, want)
        keep("ref_prefill_cached", ref.logits(engine_prompt, use_cache=True)[1])
        for v, model in variants.items():
            keep(f"{v}_engine_first_token", model.first_token(engines[v]["default"], engine_prompt))
        ref_tokens, t_ref = ref.decode(decode_prompt, args.decode_tokens)
        keep("ref_decode", t_ref)
        for v, model in variants.items():
            # each round reverses the engines' order, so neither always decodes first after the prefills
            for name, engine in list(engines[v].items())[:: 1 if rnd % 2 else -1]:
                got_tokens, t_ours = model.decode(engine, decode_prompt, args.decode_tokens)
                keep(f"{v}_decode_{name}", t_ours)
                if v == "ours":
                    agreement[f"greedy_tokens_agree_{name}"] = got_tokens == ref_tokens
        if llama is not None:
            lengths = sorted({*args.lengths, args.engine_prompt})
            for key, (tokens, rate) in llama.round(lengths, args.decode_prompt, args.decode_tokens).items():
                keep(key, tokens / rate)
    if llama is not None:
        prompt = np.asarray(ByteTokenizer(vocab).encode(args.greedy_prompt), np.int32)
        mine, _ = ours.decode(engines["ours"]["1_slot"], prompt, args.greedy_tokens - 1)
        agreement |= llama.agreement(args.greedy_prompt, args.greedy_tokens, mine)
        if ours_int8 is not None:
            mine, _ = ours_int8.decode(engines["int8"]["1_slot"], prompt, args.greedy_tokens - 1)
            agreement["greedy_jaxhybrid_int8"] = mine
    med = {name: float(np.median(v)) for name, v in samples.items()}
    return {"median_s": med, "samples_s": samples, "agreement": agreement}


def rows(med: dict[str, float], args: argparse.Namespace, fractions: dict[str, float]) -> list[dict]:
    """One row per comparison: tokens/s of both, our ratio, and our share of the machine's limit."""
    out = []
    for n in args.lengths:
        out.append(("prefill", f"full causal pass, {n} tokens", n, f"ref_prefill_{n}", f"ours_prefill_{n}"))
    n = args.engine_prompt
    out.append(
        ("prefill", f"{n} tokens through the engine", n, "ref_prefill_cached", "ours_engine_first_token")
    )
    for name, label in (("1_slot", "engine, 1 slot"), ("default", "default engine")):
        out.append(
            ("decode", f"one request, {label}", args.decode_tokens, "ref_decode", f"ours_decode_{name}")
        )
    table = []
    for kind, label, tokens, ref_key, ours_key in out:
        ref_rate, ours_rate = tokens / med[ref_key], tokens / med[ours_key]
        row = {
            "kind": kind,
            "what": label,
            "transformers_tok_s": ref_rate,
            "jaxhybrid_tok_s": ours_rate,
            "ratio": ours_rate / ref_rate,
            "machine_fraction": fractions.get(ours_key),
        }
        int8_key = "int8" + ours_key[len("ours") :]
        if int8_key in med:
            row["jaxhybrid_int8_tok_s"] = tokens / med[int8_key]
        for wtype in LLAMA_TYPES:
            key = f"llama_{wtype}_{'decode' if kind == 'decode' else f'prefill_{tokens}'}"
            if key in med:
                row[f"llama_{wtype}_tok_s"] = tokens / med[key]
                # fp32 weights against llama.cpp's f32, int8 against its q8_0
                mine = row.get("jaxhybrid_int8_tok_s") if wtype == "q8_0" else ours_rate
                if mine is not None:
                    row[f"ratio_vs_llama_{wtype}"] = mine * med[key] / tokens
        table.append(row)
    return table


def _fractions(ours: OurModel, med: dict[str, float], args: argparse.Namespace, rates: dict) -> dict:
    """Our share of the matmul rate (prefill) or of the read bandwidth (decode), counted as in throughput."""
    cfg = ours.model.config
    params = param_bytes(ours.model)
    _, matmul = active_params(cfg, params)
    out = {}
    prefill = {f"ours_prefill_{n}": n for n in args.lengths} | {"ours_engine_first_token": args.engine_prompt}
    for key, n in prefill.items():
        out[key] = prefill_flops(cfg, matmul, n)["flops"] / med[key] / rates["matmul_flop_per_s"]
    context = args.decode_prompt + args.decode_tokens // 2
    step_bytes = decode_bytes(cfg, params, 1, context, "float32")["bytes"]
    for key in ("ours_decode_1_slot", "ours_decode_default"):
        out[key] = step_bytes * args.decode_tokens / med[key] / rates["bandwidth_bytes_per_s"]
    return out


def run(args: argparse.Namespace) -> int:
    try:
        if args.make_small:
            out = make_small(args.make_small, args.config, args.seed)
            print(f"wrote transformers' KimiLinearForCausalLM ({args.config}, seed {args.seed}) to {out}")
            return 0
        if not args.model:
            raise ValueError("give --model DIR (a Hugging Face directory) or --make-small DIR")
        args.lengths = positive_ints(args.prompt_lengths, "--prompt-lengths")
        if min(args.rounds, args.decode_tokens, args.engine_prompt, args.decode_prompt) < 1:
            raise ValueError("--rounds, --decode-tokens, --engine-prompt and --decode-prompt must be >= 1")
        ref = TorchModel(args.model)
        longest = max(*args.lengths, args.engine_prompt, args.decode_prompt + args.decode_tokens + 1)
        ours = OurModel(args.model, max_len=-(-longest // 64) * 64 + 64)
        llama = _llama_runs(args)
        ours_int8 = None if llama is None else OurModel(args.model, max_len=ours.max_len, int8=True)
    except (RuntimeError, ConfigError, CheckpointError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    env = environment()
    rates = machine_rates("float32", 5, 2048 if env["platform"] == "cpu" else 8192, 256)
    try:
        result = measure(args, ours, ref, llama, ours_int8)
    except LlamaCppError as exc:  # a llama.cpp tool failed mid-run: its message, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    table = rows(result["median_s"], args, _fractions(ours, result["median_s"], args, rates))
    torch = ref.torch
    result = {
        "bench": "reference",
        "model_dir": args.model,
        "config": ours.model.config.name,
        "environment": env,
        "reference": {"torch": torch.__version__, "device": ref.device, "threads": torch.get_num_threads()},
        "machine": rates,
        "llama_cpp": None if llama is None else {**describe(llama.llama), "threads": llama.threads},
        "rows": table,
        **result,
    }
    matmul, read = rates["matmul_flop_per_s"] / 1e9, rates["bandwidth_bytes_per_s"] / 1e9
    title = (
        f"{ours.model.config.name} fp32; jax on {env['platform']} ({env['device_kind']}), transformers on "
        f"{ref.device} (torch {torch.__version__}, {torch.get_num_threads()} threads); machine: matmul "
        f"{matmul:.1f} GFLOP/s, read {read:.1f} GB/s"
    )
    columns = ["kind", "what", "transformers_tok_s", "jaxhybrid_tok_s", "ratio", "of_machine"]
    if llama is not None:
        columns += ["jaxhybrid_int8"] + [f"{p}{w}" for w in LLAMA_TYPES for p in ("llama_", "vs_llama_")]
    shown = Table([_shown(r) for r in table], columns, title=title)
    return report(result, args, shown, f"agreement: {result['agreement']}")


def _llama_runs(args: argparse.Namespace) -> LlamaRuns | None:
    """llama.cpp's side when `--against llama.cpp`: located or built, the model converted."""
    if args.against is None:
        return None
    try:
        llama = build(args.build_llama_cpp) if args.build_llama_cpp else locate(args.llama_cpp)
        work = Path(args.gguf_dir or tempfile.mkdtemp(prefix="jaxhybrid-gguf-"))
        return LlamaRuns(llama, args.model, work, args.threads or os.cpu_count() or 1)
    except LlamaCppError as exc:
        raise RuntimeError(str(exc)) from None


def _shown(r: dict[str, Any]) -> dict[str, str]:
    """A table row's figures as text."""
    out = {
        **r,
        "transformers_tok_s": f"{r['transformers_tok_s']:.1f}",
        "jaxhybrid_tok_s": f"{r['jaxhybrid_tok_s']:.1f}",
        "ratio": f"{r['ratio']:.2f}",
        "of_machine": f"{100 * r['machine_fraction']:.1f}%",
    }
    if "jaxhybrid_int8_tok_s" in r:
        out["jaxhybrid_int8"] = f"{r['jaxhybrid_int8_tok_s']:.1f}"
    for w in LLAMA_TYPES:
        if f"llama_{w}_tok_s" in r:
            out[f"llama_{w}"] = f"{r[f'llama_{w}_tok_s']:.1f}"
            if f"ratio_vs_llama_{w}" in r:
                out[f"vs_llama_{w}"] = f"{r[f'ratio_vs_llama_{w}']:.2f}"
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reference",
        help="this project vs transformers' KimiLinearForCausalLM on the same weights (needs .[reference])",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", help="a Hugging Face checkpoint directory both load")
    p.add_argument(
        "--make-small", metavar="DIR", help="write transformers' model of --config to DIR and exit"
    )
    p.add_argument("--config", default="small", help="with --make-small: the config (default small)")
    p.add_argument("--seed", type=int, default=0, help="with --make-small: torch's seed (default 0)")
    p.add_argument("--prompt-lengths", default="512,2048", help="full-pass lengths (default 512,2048)")
    p.add_argument("--engine-prompt", type=int, default=512, help="prompt through the engine (default 512)")
    p.add_argument("--decode-prompt", type=int, default=128, help="prompt before decoding (default 128)")
    p.add_argument("--decode-tokens", type=int, default=32, help="greedy decode steps timed (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds after a warm-up round (default 3)")
    p.add_argument("--against", choices=["llama.cpp"], help="also time llama.cpp on the same weights")
    p.add_argument("--llama-cpp", metavar="DIR", help="a built llama.cpp source tree (default $LLAMA_CPP)")
    p.add_argument(
        "--build-llama-cpp",
        metavar="DIR",
        help="build llama.cpp from the llama-cpp-python sdist in DIR (reused)",
    )
    p.add_argument("--gguf-dir", metavar="DIR", help="where the GGUF files go (default: a new temporary dir)")
    p.add_argument("--threads", type=int, help="llama.cpp's threads (default: every CPU)")
    p.add_argument(
        "--greedy-prompt",
        default="The quick brown fox jumps over the lazy dog.",
        help="text whose greedy continuation llama.cpp and we must agree on",
    )
    p.add_argument("--greedy-tokens", type=int, default=16, help="greedy tokens compared (default 16)")
    add_out_arg(p)
    p.set_defaults(func=run)
