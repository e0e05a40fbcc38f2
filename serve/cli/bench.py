"""`jaxhybrid bench SUBCOMMAND`: benchmarks that print JSON (and a table on stderr)."""

from __future__ import annotations

import argparse

from serve.bench import (
    checkpoint_dtype,
    compare,
    decode,
    load,
    mesh,
    prefix,
    quant,
    reference,
    route,
    serve,
    slots,
    speculative,
    throughput,
    ttft,
)

BENCHES = (
    decode,
    load,
    ttft,
    mesh,
    prefix,
    throughput,
    slots,
    serve,
    reference,
    quant,
    compare,
    speculative,
    checkpoint_dtype,
    route,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON on stdout, a table on stderr)", description=__doc__)
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        module.register(bench_sub)
