"""One process of the multi-process engine test (tests/test_multihost_engine.py); not collected by pytest.

Joins a process group on localhost, puts the `tiny` model (seed-0 weights) on a mesh over the devices
of all processes and runs `serve.engine.replicated.ReplicatedEngine`. Process 0 adds the requests of
`--schedule` (JSON: a list of {"step", "prompt", "max_tokens"}) at the engine step each names, and
aborts the ones with "abort_at_step"; followers only follow. Every process then writes the results its
own engine holds (ids, tokens, finish reasons, step count) to `--out` as JSON: they must agree.
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
    parser.add_argument("--schedule", required=True, help="JSON file: [{step, prompt, max_tokens}, ...]")
    parser.add_argument("--engine", required=True, help="JSON object of EngineConfig fields")
    parser.add_argument("--out", required=True)
    from sharding import multihost

    multihost.add_arguments(parser)
    args = parser.parse_args()
    multihost.set_cpu_device_count(args.local_devices)

    import time

    import jax

    t0 = time.perf_counter()
    jax.config.update("jax_default_matmul_precision", "highest")
    assert multihost.initialize(multihost.MultihostSettings.from_flags(vars(args)))

    from flax import nnx

    from jaxhybrid.config import load_config
    from jaxhybrid.model import HybridLM
    from serve.engine.engine import Engine, EngineConfig
    from serve.engine.replicated import ReplicatedEngine, check_engine_config
    from serve.engine.sampling import SamplingParams
    from sharding.mesh import make_mesh
    from sharding.placement import shard_model

    mesh = make_mesh(args.mesh)
    assert len({d.process_index for d in mesh.devices.reshape(-1)}) == args.num_processes
    model = shard_model(HybridLM(load_config("tiny"), rngs=nnx.Rngs(0)), mesh)
    config = check_engine_config(EngineConfig(**json.loads(args.engine)))
    rep = ReplicatedEngine(Engine(model, config, mesh=mesh))
    t_ready = time.perf_counter()
    schedule = json.loads(Path(args.schedule).read_text())
    if rep.is_leader:
        ids: dict[int, str] = {}
        step = 0
        while step <= max(s["step"] for s in schedule) or rep.has_unfinished():
            for i, s in enumerate(schedule):
                if s["step"] == step:
                    params = SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=True)
                    ids[i] = rep.add_request(s["prompt"], params, request_id=f"s{i}")
                if s.get("abort_at_step") == step:
                    rep.abort(ids[i])
            rep.step()
            step += 1
        rep.close()
        rep.step()
    else:
        rep.follow()
    engine = rep.engine
    results = {
        rid: {"tokens": r.generated, "finish_reason": r.finish_reason, "prompt": r.prompt}
        for rid, r in engine.requests.items()
    }
    times = {"setup_s": t_ready - t0, "serve_s": time.perf_counter() - t_ready}
    out = {"steps": engine.steps, "results": results, "times": times, "broadcast_bytes": rep.broadcast_bytes}
    Path(args.out).write_text(json.dumps(out))
    multihost.shutdown()


if __name__ == "__main__":
    main()
