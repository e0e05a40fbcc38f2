"""`jaxhybrid bench route`: `bench prefix`'s seeded workloads served by several replicas behind a router, once
per routing policy (`serve.route.policies`): prompt tokens computed (against the single-store lower bound),
hit rate, TTFT p50 / p99 and output tokens/s.

`--simulate`: N simulated engines (the engine's scheduler and prefix store with analytic bytes and FLOPs, no
model: any config, any scale; `serve.sim.engine`), the router's own index and policies fed each store's
events directly, the requests of a round routed in order before they run (their load counted as the live
router counts it); answers are seeded by their prompt, so every policy meets the same workload. Without it:
N `serve` apps of a model in this process (uvicorn threads, each with its own engine and event publisher)
behind `jaxhybrid route`'s app, the workload sent over HTTP (streamed, a round's requests in order a few
milliseconds apart), and the router's index brought up to date between rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.common import RoundProgress
from benchmarks.prefix import add_engine_shape_args, add_workload_args, engine_config, simulated_kv_bytes
from benchmarks.report import Table, or_dash, report
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.tokenizer import ByteTokenizer, Tokenizer, TokenizerError
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.common import add_out_arg, compile_watch, environment
from serve.engine.engine import Engine
from serve.engine.records import Ledger
from serve.engine.requests import RequestError
from serve.http.kv_events import EventPublisher
from serve.http.threaded import free_port, serving
from serve.prefix.store import PrefixStoreConfig
from serve.route.backends import Backend, BackendSpec
from serve.route.policies import Chooser, Policy
from serve.sim.cost import CostModel
from serve.sim.engine import SimEngine
from serve.sim.replay import Replay, WorkloadError, replay
from serve.sim.runner import prompt_answers
from serve.sim.workloads import FAMILIES

POLICIES = ("state-aware", "kv-only", "round-robin")
SGLANG = "sglang cache_aware"  # `--sglang-router`: that router in front of the same replicas


def merge_ledgers(ledgers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' ledgers added up: numbers summed, nested dicts key by key (else: the first's)."""

    def add(a: Any, b: Any) -> Any:
        if isinstance(a, dict) and isinstance(b, dict):
            return {
                k: add(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in a.keys() | b.keys()
            }
        return a + b if isinstance(a, int | float) and isinstance(b, int | float) else a

    return functools.reduce(add, ledgers, {})


def _weight(load_weight: float | None) -> dict[str, float]:
    return {} if load_weight is None else {"load_weight": load_weight}


class Arrivals:
    """The order a round's requests reach the router: seeded, a new one each round (chats do not take their
    turns in the same order every time; a fixed one would make round-robin send each chat to one replica)."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def order(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.permutation(n)]


class OneAtATime:
    """A routed server whose requests are sent one at a time, each after the previous one is done (and, live,
    its events applied): the simulator and a live run then decide on the same state every time."""

    def __init__(self, server: Any, seed: int):
        self.server, self.arrivals = server, Arrivals(seed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.server, name)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> list[Any]:
        results: list[Any] = [None] * len(prompts)
        for i in self.arrivals.order(len(prompts)):
            results[i] = self.server.generate([prompts[i]], sampling)[0]
        return results


class RoutedSim:
    """N simulated replicas behind the router's policy (a `bench prefix` Server); see the module doc."""

    def __init__(self, sims: list[Any], policy: str, seed: int = 0, load_weight: float | None = None):
        self.sims = sims
        self.backends = [Backend(BackendSpec(f"sim://{i}")) for i in range(len(sims))]
        for sim, backend in zip(sims, self.backends, strict=True):
            backend.capacity = sim.engine.checkpoint_capacity()
        self.chooser = Chooser(self.backends, Policy(policy), **_weight(load_weight))
        self.assigned: list[int] = []
        self.wall = 0.0  # simulated seconds: each round lasts as long as its slowest replica
        self.arrivals = Arrivals(seed)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> list[Any]:
        shares: list[list[int]] = [[] for _ in self.sims]
        tickets = []  # a round's requests are all routed before any runs: none is past its first token
        for i in self.arrivals.order(len(prompts)):
            best = self.chooser.rank(list(prompts[i]))[0]
            tickets.append(best.backend.start(best.prefill, best.prefixes, best.new_chain))
            k = self.backends.index(best.backend)
            shares[k].append(i)
            self.assigned.append(k)
        results: list[Any] = [None] * len(prompts)
        longest = 0.0
        for k, (sim, backend) in enumerate(zip(self.sims, self.backends, strict=True)):
            t0 = sim.clock
            if shares[k]:
                for i, res in zip(
                    shares[k], sim.generate([prompts[i] for i in shares[k]], sampling), strict=True
                ):
                    results[i] = res
            longest = max(longest, sim.clock - t0)
            backend.index.apply(sim.engine.take_events())
        for ticket in tickets:  # the round is done
            ticket.end()
        self.wall += longest
        return results

    def ledger(self) -> Ledger:
        return Ledger.from_json(merge_ledgers([sim.ledger().to_json() for sim in self.sims]))


class RoutedLive:
    """N in-process `serve` apps of `model` behind the router's app, over HTTP (a `bench prefix` Server)."""

    STAGGER_S = 0.005

    def __init__(
        self,
        model: Any,
        engine_config: Any,
        replicas: int,
        policy: str,
        tokenizer: Any,
        seed: int = 0,
        load_weight: float | None = None,
        text: bool = False,
        external: str | None = None,
    ):
        """`text`: prompts go as text (`CharTokenizer`, which the replicas and the router then use);
        `external`: the `sglang-router` executable to put in front of the replicas instead of ours (its
        cache_aware policy; it takes text prompts only)."""
        # the HTTP stack (fastapi, starlette, pydantic) loads when a server starts, not with the CLI
        from serve.http.app import create_app

        self._stack = contextlib.ExitStack()
        self.text = CharTokenizer(model.config.vocab_size) if text or external is not None else None
        tokenizer = self.text or tokenizer
        self.apps, self.publishers, specs = [], [], []
        for _ in range(replicas):
            pub = EventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
            app = create_app(Engine(model, engine_config), tokenizer, "bench", events=pub)
            url = self._stack.enter_context(serving(app))
            self.apps.append(app)
            self.publishers.append(pub)
            specs.append(BackendSpec(url, pub.bound, pub.replay_bound))
        self.wall, self.arrivals, self.ours = 0.0, Arrivals(seed), external is None
        if external is not None:  # its own routing: nothing of ours follows the events
            self.url = self._stack.enter_context(_external_router(external, [s.url for s in specs]))
        else:  # in a process of its own, as `jaxhybrid route` runs (not sharing the replicas' GIL)
            self.url = self._stack.enter_context(_router_process(specs, policy, load_weight, tokenizer))

    def close(self) -> None:
        self._stack.close()

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Any) -> list[Any]:
        import asyncio

        t0 = time.perf_counter()
        results = asyncio.run(self._round([[int(t) for t in p] for p in prompts], sampling.max_tokens))
        self.wall += time.perf_counter() - t0
        self._settle()
        return results

    async def _round(self, prompts: list[list[int]], max_tokens: int) -> list[Any]:
        import asyncio

        import httpx

        async with httpx.AsyncClient(base_url=self.url, timeout=600) as client:
            tasks: dict[int, Any] = {}
            for i in self.arrivals.order(len(prompts)):
                prompt: Any = self.text.decode(prompts[i]) if self.text else prompts[i]
                tasks[i] = asyncio.create_task(_streamed(client, prompt, max_tokens))
                await asyncio.sleep(self.STAGGER_S)  # the router ranks them in this order
            await asyncio.gather(*tasks.values())
            return [tasks[i].result() for i in range(len(prompts))]

    def _settle(self, timeout: float = 10.0) -> None:
        """Wait until our router has applied every event the replicas published."""
        deadline = time.monotonic() + timeout
        while self.ours and time.monotonic() < deadline:
            applied = [b["events"] for b in self.stats()["backends"]]
            if all(a == pub.seq for a, pub in zip(applied, self.publishers, strict=True)):
                return
            time.sleep(0.01)

    def stats(self) -> dict[str, Any]:
        """Our router's `/route/stats`."""
        import httpx

        return httpx.get(f"{self.url}/route/stats", timeout=10).json()

    def ledger(self) -> Ledger:
        return Ledger.from_json(merge_ledgers(self.ledgers()))

    def ledgers(self) -> list[dict[str, Any]]:
        return [app.state.server.loop.call(lambda e: e.ledger().to_json()).result() for app in self.apps]


