"""`jaxhybrid bench prefix`: replay seeded workloads through the engine for several prefix-store settings and
report reuse, recompute, prefill work against its lower bound, time to first token and checkpoint bytes.

Workloads (`--workload chat|docqa|agentic|longdoc|sysprompt`, a comma list or `all`, all five; default
chat; `serve.sim.workloads`, seeded by `--seed`): `chat`, chats behind a shared system prompt whose turns
extend or fork earlier turns; `docqa`, `--questions` questions a round over `--documents` documents of
`--doc-len` tokens (Zipf-popular, `--doc-skew`); `agentic`, tool-calling traces that grow by
`--tool-min`..`--tool-max` tokens or fork (`--fork-prob`) at an unaligned position, half of the forks
(`--retry-prob`) where an earlier one did; `longdoc` (QuALITY-like), `--questions` one-shot questions on each
of `--documents` long documents, shuffled, `--per-round` a round; `sysprompt`, one-shot user turns behind
`--prompts` system prompts of Zipf popularity. The policies' constants were chosen on the first three only.
The shared flags (`--conversations`, `--turns`, `--system-len`, `--user-min/--user-max`, `--max-tokens`,
`--documents`, `--questions`) default per family. All requests of one round are submitted together; rounds
follow one another.

Settings: off; each of `--intervals` alone, and prompt/sequence-end checkpoints beside each
`--prompt-end-interval`, once per `--eviction` policy (`--checkpoint-policy fixed`); with `adaptive` in
`--checkpoint-policy`, the adaptive policy at the smallest interval (its finest spacing); with `dp`, the
offline placement of sparse prefix caching (`serve.prefix.placement`: it knows every prompt and answer, from
the replay without a store, and the store keeps exactly its positions), the reference an online policy
should approach. `--budgets K1,K2,...` (KiB) repeats every setting under each checkpoint budget: the device
budget, with `--host-cache-mb` (then default 0) as the host's, so every policy gets the same bytes. Without
it, `--device-cache-mb` / `--host-cache-mb`. The issue's sweep is one block to 32768: `--intervals
16,64,256,1024,32768`.

Each row also reports `lower_bound_tokens`, the prompt tokens its own replay had to compute even with a
checkpoint at every token and unlimited memory (`serve.sim.replay.lower_bound_tokens`), and
`vs_lower_bound`: `prompt_tokens_computed` (what the requests computed of their prompts past their hits)
over it. The engine's `prefill_tokens_computed` is beside it; it leaves out a prompt's last token when that
one runs in a decode row. One table per workload (`prefill` / `computed` are those two); `--plot PATH.png`
draws per workload prompt tokens computed against peak checkpoint bytes, a series per policy, the bound a
line.

`--simulate`: no model runs and no weights exist, so any config (`--config kimi-k3`) and any scale: the same
workloads go through the engine's scheduler, prefix store, eviction policy and block allocator with
analytic checkpoint bytes and prefill FLOPs (`serve.sim.engine`); answers are seeded random ids, TTFT
is estimated from the FLOPs at `--flops-per-s`. `--hbm GB` sizes the KV pool as what is left of one
device's memory after `--weights-gb`, the live states of `--slots` and the checkpoints' device budget
(`--device-cache-mb`, or the largest of `--budgets`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from benchmarks.common import RoundProgress
from benchmarks.prefix_plot import write_plot
from benchmarks.report import Table, report
from jaxhybrid.cache import mla_kv_bytes
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights.pages import move_to_huge_pages
from serve.bench.common import add_out_arg, compile_watch, environment
from serve.engine.config import EngineShape, engine_default
from serve.engine.engine import Engine, EngineConfig
from serve.engine.speculative import Speculation
from serve.models import add_checkpoint_dtype_arg
from serve.prefix.placement import digest, place
from serve.prefix.store import CHECKPOINT_POLICIES, PrefixStoreConfig
from serve.report import fmt_bytes
from serve.sim.cost import CostModel
from serve.sim.engine import SimEngine
from serve.sim.replay import Replay, WorkloadError, overlap_depths, replay
from serve.sim.runner import random_answers
from serve.sim.workloads import FAMILIES, Workload

HOST_CACHE_MB = 4096.0  # --host-cache-mb without --budgets (with them: 0, the budget is all there is)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One store setting compared: the row's name, the policy family it is plotted with (off, fixed
    interval, fixed + ends, adaptive), the checkpoint budget it runs under (KiB; None: --device-cache-mb and
    --host-cache-mb) and the store's config (None: off)."""

    name: str
    policy: str
    budget_kib: float | None = None
    prefix: Any = None  # PrefixStoreConfig | None


