"""The engine's programs compile for a real TPU topology on this CPU host (libtpu describes v5e:2x2's four
devices; nothing runs): no CPU kernel inside, and XLA's argument bytes per device at least the shard bytes
counted by hand from the arguments' shardings (a TPU only pads arrays to its tiles). Needs libtpu
(`pip install -e ".[tpu]"`, which CI installs)."""

from __future__ import annotations

import importlib.util
import json

import jax
import jax.numpy as jnp
import pytest

from jaxhybrid.config import load_config
from serve.cli import main
from serve.engine.config import EngineShape
from serve.engine.engine import EngineConfig
from sharding.plan import tree_shard_nbytes

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason='libtpu is not installed (pip install -e ".[tpu]")'
)


@pytest.fixture(autouse=True)
def serving_precision():
    """The programs as `serve` compiles them: the suite asks for HIGHEST matmul precision everywhere (for its
    fp32 comparisons), under which the TPU compiler's Mosaic refuses a bfloat16 grouped product ("Bad lhs
    type")."""
    with jax.default_matmul_precision("default"):
        yield


ENGINE = EngineConfig(
    max_slots=8, block_size=16, prefill_chunk=16, max_model_len=256, prefix=None, scan_layers="off"
)


# each HLO element type's bytes, from numpy's dtypes: the oracle for `top_ops`' counts
HLO_DTYPES = {"pred": "bool", "s8": "int8", "u8": "uint8", "s16": "int16", "u16": "uint16"}
HLO_DTYPES |= {"bf16": "bfloat16"}
HLO_DTYPES |= {"f16": "float16", "s32": "int32", "u32": "uint32", "f32": "float32", "s64": "int64"}
HLO_DTYPES |= {"u64": "uint64", "f64": "float64"}


def hand_bytes(printed: str) -> int:
    """Bytes of the arrays in a printed type ("bf16[8,128]", "(f32[8], s32[])"), each element's size taken
    from numpy (jnp.dtype) and its count multiplied out here."""
    import math
    import re

    total = 0
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", printed):
        total += jnp.dtype(HLO_DTYPES[dtype]).itemsize * math.prod(int(d) for d in dims.split(",") if d)
    return total


def check_top_ops(top: list[dict], bytes_accessed: float) -> None:
    """The top instructions by bytes: some, largest first, each one's bytes its printed result's and operands'
    counted by hand, none above the whole program's bytes accessed (each is a part of them)."""
    assert top and [op["bytes"] for op in top] == sorted((op["bytes"] for op in top), reverse=True)
    for op in top:
        assert op["bytes"] == hand_bytes(op["result"]) + sum(hand_bytes(o) for o in op["operands"]), op
        assert op["kind"] and op["op_name"] and op["kind"] not in ("parameter", "tuple", "while")
    assert 0 < top[0]["bytes"] <= bytes_accessed


def per_device(structs) -> int:
    """Bytes one device holds of these placed shapes: each array's shard (every device holds the same)."""
    leaves = jax.tree.leaves(structs)
    return tree_shard_nbytes(leaves, [leaf.sharding for leaf in leaves])


@pytest.mark.parametrize("tensor, expert", [(1, 4), (4, 1)], ids=["expert=4", "tensor=4"])
def test_tiny_k3_decode_compiles_for_v5e_with_no_cpu_kernel(tensor, expert):
    from serve.engine.topology import (
        compile_engine_programs,
        program_arguments,
        replica_mesh,
        topology_devices,
    )

    cfg = load_config("tiny-k3")
    devices = topology_devices("v5e:2x2")
    assert len(devices) == 4 and all(d.platform == "tpu" for d in devices)
    mesh = replica_mesh(devices, tensor, expert)
    shape = EngineShape.resolve(ENGINE, cfg)
    (decode,) = compile_engine_programs(cfg, mesh, shape, jnp.bfloat16, programs=("decode",))
    assert decode.error is None and decode.cpu_calls == ()
    args = program_arguments(cfg, mesh, shape, jnp.bfloat16)
    ints = 4 * (
        shape.slots * (1 + 1 + 1 + 1) + shape.slots * shape.table_buckets[-1]
    )  # tokens, ids, .., table
    counted = per_device((args.params, args.kda_pools, args.mla_pools)) + ints
    assert decode.argument_bytes >= counted
    # the MLA pools are donated and come back in place: at least their bytes are aliased
    assert decode.alias_bytes >= per_device(args.mla_pools) > 0
    assert decode.flops > 0 and decode.bytes_accessed > 0
    check_top_ops(decode.as_dict()["top_ops"], decode.bytes_accessed)
    assert len(decode.top_ops) == 8
    # the floor is the HBM reads' (a decode step moves far more bytes than v5e's 4 flops a byte can use)
    assert decode.roofline_s == pytest.approx(decode.bytes_accessed / 819e9)
    if expert > 1:  # the experts' rows travel between the devices that hold them
        assert decode.collective_bytes > 0 and set(decode.collectives) & {"all-to-all", "ragged-all-to-all"}