class CharTokenizer(Tokenizer):
    """One character a token, every id its own (CJK letters from U+4E00): `--text` prompts, answers included,
    go back to exactly the ids they came from, so a text router sees a conversation continue its last answer
    as a chat client sends it, and a replica resumes the state it kept after that answer."""

    BASE = 0x4E00
    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __init__(self, vocab_size: int):
        if not 3 <= vocab_size <= 0x9FFF - self.BASE + 1:
            raise ValueError(f"--text maps a token to a CJK letter: 3..20992 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [ord(c) - self.BASE for c in text]
        if any(not 0 <= i < self.vocab_size for i in ids):
            raise TokenizerError("--text replicas read only the characters CharTokenizer writes")
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(self.BASE + int(i)) for i in ids)

    @property
    def max_token_id(self) -> int:
        return self.vocab_size - 1


def _serve_router(
    specs: list[Any], policy: str, load_weight: float | None, tokenizer: Any, port: int
) -> None:
    """The router's app over `specs` with `policy` (in a child process)."""
    import uvicorn

    # the HTTP stack (fastapi, starlette, pydantic) loads when a server starts, not with the CLI
    from serve.route.app import create_router_app

    backends = [Backend(spec) for spec in specs]
    app = create_router_app(backends, Chooser(backends, Policy(policy), **_weight(load_weight)), tokenizer)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def _router_process(specs: list[Any], policy: str, load_weight: float | None, tokenizer: Any):
    """Our router in a spawned process until the block ends; its URL once healthy."""
    import multiprocessing

    port = free_port()
    proc = multiprocessing.get_context("spawn").Process(
        target=_serve_router, args=(specs, policy, load_weight, tokenizer, port), daemon=True
    )
    proc.start()
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, lambda: proc.exitcode, "the router")
        yield url
    finally:
        proc.terminate()
        proc.join(10)


