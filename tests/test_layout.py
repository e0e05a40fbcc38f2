"""The layout by role keeps its arrows (docs/design.md): `jaxhybrid` imports neither `sharding` nor `serve`;
`sharding` imports `jaxhybrid` only; `serve/bench` never imports `serve/cli` (cli runs the benchmarks);
outside `serve/prefix/` only its interface modules are imported; no class in serve/ over 300 lines.
Read from the source (every import, lazy ones inside functions too)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the store, its weights fingerprint, and the analytic account of what it keeps (`memory --turns`)
PREFIX_INTERFACE = {
    "serve.prefix.store",
    "serve.prefix.fingerprint",
    "serve.prefix.ledger",
    "serve.prefix.events",
    "serve.prefix.placement",  # the offline placement bench prefix compares against
}


def imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def modules(package: str) -> dict[str, set[str]]:
    return {str(p.relative_to(ROOT)): imports(p) for p in sorted((ROOT / package).rglob("*.py"))}


def top(name: str) -> str:
    return name.split(".")[0]


def top_two(name: str) -> str:
    return ".".join(name.split(".")[:2])


def test_jaxhybrid_imports_neither_sharding_nor_serve():
    bad = {
        m: sorted(i for i in imps if top(i) in ("sharding", "serve"))
        for m, imps in modules("jaxhybrid").items()
    }
    assert {m: v for m, v in bad.items() if v} == {}


def test_sharding_imports_jaxhybrid_only():
    found = {m: sorted(i for i in imps if top(i) == "serve") for m, imps in modules("sharding").items()}
    assert {m: v for m, v in found.items() if v} == {}


def test_bench_and_cli_do_not_import_each_other_in_a_circle():
    bench = {
        m: sorted(i for i in imps if i.startswith("serve.cli")) for m, imps in modules("serve/bench").items()
    }
    assert {m: v for m, v in bench.items() if v} == {}


def test_only_the_prefix_store_interface_is_imported_outside_it():
    found = {}
    for package in ("serve", "sharding", "jaxhybrid"):
        for m, imps in modules(package).items():
            if m.startswith("serve/prefix/"):
                continue
            inner = sorted(
                i
                for i in imps
                if i.startswith("serve.prefix.")
                and i not in PREFIX_INTERFACE
                and i.rsplit(".", 1)[0] not in PREFIX_INTERFACE
            )
            if inner:
                found[m] = inner
    assert found == {}


# A class is the unit a reader must hold in mind at once; past about 300 lines one has taken on a second role
# (the engine's step loop and its device pools, the store's decisions and its write path), which belongs in a
# collaborator of its own. Counted from the `class` line to its last line, docstring and comments included.
MAX_CLASS_LINES = 300


def test_no_class_in_serve_is_over_300_lines():
    big = {}
    for path in sorted((ROOT / "serve").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            lines = node.end_lineno - node.lineno + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                big[f"{path.relative_to(ROOT)}:{node.name}"] = lines
    assert big == {}