def _csv(text: str, flag: str, kind: type = int) -> list[Any]:
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of numbers, got {text!r}") from None


def workload_names(spec: str) -> list[str]:
    """The families `--workload` names (a comma list, or `all`), in the order given."""
    names = list(FAMILIES) if spec.strip() == "all" else [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise ValueError(
            f"unknown workload {', '.join(unknown) or spec!r} (known: {', '.join(FAMILIES)}, all)"
        )
    return list(dict.fromkeys(names))


def budgets(args: argparse.Namespace) -> list[float] | None:
    """--budgets in KiB, ascending; None without the flag."""
    if args.budgets is None:
        return None
    out = sorted(set(_csv(args.budgets, "--budgets", float)))
    if not out or min(out) < 0:
        raise ValueError(f"--budgets takes KiB >= 0, got {args.budgets!r}")
    return out


def host_cache_mb(args: argparse.Namespace) -> float:
    if args.host_cache_mb is not None:
        return args.host_cache_mb
    return 0.0 if args.budgets is not None else HOST_CACHE_MB


def memory(args: argparse.Namespace, budget_kib: float | None) -> dict[str, int]:
    """The store's device and host budgets of a setting: the budget on the device, or --device-cache-mb."""
    device = args.device_cache_mb * 2**20 if budget_kib is None else budget_kib * 2**10
    return {"device_bytes": int(device), "host_bytes": int(host_cache_mb(args) * 2**20)}


def settings(args: argparse.Namespace) -> list[Setting]:
    """Every setting compared: off; per budget (or once, without --budgets), for `fixed` each interval alone
    and prompt/sequence-end checkpoints beside each --prompt-end-interval, once per --eviction policy; for
    `adaptive` the adaptive policy at the smallest interval (its own eviction policy); for `dp` the offline
    placement (`serve.prefix.placement`), checkpoints there only."""
    intervals = sorted(set(_csv(args.intervals, "--intervals")), reverse=True)
    ends = sorted(
        set(_csv(args.prompt_end_interval or str(intervals[-1]), "--prompt-end-interval")), reverse=True
    )
    policies = [p.strip() for p in args.checkpoint_policy.split(",") if p.strip()]
    known = (*CHECKPOINT_POLICIES, "dp")
    if not policies or any(p not in known for p in policies):
        raise ValueError(f"--checkpoint-policy takes {', '.join(known)}, got {args.checkpoint_policy!r}")
    evictions = args.eviction.split(",") if args.eviction else [None]
    out = [Setting("off", "off")]
    for budget in budgets(args) or [None]:
        mem = {**memory(args, budget), "checkpoint_dtype": args.checkpoint_dtype}
        for eviction in evictions if "fixed" in policies else []:
            tag = f" ({eviction})" if len(evictions) > 1 else ""  # None: the policy's own (lru), as serve
            for at_ends, spacing in ((False, intervals), (True, ends)):
                for interval in spacing:
                    cfg = PrefixStoreConfig(
                        checkpoint_policy="fixed",
                        checkpoint_interval=interval,
                        prompt_end_checkpoints=at_ends,
                        sequence_end_checkpoints=at_ends,
                        eviction=eviction,
                        **mem,
                    )
                    name = f"prompt/sequence-end + interval {interval}" if at_ends else f"interval {interval}"
                    policy = "fixed + ends" if at_ends else "fixed interval"
                    out.append(Setting(name + tag, policy + tag, budget, cfg))
        if "adaptive" in policies:
            cfg = PrefixStoreConfig(checkpoint_policy="adaptive", checkpoint_interval=intervals[-1], **mem)
            out.append(Setting("adaptive", "adaptive", budget, cfg))
        if "dp" in policies:  # its placement is made from the workload's replay with the store off (`_dp`)
            cfg = PrefixStoreConfig(
                checkpoint_policy="fixed", prompt_end_checkpoints=False, sequence_end_checkpoints=False, **mem
            )
            out.append(Setting("offline dp", "dp", budget, cfg))
    return out


def _dp(setting: Setting, off: Replay, shape: Any) -> Setting:
    """The offline-dp setting given its placement: the dynamic program over the overlap depths of `off`
    (the replay without a store: every prompt and answer) within the setting's device and host bytes."""
    cfg = setting.prefix
    queries = [(s.prompt, d) for s, d in zip(off.served, overlap_depths(off.served), strict=True)]
    budget = cfg.device_bytes + cfg.host_bytes
    placement = place(
        queries, budget, shape.state_bytes, shape.state_bytes + shape.block_bytes, shape.block_size
    )
    return dataclasses.replace(setting, prefix=dataclasses.replace(cfg, placement=placement))


def engine_config(args: argparse.Namespace, prefix: Any, kv_memory_bytes: int | None = None) -> Any:
    return EngineConfig(
        max_slots=args.slots,
        block_size=args.block_size,
        prefill_chunk=args.chunk,
        max_model_len=args.max_model_len,
        kv_dtype=args.dtype,
        kv_memory_bytes=kv_memory_bytes,
        num_blocks=None if args.kv_blocks is None else args.kv_blocks + 1,  # + the scratch block
        prefix=prefix,
        speculative=Speculation.parse(
            "ngram" if args.num_speculative_tokens else "off", args.num_speculative_tokens or 4
        ),
    )


def run(args: argparse.Namespace) -> int:
    """Reuse, recompute, the lower bound, TTFT and checkpoint bytes for each setting on each workload."""
    if args.hbm is not None and not args.simulate:
        raise SystemExit("error: --hbm needs --simulate")
    if args.hbm is not None and args.kv_blocks is not None:
        raise SystemExit("error: give --hbm or --kv-blocks, not both (both size the KV pool)")
    if args.kv_blocks is not None and args.kv_blocks < 1:
        raise SystemExit("error: --kv-blocks must be positive")
    try:
        workloads = [FAMILIES[name].from_settings(vars(args)) for name in workload_names(args.workload)]
        compared = settings(args)
        for s in compared:
            if s.prefix is not None:
                try:
                    s.prefix.validate(args.block_size)
                except ValueError as exc:
                    raise ValueError(f"setting '{s.name}': {exc}") from None
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cfg = load_config(args.config)
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}
    model = None if args.simulate else _model(cfg, args)
    try:
        for workload in workloads:
            if args.simulate:
                mine, extra = _simulated_rows(cfg, args, workload, compared)
            else:
                mine = _engine_rows(model, cfg, args, workload, compared)
            rows += mine
    except WorkloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    result = {
        "bench": "prefix",
        "config": cfg.name,
        "simulated": bool(args.simulate),
        "block_size": args.block_size,
        "dtype": args.dtype,
        "workloads": {w.name: dataclasses.asdict(w) for w in workloads},
        "budgets_kib": budgets(args),
        "host_cache_bytes": int(host_cache_mb(args) * 2**20),
        **({"workload": dataclasses.asdict(workloads[0])} if len(workloads) == 1 else {}),
        **extra,
        "environment": environment(),
        "rows": rows,
    }
    notes = []
    if args.plot:
        write_plot(rows, [w.name for w in workloads], args.plot)
        notes.append(f"wrote {args.plot}")
    return report(result, args, *tables(rows, [w.name for w in workloads], args.simulate), *notes)


