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
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from jaxhybrid.constraints import (
    Constraint,
    Problem,
    at_least,
    below,
    boolean,
    check,
    divides,
    in_range,
    int_at_least,
    is_int,
    negative,
    non_negative_int,
    one_of,
    optional,
    positive,
    positive_int,
    rules,
    violations,
)


class ConfigError(ValueError):
    """An invalid or inconsistent model config; the message names the field, or every bad field
    (`problems`, one per field) when a config breaks several constraints."""

    def __init__(self, message: str, problems: tuple[Problem, ...] = ()):
        super().__init__(message)
        self.problems = problems

    @classmethod
    def listing(cls, name: str, problems: list[Problem]) -> ConfigError:
        """One error for all of `problems` of config `name`."""
        if len(problems) == 1:
            p = problems[0]
            return cls(f"config field '{p.field}': {p.message} (config '{name}')", tuple(problems))
        lines = "".join(f"\n  {p}" for p in problems)
        return cls(f"config '{name}' has {len(problems)} invalid fields:{lines}", tuple(problems))


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


def _moe(cfg: Any) -> bool:
    """Whether any layer has a MoE feed-forward (`ModelConfig.num_moe_layers` > 0)."""
    return cfg.num_hidden_layers > cfg.first_k_dense_replace


MOE_REFS = ("num_hidden_layers", "first_k_dense_replace")


def _quantized(cfg: Any) -> bool:
    return _moe(cfg) and cfg.expert_quant is not None


def _quant_multiple(when: Any = _quantized, refs: tuple[str, ...] = ()) -> Constraint:
    """A width the quantized routed experts' groups divide (checked where `when` holds)."""
    return check(
        lambda v, o: v % QUANT_GROUP_SIZE[o.expert_quant] == 0,
        lambda v, o: (
            f"must be a multiple of {QUANT_GROUP_SIZE[o.expert_quant]} for {o.expert_quant} routed "
            f"experts, got {v}"
        ),
        "expert_quant",
    ).only_when(when, MOE_REFS + refs)


def _layers_outside(v: Any, cfg: Any) -> list[Any]:
    return [layer for layer in v if not 1 <= layer <= cfg.num_hidden_layers]


def _twice(v: Any) -> list[Any]:
    return sorted({layer for layer in v if list(v).count(layer) > 1})


def _layer_list(key: str, across: Constraint) -> dict[str, Any]:
    """The metadata of layer list `key` of linear_attn_config: 1-indexed layer numbers, none twice, each in
    1..num_hidden_layers, and `across`, what it must be with the other list."""
    return rules(
        check(
            lambda v, _: isinstance(v, (tuple, list)) and all(is_int(x) for x in v),
            lambda v, _: f"must be a list of layer numbers, got {v!r}",
        ),
        check(lambda v, _: not _twice(v), lambda v, _: f"layers {_twice(v)} are listed twice"),
        check(
            lambda v, o: not _layers_outside(v, o),
            lambda v, o: (
                f"layers {_layers_outside(v, o)} are outside 1..num_hidden_layers="
                f"{o.num_hidden_layers} (the lists are 1-indexed)"
            ),
            "num_hidden_layers",
        ),
        across,
        label=_lin(key),
    )


def _uncovered(cfg: Any) -> list[int]:
    return sorted(set(range(1, cfg.num_hidden_layers + 1)) - set(cfg.kda_layers) - set(cfg.full_attn_layers))


def _in_both(cfg: Any) -> list[int]:
    return sorted(set(cfg.kda_layers) & set(cfg.full_attn_layers))


