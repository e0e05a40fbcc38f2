"""`jaxhybrid plan`: which mesh, and how many sequences fit, for a model on a slice of chips (`serve.plan`).

Every list flag (--chips, --hbm, --context, --experts, --checkpoint-interval) takes comma-separated values;
more than one value anywhere makes a sweep: one row per combination."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NamedTuple

from jaxhybrid.config import load_config
from serve.cli.common import add_config_arg, add_kernels_arg
from serve.engine.config import engine_default
from serve.engine.topology import (
    PROGRAMS,
    compile_engine_programs,
    cut_layers,
    program_arguments,
    replica_mesh,
    topology_devices,
)
from serve.models import add_checkpoint_dtype_arg
from serve.plan import PlanError, Planner, PlanRequest, sweep
from serve.report import DTYPES, print_table
from sharding.hosts import host_shards
from sharding.mesh import MeshSpecError, parse_mesh_spec

EXPERTS = ("packed", "dequantized")
# by-kind columns of the tables: (DeviceBytes field, column)
KINDS = (
    ("experts", "routed"),
    ("other_weights", "other"),
    ("scanned_copy", "scan_copy"),
    ("kv_pool", "kv_pool"),
    ("live_states", "states"),
    ("checkpoints", "checkpoints"),
    ("activations", "activations"),
    ("total", "total"),
)


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f}"


def _list(text: str, flag: str, kind: Any = int, allow_zero: bool = False) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list, got {text!r}") from None
    if not values or any(v < 0 or (v == 0 and not allow_zero) for v in values):
        raise ValueError(f"{flag} must be {'non-negative' if allow_zero else 'positive'}, got {text!r}")
    return list(dict.fromkeys(values))


def _experts(text: str) -> list[bool]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in EXPERTS]
    if bad or not names:
        raise ValueError(f"--experts must be a list of {', '.join(EXPERTS)}, got {text!r}")
    return [n == "packed" for n in dict.fromkeys(names)]


def _config(args: argparse.Namespace) -> Any:
    if bool(args.model) == bool(args.config):
        raise ValueError("give exactly one of --config NAME and --model DIR")
    cfg = load_config(args.model or args.config)
    return cfg if args.layers is None else cut_layers(cfg, args.layers)


def _programs(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    bad = [n for n in names if n not in PROGRAMS]
    if bad or not names:
        raise ValueError(f"--programs must be a list of {', '.join(PROGRAMS)}, got {text!r}")
    return names


def _row(plan: Any) -> dict[str, Any]:
    """One sweep row: the request's swept values, the chosen mesh and its bytes by kind (GB)."""
    req, m = plan.request, plan.chosen
    row: dict[str, Any] = {
        "chips": req.chips,
        "hbm_GB": f"{req.hbm_bytes / 1e9:g}",
        "context": f"{req.context:,}",
        "experts": "packed" if req.packed else "dequant",
        "interval": req.checkpoint_interval or "-",
    }
    if m is None:
        return {**row, "mesh": "nothing fits"}
    row.update(mesh=f"TP{m.tensor} x EP{m.expert} x DP{m.data}")
    row.update({col: _gb(getattr(m.bytes, f)) for f, col in KINDS})
    row.update(seqs_replica=m.slots, seqs_slice=m.sequences_per_slice)
    return row


