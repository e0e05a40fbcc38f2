"""What a start pays for a model program that an earlier start compiled (issue 27 item 7).

In fresh processes on one fresh cache directory, `Runner.compile_program` of the README curl's two model
programs (the one-row decode step and the 16-token prefill at the narrowest block table) of the shipped
model with the default engine: first compiling them (which fills the cache), then alternately reading them
as serialized executables (`serve.engine.executables`) and through JAX's persistent compilation cache
alone (tracing and lowering the model, then reading XLA's result). Alternating keeps a shared machine's load
from favouring one way. Prints JSON and a table.

    python -m benchmarks cached-programs [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from serve.report import print_table

MODES = ("compile", "executables", "jax-cache")


def child(mode: str, cache: str) -> None:
    from serve.cli.common import setup_compile_cache

    setup_compile_cache(cache)
    from jaxhybrid.assets import shipped_model_dir
    from jaxhybrid.weights import load_pretrained
    from serve.engine import executables
    from serve.engine.config import EngineShape, ProgramShape
    from serve.engine.engine import EngineConfig
    from serve.engine.runner import Runner

    if mode == "jax-cache":  # the serialized executables off: JAX's cache alone
        executables.ExecutableCache.from_jax_config = classmethod(lambda cls: cls(None))
    model = load_pretrained(shipped_model_dir(), progress=False)
    shape = EngineShape.resolve(EngineConfig(), model.config)
    runner = Runner(model, shape)
    width = shape.table_buckets[0]
    seconds = {}
    for program in (ProgramShape(1, 1, width), ProgramShape(1, 16, width)):
        t0 = time.perf_counter()
        runner.compile_program(program)
        seconds["decode" if program.is_decode else "prefill 16"] = time.perf_counter() - t0
    print(json.dumps(seconds))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="alternations of the two cached ways (default 2)")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.cache)

    rows = []
    with tempfile.TemporaryDirectory(prefix="cached-programs-") as cache:
        for mode in ("compile", *(m for _ in range(args.rounds) for m in MODES[1:])):
            cmd = [sys.executable, __file__, "--child", mode, "--cache", cache]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
            row = {"way": mode, **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(rows, indent=1))
    for row in rows:
        for k in ("decode", "prefill 16"):
            row[k] = f"{row[k]:.2f}"
    print_table(rows, ["way", "decode", "prefill 16"])


if __name__ == "__main__":
    main()
