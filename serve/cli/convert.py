"""`jaxhybrid convert [SRC] OUT_DIR`: a checkpoint to our Orbax directory, or to an MXFP4 one.

SRC is a Hugging Face Kimi Linear (or released Kimi K3) directory or one of our Orbax model directories;
without it, the shipped model. K3's vision tower is skipped (counted in the summary); its MXFP4 experts
stay packed (`--dequantize-experts`: stored dense). `--quantize-experts mxfp4` writes the routed experts in
K3's compressed-tensors form instead (safetensors `experts.{e}.w{1,2,3}.weight_packed` / `weight_scale`
and a `quantization_config`), the rest of the tensors as they load, so a dense model can be tried on
the packed path."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.config import ConfigError
from jaxhybrid.weights import CheckpointError, load_pretrained, save_hf, save_orbax
from jaxhybrid.weights.hf import named_arrays
from jaxhybrid.weights.orbax_io import PARAMS_DIR
from jaxhybrid.weights.safetensors import INDEX_FILE
from serve.models import add_dequantize_experts_arg
from serve.report import DTYPES, fmt_bytes

QUANTIZATIONS = ("mxfp4",)
LAYOUTS = ("kimi-linear", "k3-released")


def _clear_output(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty OUT_DIR unless `overwrite`; then remove the checkpoint files it holds (an old
    Orbax params/ would otherwise be what a loader finds first)."""
    if not out.exists() or not any(out.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass --overwrite to replace it)")

    shutil.rmtree(out / PARAMS_DIR, ignore_errors=True)
    for path in [*out.glob("*.safetensors"), out / INDEX_FILE]:
        path.unlink(missing_ok=True)


def _write_mxfp4(model: object, src: Path, out: Path, args: argparse.Namespace) -> None:
    """The model as a Hugging Face directory with MXFP4 routed experts; the expert widths are checked (a
    ConfigError naming the width) before anything is written."""
    model.config.replace(expert_quant=args.quantize_experts)  # type: ignore[attr-defined]
    if src.resolve() == out.resolve():
        raise FileExistsError(f"{out}: the output directory must differ from the source")
    _clear_output(out, args.overwrite)
    save_hf(model, out, tokenizer_dir=src, layout=args.layout, expert_quant=args.quantize_experts)


def run(args: argparse.Namespace) -> int:
    """Load SRC (Hugging Face safetensors or our Orbax directory; default the shipped model) and write
    OUT_DIR: config.json, tokenizer files and the Orbax params/, or with --quantize-experts a safetensors
    checkpoint whose routed experts are MXFP4."""
    import jax
    import numpy as np

    src = args.src if args.src is not None else shipped_model_dir()
    if src is None:
        print("error: give SRC (the shipped model is not installed)", file=sys.stderr)
        return 2
    src, out = Path(src), Path(args.out_dir)
    dtype = None if args.dtype == "auto" else args.dtype
    try:
        t0 = time.perf_counter()
        report: dict = {}
        model = load_pretrained(
            src,
            dtype=dtype,
            progress=None if args.progress else False,
            report=report,
            dequantize_experts=args.dequantize_experts,
        )
        t1 = time.perf_counter()
        if args.quantize_experts:
            _write_mxfp4(model, src, out, args)
        else:
            save_orbax(model, out, tokenizer_dir=src, overwrite=args.overwrite)
        t2 = time.perf_counter()
    except (ConfigError, CheckpointError, FileExistsError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    arrays = named_arrays(model)
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays.values())
    written = sum(p.stat().st_size for p in out.glob("*.safetensors")) if args.quantize_experts else None
    result = {
        "src": str(src),
        "out_dir": str(out),
        "format": "hf" if args.quantize_experts else "orbax",
        "dtype": str(jax.numpy.dtype(model.model.embed_tokens.weight[...].dtype)),
        "arrays": len(arrays),
        "bytes": nbytes,
        "layout": report.get("layout"),
        "expert_quant": report.get("expert_quant"),
        "quantize_experts": args.quantize_experts,
        "out_layout": args.layout if args.quantize_experts else None,
        "safetensors_bytes": written,
        "skipped": report.get("skipped", 0),
        "skipped_summary": report.get("skipped_summary", {}),
        "load_s": round(t1 - t0, 3),
        "save_s": round(t2 - t1, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        what = f"{len(arrays)} arrays, {fmt_bytes(nbytes)} ({result['dtype']})"
        if written is not None:
            what += f" -> {fmt_bytes(written)} of safetensors with {args.quantize_experts} routed experts"
        print(f"wrote {out}: {what}; load {result['load_s']:.2f} s, save {result['save_s']:.2f} s")
        if result["skipped"]:
            parts = ", ".join(f"{k} {v}" for k, v in result["skipped_summary"].items())
            print(f"skipped {result['skipped']} tensors outside the text model ({parts})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a checkpoint directory to an Orbax one, or quantize its experts to MXFP4",
        description=run.__doc__,
    )
    p.add_argument(
        "src",
        nargs="?",
        help="Hugging Face Kimi Linear / released Kimi K3 directory (config.json + *.safetensors) or an "
        "Orbax model directory (default: the shipped model)",
    )
    p.add_argument("out_dir", help="output directory (must not exist or be empty unless --overwrite)")
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="parameter dtype to store (default auto: the checkpoint's; fp32 parts stay fp32)",
    )
    p.add_argument(
        "--quantize-experts",
        choices=QUANTIZATIONS,
        default=None,
        help="write a safetensors checkpoint with the routed experts quantized (MXFP4: 4.25 bits per weight, "
        "compressed-tensors names; expert widths must be multiples of 32) instead of an Orbax one",
    )
    p.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="kimi-linear",
        help="names of the --quantize-experts checkpoint: Kimi Linear's (default) or the released K3 "
        "layout (`language_model.` prefix, config under text_config)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the checkpoint in a non-empty OUT_DIR")
    add_dequantize_experts_arg(p)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