def test_plan_compiles_its_choice_for_a_topology(capsys):
    """`plan --topology NAME --compile`: the topology's device count as --chips, the chosen replica's programs
    (decode, prefill chunk, packed prefill, verify with 4 drafted tokens, a checkpoint's copy and restore)
    compiled there,
    XLA's figures in the JSON."""
    args = ["plan", "--config", "tiny-k3", "--topology", "v5e:2x2", "--hbm", "0.05", "--context", "256"]
    args += [
        "--block-size",
        "16",
        "--prefill-chunk",
        "16",
        "--mesh",
        "expert=4,tensor=1",
        "--no-prefix-cache",
    ]
    assert main([*args, "--compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["request"]["chips"] == 4 and out["topology"] == "v5e:2x2"
    (host,) = out["hosts"]  # one host: it reads every weight
    assert host["process"] == 0 and len(host["devices"]) == 4 and host["bytes"] > 0
    compiled = {c["name"]: c for c in out["compiled"]}
    assert set(compiled) == {"decode", "prefill", "packed", "verify", "checkpoint", "restore"}
    assert compiled["decode"]["rows"] == out["chosen"]["slots"] and compiled["prefill"]["length"] == 16
    assert compiled["verify"]["rows"] == out["chosen"]["slots"] and compiled["verify"]["length"] == 4 + 1
    assert 1 < compiled["packed"]["rows"] <= out["chosen"]["slots"]  # short chunks of several requests
    for c in compiled.values():
        assert c["error"] is None and c["cpu_calls"] == [] and c["argument_bytes"] > 0
        check_top_ops(c["top_ops"], c["bytes_accessed"])


def test_an_unknown_topology_is_a_usage_error(capsys):
    assert main(["plan", "--config", "tiny", "--topology", "v9z:1x1", "--compile"]) == 2
    err = capsys.readouterr().err
    assert "cannot describe the TPU topology 'v9z:1x1'" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "command",
    [
        ["serve.cli", "generate", "--config", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "2"],
        ["benchmarks", "decode", "--config", "tiny", "--contexts", "16", "--repeats", "1"],
    ],
    ids=["jaxhybrid", "benchmarks"],
)
def test_a_command_on_a_host_without_a_tpu_does_not_try_to_open_one(tmp_path, command):
    """libtpu installed, no TPU chip here, JAX_PLATFORMS unset: `jaxhybrid generate` and `python -m
    benchmarks` run on the CPU without libtpu's screen of discovery errors (it would try to open a TPU first,
    then fall back to the CPU)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from serve.models import tpu_devices_present

    if tpu_devices_present():
        pytest.skip("this host has TPU chips")
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    cmd = [sys.executable, "-m", *command, *(["--compile-cache", "off"] if command[0] == "serve.cli" else [])]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TPU" not in done.stderr and "libtpu" not in done.stderr, done.stderr[-2000:]


def test_each_host_of_a_multi_host_replica_reads_the_shards_its_programs_take():
    """v6e:2x4 is two hosts of four devices. A replica of expert=2 x tensor=4 puts one expert half on each
    host: the plan's per-host shards (`host_shards` of the weights as the engine places them) are the
    ones the compiled decode program takes as its inputs, and by hand each host reads every weight whole
    except the routed experts, of which it reads half."""
    import math

    import numpy as np

    from serve.engine.topology import program_arguments, replica_mesh, topology_devices
    from sharding.hosts import host_shards

    cfg = load_config("tiny-k3")
    devices = topology_devices("v6e:2x4")
    mesh = replica_mesh(devices, tensor=4, expert=2)
    assert sorted({d.process_index for d in mesh.devices.flat}) == [0, 1]
    shape = EngineShape.resolve(ENGINE, cfg)
    args = program_arguments(cfg, mesh, shape, jnp.bfloat16)
    hosts = host_shards(args.params)
    assert [h.process for h in hosts] == [0, 1] and all(len(h.devices) == 4 for h in hosts)

    widest = shape.table_buckets[-1]
    ints = [(shape.slots, 1), (shape.slots,), (shape.slots, widest), (shape.slots,), (shape.slots,)]
    ints = [jax.ShapeDtypeStruct(d, jnp.int32, sharding=jax.NamedSharding(mesh, jax.P())) for d in ints]
    compiled = args.run.lower(args.params, args.kda_pools, args.mla_pools, *ints).compile()
    taken = host_shards(args.params, compiled.input_shardings[0][0])
    read = [{k: v for k, v in h.shards.items() if k in t.shards} for h, t in zip(hosts, taken, strict=True)]
    assert [t.shards for t in taken] == read and [t.devices for t in taken] == [h.devices for h in hosts]
    # XLA prunes what the program never reads: the first layer's attention-residual weights (nothing to mix)
    unread = {k for k in hosts[0].shards if k not in taken[0].shards}
    assert unread == {f"['model']['layers'][0]['self_attention_res_{n}']['weight']" for n in ("norm", "proj")}

    leaves = jax.tree_util.tree_flatten_with_path(args.params)[0]
    nbytes = lambda leaf: math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize  # noqa: E731
    experts = sum(nbytes(leaf) for path, leaf in leaves if "'experts'" in jax.tree_util.keystr(path))
    total = sum(nbytes(leaf) for _, leaf in leaves)
    assert experts > 0
    assert [h.nbytes for h in hosts] == [total - experts // 2] * 2


def test_top_ops_count_non_fused_instructions_by_their_shapes():
    """A module's text by hand: the fusion counts by its result and operands (a layout's tiles are not
    dimensions), its fused computation's insides and the reducer do not count, nor do parameters, tuples and
    loops; an async pair counts once, at its start, by its result (which holds its operand). An operand's type
    is the one printed before it, else (as a compiled module prints them) its instruction's."""
    from serve.engine.topology import top_ops

    text = """HloModule m

%fused_computation (param_0: bf16[64,128]) -> bf16[64,128] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  ROOT %huge = f32[1000,1000]{1,0} multiply(f32[1000,1000]{1,0} %param_0, f32[1000,1000]{1,0} %param_0)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

ENTRY %main (p0: bf16[64,128], p1: u8[4,32]) -> (bf16[64,128], f32[]) {
  %p0 = bf16[64,128]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = u8[4,32]{1,0} parameter(1)
  %fusion = bf16[64,128]{1,0:T(8,128)(2,1)} fusion(bf16[64,128]{1,0:T(8,128)(2,1)} %p0), kind=kLoop, \
calls=%fused_computation, metadata={op_name="jit(run)/layers/mul"}
  %copy-start = (u8[4,32]{1,0}, u8[4,32]{0,1}, u32[]) copy-start(%p1)
  %copy-done = u8[4,32]{0,1} copy-done((u8[4,32]{1,0}, u8[4,32]{0,1}, u32[]) %copy-start)
  %zero = f32[] constant(0)
  %reduce = f32[] reduce(%fusion, %zero), dimensions={0,1}, to_apply=%add
  ROOT %tuple = (bf16[64,128]{1,0}, f32[]) tuple(%fusion, %reduce)
}
"""  # a backslash at a line's end continues it (the fusion's line is one line)
    top = top_ops(text, 8)
    assert [(op.kind, op.bytes) for op in top] == [
        ("fusion", 2 * 64 * 128 * 2),
        ("reduce", 64 * 128 * 2 + 4 + 4),
        ("copy-start", 4 * 32 * 2 + 4),
    ]
    assert top[0].result == "bf16[64,128]" and top[0].operands == ("bf16[64,128]",)
    assert top[0].op_name == "jit(run)/layers/mul" and top_ops(text, 1) == top[:1]


