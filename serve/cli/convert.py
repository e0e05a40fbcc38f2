"""`jaxhybrid convert HF_DIR OUT_DIR`: a Hugging Face Kimi Linear (or released Kimi K3) checkpoint to our
Orbax directory. K3's vision tower is skipped (counted in the summary); its MXFP4 experts stay packed
(`--dequantize-experts`: stored dense)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from serve.models import add_dequantize_experts_arg
from serve.report import DTYPES, fmt_bytes


def run(args: argparse.Namespace) -> int:
    """Load HF_DIR (safetensors) and write OUT_DIR: config.json, tokenizer files and the Orbax params/."""
    import jax
    import numpy as np

    from jaxhybrid.config import ConfigError
    from jaxhybrid.weights import CheckpointError, load_pretrained, save_orbax
    from jaxhybrid.weights.hf import named_arrays

    dtype = None if args.dtype == "auto" else args.dtype
    try:
        t0 = time.perf_counter()
        report: dict = {}
        model = load_pretrained(
            args.hf_dir,
            dtype=dtype,
            progress=None if args.progress else False,
            report=report,
            dequantize_experts=args.dequantize_experts,
        )
        t1 = time.perf_counter()
        save_orbax(model, args.out_dir, tokenizer_dir=args.hf_dir, overwrite=args.overwrite)
        t2 = time.perf_counter()
    except (ConfigError, CheckpointError, FileExistsError, NotImplementedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    arrays = named_arrays(model)
    nbytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in arrays.values())
    result = {
        "hf_dir": str(args.hf_dir),
        "out_dir": str(args.out_dir),
        "dtype": str(jax.numpy.dtype(model.model.embed_tokens.weight[...].dtype)),
        "arrays": len(arrays),
        "bytes": nbytes,
        "layout": report.get("layout"),
        "expert_quant": report.get("expert_quant"),
        "skipped": report.get("skipped", 0),
        "skipped_summary": report.get("skipped_summary", {}),
        "load_s": round(t1 - t0, 3),
        "save_s": round(t2 - t1, 3),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"wrote {args.out_dir}: {len(arrays)} arrays, {fmt_bytes(nbytes)} ({result['dtype']}); "
            f"load {result['load_s']:.2f} s, save {result['save_s']:.2f} s"
        )
        if result["skipped"]:
            parts = ", ".join(f"{k} {v}" for k, v in result["skipped_summary"].items())
            print(f"skipped {result['skipped']} tensors outside the text model ({parts})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint directory to an Orbax one", description=run.__doc__
    )
    p.add_argument(
        "hf_dir", help="Hugging Face Kimi Linear or released Kimi K3 directory (config.json + *.safetensors)"
    )
    p.add_argument("out_dir", help="output directory (must not exist or be empty unless --overwrite)")
    p.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="parameter dtype to store (default auto: the checkpoint's; fp32 parts stay fp32)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace the parameters in a non-empty OUT_DIR")
    add_dequantize_experts_arg(p)
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)