def _print_plan(cfg: Any, plan: Any) -> None:
    req, m = plan.request, plan.chosen
    experts = "dense" if cfg.expert_quant != "mxfp4" else ("MXFP4 packed" if req.packed else "dequantized")
    checkpoints = "no state checkpoints"
    if req.checkpoint_interval:
        held = (
            "all on the device"
            if req.device_cache_bytes is None
            else f"device budget {req.device_cache_bytes:,} B"
        )
        checkpoints = (
            f"state checkpoints every {req.checkpoint_interval:,} tokens in {req.checkpoint_dtype} ({held})"
        )
    print(
        f"{cfg.name}: {req.chips} chips of {req.hbm_bytes / 1e9:g} GB, context {req.context:,} tokens, "
        f"{req.dtype}, routed experts {experts}, {checkpoints}"
    )
    if m is not None:
        print(
            f"recommended: tensor={m.tensor} expert={m.expert} data={m.data}: {m.data} replica(s) of "
            f"{m.tensor * m.expert} chips, {m.slots} sequences per replica, {m.sequences_per_slice} per slice"
        )
        print("  bytes per device (GB):")
        for field, _ in KINDS:
            print(f"    {field:<14} {_gb(getattr(m.bytes, field)):>10}")
        print(f"    {'HBM':<14} {_gb(req.hbm_bytes):>10}")
        flags = (
            f"--mesh {m.mesh} --slots {m.slots} --max-model-len {req.context} --block-size {req.block_size} "
            f"--prefill-chunk {req.prefill_chunk} --dtype {req.dtype}"
        )
        if req.checkpoint_interval:
            budget = m.device_cache_bytes / 2**20
            flags += f" --checkpoint-interval {req.checkpoint_interval} --device-cache-mb {budget:.0f}"
            if req.checkpoint_dtype != "float32":
                flags += f" --checkpoint-dtype {req.checkpoint_dtype}"
        else:
            flags += " --no-prefix-cache"
        print(f"  engine (each replica): {flags}")
    print(f"meshes that fit (tensor x expert per replica, data = replicas){'' if plan.fitting else ': none'}")
    rows = [
        {
            "tensor": p.tensor,
            "expert": p.expert,
            "data": p.data,
            "seqs_replica": p.slots,
            "seqs_slice": p.sequences_per_slice,
            "total_GB": _gb(p.bytes.total),
            "": "<- recommended" if p is m else "",
        }
        for p in plan.fitting
    ]
    if rows:
        print_table(rows, ["tensor", "expert", "data", "seqs_replica", "seqs_slice", "total_GB", ""])
    print("rejected:" if plan.rejected else "rejected: none")
    for r in plan.rejected:
        print(f"  tensor={r.tensor} expert={r.expert} data={r.data}: {r.reason}")


