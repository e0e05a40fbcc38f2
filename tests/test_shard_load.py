"""Checkpoints read straight into their shardings (jaxhybrid.weights.slices): the sharded load equals the
unsharded one bit for bit, each process reads only the byte ranges of its own devices' slices (each slice
once), and two processes x 4 devices load a model directory and compute what one process computes."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bounds import float32_network_bound
from conftest import rel_err
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from test_k3_weights import with_mxfp4_experts
from test_multihost_engine import ENGINE, run_two
from test_weights import random_model

from jaxhybrid.config import load_config
from jaxhybrid.weights import load_pretrained, save_hf, save_orbax
from jaxhybrid.weights.hf import named_arrays
from jaxhybrid.weights.safetensors import scan_checkpoint
from jaxhybrid.weights.slices import slice_ranges
from serve.models import ModelSettings, load_on_mesh
from sharding.mesh import make_mesh
from sharding.placement import load_pretrained_on_mesh

# tiny cut to two layers (KDA + dense MLP, MLA + MoE): one MoE layer of 8 experts
CFG = load_config("tiny").replace(num_hidden_layers=2, kda_layers=(1,), full_attn_layers=(2,))
EXPERT_TENSOR_BYTES = CFG.moe_intermediate_size * CFG.hidden_size * 4  # w1, w2, w3: [32, 64] / [64, 32] fp32
MESHES = ["expert=8", "tensor=2,expert=4", "data=2,expert=2,tensor=2", "data=8"]
ORBAX_CHUNK_BYTES = 4096  # half of one expert's [32, 64] fp32 matrix


@pytest.fixture(scope="module")
def model():
    return random_model(CFG)


@pytest.fixture(scope="module")
def ckpt(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ckpt")
    save_hf(model, out, max_shard_bytes=64 << 10)  # several files
    return out


@pytest.fixture(scope="module")
def orbax_ckpt(model, tmp_path_factory) -> Path:
    return save_orbax(model, tmp_path_factory.mktemp("orbax") / "m", chunk_bytes=ORBAX_CHUNK_BYTES)


def zarr_chunks(directory: Path) -> dict[str, tuple[list[int], list[int]]]:
    """Our name -> (shape, chunk shape) from each array's `.zarray` inside the Orbax directory's OCDBT
    store: what a reader finds on disk, independent of the code that chose it."""
    import tensorstore as ts

    base = f"file://{(directory / 'params').resolve()}"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    out = {}
    for key in kv.list().result():
        if key.endswith(b"/.zarray"):
            meta = json.loads(kv.read(key).result().value)
            out[key.decode()[: -len("/.zarray")]] = (meta["shape"], meta["chunks"])
    return out


def file_bytes(directory: Path) -> dict[str, int]:
    return {name: info.nbytes for name, info in scan_checkpoint(directory).items()}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_slice_ranges_cover_exactly_the_slice(data):
    """The byte ranges of a slice, read from the array's bytes in order, are the slice's bytes."""
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    bounds = []
    for n in shape:
        a = data.draw(st.integers(0, n))
        bounds.append((a, data.draw(st.integers(a, n))))
    arr = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    offsets, length = slice_ranges(shape, tuple(bounds), arr.itemsize)
    raw = arr.tobytes()
    got = b"".join(raw[o : o + length] for o in offsets.tolist())
    want = arr[tuple(slice(a, b) for a, b in bounds)]
    assert got == want.tobytes()
    # as few ranges as the layout allows: one per run of the last dimension taken in part
    assert len(offsets) * length == want.nbytes


@pytest.mark.parametrize("spec", MESHES)
def test_sharded_load_equals_unsharded_and_reads_each_byte_once(ckpt, spec):
    """On 8 devices of one process, every parameter equals the unsharded load bit for bit, and every
    checkpoint tensor is read exactly once: replicated slices (data=8: every device holds everything) are
    read once per process, split ones once per distinct slice."""
    want = named_arrays(load_pretrained(ckpt, progress=False))
    report = {}
    loaded = load_pretrained_on_mesh(ckpt, make_mesh(spec), progress=False, report=report)
    for name, arr in named_arrays(loaded).items():
        assert len(arr.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[name]), err_msg=name)
    assert report["read_bytes_by_tensor"] == file_bytes(ckpt)


def test_bf16_checkpoint_to_fp32_on_a_mesh_and_mxfp4_experts(ckpt, tmp_path):
    """The dtype conversion on the way (bf16 stored, fp32 asked; column slices of o_proj and w2 over
    tensor=2), MXFP4 experts dequantized at load (the slice's rows of codes and scales) and MXFP4 experts
    kept packed equal the unsharded load bit for bit."""
    bf16 = tmp_path / "bf16"
    save_hf(load_pretrained(ckpt, dtype=jnp.bfloat16, progress=False), bf16)
    mx = tmp_path / "mx"
    save_hf(with_mxfp4_experts(random_model(CFG), seed=3)[0], mx, expert_quant="mxfp4")
    mesh = make_mesh("tensor=2,expert=4")
    # the MXFP4 checkpoint twice: dequantized at load, and kept packed (uint8 codes and scales)
    for directory, dtype, dq in ((bf16, jnp.float32, False), (mx, None, True), (mx, None, False)):
        want = named_arrays(load_pretrained(directory, dtype=dtype, progress=False, dequantize_experts=dq))
        report = {}
        got = named_arrays(
            load_pretrained_on_mesh(
                directory, mesh, dtype, progress=False, report=report, dequantize_experts=dq
            )
        )
        assert got.keys() == want.keys()
        for name, arr in got.items():
            assert arr.dtype == want[name].dtype, name
            np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[name]), err_msg=name)
        sizes = file_bytes(directory)
        if directory == mx and dq:  # w2's 32 columns split in halves of 16: both read its one scale group
            sizes = {n: 2 * v if ".w2." in n else v for n, v in sizes.items()}
        assert report["read_bytes_by_tensor"] == sizes
        if directory == mx and not dq:
            assert want["model.layers.1.block_sparse_moe.experts.w1_packed"].dtype == jnp.uint8
        elif directory == mx:
            assert want["model.layers.1.block_sparse_moe.experts.w1"].dtype == jnp.float32  # dequantized


@pytest.mark.parametrize("spec", ["expert=8", "tensor=2,expert=4"])
def test_orbax_chunks_split_on_expert_boundaries(model, orbax_ckpt, spec):
    """`save_orbax` stores each array in chunks of at most its chunk size (the zarr metadata on disk says
    so), one expert per chunk at most, so a device's experts shard (here 1 or 2 experts, whole or split
    over tensor) is a whole number of chunks along the expert axis: a process reads its own experts
    only. Restored onto the mesh, every array equals the saved one bit for bit."""
    chunks = zarr_chunks(orbax_ckpt)
    want = named_arrays(model)
    assert set(chunks) == set(want)
    got = named_arrays(load_pretrained_on_mesh(orbax_ckpt, make_mesh(spec), progress=False))
    experts = [n for n in want if ".experts." in n]
    assert len(experts) == 3
    for name, arr in got.items():
        shape, chunk = chunks[name]
        assert shape == list(want[name].shape), name
        if want[name].nbytes > ORBAX_CHUNK_BYTES:
            assert np.prod(chunk) * want[name].dtype.itemsize <= ORBAX_CHUNK_BYTES, (name, chunk)
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[name]), err_msg=name)
    for name in experts:
        shard = got[name].sharding.shard_shape(got[name].shape)
        assert shard[0] < CFG.num_experts and chunks[name][1][0] == 1, (name, shard, chunks[name])


def test_orbax_slice_reads_equal_orbax_restore(model, orbax_ckpt, tmp_path):
    """`restore` reads each process's slices from the OCDBT store itself: on tensor=2,expert=4, cast to
    bf16 on the way, every array equals Orbax's own restore bit for bit with the same sharding, for the
    chunked directory and for one written with one chunk per array (how `save_orbax` wrote them before).
    A slice that several local devices hold is read once into one buffer they all use."""
    import orbax.checkpoint as ocp

    from jaxhybrid.model import abstract_model, path_name
    from jaxhybrid.weights import orbax_io
    from sharding.rules import state_shardings

    want_arrays = named_arrays(model)
    old = tmp_path / "one-chunk"
    ck = orbax_io.checkpointer()
    ck.save((old / "params").resolve(), args=ocp.args.PyTreeSave(orbax_io._nest(want_arrays)))
    ck.close()
    assert zarr_chunks(old)["lm_head.weight"][1] == list(model.lm_head.weight.shape)
    mesh = make_mesh("tensor=2,expert=4")
    placement = nnx.to_flat_state(state_shardings(abstract_model(CFG, jnp.bfloat16), mesh))
    shardings = {path_name(p): v.get_value() for p, v in placement}
    targets = {n: (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16), shardings[n]) for n, a in want_arrays.items()}
    for directory in (orbax_ckpt, old):
        got = orbax_io.restore(directory, targets)
        want = orbax_io.restore_with_orbax((directory / "params").resolve(), targets)
        for name, arr in got.items():
            assert arr.dtype == jnp.bfloat16 and arr.sharding == want[name].sharding, name
            np.testing.assert_array_equal(
                np.asarray(arr, np.float32), np.asarray(want[name], np.float32), err_msg=name
            )
        norm = got["model.norm.weight"]  # replicated on all 8 devices
        assert len({s.data.unsafe_buffer_pointer() for s in norm.addressable_shards}) == 1


def test_mesh_flag_loads_a_model_directory_into_its_shardings(ckpt):
    """`--model DIR --mesh expert=8` (serve / generate) reads the parameters into their shardings, with
    expert parallelism installed, and equals the model loaded without a mesh."""
    model, mesh = load_on_mesh(ModelSettings(model=str(ckpt), mesh="expert=8"), multi=False)
    w1 = model.model.layers[1].block_sparse_moe.experts.w1[...]
    assert mesh.shape["expert"] == 8 and w1.addressable_shards[0].data.shape[0] == 1
    assert model.model.layers[1].block_sparse_moe.experts_fn is not None
    want = named_arrays(load_pretrained(ckpt, progress=False))
    for name, arr in named_arrays(model).items():
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(want[name]), err_msg=name)


def test_two_processes_read_only_their_own_shards(ckpt, model, tmp_path):
    """Two processes x 4 CPU devices, mesh expert=8, load the model directory straight into their shards:
    each reads the 4 experts its devices hold (half of the expert bytes, by hand: 4 experts x 3 weights x
    32 x 64 x 4 bytes) and every other tensor once (replicated over its 4 devices), and both compute the
    single-process logits."""
    worker = Path(__file__).with_name("multihost_worker.py")
    tokens = (4, 16)

    def cmd(i: int, port: int) -> list[str]:
        return [
            sys.executable, str(worker), f"--coordinator=127.0.0.1:{port}", "--num-processes=2",
            f"--process-id={i}", "--local-devices=4", "--mesh=expert=8", f"--hf={ckpt}",
            f"--report={tmp_path / f'report{i}.json'}", f"--batch={tokens[0]}", f"--length={tokens[1]}",
            f"--out={tmp_path / f'logits{i}.npy'}",
        ]  # fmt: skip

    for rc, out, err in run_two(cmd, tmp_path, tmp_path / "jax-cache"):
        assert rc == 0, (out + err)[-3000:]
    sizes = file_bytes(ckpt)
    experts = {n for n in sizes if ".experts." in n}
    assert sum(sizes[n] for n in experts) == 8 * 3 * EXPERT_TENSOR_BYTES
    for i in range(2):
        read = json.loads((tmp_path / f"report{i}.json").read_text())["read_bytes_by_tensor"]
        mine = {n for n in experts if int(n.split(".experts.")[1].split(".")[0]) // 4 == i}
        assert set(read) == (set(sizes) - experts) | mine  # only this process's experts
        assert sum(read[n] for n in mine) == 4 * 3 * EXPERT_TENSOR_BYTES  # half of the expert bytes
        assert all(read[n] == sizes[n] for n in read)  # each once, though 4 local devices hold it
    got = [np.load(tmp_path / f"logits{i}.npy") for i in range(2)]
    np.testing.assert_array_equal(got[0], got[1])
    want = np.random.default_rng(1).integers(0, CFG.vocab_size, tokens, dtype=np.int32)  # the worker's
    graphdef, state = nnx.split(model)
    reference = np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, want))
    assert rel_err(got[0], reference) < float32_network_bound(CFG, tokens[1])  # another mesh: other orders


@pytest.mark.slow
def test_generate_cli_with_a_model_directory_on_two_processes(ckpt, tmp_path):
    """`jaxhybrid generate --model DIR --mesh expert=8` on two processes x 4 devices (each reading its own
    shards) gives the greedy tokens of one process's engine on the model loaded whole."""
    from serve.engine.engine import Engine, EngineConfig
    from serve.engine.sampling import SamplingParams

    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, CFG.vocab_size, n).tolist() for n in (7, 20)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt_ids": p}) for p in prompts))
    flags = [f"--{k.replace('_', '-').replace('max-slots', 'slots')}={v}" for k, v in ENGINE.items()]

    def cmd(i: int, port: int) -> list[str]:
        return [
            sys.executable, "-m", "serve.cli", "generate", f"--model={ckpt}", "--max-tokens=5",
            *([f"--prompts-file={tmp_path / 'prompts.jsonl'}"] if i == 0 else []), "--ignore-eos", "--json",
            "--mesh=expert=8", *flags, f"--coordinator=127.0.0.1:{port}", "--num-processes=2",
            f"--process-id={i}",
        ]  # fmt: skip

    (rc0, out0, err0), (rc1, _, err1) = run_two(cmd, tmp_path, tmp_path / "jax-cache")
    assert rc0 == 0 and rc1 == 0, (err0 + err1)[-3000:]
    engine = Engine(load_pretrained(ckpt, progress=False), EngineConfig(**ENGINE))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    want = [r.token_ids for r in engine.generate(prompts, [params] * len(prompts))]
    assert [json.loads(x)["token_ids"] for x in out0.splitlines()] == want


def test_bench_load_on_two_processes_counts_each_process_reads(ckpt):
    """`bench load --mesh expert=8 --processes 2 --local-devices 4`: each process's figures, its reads
    those of its own shards (every non-expert tensor once, half of the expert bytes)."""
    from benchmarks.load import measure

    row = measure(ckpt, "auto", 1, mesh="expert=8", processes=2, local_devices=4)
    sizes = file_bytes(ckpt)
    experts = sum(v for n, v in sizes.items() if ".experts." in n)
    assert row["processes"] == 2 and [r["process"] for r in row["per_process"]] == [0, 1]
    for r in row["per_process"]:
        assert r["loader_read_bytes"] == sum(sizes.values()) - experts // 2
        assert r["io_read_bytes"] >= r["loader_read_bytes"]
        assert r["peak_rss_bytes"] >= r["baseline_rss_bytes"]
