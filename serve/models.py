"""Model loading shared by the commands and the benchmarks: `--model` / `--config` / the shipped model, in
the dtype `serving_dtype` resolves, read straight into the `--mesh`'s shardings when one is given."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxhybrid.assets import shipped_model_dir
from jaxhybrid.cache import CHECKPOINT_DTYPES
from jaxhybrid.config import load_config
from jaxhybrid.model import HybridLM
from jaxhybrid.weights import CheckpointError, checkpoint_format, load_pretrained, stored_dtype
from jaxhybrid.weights.pages import move_to_huge_pages
from sharding.mesh import mesh_from_flag
from sharding.placement import load_pretrained_on_mesh, shard_model

log = logging.getLogger("jaxhybrid.models")

RANDOM_WEIGHTS_DTYPE = "float32"  # the model's own default, for --config random weights
DTYPE_HELP = (
    "weights and KV-cache dtype (default: the checkpoint's own dtype for --model, float32 for --config "
    "random weights)"
)


class UsageError(ValueError):
    """Bad command-line input; printed as `error: ...` with exit status 2."""


def add_dequantize_experts_arg(p: Any) -> None:
    """`--dequantize-experts`, for every command that loads a model (`ModelSettings.dequantize_experts`)."""
    p.add_argument(
        "--dequantize-experts",
        action="store_true",
        help="hold MXFP4 routed experts dequantized (3.6x their bytes at bf16) instead of packed",
    )


def add_weight_dtype_arg(p: Any) -> None:
    """`--weight-dtype`, for the commands that serve or benchmark a model on one device
    (`ModelSettings.weight_dtype`)."""
    p.add_argument(
        "--weight-dtype",
        choices=["int8"],
        help="hold the linear layers' and dense experts' weights as int8 with a float32 scale per output "
        "channel (weight-only: activations and the KV cache keep --dtype; on the CPU a kernel reads the "
        "codes directly); one device only",
    )


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """The weights (and KV-cache) dtype a command uses, and why."""

    dtype: str  # numpy name: float32, bfloat16, ...
    reason: str

    def describe(self) -> str:
        return f"{self.dtype} ({self.reason})"


def add_checkpoint_dtype_arg(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--checkpoint-dtype",
        choices=CHECKPOINT_DTYPES,
        default="float32",
        help="precision of the KDA state (and conv window) in prefix-store checkpoints, in every tier: "
        "float32 resumes exactly (default); bfloat16 halves a checkpoint's recurrent state and rounds it "
        "once on resume (docs/benchmarks.md: 'Checkpoints in bfloat16' says what that changes)",
    )


def checkpoint_dir(source: str | None) -> Path | None:
    """The checkpoint directory `source` names (a directory with weights, or its config.json), else None."""
    if not source:
        return None
    path = Path(source)
    path = path.parent if path.name == "config.json" else path
    if not path.is_dir():
        return None

    try:
        checkpoint_format(path)
    except CheckpointError:
        return None
    return path


# Checkpoint dtypes served in float32 on a CPU: XLA:CPU's bfloat16 / float16 products are far slower than
# its float32 ones (docs/benchmarks.md, "The shipped model: float32 against bf16 on a CPU"), and float32
# greedy tokens do not depend on the batch they run in.
WIDENED_ON_CPU = ("bfloat16", "float16")
CPU_MEMORY_SHARE = 0.5  # a widened checkpoint's float32 bytes may take at most this share of the memory


def serving_dtype(
    requested: str | None, model_dir: str | Path | None, backend: str | None = None
) -> DtypeChoice:
    """What `serve` / `generate` allocate: `--dtype` when given; else a checkpoint's own dtype (its embedding
    table's, as `load_pretrained(dtype=None)` loads it), but a bfloat16 / float16 one in float32 on a CPU
    when that fits in half of the machine's memory (`backend`: JAX's default backend; `guess_backend`'s
    guess, which starts no runtime, when not given); else float32 for random weights (`--config`)."""
    if requested:
        return DtypeChoice(requested, "--dtype")
    if model_dir is None:
        return DtypeChoice(RANDOM_WEIGHTS_DTYPE, "random weights: the model's default")

    stored = stored_dtype(model_dir)
    if stored.name not in WIDENED_ON_CPU or (backend or guess_backend()) != "cpu":
        return DtypeChoice(stored.name, "the checkpoint's dtype")
    widened = checkpoint_file_bytes(model_dir) * 4 // stored.itemsize
    memory = physical_memory()
    if widened > CPU_MEMORY_SHARE * memory:
        return DtypeChoice(
            stored.name,
            f"the checkpoint's dtype: in float32 it would take {widened / 2**30:.1f} GiB, over half of this "
            f"machine's {memory / 2**30:.1f} GiB",
        )
    return DtypeChoice(
        "float32",
        f"a {stored.name} checkpoint on the CPU, where XLA's {stored.name} products are slower than "
        f"float32's; --dtype {stored.name} keeps it",
    )


def guess_backend() -> str:
    """The backend JAX will run on, without starting an accelerator's runtime to ask (`info` and `memory` may
    run beside a server that holds the accelerator): JAX_PLATFORMS when set; else "cpu" unless an
    accelerator plugin (a `jax_plugins` entry point or module) is installed, or libtpu on a host with TPU
    chips."""
    import importlib.metadata
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower()
    plugins = list(importlib.metadata.entry_points(group="jax_plugins"))
    installed = plugins or importlib.util.find_spec("jax_plugins") is not None
    # libtpu alone is no TPU: it is also installed to compile for TPU topologies on a CPU-only host
    tpu = importlib.util.find_spec("libtpu") is not None and tpu_devices_present()
    return "accelerator" if installed or tpu else "cpu"


def tpu_devices_present() -> bool:
    """Whether this host has TPU chips: their device files (/dev/accel* on v4 and v5e hosts, /dev/vfio/N on
    later ones)."""
    import glob

    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def checkpoint_file_bytes(directory: str | Path) -> int:
    """Bytes of the files of a checkpoint directory (its weights, at their stored dtypes)."""
    return sum(f.stat().st_size for f in Path(directory).rglob("*") if f.is_file())


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """The model a command loads, as its flags give it: a checkpoint directory (`model`, --model) or a
    config's random weights (`config`, --config, from `seed`), in `dtype` (None: `serving_dtype` decides),
    MXFP4 experts held dense or packed, weights int8 or not, over the `mesh` (--mesh) or one device.
    `resolve_model` fills in what was left to choose; `dtype_reason` then says why `dtype`."""

    model: str | None = None
    config: str | None = None
    dtype: str | None = None
    seed: int = 0
    dequantize_experts: bool = False
    weight_dtype: str | None = None  # "int8": linear weights held as int8 codes with a scale per channel
    mesh: str | None = None
    dtype_reason: str | None = None  # set by `resolve_model`

    FLAGS = ("model", "config", "dtype", "seed", "dequantize_experts", "weight_dtype", "mesh")

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> ModelSettings:
        """The settings of a command's parsed flags (`vars(args)`, read at the CLI's edge); a flag the command
        does not have keeps the field's default."""
        return cls(**{k: flags[k] for k in cls.FLAGS if flags.get(k) is not None})


