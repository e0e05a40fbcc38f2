"""What an int8-weight product costs on this CPU, by formulation, against the float32 product XLA runs.

For `small`'s matrix shapes (lm_head, the dense MLP's two, one expert's) and decode-sized row counts it times,
in one process, interleaved: XLA's float32 product; XLA with int8 weights converted in the product (what
`x @ q.astype(f32).T * scale` compiles to: XLA:CPU fuses the convert into a loop without vectors); XLA's
multiply-and-sum form (`sum(q * x, -1) * scale`, which reads the int8 bytes but no faster than the float32
product reads four times as many); and `jaxhybrid.ops.int8.matmul` (the CPU kernel up to KERNEL_ROWS rows,
the blocked product past them). Prints JSON and a table: milliseconds and the GB/s of weight bytes read.

    python -m benchmarks int8-products
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxhybrid.ops import int8
from jaxhybrid.ops.native import int8_kernel

SHAPES = {"lm_head": (32000, 1024), "mlp up": (2816, 1024), "mlp down": (1024, 2816), "expert": (512, 1024)}


def timed(fn, args, repeats: int) -> float:
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(5):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t0) / 5)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="1,4,16", help="rows of x (default 1,4,16)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    forms = {
        "xla_f32": (jax.jit(lambda x, w, q, s: x @ w.T), 4),
        "xla_int8_convert": (jax.jit(lambda x, w, q, s: (x @ q.astype(jnp.float32).T) * s), 1),
        "xla_int8_mul_sum": (
            jax.jit(lambda x, w, q, s: jnp.sum(q.astype(jnp.float32)[None] * x[:, None, :], -1) * s),
            1,
        ),
        "jaxhybrid_int8": (jax.jit(lambda x, w, q, s: int8.matmul(x, int8.Int8(q, s))), 1),
    }
    rng = np.random.default_rng(0)
    rows = []
    for name, (out, cols) in SHAPES.items():
        w = jnp.asarray(rng.standard_normal((out, cols), dtype=np.float32))
        q = int8.quantize(w)
        for m in (int(r) for r in args.rows.split(",")):
            x = jnp.asarray(rng.standard_normal((m, cols), dtype=np.float32))
            row = {"matrix": name, "shape": f"{out}x{cols}", "rows": m}
            for form, (fn, nbytes) in forms.items():
                s = timed(fn, (x, w, q.q, q.scale), args.repeats)
                row[f"{form}_ms"] = 1e3 * s
                row[f"{form}_gb_s"] = out * cols * nbytes / s / 1e9
            rows.append(row)
    result = {
        "bench": "int8_products",
        "kernel": int8_kernel(),
        "device": str(jax.devices()[0]),
        "rows": rows,
    }
    print(json.dumps(result))
    cols = ["matrix", "rows", *(f"{f}_ms" for f in forms), *(f"{f}_gb_s" for f in forms)]
    print(" | ".join(c.replace("_ms", " ms").replace("_gb_s", " GB/s") for c in cols), file=sys.stderr)
    for r in rows:
        cells = [str(r[c]) if not isinstance(r[c], float) else f"{r[c]:.2f}" for c in cols]
        print(" | ".join(cells), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
