"""The `jaxhybrid` command line: one entry point, one module per subcommand in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from jaxhybrid.ops import registry
from serve.cli import bench, convert, generate, info, memory, plan, route, serve, train
from serve.models import guess_backend

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
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # the flag where a command has one, else $JAXHYBRID_KERNELS, checked before anything runs
        registry.set_mode(getattr(args, "kernels", None))
    except registry.KernelsError as e:
        parser.error(str(e))
    skip_absent_tpu()
    return args.func(args)


def skip_absent_tpu() -> None:
    """Where libtpu is installed (the `tpu` extra, to compile for TPU topologies) but this host has no TPU
    chip and nothing else chose the platforms (JAX_PLATFORMS, another accelerator plugin), run on the CPU
    without first trying to open a TPU: libtpu would log a screen of discovery errors at every start, then
    fall back to the CPU anyway. `plan --topology` describes TPU devices without opening one either way."""
    import importlib.util
    import os

    if os.environ.get("JAX_PLATFORMS") or importlib.util.find_spec("libtpu") is None:
        return

    if guess_backend() != "cpu":  # a TPU chip here, or another accelerator's plugin
        return
    import jax

    jax.config.update("jax_platforms", "cpu")


if __name__ == "__main__":
    sys.exit(main())
