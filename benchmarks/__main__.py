"""`python -m benchmarks NAME ...`: the research benchmarks, one subcommand each (the same arguments as
`jaxhybrid bench NAME` from a checkout), and the standalone studies of this directory (`SCRIPTS`: each
parses its own arguments; `python -m benchmarks NAME --help`)."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from benchmarks import commands
from serve.cli import skip_absent_tpu

# studies with a `main()` of their own, by subcommand name -> module
SCRIPTS = {
    "cached-programs": "cached_programs",
    "compile-depth": "compile_depth",
    "decode-options": "decode_options",
    "first-start": "first_start",
    "int8-products": "int8_products",
    "plan-activations": "plan_activations",
    "prefill-chunk": "prefill_chunk",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="standalone studies: " + ", ".join(SCRIPTS),
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    commands.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    skip_absent_tpu()  # as the CLI does: libtpu installed and no TPU chip here, run on the CPU quietly
    if argv and argv[0] in SCRIPTS:
        # the module is named here, not imported at the top: each study parses sys.argv itself
        study = importlib.import_module(f"benchmarks.{SCRIPTS[argv[0]]}")
        sys.argv = [f"python -m benchmarks {argv[0]}", *argv[1:]]
        return study.main() or 0
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