def resolve_model(settings: ModelSettings) -> ModelSettings:
    """`settings` with its choices made: the shipped model when neither a model nor a config is given (its
    tokenizer is then used), and the `serving_dtype` with its reason (the engine's KV dtype follows it).
    Settings already resolved are returned as they are."""
    if settings.dtype_reason is not None:
        return settings
    model = settings.model
    if not model and not settings.config and shipped_model_dir() is not None:
        model = str(shipped_model_dir())
    if model and settings.config:
        raise UsageError("give either --model DIR or --config NAME, not both")
    import jax  # (after a multi-process server started JAX's distributed runtime: the backend is known)

    choice = serving_dtype(settings.dtype, model, jax.default_backend() if model else None)
    log.debug("weights and KV cache in %s", choice.describe())
    return dataclasses.replace(settings, model=model, dtype=choice.dtype, dtype_reason=choice.reason)


def load_model(settings: ModelSettings) -> Any:
    """The model `settings` name (random weights from their seed for a config), in the `serving_dtype`;
    with neither a model nor a config, the shipped model (`jaxhybrid.assets`)."""
    return _build(resolve_model(settings))


def _build(settings: ModelSettings) -> Any:
    import jax.numpy as jnp
    from flax import nnx

    dq = settings.dequantize_experts
    if settings.model:
        # a bar on a terminal, log lines otherwise, once the load takes a few seconds
        model = load_pretrained(
            settings.model, dtype=jnp.dtype(settings.dtype), progress=None, dequantize_experts=dq
        )
    else:
        cfg = load_config(settings.config or "tiny")
        model = HybridLM(
            cfg, rngs=nnx.Rngs(settings.seed), dtype=jnp.dtype(settings.dtype), dequantize_experts=dq
        )
    if settings.weight_dtype == "int8":
        model.to_int8()
        log.info("weights: int8 codes with a float32 scale per output channel")
    # a decode step streams every weight: on the CPU it reads them faster from 2 MB pages (same values)
    move_to_huge_pages(model)
    return model


def make_mesh(spec: str | None) -> Any:
    """The `--mesh` device mesh (None when unset or one device); MeshSpecError names what does not fit."""
    if spec is None or not spec.strip():
        return None

    mesh = mesh_from_flag(spec)
    return None if mesh.devices.size == 1 else mesh


def load_on_mesh(settings: ModelSettings, multi: bool) -> tuple[Any, Any]:
    """(the model of `load_model`, the settings' mesh or None), its parameters sharded over the mesh, expert
    parallelism installed where the expert axis divides the experts. A checkpoint is read straight into the
    shardings (each process reads only its own devices' shards); a config's random weights are created on
    one device and then sharded. Several processes (`multi`) need a mesh over the devices of all of them."""
    mesh = make_mesh(settings.mesh)
    if mesh is not None and settings.weight_dtype == "int8":
        raise UsageError("--weight-dtype int8 runs on one device; drop --mesh")
    if multi and mesh is None:
        raise UsageError(
            "several processes need --mesh over the devices of all of them "
            "(e.g. --mesh data=2,expert=2,tensor=2)"
        )
    settings = resolve_model(settings)
    if mesh is None:
        return _build(settings), None
    if settings.model:
        import jax.numpy as jnp

        report: dict[str, Any] = {}
        model = load_pretrained_on_mesh(
            settings.model,
            mesh,
            jnp.dtype(settings.dtype),
            progress=None,
            report=report,
            dequantize_experts=settings.dequantize_experts,
        )
        if "read_bytes" in report:
            log.info("read %d checkpoint bytes: this process's shards", report["read_bytes"])
        return model, mesh

    return shard_model(_build(settings), mesh), mesh