def _row(workload: Workload, setting: Setting, rep: Replay) -> dict[str, Any]:
    """A row's identity (workload, setting, policy family, budget, interval) and the replay's summary."""
    interval = None if setting.prefix is None else setting.prefix.checkpoint_interval
    ident = {"workload": workload.name, "setting": setting.name, "policy": setting.policy}
    row = {**ident, "budget_kib": setting.budget_kib, "interval": interval, **rep.summary()}
    placement = None if setting.prefix is None else setting.prefix.placement
    if placement is not None:  # what the offline program chose and expected
        row.update(placed_checkpoints=len(placement.prefixes), placement_cost_tokens=placement.cost)
    return row


def tables(rows: list[dict[str, Any]], families: list[str], simulated: bool) -> list[Table]:
    """One table per workload family: rows are setting x budget."""
    columns = [
        "setting",
        "budget",
        "hit_rate",
        "recomputed",
        "prefill",
        "computed",
        "lower_bound",
        "vs_bound",
    ]
    columns += ["ttft_p50_ms", "ttft_p95_ms", "peak_ckpt_device", "peak_ckpt_host", "dropped"]
    columns += ["prefill_PFLOP", "fit"] if simulated else ["compiles_while_timed"]
    return [
        Table([_cells(r) for r in rows if r["workload"] == family], columns, title=f"\n{family}:")
        for family in families
    ]


