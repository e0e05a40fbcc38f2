"""Research benchmarks: accuracy and speed studies, placement and routing studies, comparisons with
transformers and llama.cpp. They live in the source checkout, not in the installed package: run them as
`python -m benchmarks NAME ...` (or `jaxhybrid bench NAME ...` from a checkout). Each subcommand module has
`register(subparsers)` (`benchmarks.__main__` lists them); results are one JSON line on stdout (and
`--out`) and tables on stderr (`benchmarks.report`). They import the package; it never imports them."""