def _lin(key: str) -> str:
    return f"linear_attn_config.{key}"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Kimi Linear family model. Layer lists are 1-indexed, as in the checkpoint.

    Each field's metadata lists the constraints its value must meet (`jaxhybrid.constraints`); building a
    config checks them all and raises one ConfigError naming every field that breaks one."""

    vocab_size: int = field(metadata=rules(int_at_least(2)))
    hidden_size: int = field(
        metadata=rules(
            positive_int,
            _quant_multiple(
                lambda o: _quantized(o) and o.routed_expert_hidden_size is None,
                ("routed_expert_hidden_size",),
            ),
        )
    )
    num_hidden_layers: int = field(metadata=rules(positive_int))
    intermediate_size: int = field(metadata=rules(positive_int))
    kda_layers: tuple[int, ...] = field(
        metadata=_layer_list(
            "kda_layers",
            check(
                lambda v, o: not _uncovered(o),
                lambda v, o: f"layers {_uncovered(o)} are in neither kda_layers nor full_attn_layers",
                "full_attn_layers",
                "num_hidden_layers",
            ),
        )
    )
    full_attn_layers: tuple[int, ...] = field(
        metadata=_layer_list(
            "full_attn_layers",
            check(
                lambda v, o: not _in_both(o),
                lambda v, o: f"layers {_in_both(o)} are listed twice (also in kda_layers)",
                "kda_layers",
            ),
        )
    )
    # KDA
    kda_num_heads: int = field(metadata=rules(positive_int, label=_lin("num_heads")))
    kda_head_dim: int = field(metadata=rules(positive_int, label=_lin("head_dim")))
    short_conv_kernel_size: int = field(
        default=4, metadata=rules(int_at_least(2), label=_lin("short_conv_kernel_size"))
    )
    gate_lower_bound: float | None = field(
        default=None, metadata=rules(optional(negative), label=_lin("gate_lower_bound"))
    )
    # K3: output gate g_proj [H*d, hidden] instead of g_a_proj/g_b_proj
    use_full_rank_gate: bool = field(default=False, metadata=rules(boolean, label=_lin("use_full_rank_gate")))
    # K3: A_log stored with this many entries (first H used); None = H
    kda_a_log_size: int | None = field(
        default=None, metadata=rules(optional(positive_int), at_least("kda_num_heads", _lin("num_heads")))
    )
    # MLA
    num_attention_heads: int = field(default=1, metadata=rules(positive_int))
    q_lora_rank: int | None = field(default=None, metadata=rules(optional(positive_int)))
    kv_lora_rank: int = field(default=512, metadata=rules(positive_int))
    qk_nope_head_dim: int = field(default=128, metadata=rules(positive_int))
    qk_rope_head_dim: int = field(default=64, metadata=rules(non_negative_int))
    v_head_dim: int = field(default=128, metadata=rules(positive_int))
    # q_a_layernorm / kv_a_layernorm (not rms_norm_eps)
    mla_lora_norm_eps: float = field(default=1e-6, metadata=rules(positive))
    # K3: o * sigmoid(g_proj(x)) before o_proj
    mla_use_output_gate: bool = field(default=False, metadata=rules(boolean))
    # MoE
    num_experts: int = field(
        default=0,
        metadata=rules(
            non_negative_int,
            check(lambda v, _: v > 0, "must be positive when any layer is MoE").only_when(_moe, MOE_REFS),
        ),
    )
    num_experts_per_token: int = field(
        default=1,
        metadata=rules(
            positive_int,
            in_range(1, "num_experts").only_when(_moe, MOE_REFS),
            check(
                lambda v, o: v <= o.topk_group * (o.num_experts // o.num_expert_group),
                lambda v, o: (
                    f"{v} exceeds the {o.topk_group * (o.num_experts // o.num_expert_group)} experts in "
                    "the kept groups"
                ),
                "topk_group",
                "num_experts",
                "num_expert_group",
            ).only_when(_moe, MOE_REFS),
        ),
    )
    num_shared_experts: int = field(default=0, metadata=rules(non_negative_int))
    moe_intermediate_size: int = field(
        default=0,
        metadata=rules(
            non_negative_int,
            check(lambda v, _: v > 0, "must be positive when any layer is MoE").only_when(_moe, MOE_REFS),
            _quant_multiple(),
        ),
    )
    first_k_dense_replace: int = field(
        default=0,
        metadata=rules(
            non_negative_int,
            check(
                lambda v, o: v <= o.num_hidden_layers,
                "must be <= num_hidden_layers={num_hidden_layers}",
                "num_hidden_layers",
            ),
        ),
    )
    routed_scaling_factor: float = 1.0
    moe_renormalize: bool = True
    num_expert_group: int = field(
        default=1,
        metadata=rules(
            positive_int,
            divides("num_experts").only_when(_moe, MOE_REFS),
            check(
                lambda v, o: v == 1 or o.num_experts // v >= 2,
                lambda v, o: (
                    "groups are scored by their top-2 experts, so each group needs at least 2 experts, "
                    f"got {v} groups of {o.num_experts} experts"
                ),
                "num_experts",
            ).only_when(_moe, MOE_REFS),
        ),
    )
    topk_group: int = field(
        default=1, metadata=rules(positive_int, in_range(1, "num_expert_group").only_when(_moe, MOE_REFS))
    )
    # K3 latent MoE: routed experts run in this width
    routed_expert_hidden_size: int | None = field(
        default=None,
        metadata=rules(
            optional(positive_int),
            _quant_multiple(lambda o: _quantized(o) and o.routed_expert_hidden_size is not None),
        ),
    )
    # K3: RMSNorm of the combined latent before routed_expert_up_proj
    latent_moe_use_norm: bool = field(
        default=False,
        metadata=rules(
            boolean,
            check(
                lambda v, o: not v or o.routed_expert_hidden_size is not None,
                lambda v, o: "needs routed_expert_hidden_size (the latent the norm acts on)",
                "routed_expert_hidden_size",
            ),
        ),
    )
    # checkpoint storage of the routed experts: None (dense) or "mxfp4"
    expert_quant: str | None = field(default=None, metadata=rules(optional(one_of(sorted(QUANT_GROUP_SIZE)))))
    # gated MLPs (dense, shared and routed experts)
    hidden_act: str = field(default="silu", metadata=rules(one_of(("silu", "situ"))))  # "situ": K3
    # SiTU gate cap (1.0 when None)
    activation_situ_beta: float | None = field(default=None, metadata=rules(optional(positive)))
    # SiTU up cap (no cap when None)
    activation_situ_linear_beta: float | None = field(default=None, metadata=rules(optional(positive)))
    # residual stream; K3 attention residuals: a new block every this many layers
    attn_res_block_size: int | None = field(default=None, metadata=rules(optional(positive_int)))
    # misc
    rms_norm_eps: float = field(default=1e-5, metadata=rules(positive))
    tie_word_embeddings: bool = False
    max_position_embeddings: int = field(default=1048576, metadata=rules(positive_int))
    bos_token_id: int | None = field(default=None, metadata=rules(below("vocab_size", "a token id")))
    eos_token_id: int | None = field(default=None, metadata=rules(below("vocab_size", "a token id")))
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
    """Raise one ConfigError naming every field of `cfg` that breaks a constraint of its own."""
    problems = violations(ModelConfig, {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    if problems:
        raise ConfigError.listing(cfg.name, problems)


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
    key = "quantization_config"
    if not isinstance(qc, Mapping):
        raise ConfigError(f"config field '{key}' must be a mapping (config '{name}')")
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"config field '{key}.quant_method': only 'compressed-tensors' is supported, got {method!r} "
            f"(config '{name}')"
        )
    formats: list[Any] = [qc["format"]] if qc.get("format") not in (None, "mixed-precision") else []
    group_sizes: list[Any] = [qc["group_size"]] if "group_size" in qc else []
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, Mapping):
        raise ConfigError(f"config field '{key}.config_groups' must be a mapping (config '{name}')")
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
            f"config field '{key}.format': supported formats are {sorted(QUANT_FORMATS)}, got "
            f"{formats or 'none'} (config '{name}')"
        )
    bad = [g for g in group_sizes if g != QUANT_GROUP_SIZE[kind]]
    if bad:
        raise ConfigError(
            f"config field '{key}': {kind} needs group size {QUANT_GROUP_SIZE[kind]}, got {bad[0]!r} "
            f"(config '{name}')"
        )
    return kind


REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "intermediate_size",
    "kda_layers",
    "full_attn_layers",
    "kda_num_heads",
    "kda_head_dim",
)


def _label(target: str) -> str:
    """A field's name as a config file writes it (`linear_attn_config.num_heads` for kda_num_heads)."""
    return next((_lin(k) for k, v in LINEAR_ATTN_KEYS.items() if v == target), target)