def _ms(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.3g}"


def _cells(r: dict[str, Any]) -> dict[str, Any]:
    bound = r["vs_lower_bound"]
    cells = {
        **r,
        "budget": "-" if r["budget_kib"] is None else f"{r['budget_kib']:g} KiB",
        "hit_rate": f"{r['hit_rate']:.3f}",
        "recomputed": r["recomputed_tokens"],
        "prefill": r["prefill_tokens_computed"],
        "computed": r["prompt_tokens_computed"],
        "lower_bound": r["lower_bound_tokens"],
        "vs_bound": "-" if bound is None else f"{bound:.2f}",
        "ttft_p50_ms": _ms(r["ttft_p50_ms"]),
        "ttft_p95_ms": _ms(r["ttft_p95_ms"]),
        "peak_ckpt_device": fmt_bytes(r["peak_checkpoint_bytes"]["device"]),
        "peak_ckpt_host": fmt_bytes(r["peak_checkpoint_bytes"]["host"]),
        "dropped": r["dropped_checkpoints"],
    }
    if "prefill_flops" in r:
        cells.update(prefill_PFLOP=f"{r['prefill_flops'] / 1e15:.3g}", fit=r.get("sequences_fit", ""))
    return cells


def _model(cfg: Any, args: argparse.Namespace) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    model = HybridLM(cfg, rngs=nnx.Rngs(0), dtype=jnp.dtype(args.dtype))
    move_to_huge_pages(model)  # as the server's loader does
    return model


def _engine_rows(
    model: Any, cfg: Any, args: argparse.Namespace, workload: Workload, compared: list[Setting]
) -> list[dict[str, Any]]:
    if any(s.policy == "dp" for s in compared):  # the offline placement knows every prompt and answer
        off = replay(Engine(model, engine_config(args, None)), workload, cfg.vocab_size)
        shape = EngineShape.resolve(engine_config(args, None), cfg)
        compared = [_dp(s, off, shape) if s.policy == "dp" else s for s in compared]
    configs = [(s, engine_config(args, s.prefix)) for s in compared]
    # The same workload once on a fresh engine of every setting first. The scheduler is deterministic, so the
    # measured replay meets exactly the shapes this compiled (a warm-up of another seed missed some, and the
    # first setting measured paid their compiles). `compiles_while_timed` checks it.
    for _, engine_cfg in configs:
        replay(Engine(model, engine_cfg), workload, cfg.vocab_size)
    rows = []
    for setting, engine_cfg in configs:
        engine = Engine(model, engine_cfg)
        with compile_watch() as compiles:
            rep = replay(engine, workload, cfg.vocab_size)
        rows.append({**_row(workload, setting, rep), "compiles_while_timed": compiles["compiles"]})
    return rows


