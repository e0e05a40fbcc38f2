"""The `jaxhybrid` command line: one entry point, one module per subcommand in this package."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from serve.cli import bench, convert, generate, info, memory, plan, route, serve, train

COMMANDS = (info, generate, bench, convert, memory, plan, serve, route, train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxhybrid", description="Kimi Linear hybrid models in JAX: inspect, run and serve them."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def full_precision_products() -> None:
    """Run float32 matrix products at float32 precision on every backend. JAX's default leaves the precision
    to the backend: a GPU runs them in TF32 and a TPU in one bfloat16 pass, which changes greedy tokens
    (BENCHMARKS.md, "On a GPU"). Serve bfloat16 weights for speed. $JAX_DEFAULT_MATMUL_PRECISION, when set,
    wins. A no-op for the CPU, whose float32 products are float32 either way."""
    if "JAX_DEFAULT_MATMUL_PRECISION" in os.environ:
        return
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    full_precision_products()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