def test_layers_cut_a_config_to_its_first_layers_of_the_same_kinds(capsys):
    """`plan --layers N`: the config's first N layers, each of its kind in the full model (KDA or MLA, dense
    or MoE); N outside 1..num_hidden_layers is a usage error."""
    from serve.engine.topology import cut_layers

    full = load_config("tiny-k3")
    for n in (1, 4, 5, full.num_hidden_layers):
        cut = cut_layers(full, n)
        assert cut.layer_types == full.layer_types[:n] and cut.num_hidden_layers == n
        assert [cut.is_moe_layer(i) for i in range(n)] == [full.is_moe_layer(i) for i in range(n)]
    args = ["plan", "--config", "tiny-k3", "--hbm", "1", "--context", "256", "--json"]
    assert main([*args, "--layers", "5"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 5
    for bad in ("0", str(full.num_hidden_layers + 1)):
        assert main(["plan", "--config", "tiny-k3", "--layers", bad]) == 2
        err = capsys.readouterr().err
        assert f"--layers must be in 1..{full.num_hidden_layers}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--programs", "decode,nope", "--compile"], "--programs must be a list of decode"),
        (["--slots", "8"], "--slots takes a positive count, with --compile"),
        (["--slots", "100000", "--compile"], "--slots 100000: only"),
    ],
    ids=["unknown-program", "slots-without-compile", "slots-beyond-the-plan"],
)
def test_compile_flags_are_checked_before_compiling(capsys, flags, message):
    args = ["plan", "--config", "tiny-k3", "--topology", "v5e:2x2", "--hbm", "0.05", "--context", "256"]
    assert main([*args, "--mesh", "expert=4,tensor=1", "--no-prefix-cache", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "compiling" not in err
