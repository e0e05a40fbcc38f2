"""`jaxhybrid bench` subcommands: each module has `register(subparsers)`; results are JSON + a table."""
