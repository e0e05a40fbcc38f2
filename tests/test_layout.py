"""The layout by role keeps its arrows (docs/design.md): `jaxhybrid` imports neither `sharding` nor `serve`;
`sharding` imports `jaxhybrid` only; `serve/bench` never imports `serve/cli` (cli runs the benchmarks); the
installed package (`jaxhybrid`, `serve`, `sharding`) never imports the research benchmarks of `benchmarks/`
(not installed; they import the package, and `jaxhybrid bench` finds them by name in a source checkout);
outside `serve/prefix/` only its interface modules are imported; no two modules import each other, however
indirectly; imports of the project's own modules sit at module level, where a reader sees the graph, save
the few listed lazy ones.
Read from the source (every import, lazy ones inside functions and those under TYPE_CHECKING too)."""

import ast
import graphlib
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


PACKAGES = ("jaxhybrid", "serve", "sharding")  # what the wheel installs
LAB = "benchmarks"  # the research benchmarks of the source checkout

# The function-local imports of project modules that stay lazy, "module:function" -> why. Everything else is
# imported at module level.
LAZY_IMPORTS = {
    "jaxhybrid:__getattr__": "`import jaxhybrid` (any of its modules) does not load the checkpoint code",
    "serve.cli.serve:serve_http": "the HTTP stack (fastapi, starlette, pydantic) loads when a server starts",
    "serve.cli.route:run": "the HTTP stack (fastapi, starlette, pydantic) loads when the router starts",
    "benchmarks.route:RoutedLive.__init__": "the HTTP stack loads when a live bench starts its servers",
    "benchmarks.route:_serve_router": "the HTTP stack loads when a live bench starts its router",
    "benchmarks.cached_programs:child": "a child sets the compilation cache up before the engine loads",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in (*PACKAGES, LAB) for p in sorted((ROOT / package).rglob("*.py"))}


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The project module an imported name loads: itself, or the module that holds it (None: not ours)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_sites(path: Path, known: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(the project module imported, the function importing it or None at module level) for every import in
    `path`: at module level, under `if TYPE_CHECKING:`, inside functions and methods. `from pkg import x`
    names the submodule `pkg.x` where there is one; relative imports are resolved."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    sites: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, scope: list[str], in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    base = ".".join(up + ([child.module] if child.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            else:
                targets = []
            for target in filter(None, (resolve(t, known) for t in targets)):
                if target != module:
                    sites.append((target, ".".join(scope) if in_function else None))
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = in_function or not isinstance(child, ast.ClassDef)
                visit(child, scope + [child.name], inner)
            else:
                visit(child, scope, in_function)

    visit(ast.parse(path.read_text()), [], False)
    return sites


def import_graph() -> dict[str, set[str]]:
    known = project_modules()
    return {m: {t for t, _ in import_sites(p, known)} for m, p in known.items()}


def test_no_import_circle():
    """No module reaches itself through imports of any kind (a circle under TYPE_CHECKING or inside a
    function is still one: the modules cannot be read, tested or moved apart)."""
    try:
        tuple(graphlib.TopologicalSorter(import_graph()).static_order())
    except graphlib.CycleError as exc:
        # graphlib lists each module before the one that imports it
        raise AssertionError(f"import circle: {' imports '.join(reversed(exc.args[1]))}") from None


def test_project_imports_are_at_module_level():
    known = project_modules()
    local: dict[str, set[str]] = {}
    for module, path in known.items():
        for target, function in import_sites(path, known):
            if function is not None:
                local.setdefault(f"{module}:{function}", set()).add(target)
    unlisted = {site: sorted(targets) for site, targets in local.items() if site not in LAZY_IMPORTS}
    assert unlisted == {}
    assert sorted(set(LAZY_IMPORTS) - set(local)) == []  # the list names only lazy imports that exist


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


def test_the_package_never_imports_the_research_benchmarks():
    found = {}
    for package in PACKAGES:
        for m, imps in modules(package).items():
            if lab := sorted(i for i in imps if top(i) == LAB):
                found[m] = lab
    assert found == {}


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


# The command-line front ends: they parse flags and turn them into typed settings (`ModelSettings`,
# `MultihostSettings`, `EngineConfig`, ...) at their edge; everything below them takes those settings.
FRONT_ENDS = ("serve/cli/", "serve/bench/", "benchmarks/")


def namespace_uses(path: Path) -> list[str]:
    """Where `path` takes an argparse Namespace (a parameter annotated `argparse.Namespace` or `Namespace`)
    or parses a command line (a call of `.parse_args` / `.parse_known_args`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            params = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
            params += [a for a in (node.args.vararg, node.args.kwarg) if a is not None]
            for param in params:
                note = ast.unparse(param.annotation) if param.annotation is not None else ""
                if "Namespace" in note:
                    found.append(f"{node.name}({param.arg}: {note}) line {node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("parse_args", "parse_known_args"):
                found.append(f".{node.func.attr}() line {node.lineno}")
    return found


def test_no_argparse_namespace_below_the_command_line():
    """Outside the front ends no function takes an argparse Namespace or parses arguments: the model, the
    mesh and the engine are set up from typed settings, which a test or another program builds directly."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = str(path.relative_to(ROOT))
            if not name.startswith(FRONT_ENDS) and (uses := namespace_uses(path)):
                found[name] = uses
    assert found == {}
    # the check sees what it looks for: the front ends do take Namespaces
    assert namespace_uses(ROOT / "serve/cli/generate.py")
