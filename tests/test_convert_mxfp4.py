"""`jaxhybrid convert --quantize-experts mxfp4`: a dense checkpoint (our Orbax directory, or the shipped
model when no source is given) written with MXFP4 routed experts in K3's compressed-tensors names.

The oracle for the expert tensors is `quantize_mxfp4` applied to the source's experts (unstacked by hand
here); every other tensor must come back bit for bit under its published name (`published_tensors`,
written independently of jaxhybrid.weights), and the loaded model must hold exactly the dequantized
experts and the untouched rest."""

import json

import ml_dtypes  # noqa: F401  (bfloat16 in numpy)
import numpy as np
import pytest
from safetensors.numpy import load_file
from test_weights import published_tensors, random_model

from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.config import load_config
from jaxhybrid.weights import load_pretrained, read_model_config, save_orbax
from jaxhybrid.weights.hf import named_arrays
from jaxhybrid.weights.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from serve.cli import main as cli_main

EXPERT_SUFFIXES = (".w1.weight", ".w2.weight", ".w3.weight")


def is_routed_expert(name: str) -> bool:
    return ".block_sparse_moe.experts." in name and name.endswith(EXPERT_SUFFIXES)


def written_tensors(directory, prefix: str = "") -> dict[str, np.ndarray]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    assert all(n.startswith(prefix) for n in tensors)
    return {n.removeprefix(prefix): t for n, t in tensors.items()}


@pytest.fixture(scope="module")
def dense():
    return random_model(load_config("tiny"), seed=4)


@pytest.fixture(scope="module")
def orbax_src(dense, tmp_path_factory):
    return save_orbax(dense, tmp_path_factory.mktemp("src") / "tiny-orbax")


@pytest.mark.parametrize("layout, prefix", [("kimi-linear", ""), ("k3-released", "language_model.")])
def test_quantized_checkpoint_round_trips(dense, orbax_src, tmp_path, capsys, layout, prefix):
    out = tmp_path / "mx"
    args = ["convert", str(orbax_src), str(out), "--quantize-experts", "mxfp4", "--layout", layout]
    assert cli_main([*args, "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["quantize_experts"] == "mxfp4" and summary["format"] == "hf"

    source = published_tensors(dense)
    got = written_tensors(out, prefix)
    dense_names = {n for n in source if not is_routed_expert(n)}
    expert_names = sorted(n for n in source if is_routed_expert(n))
    assert len(expert_names) == 3 * 8 * 3  # 3 MoE layers x 8 experts x w1/w2/w3
    want_names = dense_names | {
        n.removesuffix(".weight") + f".weight_{part}" for n in expert_names for part in ("packed", "scale")
    }
    assert set(got) == want_names
    for name in dense_names:
        assert got[name].dtype == source[name].dtype
        np.testing.assert_array_equal(got[name], source[name], err_msg=name)
    for name in expert_names:
        stem = name.removesuffix(".weight")
        packed, scale = got[stem + ".weight_packed"], got[stem + ".weight_scale"]
        want_packed, want_scale = quantize_mxfp4(source[name])
        assert packed.dtype == np.uint8 and scale.dtype == np.uint8
        np.testing.assert_array_equal(packed, want_packed, err_msg=name)
        np.testing.assert_array_equal(scale, want_scale, err_msg=name)

    cfg = read_model_config(out)
    assert cfg.expert_quant == "mxfp4"
    raw = json.loads((out / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "compressed-tensors"
    assert cfg.replace(expert_quant=None, name=dense.config.name) == dense.config

    loaded = named_arrays(load_pretrained(out, progress=False, dequantize_experts=True))
    for name, arr in named_arrays(dense).items():
        arr = np.asarray(arr)
        if ".block_sparse_moe.experts." in name:  # stacked [E, out, in]
            want = dequantize_mxfp4(*quantize_mxfp4(arr), np.float32)
            assert not np.array_equal(want, arr)  # random weights are not MXFP4 values: a real change
        else:
            want = arr
        np.testing.assert_array_equal(np.asarray(loaded[name]), want, err_msg=name)


def test_expert_width_not_a_multiple_of_32_is_refused(tmp_path, capsys):
    cfg = load_config("tiny").replace(moe_intermediate_size=48)
    src = save_orbax(random_model(cfg), tmp_path / "src")
    out = tmp_path / "mx"
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(out), "--quantize-experts", "mxfp4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "moe_intermediate_size" in err and "multiple of 32" in err
    assert "Traceback" not in err
    assert not out.exists()


def test_non_empty_output_needs_overwrite_and_loses_its_old_checkpoint(orbax_src, tmp_path, capsys):
    """Over an Orbax directory (whose params/ a loader would find first), --overwrite leaves only the
    MXFP4 checkpoint."""
    out = tmp_path / "out"
    assert cli_main(["convert", str(orbax_src), str(out), "--no-progress"]) == 0
    mx = ["convert", str(orbax_src), str(out), "--quantize-experts", "mxfp4", "--no-progress"]
    assert cli_main(mx) == 2
    assert "not empty" in capsys.readouterr().err
    assert cli_main([*mx, "--overwrite"]) == 0
    assert not (out / "params").exists()
    assert read_model_config(out).expert_quant == "mxfp4"


def test_cli_end_to_end(orbax_src, tmp_path, capsys):
    """convert, then `generate --model` on the MXFP4 directory: it loads and decodes (the values it loads are
    checked above)."""
    out = tmp_path / "mx"
    mx = ["convert", str(orbax_src), str(out), "--quantize-experts", "mxfp4", "--no-progress"]
    assert cli_main(mx) == 0
    capsys.readouterr()
    gen = ["generate", "--prompt-ids", "5,6,7,8", "--max-tokens", "4", "--ignore-eos", "--temperature", "0"]
    gen += ["--json", "--slots", "1", "--block-size", "8", "--prefill-chunk", "32"]
    assert cli_main([*gen, "--model", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(result["token_ids"]) == 4


@pytest.mark.skipif(shipped_model_dir() is None, reason="the shipped model is not installed")
def test_no_source_converts_the_shipped_model(tmp_path, capsys):
    """No source: the shipped model (an Orbax directory). Its MXFP4 copy keeps the tokenizer and the config,
    is smaller, and loads."""
    out = tmp_path / "stdlib-small-mxfp4"
    assert cli_main(["convert", str(out), "--quantize-experts", "mxfp4", "--json", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["src"] == str(shipped_model_dir()) and summary["layout"] == "orbax"
    assert summary["dtype"] == "bfloat16"
    assert (out / "tokenizer.json").exists()
    assert summary["safetensors_bytes"] < summary["bytes"]  # 4.25-bit experts
    shipped = read_model_config(shipped_model_dir())
    assert read_model_config(out).replace(expert_quant=None) == shipped
    loaded = load_pretrained(out, progress=False)
    assert loaded.model.embed_tokens.weight[...].dtype == np.dtype("bfloat16")
