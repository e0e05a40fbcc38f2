"""Compile time of the engine's programs against depth, on its default settings (issue 14, item 4).

For `tiny` (4 layers) and `tiny` widths at other depths (every 4th layer MLA, one dense lead layer), it
compiles one prefill program (bucket `--chunk`) and one decode program (1 row) of the same table width
through `Runner.compile_program`, with `--scan-layers` (default: the engine's own default), and prints JSON
and a table: seconds per program and the ratio to the 4-layer model.

    python -m benchmarks compile-depth --layers 4,92
    python -m benchmarks compile-depth --layers 4,92 --scan-layers off
"""

from __future__ import annotations

import argparse
import time

from benchmarks.report import Table, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from serve.engine.config import ProgramShape
from serve.engine.engine import Engine, EngineConfig


def depth_config(layers: int):

    base = load_config("tiny")
    if layers == base.num_hidden_layers:
        return base
    kda = tuple(i for i in range(1, layers + 1) if i % 4)
    mla = tuple(i for i in range(1, layers + 1) if i % 4 == 0)
    return base.replace(num_hidden_layers=layers, kda_layers=kda, full_attn_layers=mla)


def measure(layers: int, scan_layers: str | None, chunk: int) -> dict:
    from flax import nnx

    config = EngineConfig(max_model_len=1024, prefix=None, prefill_chunk=chunk)
    if scan_layers is not None:
        config.scan_layers = scan_layers
    engine = Engine(HybridLM(depth_config(layers), rngs=nnx.Rngs(0)), config)
    width = engine.shape.table_width(chunk // engine.shape.block_size + 1)
    row = {"layers": layers, "scan": engine.runner.scan_mode}
    programs = {"prefill_s": ProgramShape(1, chunk, width), "decode_s": ProgramShape(1, 1, width)}
    for name, program in programs.items():
        t0 = time.perf_counter()
        engine.runner.compile_program(program)
        row[name] = round(time.perf_counter() - t0, 2)
    return row


def main() -> None:

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", default="4,92", help="depths, comma-separated (default 4,92)")
    p.add_argument("--scan-layers", default=None, help="auto | off | prefill | all (default: the engine's)")
    p.add_argument("--chunk", type=int, default=512, help="the prefill program's length (default 512)")
    args = p.parse_args()
    rows = [measure(n, args.scan_layers, args.chunk) for n in map(int, args.layers.split(","))]
    base = rows[0]
    for r in rows:
        r["prefill_vs_first"] = round(r["prefill_s"] / base["prefill_s"], 2)
        r["decode_vs_first"] = round(r["decode_s"] / base["decode_s"], 2)
    columns = ["layers", "scan", "prefill_s", "decode_s", "prefill_vs_first", "decode_vs_first"]
    report({"bench": "compile_depth", "rows": rows}, args, Table(rows, columns))


if __name__ == "__main__":
    main()
