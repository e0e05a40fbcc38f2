"""Subcommands of `jaxhybrid`: each module has `register(subparsers)` and sets `func` on its parser."""
