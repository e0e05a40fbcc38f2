"""Model configuration: one dataclass, read from our YAML files or a Hugging Face `config.json`.

Our YAML files use the Hugging Face key names (including the nested `linear_attn_config` with
1-indexed layer lists), so one parser serves both sources. YAML is strict (an unknown key is an
error); a Hugging Face file may carry keys we do not use, which are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """An invalid or inconsistent model config; the message names the field."""


# Hugging Face alias -> our field name.
ALIASES: dict[str, str] = {
    "num_local_experts": "num_experts",
    "n_routed_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "n_group": "num_expert_group",
    "norm_topk_prob": "moe_renormalize",
    "model_max_length": "max_position_embeddings",
}

# Keys of `linear_attn_config` -> our field name.
LINEAR_ATTN_KEYS: dict[str, str] = {
    "kda_layers": "kda_layers",
    "full_attn_layers": "full_attn_layers",
    "num_heads": "kda_num_heads",
    "head_dim": "kda_head_dim",
    "short_conv_kernel_size": "short_conv_kernel_size",
    "gate_lower_bound": "gate_lower_bound",
    "use_full_rank_gate": "use_full_rank_gate",
}

# Fields this codebase does not implement yet (value that means "off"): multi-token prediction layers.
UNIMPLEMENTED_DEFAULTS: dict[str, Any] = {
    "num_nextn_predict_layers": 0,
}

# compressed-tensors formats of quantized routed experts -> `ModelConfig.expert_quant`.
QUANT_FORMATS: dict[str, str] = {"mxfp4-pack-quantized": "mxfp4"}
QUANT_GROUP_SIZE: dict[str, int] = {"mxfp4": 32}

# Hugging Face keys that are known and either irrelevant here or checked for their only supported value.
FIXED_VALUES: dict[str, Any] = {
    "mla_use_nope": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
}
IGNORED_HF_KEYS = {
    "model_type",
    "architectures",
    "auto_map",
    "rope_theta",
    "rope_scaling",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "num_key_value_heads",
    "head_dim",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "use_grouped_topk",
    "attention_dropout",
    "vision_config",
    "text_config",
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Kimi Linear family model. Layer lists are 1-indexed, as in the checkpoint."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    kda_layers: tuple[int, ...]
    full_attn_layers: tuple[int, ...]
    # KDA
    kda_num_heads: int
    kda_head_dim: int
    short_conv_kernel_size: int = 4
    gate_lower_bound: float | None = None
    use_full_rank_gate: bool = False  # K3: output gate g_proj [H*d, hidden] instead of g_a_proj/g_b_proj
    kda_a_log_size: int | None = None  # K3: A_log stored with this many entries (first H used); None = H
    # MLA
    num_attention_heads: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    mla_lora_norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (not rms_norm_eps)
    mla_use_output_gate: bool = False  # K3: o * sigmoid(g_proj(x)) before o_proj
    # MoE
    num_experts: int = 0
    num_experts_per_token: int = 1
    num_shared_experts: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = 1
    topk_group: int = 1
    routed_expert_hidden_size: int | None = None  # K3 latent MoE: routed experts run in this width
    latent_moe_use_norm: bool = False  # K3: RMSNorm of the combined latent before routed_expert_up_proj
    expert_quant: str | None = None  # checkpoint storage of the routed experts: None (dense) or "mxfp4"
    # gated MLPs (dense, shared and routed experts)
    hidden_act: str = "silu"  # "silu" or "situ" (K3)
    activation_situ_beta: float | None = None  # SiTU gate cap (1.0 when None)
    activation_situ_linear_beta: float | None = None  # SiTU up cap (no cap when None)
    # residual stream
    attn_res_block_size: int | None = None  # K3 attention residuals: a new block every this many layers
    # misc
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    name: str = "custom"
    # Fields set to a value this codebase cannot run yet (multi-token prediction): {field: value}.
    unimplemented: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        validate(self)

    # --- derived ---------------------------------------------------------------------------------
    @property
    def layer_types(self) -> tuple[str, ...]:
        """'kda' or 'mla' for each layer, 0-indexed."""
        mla = set(self.full_attn_layers)
        return tuple("mla" if i + 1 in mla else "kda" for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether 0-indexed `layer` has a MoE feed-forward (else a dense SwiGLU)."""
        return layer >= self.first_k_dense_replace

    @property
    def num_kda_layers(self) -> int:
        return len(self.kda_layers)

    @property
    def num_mla_layers(self) -> int:
        return len(self.full_attn_layers)

    @property
    def num_moe_layers(self) -> int:
        return max(0, self.num_hidden_layers - self.first_k_dense_replace)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per MLA layer in the cache: kv_lora_rank + rope dims."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_proj_dim(self) -> int:
        return self.kda_num_heads * self.kda_head_dim

    @property
    def a_log_size(self) -> int:
        """Entries of each KDA layer's stored A_log (the first kda_num_heads are used)."""
        return self.kda_a_log_size if self.kda_a_log_size is not None else self.kda_num_heads

    @property
    def expert_dim(self) -> int:
        """Input/output width of the routed experts: the latent width (K3) or the hidden size."""
        return self.routed_expert_hidden_size or self.hidden_size

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config as a Hugging Face style dict (round-trips through `from_dict`)."""
        out: dict[str, Any] = {}
        inverse = {v: k for k, v in LINEAR_ATTN_KEYS.items()}
        lin: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "unimplemented":
                out.update(dict(value))
            elif f.name in inverse:
                lin[inverse[f.name]] = list(value) if isinstance(value, tuple) else value
            else:
                out[f.name] = value
        out["linear_attn_config"] = lin
        return out


_INT_FIELDS = {f.name for f in dataclasses.fields(ModelConfig) if f.type in ("int", "int | None")}


def validate(cfg: ModelConfig) -> None:
    """Raise ConfigError naming the first invalid or inconsistent field."""

    def need(cond: bool, fld: str, msg: str) -> None:
        if not cond:
            raise ConfigError(f"config field '{fld}': {msg} (config '{cfg.name}')")

    for fld in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "kda_num_heads",
        "kda_head_dim",
        "num_attention_heads",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "v_head_dim",
        "max_position_embeddings",
    ):
        value = getattr(cfg, fld)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value > 0,
            fld,
            f"must be a positive integer, got {value!r}",
        )
    for fld in (
        "qk_rope_head_dim",
        "num_experts",
        "num_shared_experts",
        "moe_intermediate_size",
        "first_k_dense_replace",
    ):
        value = getattr(cfg, fld)
        need(
            isinstance(value, int) and not isinstance(value, bool) and value >= 0,
            fld,
            f"must be a non-negative integer, got {value!r}",
        )
    need(
        cfg.q_lora_rank is None or (isinstance(cfg.q_lora_rank, int) and cfg.q_lora_rank > 0),
        "q_lora_rank",
        f"must be null or a positive integer, got {cfg.q_lora_rank!r}",
    )
    need(
        isinstance(cfg.short_conv_kernel_size, int) and cfg.short_conv_kernel_size >= 2,
        "linear_attn_config.short_conv_kernel_size",
        f"must be an integer >= 2, got {cfg.short_conv_kernel_size!r}",
    )
    need(
        cfg.gate_lower_bound is None or float(cfg.gate_lower_bound) < 0,
        "linear_attn_config.gate_lower_bound",
        f"must be null or negative, got {cfg.gate_lower_bound!r}",
    )
    for fld in ("rms_norm_eps", "mla_lora_norm_eps"):
        value = getattr(cfg, fld)
        need(
            isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
            fld,
            f"must be positive, got {value!r}",
        )
    need(
        cfg.hidden_act in ("silu", "situ"), "hidden_act", f"must be 'silu' or 'situ', got {cfg.hidden_act!r}"
    )
    for fld in ("activation_situ_beta", "activation_situ_linear_beta"):
        value = getattr(cfg, fld)
        need(
            value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0),
            fld,
            f"must be null or positive, got {value!r}",
        )
    for fld in ("attn_res_block_size", "routed_expert_hidden_size", "kda_a_log_size"):
        value = getattr(cfg, fld)
        need(
            value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
            fld,
            f"must be null or a positive integer, got {value!r}",
        )
    for fld in ("use_full_rank_gate", "mla_use_output_gate", "latent_moe_use_norm"):
        need(isinstance(getattr(cfg, fld), bool), fld, f"must be true or false, got {getattr(cfg, fld)!r}")
    need(
        cfg.kda_a_log_size is None or cfg.kda_a_log_size >= cfg.kda_num_heads,
        "kda_a_log_size",
        f"must be >= linear_attn_config.num_heads={cfg.kda_num_heads}, got {cfg.kda_a_log_size!r}",
    )
    need(
        not cfg.latent_moe_use_norm or cfg.routed_expert_hidden_size is not None,
        "latent_moe_use_norm",
        "needs routed_expert_hidden_size (the latent the norm acts on)",
    )
    need(
        cfg.expert_quant is None or cfg.expert_quant in QUANT_GROUP_SIZE,
        "expert_quant",
        f"must be null or one of {sorted(QUANT_GROUP_SIZE)}, got {cfg.expert_quant!r}",
    )

    n = cfg.num_hidden_layers
    seen: dict[int, str] = {}
    for fld, layers in (("kda_layers", cfg.kda_layers), ("full_attn_layers", cfg.full_attn_layers)):
        for layer in layers:
            need(
                isinstance(layer, int) and 1 <= layer <= n,
                f"linear_attn_config.{fld}",
                f"layer {layer!r} is outside 1..num_hidden_layers={n} (the lists are 1-indexed)",
            )
            need(
                layer not in seen,
                f"linear_attn_config.{fld}",
                f"layer {layer} is listed twice" + (f" (also in {seen[layer]})" if layer in seen else ""),
            )
            seen[layer] = fld
    missing = sorted(set(range(1, n + 1)) - set(seen))
    need(
        not missing,
        "linear_attn_config.kda_layers",
        f"layers {missing} are in neither kda_layers nor full_attn_layers",
    )

    need(
        cfg.first_k_dense_replace <= n,
        "first_k_dense_replace",
        f"must be <= num_hidden_layers={n}, got {cfg.first_k_dense_replace}",
    )
    if cfg.num_moe_layers > 0:
        need(cfg.num_experts > 0, "num_experts", "must be positive when any layer is MoE")
        need(cfg.moe_intermediate_size > 0, "moe_intermediate_size", "must be positive when any layer is MoE")
        need(
            1 <= cfg.num_experts_per_token <= cfg.num_experts,
            "num_experts_per_token",
            f"must be in 1..num_experts={cfg.num_experts}, got {cfg.num_experts_per_token}",
        )
        need(
            cfg.num_expert_group >= 1 and cfg.num_experts % cfg.num_expert_group == 0,
            "num_expert_group",
            f"must divide num_experts={cfg.num_experts}, got {cfg.num_expert_group}",
        )
        need(
            1 <= cfg.topk_group <= cfg.num_expert_group,
            "topk_group",
            f"must be in 1..num_expert_group={cfg.num_expert_group}, got {cfg.topk_group}",
        )
        per_group = cfg.num_experts // cfg.num_expert_group
        need(
            cfg.num_expert_group == 1 or per_group >= 2,
            "num_expert_group",
            "groups are scored by their top-2 experts, so each group needs at least 2 experts",
        )
        need(
            cfg.num_experts_per_token <= cfg.topk_group * per_group,
            "num_experts_per_token",
            f"{cfg.num_experts_per_token} exceeds the {cfg.topk_group * per_group} in the kept groups",
        )
        if cfg.expert_quant is not None:
            group = QUANT_GROUP_SIZE[cfg.expert_quant]
            for fld, width in (
                ("moe_intermediate_size", cfg.moe_intermediate_size),
                (
                    "routed_expert_hidden_size" if cfg.routed_expert_hidden_size else "hidden_size",
                    cfg.expert_dim,
                ),
            ):
                need(
                    width % group == 0,
                    fld,
                    f"must be a multiple of {group} for {cfg.expert_quant} routed experts, got {width}",
                )
    need(cfg.vocab_size >= 2, "vocab_size", "must be at least 2")
    for tok in ("bos_token_id", "eos_token_id"):
        value = getattr(cfg, tok)
        need(
            value is None or (isinstance(value, int) and 0 <= value < cfg.vocab_size),
            tok,
            f"must be null or a token id in 0..vocab_size-1, got {value!r}",
        )


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def parse_quantization_config(qc: Any, name: str = "custom") -> str | None:
    """`expert_quant` from a checkpoint's `quantization_config` (compressed-tensors), or None.

    The format may sit at the top level or under `config_groups.<group>.format`; only the routed experts
    are quantized. Anything but a supported format (mxfp4-pack-quantized, group size 32) is an error, since
    the weights could not be read."""
    if qc is None:
        return None
    field = "quantization_config"
    if not isinstance(qc, Mapping):
        raise ConfigError(f"config field '{field}' must be a mapping (config '{name}')")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"config field '{field}.quant_method': only 'compressed-tensors' is supported, got {method!r} "
            f"(config '{name}')"
        )
    formats: list[Any] = [qc["format"]] if qc.get("format") not in (None, "mixed-precision") else []
    group_sizes: list[Any] = [qc["group_size"]] if "group_size" in qc else []
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ConfigError(f"config field '{field}.config_groups' must be a mapping (config '{name}')")
    for group in groups.values():
        if isinstance(group, Mapping):
            if group.get("format") is not None:
                formats.append(group["format"])
            weights = group.get("weights")
            if isinstance(weights, Mapping) and weights.get("group_size") is not None:
                group_sizes.append(weights["group_size"])
    kind = next((QUANT_FORMATS[f] for f in formats if f in QUANT_FORMATS), None)
    if kind is None:
        raise ConfigError(
            f"config field '{field}.format': supported formats are {sorted(QUANT_FORMATS)}, got "
            f"{formats or 'none'} (config '{name}')"
        )
    bad = [g for g in group_sizes if g != QUANT_GROUP_SIZE[kind]]
    if bad:
        raise ConfigError(
            f"config field '{field}': {kind} needs group size {QUANT_GROUP_SIZE[kind]}, got {bad[0]!r} "
            f"(config '{name}')"
        )
    return kind


def from_dict(raw: Mapping[str, Any], *, strict: bool, name: str = "custom") -> ModelConfig:
    """Build a config from a Hugging Face style dict (`strict`: unknown keys are errors).

    A multimodal wrapper (Kimi K3) keeps the text model under `text_config`; its `quantization_config` may
    sit inside text_config or at the top level and becomes `expert_quant`."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config '{name}' must be a mapping, got {type(raw).__name__}")
    quant_config = raw.get("quantization_config")
    if "text_config" in raw and isinstance(raw["text_config"], Mapping):
        merged = dict(raw["text_config"])
        merged.setdefault("name", raw.get("name", name))
        quant_config = merged.get("quantization_config", quant_config)
        raw = merged
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    kw: dict[str, Any] = {"name": raw.get("name", name)}
    unimpl: dict[str, Any] = {}
    for key, value in raw.items():
        if key in ("name", "quantization_config"):
            continue
        if key == "linear_attn_config":
            if not isinstance(value, Mapping):
                raise ConfigError(f"config field 'linear_attn_config' must be a mapping (config '{name}')")
            for sub, sub_value in value.items():
                if sub in LINEAR_ATTN_KEYS:
                    target = LINEAR_ATTN_KEYS[sub]
                    kw[target] = tuple(sub_value) if isinstance(sub_value, list) else sub_value
                elif sub in UNIMPLEMENTED_DEFAULTS:
                    if sub_value != UNIMPLEMENTED_DEFAULTS[sub]:
                        unimpl[sub] = sub_value
                elif sub == "kda_layer_index_base" and sub_value not in (1, None):
                    raise ConfigError(
                        f"config field 'linear_attn_config.kda_layer_index_base': only 1 "
                        f"(1-indexed lists) is supported, got {sub_value!r}"
                    )
                elif strict and sub != "kda_layer_index_base":
                    raise ConfigError(f"config field 'linear_attn_config.{sub}' is unknown (config '{name}')")
            continue
        target = ALIASES.get(key, key)
        if target in ("bos_token_id", "eos_token_id"):
            kw[target] = _first_id(value)
        elif target in UNIMPLEMENTED_DEFAULTS:
            if value != UNIMPLEMENTED_DEFAULTS[target]:
                unimpl[target] = value
        elif target in FIXED_VALUES:
            if value != FIXED_VALUES[target]:
                raise ConfigError(
                    f"config field '{key}': only {FIXED_VALUES[target]!r} is supported, "
                    f"got {value!r} (config '{name}')"
                )
        elif target == "unimplemented" and isinstance(value, Mapping):
            unimpl.update(value)
        elif target in fields:
            if target in kw and key != target:
                raise ConfigError(f"config field '{target}' is given twice (also as alias '{key}')")
            kw[target] = value
        elif strict and key not in IGNORED_HF_KEYS:
            raise ConfigError(f"config field '{key}' is unknown (config '{name}')")
    for req in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "intermediate_size",
        "kda_layers",
        "full_attn_layers",
        "kda_num_heads",
        "kda_head_dim",
    ):
        if req not in kw:
            label = next((f"linear_attn_config.{k}" for k, v in LINEAR_ATTN_KEYS.items() if v == req), req)
            raise ConfigError(f"config field '{label}' is required (config '{name}')")
    for key, value in list(kw.items()):
        if key in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            kw[key] = int(value)
    if quant_config is not None:
        parsed = parse_quantization_config(quant_config, kw["name"])
        if kw.get("expert_quant") not in (None, parsed):
            raise ConfigError(
                f"config field 'expert_quant' ({kw['expert_quant']!r}) disagrees with quantization_config "
                f"({parsed!r}) (config '{kw['name']}')"
            )
        kw["expert_quant"] = parsed
    kw["unimplemented"] = tuple(sorted(unimpl.items()))
    try:
        return ModelConfig(**kw)
    except TypeError as exc:  # a wrongly typed value that the dataclass itself rejects
        raise ConfigError(f"config '{name}': {exc}") from exc


def configs_dir() -> Path:
    """Where named configs live: $JAXHYBRID_CONFIGS or the package's `jaxhybrid/configs/` (package data: a
    wheel or a non-editable install has them too)."""
    env = os.environ.get("JAXHYBRID_CONFIGS")
    return Path(env) if env else Path(__file__).resolve().parent / "configs"


def available_configs() -> list[str]:
    return sorted(p.stem for p in configs_dir().glob("*.yaml"))


def load_config(spec: str | os.PathLike[str]) -> ModelConfig:
    """A config by name (`jaxhybrid/configs/NAME.yaml`), YAML path, HF `config.json` path, or a model
    directory."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").exists():
        path = path / "config.json"
    if not path.exists():
        named = configs_dir() / f"{spec}.yaml"
        if not named.exists():
            raise ConfigError(
                f"no config named '{spec}' (available: {', '.join(available_configs())}) and no such file"
            )
        path = named
    text = path.read_text()
    if path.suffix == ".json":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
        return from_dict(raw, strict=False, name=path.parent.name or "custom")
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return from_dict(raw, strict=True, name=path.stem)