def run(args: argparse.Namespace) -> int:
    """Which mesh, and how many sequences of --context tokens fit on --chips chips of --hbm GB each: the
    replica mesh (tensor x expert; data = replicas) and the bytes per device by kind, counted from the
    engine's own sharding rules and pool sizing (activations estimated). Exit status 1 when nothing fits."""
    devices = None
    try:
        cfg = _config(args)
        if args.compile and not args.topology:
            raise ValueError("--compile needs --topology (the TPU topology to compile for, e.g. v5e:2x2)")
        programs = _programs(args.programs)
        if args.slots is not None and (args.slots < 1 or not args.compile):
            raise ValueError(f"--slots takes a positive count, with --compile; got {args.slots}")
        if args.topology:
            devices = topology_devices(args.topology)
        axes = {
            "chips": [len(devices)] if devices else _list(args.chips, "--chips"),
            "hbm_bytes": [int(v * 1e9) for v in _list(args.hbm, "--hbm", float)],
            "context": _list(args.context or str(cfg.max_position_embeddings), "--context"),
            "packed": _experts(args.experts),
            "checkpoint_interval": [0]
            if args.no_prefix_cache
            else _list(args.checkpoint_interval, "--checkpoint-interval", allow_zero=True),
        }
        cache = args.device_cache_mb
        base = PlanRequest(
            chips=axes["chips"][0],
            hbm_bytes=axes["hbm_bytes"][0],
            context=axes["context"][0],
            chips_per_host=args.chips_per_host,
            dtype=args.dtype,
            block_size=args.block_size,
            prefill_chunk=args.prefill_chunk,
            device_cache_bytes=None if cache == "all" else int(float(cache) * 2**20),
            checkpoint_dtype=args.checkpoint_dtype,
            scan_layers=args.scan_layers,
            mesh=None if args.mesh is None else parse_mesh_spec(args.mesh),
        )
        planner = Planner(cfg)
        plans = sweep(planner, base, **axes)
    except (PlanError, MeshSpecError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    single = len(plans) == 1
    if args.compile and not single:
        print("error: --compile compiles one plan: give one value per list flag", file=sys.stderr)
        return 2
    chosen = plans[0].chosen
    if args.slots is not None and chosen is not None and args.slots > chosen.slots:
        print(f"error: --slots {args.slots}: only {chosen.slots} fit the chosen mesh", file=sys.stderr)
        return 2
    slots = args.slots or (chosen.slots if chosen else 0)
    replica = _Replica.build(planner, plans[0], devices, slots) if devices and single and chosen else None
    compiled = _compile(planner, replica, programs) if args.compile and replica else None
    # what each host's process reads of the weights: the parameters as the engine's programs take them
    hosts = host_shards(replica.args.params) if replica else None
    if args.json:
        out = plans[0].as_dict() if single else {"config": cfg.name, "plans": [p.as_dict() for p in plans]}
        if hosts is not None:
            out["topology"] = args.topology
            out["hosts"] = [h.as_dict(with_shards=True) for h in hosts]
        if compiled is not None:
            out["compiled"] = [c.as_dict() for c in compiled]
        if args.layers is not None:
            out["layers"] = args.layers
        print(json.dumps({"config": cfg.name, **out} if single else out))
    elif single:
        if args.layers is not None:
            print(f"(cut to its first {args.layers} layers, for compile studies: --layers)")
        _print_plan(cfg, plans[0])
        if hosts is not None:
            _print_hosts(args.topology, hosts)
        if compiled is not None:
            _print_compiled(args.topology, plans[0], compiled)
    else:
        print(f"{cfg.name}: the recommended mesh per case; bytes per device in GB, by kind")
        columns = ["chips", "hbm_GB", "context", "experts", "interval", "mesh", *(c for _, c in KINDS)]
        print_table([_row(p) for p in plans], [*columns, "seqs_replica", "seqs_slice"])
    if single and plans[0].chosen is None:
        req = plans[0].request
        reasons = "; ".join(f"tensor={r.tensor} expert={r.expert}: {r.reason}" for r in plans[0].rejected)
        print(
            f"error: nothing fits {cfg.name} at {req.context:,} tokens on {req.chips} chips of "
            f"{req.hbm_bytes / 1e9:g} GB ({reasons})",
            file=sys.stderr,
        )
        return 1
    return 0


class _Replica(NamedTuple):
    """The chosen replica on the topology's devices: its mesh, the engine shape the plan sizes for `slots`
    sequences (the most that fit, unless --slots asks for fewer), and the engine's program arguments there
    (`program_arguments`, built once for the host table and the compile)."""

    mesh: Any
    shape: Any
    dtype: Any
    packed: bool
    args: Any

    @classmethod
    def build(cls, planner: Any, plan: Any, devices: list[Any], slots: int) -> _Replica:
        import jax.numpy as jnp

        req, m = plan.request, plan.chosen
        mesh, shape, dtype = (
            replica_mesh(devices, m.tensor, m.expert),
            planner.engine_shape(req, slots),
            jnp.dtype(req.dtype),
        )
        return cls(
            mesh, shape, dtype, req.packed, program_arguments(planner.cfg, mesh, shape, dtype, req.packed)
        )


def _compile(planner: Any, replica: _Replica, programs: tuple[str, ...]) -> list[Any]:
    """The chosen replica's `programs` compiled for the topology's devices (`compile_engine_programs`)."""
    mesh, shape = replica.mesh, replica.shape
    kind = mesh.devices.flat[0].device_kind
    print(
        f"compiling {','.join(programs)} for {kind} (tensor={mesh.shape['tensor']}, "
        f"expert={mesh.shape['expert']}, {shape.slots} slots) ...",
        file=sys.stderr,
    )
    return compile_engine_programs(
        planner.cfg, mesh, shape, replica.dtype, packed=replica.packed, programs=programs, args=replica.args
    )


def _print_hosts(topology: str, hosts: list[Any]) -> None:
    """One row per host of the replica: its devices and the weights' shards its process reads."""
    print(f"\nweights each host of the replica reads on {topology} (a process a host; --json: the shards)")
    rows = [
        {
            "host": h.process,
            "devices": ",".join(str(d) for d in h.devices),
            "arrays": len(h.shards),
            "shards": sum(len(s) for s in h.shards.values()),
            "read_GB": round(h.nbytes / 1e9, 3),
        }
        for h in hosts
    ]
    print_table(rows, list(rows[0]))


def _print_compiled(topology: str, plan: Any, compiled: list[Any]) -> None:
    """XLA's figures per device of the replica, one row per program."""
    hbm = plan.request.hbm_bytes
    print(
        f"\ncompiled for {topology} by XLA, per device (GB = 1e9 bytes; fits: peak within --hbm; roofline: "
        "the slowest of flops, bytes read and collectives at the chip's peaks; host: this process's peak)"
    )
    rows = [
        {
            "program": c.name,
            "rows x tokens": f"{c.rows} x {c.length}" if c.length else "a slot",
            "argument_GB": round(c.argument_bytes / 1e9, 3),
            "output_GB": round(c.output_bytes / 1e9, 3),
            "temp_GB": round(c.temp_bytes / 1e9, 3),
            "alias_GB": round(c.alias_bytes / 1e9, 3),
            "peak_GB": round(c.peak_bytes / 1e9, 3),
            "fits": "yes" if c.peak_bytes <= hbm else "NO",
            "GFLOP": round(c.flops / 1e9, 3),
            "read_GB": round(c.bytes_accessed / 1e9, 3),
            "collective_MB": round(c.collective_bytes / 1e6, 3),
            "roofline_ms": None if c.roofline_s is None else round(c.roofline_s * 1e3, 3),
            "compile_s": c.compile_s,
            "host_GB": round(c.host_peak_bytes / 1e9, 2),
        }
        for c in compiled
        if c.error is None
    ]
    if rows:
        print_table(rows, list(rows[0]))
    for c in compiled:
        if c.collectives:
            kinds = ", ".join(f"{k} x{n} ({b / 1e6:.3f} MB)" for k, (n, b) in sorted(c.collectives.items()))
            print(f"{c.name} collectives per device: {kinds}")
        if c.error is not None:
            print(f"{c.name} ({c.rows} rows x {c.length} tokens) does not compile: {c.error}")
        if c.top_ops:
            print(
                f"{c.name}: its top instructions by bytes touched (result + operands by their shapes, "
                "approximate; not fused computations' insides)"
            )
            for op in c.top_ops:
                inputs = ", ".join(op.operands)
                inputs = inputs if len(inputs) <= 60 else inputs[:57] + "..."
                print(f"  {op.bytes / 1e6:12,.3f} MB  {op.kind:<14} {op.result} <- ({inputs})  {op.op_name}")
        if c.cpu_calls:
            print(f"warning: {c.name} calls CPU kernels: {', '.join(c.cpu_calls)}", file=sys.stderr)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="which mesh, and how many sequences fit, on N chips of a given HBM",
        description=run.__doc__,
    )
    add_config_arg(p)
    p.add_argument("--model", help="a checkpoint directory (its config.json) instead of --config")
    p.add_argument("--chips", default="8", help="chips in the slice (default 8; a list sweeps)")
    p.add_argument("--hbm", default="95", help="memory per chip in GB, 1e9 bytes (default 95; a list sweeps)")
    p.add_argument("--chips-per-host", type=int, default=None, help="keep the tensor axis within one host")
    p.add_argument(
        "--context",
        default=None,
        help="tokens per sequence, the engine's --max-model-len (default: the model's own context, its "
        "max_position_embeddings)",
    )
    p.add_argument(
        "--experts",
        default="packed",
        help="MXFP4 routed experts 'packed' (4.25 bits) or 'dequantized' (the dtype); a list sweeps",
    )
    p.add_argument("--mesh", default=None, help="only this replica mesh, e.g. 'expert=4,tensor=8'")
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="weights and KV dtype (default bfloat16)"
    )
    block, chunk = engine_default("block_size"), engine_default("prefill_chunk")
    p.add_argument("--block-size", type=int, default=block, help=f"tokens per KV block (default {block})")
    p.add_argument(
        "--prefill-chunk", type=int, default=chunk, help=f"longest prefill piece (default {chunk})"
    )
    p.add_argument(
        "--scan-layers",
        choices=("auto", "off", "prefill", "all"),
        default="auto",
        help="the engine's scan of repeated layers (its stacked copy counts; default auto)",
    )
    g = p.add_argument_group("prefix cache")
    g.add_argument(
        "--checkpoint-interval",
        default="32768",
        help="a KDA state checkpoint every N tokens of each sequence (default 32768; 0: none; a list sweeps)",
    )
    g.add_argument(
        "--device-cache-mb",
        default="1024",
        help="the prefix store's device budget, MiB (default 1024, the engine's); 'all': room for every "
        "sequence's interval checkpoints (the plan prints the budget to set)",
    )
    add_checkpoint_dtype_arg(g)
    g.add_argument("--no-prefix-cache", action="store_true", help="no state checkpoints")
    t = p.add_argument_group("compiling for a TPU topology (needs libtpu: pip install -e '.[tpu]')")
    t.add_argument(
        "--topology",
        default=None,
        help="a TPU topology, e.g. v5e:2x2, v6e:2x4, tpu7x:2x2x4: --chips becomes its device count",
    )
    t.add_argument(
        "--compile",
        action="store_true",
        help="compile the chosen replica's programs for --topology (decode step, longest prefill chunk, "
        "packed prefill, verify step, a prefix checkpoint's copy and restore) and print XLA's bytes and "
        "costs per device",
    )
    add_kernels_arg(t)
    t.add_argument(
        "--slots",
        type=int,
        default=None,
        help="compile for this many slots (a decode step of N rows) instead of the most that fit",
    )
    t.add_argument(
        "--programs",
        default=",".join(PROGRAMS),
        help=f"which programs --compile compiles (default all: {','.join(PROGRAMS)}); e.g. 'decode' alone "
        "where each compile takes minutes",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="plan (and compile) the model cut to its first N layers, same layer pattern: for compile "
        "studies (the full model's figures scale with the layer count only approximately)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
