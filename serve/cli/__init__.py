"""The `jaxhybrid` command line: one entry point, one module per subcommand in this package."""

from __future__ import annotations

import argparse
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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
