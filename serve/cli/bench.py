"""`jaxhybrid bench SUBCOMMAND`: benchmarks that print JSON (and a table on stderr).

`serve` and `throughput` are the package's own. The research benchmarks (`RESEARCH`) live in the source
checkout's `benchmarks/`, which is not installed: from a checkout this registers them as they are
(`benchmarks.commands`, found by name so that the package never imports them); elsewhere each name says
how to run it."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from serve.bench import serve, throughput

BENCHES = (throughput, serve)

# the research benchmarks' subcommands (`benchmarks.commands`), and what each is for
RESEARCH = {
    "decode": "decode step time against context length",
    "load": "peak RSS and time of loading a checkpoint",
    "ttft": "time to first token with and without the prefix store",
    "mesh": "decode on a device mesh",
    "prefix": "prefix-store policies over seeded workloads (engine or simulator)",
    "slots": "decode throughput against concurrent slots",
    "reference": "the model against transformers (and llama.cpp)",
    "quant": "accuracy of quantized weights",
    "compare": "several bench results of one kind side by side",
    "speculative": "speculative decoding's speedup",
    "checkpoint-dtype": "accuracy of narrowed prefix checkpoints",
    "route": "the router's policies over replicas",
}


def research_benchmarks() -> ModuleType | None:
    """`benchmarks.commands` from the source checkout this package runs from, or None where there is none
    (an installed wheel). The checkout is the directory above `serve/` that holds `benchmarks/`."""
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "commands.py").is_file():
        return None
    if str(root) not in sys.path:
        sys.path.append(str(root))
    module = importlib.import_module("benchmarks.commands")
    if Path(module.__file__).resolve().parents[1] != root:
        return None  # another `benchmarks` came first on the path
    return module


def _absent(name: str) -> int:
    print(
        f"error: `bench {name}` is a research benchmark: run it from a source checkout: "
        f"python -m benchmarks {name}",
        file=sys.stderr,
    )
    return 2


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (JSON on stdout, a table on stderr)", description=__doc__)
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for module in BENCHES:
        module.register(bench_sub)
    research = research_benchmarks()
    if research is not None:
        research.register(bench_sub)
        return
    for name, what in RESEARCH.items():
        # no prefix characters: every argument (--help too) is taken as given, and the run says where to go
        q = bench_sub.add_parser(
            name, help=f"{what} (research: from a source checkout)", add_help=False, prefix_chars="\0"
        )
        q.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
        q.set_defaults(func=lambda args, name=name: _absent(name))
