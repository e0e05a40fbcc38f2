"""The user benchmarks of `jaxhybrid bench`: `serve` (a running server under load) and `throughput` (tokens/s
against the machine's measured rates), each module with `register(subparsers)`. The research benchmarks are
in the source checkout's `benchmarks/`."""
