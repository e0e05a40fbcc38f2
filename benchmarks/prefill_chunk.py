"""Prompts through the default engine (4 slots, store off) at several prefill chunk sizes and packed rows
(issue 14).

Random weights of `--config` (default small), fp32. Each engine (every `--chunks` x `--rows` pair) serves
`--prompts` prompts of `--prompt` tokens arriving together, first once (compiling its programs), then the
engines take turns for `--rounds` rounds (time until every prompt has its first token). Prints JSON and a
table: tokens/s and the share of the machine's 2048^3 matmul rate measured in the same run, at the model
FLOPs `bench throughput` counts (`prefill_flops`).

    python -m benchmarks prefill-chunk --chunks 128,256,512
    python -m benchmarks prefill-chunk --chunks 512 --rows 1,4 --prompts 4 --prompt 64
"""

from __future__ import annotations

import argparse
import time

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.throughput import machine_rates
from serve.engine.engine import Engine, EngineConfig
from serve.engine.sampling import SamplingParams
from serve.sim.cost import active_params, param_bytes, prefill_flops


def main() -> None:
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--chunks", default="128,256,512", help="prefill chunk sizes (default 128,256,512)")
    p.add_argument("--rows", default="4", help="EngineConfig.prefill_rows values (default 4)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--prompts", type=int, default=1, help="prompts arriving together (default 1)")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    cfg = load_config(args.config)
    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.float32)
    move_to_huge_pages(model)  # as the server's loader does
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    prompts = lambda: [rng.integers(3, cfg.vocab_size, args.prompt).tolist() for _ in range(args.prompts)]  # noqa: E731
    engines = {
        (c, r): Engine(
            model, EngineConfig(prefill_chunk=c, prefill_rows=r, max_model_len=2 * args.prompt, prefix=None)
        )
        for c in map(int, args.chunks.split(","))
        for r in map(int, args.rows.split(","))
    }
    samples: dict[tuple[int, int], list[float]] = {key: [] for key in engines}
    for engine in engines.values():
        engine.generate(prompts(), params)
    for _ in range(args.rounds):
        for key, engine in engines.items():
            t0 = time.perf_counter()
            engine.generate(prompts(), params)
            samples[key].append(time.perf_counter() - t0)
    rate = machine_rates("float32", 5, 2048, 256)["matmul_flop_per_s"]
    _, matmul = active_params(cfg, param_bytes(model))
    flops = prefill_flops(cfg, matmul, args.prompt)["flops"] / args.prompt
    rows = []
    for (c, r), ts in samples.items():
        seconds = float(np.median(ts))
        tok_s = args.prompts * args.prompt / seconds
        share = round(tok_s * flops / rate, 3)
        rows.append(
            {
                "prefill_chunk": c,
                "prefill_rows": r,
                "s": round(seconds, 3),
                "tok_s": round(tok_s, 1),
                "of_matmul": share,
            }
        )
    result = {
        "bench": "prefill_chunk",
        "prompts": args.prompts,
        "prompt_tokens": args.prompt,
        "matmul_flop_per_s": rate,
        "flops_per_token": flops,
        "rows": rows,
    }
    report(result, args, Table(rows, ["prefill_chunk", "prefill_rows", "s", "tok_s", "of_matmul"]))


if __name__ == "__main__":
    main()