def pool_budget_bytes(args: argparse.Namespace) -> int:
    """The checkpoints' device budget a simulated KV pool leaves room for: the largest of --budgets, or
    --device-cache-mb."""
    largest = budgets(args)
    return int(args.device_cache_mb * 2**20) if largest is None else int(largest[-1] * 2**10)


def simulated_kv_bytes(cfg: Any, args: argparse.Namespace) -> int | None:
    """The KV pool of a simulation: with --hbm, one device's memory less the weights, the live states of every
    slot and the checkpoints' device budget; else the engine's default (every slot at --max-model-len)."""
    if args.hbm is None:
        return None
    state = EngineShape.resolve(engine_config(args, None), cfg).state_bytes
    left = int((args.hbm - args.weights_gb) * 1e9) - args.slots * state - pool_budget_bytes(args)
    if left <= 0:
        raise SystemExit(
            f"error: --hbm {args.hbm:g} GB leaves nothing for the KV pool after --weights-gb, the states of "
            f"{args.slots} slots ({args.slots * state / 1e9:.2f} GB) and the checkpoints' device budget"
        )
    return left


def _simulated_rows(
    cfg: Any, args: argparse.Namespace, workload: Workload, compared: list[Setting]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import time

    cost = CostModel.of(cfg, args.flops_per_s)
    kv_bytes = simulated_kv_bytes(cfg, args)
    rows = []
    shape = off = None
    for setting in compared:
        t0 = time.perf_counter()
        answers = random_answers(cfg.vocab_size, args.seed)
        if setting.policy == "dp":  # the offline placement: made from, and given, the answers of `off`
            setting, answers = _dp(setting, off, shape), known_answers(off, answers)
        sim = SimEngine(
            cfg,
            engine_config(args, setting.prefix, kv_bytes),
            answers,
            cost,
            draft_acceptance=args.draft_acceptance,
            seed=args.seed,
        )
        shape = sim.shape
        progress = RoundProgress(f"{workload.name}, {setting.name}", getattr(workload, "turns", None))
        rep = replay(sim, workload, cfg.vocab_size, progress)
        off = rep if setting.policy == "off" else off
        row = {**_row(workload, setting, rep), **_simulated_row(rep, sim, args)}
        rows.append({**row, "wall_s": round(time.perf_counter() - t0, 2)})
    extra = {
        "flops_per_s": args.flops_per_s,
        "matmul_params": cost.matmul_params,
        "hbm_gb": args.hbm,
        "weights_gb": args.weights_gb,
        "kv_pool_bytes": shape.num_blocks * shape.block_bytes,
        "kv_pool_blocks": shape.num_blocks,
        "block_bytes": shape.block_bytes,
        "state_bytes": shape.state_bytes,
        "slots": args.slots,
        "device_cache_bytes": pool_budget_bytes(args),
    }
    return rows, extra


def known_answers(rep: Replay, otherwise: Any) -> Any:
    """The answers `rep` got, by prompt (a simulation's are drawn in the order requests need them, which
    the store's settings change), `otherwise` for a prompt it did not see."""
    known = {digest(s.prompt): s.generated.tolist() for s in rep.served}
    return lambda prompt, n: known.get(digest(prompt)) or otherwise(prompt, n)


def _simulated_row(rep: Replay, sim: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What a simulation adds to the bench's row: FLOPs, per-request recompute, the store's counters, and
    the sequences that fit in --hbm (see the flag; a session is a request of the last round)."""
    requests = len(rep.stats)
    last = rep.ledgers[-1]
    row = dict(
        recomputed_per_request=sum(s["recomputed_tokens"] for s in rep.stats) / requests,
        prefill_flops=sim.flops["prefill"],
        decode_flops=sim.flops["decode"],
        simulated_s=sim.clock,
        steps=sim.steps,
        **{k: last.get(k, 0) for k in ("saves", "demotions", "dropped_checkpoints", "evicted_blocks")},
        checkpoints_by_kind=last["checkpoints_by_kind"],
        checkpoint_bytes_by_kind=last["checkpoint_bytes_by_kind"],
    )
    if args.num_speculative_tokens:
        spec = sim.speculation_stats()
        row.update(drafted_tokens=spec.drafted, accepted_tokens=spec.accepted, verify_windows=spec.windows)
    if args.hbm is not None:
        final_round = rep.served[-1].round
        final = [s for s, r in zip(rep.stats, rep.served, strict=True) if r.round == final_round]
        context = sum(s["prompt_tokens"] + s["generated_tokens"] for s in final) / len(final)
        held = (last["checkpoint_bytes"]["device"] + last["checkpoint_bytes"]["host"]) / len(final)
        per_seq = mla_kv_bytes(sim.model_config, int(context), sim.shape.kv_dtype) + sim.shape.state_bytes
        cache = (args.hbm - args.weights_gb) * 1e9
        row.update(
            mean_final_context=context,
            checkpoint_bytes_per_conversation=held,
            sequences_fit=int(cache // (per_seq + held)),
            sequences_fit_without_checkpoints=int(cache // per_seq),
        )
    return row


def _defaults(field: str) -> str:
    """`chat 6, agentic 4`: each family's default of a shared flag."""
    out = []
    for name, family in FAMILIES.items():
        for f in dataclasses.fields(family):
            if f.name == field:
                out.append(f"{name} {f.default}")
    return ", ".join(out)


def register(sub: argparse._SubParsersAction) -> None:
    store_default = PrefixStoreConfig()
    p = sub.add_parser(
        "prefix", help="seeded workload replays over prefix-store settings and budgets", description=__doc__
    )
    p.add_argument("--config", default="tiny", help="config name or path (default tiny)")
    add_checkpoint_dtype_arg(p)
    p.add_argument(
        "--workload",
        default="chat",
        help=f"workload families, comma-separated, or all ({', '.join(FAMILIES)}; default chat)",
    )
    p.add_argument(
        "--intervals",
        default="16,64,256",
        help="checkpoint intervals to compare (default 16,64,256; the issue's sweep: 16,64,256,1024,32768)",
    )
    p.add_argument(
        "--prompt-end-interval",
        default=None,
        help="interval(s) beside the prompt/sequence-end checkpoints, comma-separated (default: the "
        "smallest of --intervals)",
    )
    p.add_argument(
        "--eviction",
        default=None,
        help="eviction policies of the fixed settings, comma-separated (default: the policy's own, lru, as "
        "serve)",
    )
    p.add_argument(
        "--checkpoint-policy",
        default=f"fixed,{store_default.checkpoint_policy}",
        help="fixed, adaptive and/or dp, comma-separated (default: fixed, for the intervals compared, and "
        f"serve's {store_default.checkpoint_policy}); adaptive: one setting per budget at the smallest "
        "interval (its finest spacing), with its own eviction policy; dp: the offline placement "
        "(serve.prefix.placement) per budget, made from a replay without a store, a comparison only",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="checkpoint budgets in KiB, comma-separated: every setting runs under each as its device "
        "budget (the host's: --host-cache-mb, then 0 by default); default: --device-cache-mb once",
    )
    add_workload_args(p)
    add_engine_shape_args(p)
    p.add_argument(
        "--device-cache-mb",
        type=float,
        default=store_default.device_bytes / 2**20,
        help="the store's device budget for checkpoints without --budgets, MiB "
        f"(default {store_default.device_bytes / 2**20:g})",
    )
    p.add_argument(
        "--host-cache-mb",
        type=float,
        default=None,
        help=f"the store's host budget, MiB (default {HOST_CACHE_MB:g}; 0 with --budgets)",
    )
    p.add_argument("--plot", default=None, metavar="PATH.png", help="write the prefill-vs-bytes plot here")
    s = p.add_argument_group("simulation (no model, no weights: any config, any scale)")
    s.add_argument(
        "--simulate",
        action="store_true",
        help="drive the engine's scheduler and prefix store with analytic bytes and FLOPs, no model",
    )
    s.add_argument(
        "--hbm",
        type=float,
        default=None,
        help="device memory in GB (1e9 B): the KV pool is what is left after --weights-gb, the slots' live "
        "states and the checkpoints' device budget; also reports the sequences that fit (default: the "
        "engine's pool, every slot at --max-model-len)",
    )
    s.add_argument("--weights-gb", type=float, default=0.0, help="with --hbm: weights per device, GB (0)")
    s.add_argument(
        "--draft-acceptance",
        type=float,
        default=0.7,
        help="with --num-speculative-tokens: the probability each drafted token is right (the simulator's "
        "seeded acceptance model; default 0.7)",
    )
    s.add_argument(
        "--flops-per-s",
        type=float,
        default=1e15,
        help="FLOP rate the simulated TTFT is computed at (default 1e15)",
    )
    add_out_arg(p)
    p.set_defaults(func=run)


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload families' flags (`FAMILIES[name].from_settings`) and their seed."""
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    w = p.add_argument_group("workloads (a shared flag's default is per family)")
    w.add_argument("--conversations", type=int, help=f"chats / traces ({_defaults('conversations')})")
    w.add_argument("--turns", type=int, help=f"rounds ({_defaults('turns')})")
    w.add_argument("--system-len", type=int, help=f"shared system prompt tokens ({_defaults('system_len')})")
    w.add_argument(
        "--user-min", type=int, help=f"shortest user message / question / task ({_defaults('user_min')})"
    )
    w.add_argument(
        "--user-max", type=int, help=f"longest user message / question / task ({_defaults('user_max')})"
    )
    w.add_argument("--max-tokens", type=int, help=f"answer tokens per request ({_defaults('max_tokens')})")
    w.add_argument("--branch-prob", type=float, help="chat: chance a turn forks an earlier turn (0.25)")
    w.add_argument("--documents", type=int, help=f"docqa / longdoc: documents ({_defaults('documents')})")
    w.add_argument(
        "--doc-len", type=int, help="docqa: tokens per document (200; + system 12 = 212, off any block)"
    )
    w.add_argument(
        "--questions",
        type=int,
        help=f"docqa: questions per round, longdoc: per document ({_defaults('questions')})",
    )
    w.add_argument(
        "--per-round", type=int, help=f"longdoc / sysprompt: requests per round ({_defaults('per_round')})"
    )
    w.add_argument("--prompts", type=int, help="sysprompt: distinct system prompts (5)")
    w.add_argument("--doc-skew", type=float, help="docqa: Zipf exponent of document popularity (1.0)")
    w.add_argument("--tool-min", type=int, help="agentic: shortest tool output / forked continuation (16)")
    w.add_argument("--tool-max", type=int, help="agentic: longest tool output / forked continuation (48)")
    w.add_argument("--fork-prob", type=float, help="agentic: chance a round forks the trace (0.3)")
    w.add_argument(
        "--retry-prob", type=float, help="agentic: chance a fork retries an earlier fork point (0.5)"
    )


def add_engine_shape_args(p: argparse.ArgumentParser) -> None:
    """The engine's shape as `engine_config` reads it (slots, blocks, chunk, context, dtype, speculation)."""
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="the KV pool's usable blocks (default: the engine's, every slot at --max-model-len; a smaller "
        "pool evicts cached blocks between turns)",
    )

    slots, block, chunk = map(engine_default, ("max_slots", "block_size", "prefill_chunk"))
    p.add_argument("--slots", type=int, default=slots, help=f"engine slots (default {slots}, as serve)")
    p.add_argument("--block-size", type=int, default=block, help=f"KV block size (default {block}, as serve)")
    p.add_argument("--chunk", type=int, default=chunk, help=f"prefill chunk (default {chunk}, as serve)")
    p.add_argument(
        "--max-model-len", type=int, default=None, help="context limit (default as serve: min(config, 4096))"
    )
    p.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="weights and cache dtype"
    )
    p.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="requests draft up to this many tokens a step (0: off, as serve's default; prompt lookup with a "
        "model, the seeded acceptance model with --simulate)",
    )