def from_dict(raw: Mapping[str, Any], *, strict: bool, name: str = "custom") -> ModelConfig:
    """Build a config from a Hugging Face style dict (`strict`: unknown keys are errors).

    Every bad key (unknown, unsupported, given twice, missing, or a value that breaks its field's
    constraints) is reported in one ConfigError. A multimodal wrapper (Kimi K3) keeps the text model under
    `text_config`; its `quantization_config` may sit inside text_config or at the top level and becomes
    `expert_quant`."""
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
    problems: list[Problem] = []
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
                    problems.append(
                        Problem(_lin(sub), f"only 1 (1-indexed lists) is supported, got {sub_value!r}")
                    )
                elif strict and sub != "kda_layer_index_base":
                    problems.append(Problem(_lin(sub), "is unknown"))
            continue
        target = ALIASES.get(key, key)
        if target in ("bos_token_id", "eos_token_id"):
            kw[target] = _first_id(value)
        elif target in UNIMPLEMENTED_DEFAULTS:
            if value != UNIMPLEMENTED_DEFAULTS[target]:
                unimpl[target] = value
        elif target in FIXED_VALUES:
            if value != FIXED_VALUES[target]:
                problems.append(Problem(key, f"only {FIXED_VALUES[target]!r} is supported, got {value!r}"))
        elif target == "unimplemented" and isinstance(value, Mapping):
            unimpl.update(value)
        elif target in fields:
            if target in kw and key != target:
                problems.append(Problem(target, f"is given twice (also as alias '{key}')"))
            kw[target] = value
        elif strict and key not in IGNORED_HF_KEYS:
            problems.append(Problem(key, "is unknown"))
    missing = [req for req in REQUIRED if req not in kw]
    problems += [Problem(_label(req), "is required") for req in missing]
    for key, value in list(kw.items()):
        if key in _INT_FIELDS and isinstance(value, float) and value.is_integer():
            kw[key] = int(value)
    if quant_config is not None:
        parsed = parse_quantization_config(
            quant_config, kw["name"]
        )  # the checkpoint's format: unreadable if bad
        if kw.get("expert_quant") not in (None, parsed):
            problems.append(
                Problem(
                    "expert_quant",
                    f"({kw['expert_quant']!r}) disagrees with quantization_config ({parsed!r})",
                )
            )
        kw["expert_quant"] = parsed
    kw["unimplemented"] = tuple(sorted(unimpl.items()))
    defaults = {
        f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING
    }
    problems += violations(ModelConfig, {**defaults, **kw}, unknown=missing)
    if problems:
        raise ConfigError.listing(kw["name"], problems)
    return ModelConfig(**kw)


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
