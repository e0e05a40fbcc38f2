"""The research benchmarks' subcommands, one module each with `register(subparsers)`: `python -m benchmarks`
and, from a source checkout, `jaxhybrid bench` register these (`serve.cli.bench` finds this module by
name, so that the installed package never imports `benchmarks`)."""

from __future__ import annotations

import argparse

from benchmarks import (
    checkpoint_dtype,
    compare,
    decode,
    load,
    mesh,
    prefix,
    quant,
    reference,
    route,
    slots,
    speculative,
    ttft,
)

# in the order `--help` lists them
COMMANDS = (
    decode,
    load,
    ttft,
    mesh,
    prefix,
    slots,
    reference,
    quant,
    compare,
    speculative,
    checkpoint_dtype,
    route,
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add every research benchmark's subcommand to `sub`."""
    for module in COMMANDS:
        module.register(sub)