def _wait_healthy(url: str, exited: Any, name: str, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if exited() is not None:
            raise RuntimeError(f"{name} exited with {exited()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become healthy")
        time.sleep(0.1)


@contextlib.contextmanager
def _external_router(executable: str, urls: list[str]):
    """`sglang-router launch` in front of `urls` (cache_aware policy), until the block ends; its URL."""
    import subprocess

    port = free_port()
    cmd = [executable, "launch", "--worker-urls", *urls, "--policy", "cache_aware", "--host", "127.0.0.1"]
    proc = subprocess.Popen([*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, proc.poll, executable, timeout=60)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@dataclasses.dataclass
class _Result:
    """What `replay` needs of a served request."""

    token_ids: list[int]
    stats: dict[str, Any]


async def _streamed(client: Any, prompt: list[int] | str, max_tokens: int) -> _Result:
    import json

    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    t0, ttft, ids, usage = time.perf_counter(), None, [], {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 400:  # the replica refused the request: say why, as the engine would
            raise RequestError(f"HTTP 400: {(await r.aread())[:200].decode(errors='replace')}")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            for c in event.get("choices", []):
                if c.get("token_ids"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    ids += c["token_ids"]
            usage = event.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    stats = {
        "prompt_tokens": len(prompt),
        "prefix_hit_tokens": cached,
        "prefill_tokens_computed": len(prompt) - cached,
        "recomputed_tokens": 0,
        "time_to_first_token_s": ttft or 0.0,
        "generated_tokens": len(ids),
    }
    return _Result(ids, stats)


def _per_replica(server: Any) -> list[int]:
    """Requests each replica served: the router's count, or (another router) each replica's lookups."""
    if hasattr(server, "assigned"):
        return np.bincount(server.assigned, minlength=len(server.backends)).tolist()
    if server.ours:
        return [b["routed"] for b in server.stats()["backends"]]
    return [led.get("lookups", 0) for led in server.ledgers()]


def row(workload: Any, policy: str, rep: Replay, server: Any) -> dict[str, Any]:
    summary = rep.summary()
    ms = 1e3 * np.asarray([s["time_to_first_token_s"] for s in rep.stats])
    generated = sum(len(s.generated) for s in rep.served)
    return {
        "workload": workload.name,
        "policy": policy,
        **{k: summary[k] for k in ("requests", "prompt_tokens", "hit_rate", "prompt_tokens_computed")},
        "lower_bound_tokens": summary["lower_bound_tokens"],
        "ttft_p50_ms": float(np.percentile(ms, 50)),
        "ttft_p99_ms": float(np.percentile(ms, 99)),
        "output_tokens_per_s": generated / server.wall if server.wall else None,
        "wall_s": server.wall,
        "per_replica": _per_replica(server),
    }


def live(model: Any, config: Any, tokenizer: Any, policy: str, args: argparse.Namespace) -> RoutedLive:
    """The live replicas behind our router with `policy`, or (SGLANG) behind `--sglang-router`."""
    external = args.sglang_router if policy == SGLANG else None
    our = "round-robin" if external else policy
    return RoutedLive(
        model, config, args.replicas, our, tokenizer, args.seed, args.load_weight, args.text, external
    )


MEASURE_TRIES = 3  # a live pass that compiled a program (a batch shape no earlier pass met) is run again


def measure(model: Any, config: Any, tokenizer: Any, cfg: Any, workload: Any, policy: str, args: Any) -> dict:
    """One row: `workload` served behind `policy`, simulated or live; a live pass that timed a compile is
    served again on fresh replicas (the compile is now cached), up to MEASURE_TRIES passes in all."""
    for attempt in range(1, MEASURE_TRIES + 1):
        t0 = time.perf_counter()
        if args.simulate:
            answers, cost = prompt_answers(cfg.vocab_size, args.seed), CostModel.of(cfg, args.flops_per_s)
            sims = [SimEngine(cfg, config, answers, cost) for _ in range(args.replicas)]
            server: Any = RoutedSim(sims, policy, args.seed, args.load_weight)
        else:
            server = live(model, config, tokenizer, policy, args)
        if args.one_at_a_time:
            server = OneAtATime(server, args.seed)
        try:
            with compile_watch() as compiles:
                progress = RoundProgress(f"{workload.name}, {policy}", getattr(workload, "turns", None))
                rep = replay(server, workload, cfg.vocab_size, progress)
            measured = row(workload, policy, rep, server)  # (live: while the replicas still answer)
        finally:
            if not args.simulate:
                server.close()
        timing = {
            "bench_s": round(time.perf_counter() - t0, 1),
            "compiles_while_timed": compiles["compiles"],
            "passes": attempt,
        }
        if args.simulate or not compiles["compiles"]:
            break
    return {**measured, **timing}


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or any(p not in POLICIES for p in policies):
        print(f"error: --policies takes {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    if args.sglang_router:
        if args.simulate:
            print("error: --sglang-router needs a live run (drop --simulate)", file=sys.stderr)
            return 2
        policies.append(SGLANG)
    if args.replicas < 1:
        print("error: --replicas must be >= 1", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.workload.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        print(
            f"error: unknown workload {unknown[0] if unknown else ''!r} (known: {', '.join(FAMILIES)})",
            file=sys.stderr,
        )
        return 2
    cfg = load_config(args.config)
    workloads = [FAMILIES[n].from_settings(vars(args)) for n in names]

    prefix = PrefixStoreConfig(
        checkpoint_policy=args.checkpoint_policy,
        checkpoint_interval=args.checkpoint_interval,
        device_bytes=int(args.device_cache_mb * 2**20),
        host_bytes=int(args.host_cache_mb * 2**20),
        events=True,
    )
    config = engine_config(args, prefix, simulated_kv_bytes(cfg, args) if args.simulate else None)
    model = tokenizer = None
    if not args.simulate:
        import jax.numpy as jnp
        from flax import nnx

        model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))

        move_to_huge_pages(model)  # as the server's loader does
        tokenizer = ByteTokenizer(cfg.vocab_size) if cfg.vocab_size >= 259 else None
    rows = []
    try:
        if not args.simulate:  # every policy once first: a process compiles each program shape once, and each
            # policy batches differently (the measured passes then compile nothing: `compiles_while_timed`)
            for policy in policies:
                warm = live(model, config, tokenizer, policy, args)
                try:
                    for workload in workloads:
                        replay(warm, workload, cfg.vocab_size)
                finally:
                    warm.close()
        for workload in workloads:
            for policy in policies:
                rows.append(measure(model, config, tokenizer, cfg, workload, policy, args))
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tables = []
    for w in workloads:
        mine = [r for r in rows if r["workload"] == w.name]
        rr = next((r for r in mine if r["policy"] == "round-robin"), None)
        for r in mine:
            r["vs_round_robin"] = r["prompt_tokens_computed"] / rr["prompt_tokens_computed"] if rr else None
        cells = [
            {
                **r,
                "computed": r["prompt_tokens_computed"],
                "lower_bound": r["lower_bound_tokens"],
                "out_tok_s": r["output_tokens_per_s"],
            }
            for r in mine
        ]
        title = f"\n{w.name} ({args.replicas} replicas{', simulated' if args.simulate else ''}):"
        tables.append(Table(cells, TABLE_COLUMNS, TABLE_FORMATS, title=title))
    result = {
        "bench": "route",
        "config": cfg.name,
        "simulated": bool(args.simulate),
        "replicas": args.replicas,
        "workloads": {w.name: dataclasses.asdict(w) for w in workloads},
        "environment": environment(),
        "rows": rows,
    }
    return report(result, args, *tables)


# the table of each workload: a row per policy
TABLE_COLUMNS = [
    "policy",
    "computed",
    "vs_round_robin",
    "lower_bound",
    "hit_rate",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "out_tok_s",
    "per_replica",
]
TABLE_FORMATS = {
    "computed": ",",
    "vs_round_robin": or_dash(".2f"),
    "lower_bound": ",",
    "hit_rate": ".3f",
    "ttft_p50_ms": ".1f",
    "ttft_p99_ms": ".1f",
    "out_tok_s": or_dash(".1f"),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "route",
        help="a workload through a router over N replicas, per routing policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--config", default="tiny", help="config name or path (default tiny)")
    p.add_argument("--replicas", type=int, default=4, help="replicas behind the router (default 4)")
    p.add_argument(
        "--text",
        action="store_true",
        help="send prompts as text (one character a token, answers included: CharTokenizer), every policy",
    )
    p.add_argument(
        "--sglang-router",
        metavar="PATH",
        default=None,
        help="also run this `sglang-router` executable (pip install sglang-router) in front of the same "
        "replicas with its cache_aware policy; it takes text prompts only, so use --text",
    )
    p.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="send each request after the previous one is done (the simulator and a live run then agree)",
    )
    p.add_argument("--load-weight", type=float, default=None, help="the router's --load-weight (its default)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated ({', '.join(POLICIES)})")
    p.add_argument(
        "--workload", default="chat,agentic", help=f"families, comma-separated ({', '.join(FAMILIES)})"
    )
    p.add_argument("--checkpoint-interval", type=int, default=32768, help="each replica's (default 32768)")
    p.add_argument(
        "--checkpoint-policy",
        choices=("adaptive", "fixed"),
        default="adaptive",
        help="each replica's (default adaptive: KV and checkpoints evicted as one; fixed: each by LRU)",
    )
    p.add_argument("--device-cache-mb", type=float, default=1024.0, help="each replica's checkpoint budget")
    p.add_argument("--host-cache-mb", type=float, default=4096.0, help="each replica's host budget")
    p.add_argument(
        "--simulate", action="store_true", help="simulated engines, no model (any config, any scale)"
    )
    p.add_argument(
        "--hbm", type=float, default=None, help="with --simulate: device memory, GB (as bench prefix)"
    )
    p.add_argument("--weights-gb", type=float, default=0.0, help="with --hbm: weights per device, GB")
    p.add_argument("--flops-per-s", type=float, default=1e15, help="with --simulate: the FLOP rate of TTFT")
    add_engine_shape_args(p)
    add_workload_args(p)
    add_out_arg(p)
    p.set_defaults(func=run, budgets=None)
