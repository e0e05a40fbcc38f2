"""One process of the multi-process test (tests/test_sharding_multihost.py); not collected by pytest.

Joins a process group on localhost, builds a mesh over the devices of all processes, creates the model
directly in its shardings (or restores it from an Orbax checkpoint onto that mesh, or loads a model
directory straight into its shardings), runs a forward pass
(expert parallel across the processes) and writes the (replicated) logits to `--out` as .npy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local-devices", type=int, required=True)
    parser.add_argument("--mesh", required=True)
    parser.add_argument("--config", default="tiny", help="config name or path (YAML / HF config.json)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default=None, help="restore parameters from this Orbax checkpoint")
    parser.add_argument("--hf", default=None, help="load this model directory with load_pretrained_on_mesh")
    parser.add_argument("--report", default=None, help="with --hf: write the loader's report here (JSON)")
    from sharding import multihost

    multihost.add_arguments(parser)
    args = parser.parse_args()
    multihost.set_cpu_device_count(args.local_devices)

    import jax
    import numpy as np
    from flax import nnx

    jax.config.update("jax_default_matmul_precision", "highest")
    assert multihost.initialize(multihost.MultihostSettings.from_flags(vars(args)))

    from jaxhybrid.config import load_config
    from sharding.mesh import make_mesh
    from sharding.placement import create_sharded_model, load_sharded_model
    from sharding.rules import batch_sharding, replicated

    mesh = make_mesh(args.mesh)
    assert jax.process_count() == args.num_processes
    assert len({d.process_index for d in mesh.devices.reshape(-1)}) == args.num_processes
    cfg = load_config(args.config)
    if args.hf:
        from sharding.placement import load_pretrained_on_mesh

        report: dict = {}
        model = load_pretrained_on_mesh(args.hf, mesh, progress=False, report=report)
        cfg = model.config
        Path(args.report).write_text(json.dumps(report))
    elif args.checkpoint:
        model = load_sharded_model(args.checkpoint, cfg, mesh)
    else:
        model = create_sharded_model(cfg, mesh, seed=0)
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, args.length), dtype=np.int32)
    tokens = jax.make_array_from_callback(
        tokens.shape, batch_sharding(mesh, tokens.shape), lambda i: tokens[i]
    )
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t), out_shardings=replicated(mesh))
    logits = forward(state, tokens)
    np.save(args.out, np.asarray(logits.addressable_shards[0].data))
    multihost.shutdown(timeout=30)  # outputs written: a slow barrier at exit costs the test nothing


if __name__ == "__main__":
    main()
