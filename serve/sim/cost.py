"""The analytic cost model: the FLOPs of a prefill and the bytes of a decode step, counted from the config
and the parameters (`COUNTING` says how), and the rate a simulated step's FLOPs are computed at. `bench
throughput` holds its measured rates against these counts; the simulator's clock advances by them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxhybrid.cache import kda_state_bytes, mla_kv_bytes
from jaxhybrid.config import ModelConfig
from jaxhybrid.counting import count_params

COUNTING = {
    "prefill_flops": "2 x (active params - embedding) per token (every matmul weight, lm_head over all T "
    "positions, the top-k of E routed experts) + MLA attention 2 x heads x (qk_head_dim + v_head_dim) x "
    "T(T+1)/2 per MLA layer (causal pairs only) + KDA 6 x heads x head_dim^2 per token per KDA layer "
    "(state read-out, k^T S and the rank-1 update of the recurrent form)",
    "decode_bytes": "weights read once per step: all non-routed params except the embedding table + "
    "routed experts x (1 - (1 - k/E)^batch) (expected distinct experts, uniform routing); plus per row the "
    "MLA latent KV of `context` tokens and the live KDA state (recurrent fp32 + conv)",
    "matmul_rate": "2 n^3 / median time of a jitted n x n @ n x n matmul in the run's dtype",
    "bandwidth": "bytes of a large fp32 array / median time of reading it once, as a sum and as a "
    "matrix-vector product; the faster of the two",
}


def param_bytes(model: Any) -> dict[str, int]:
    """Elements and bytes of the model's parameters, split into embedding table, routed experts and the rest
    (from the arrays themselves, so mixed dtypes such as the fp32 router and MXFP4 experts kept packed are
    counted as stored; elements are logical weights: a packed byte holds two, a scale byte none)."""
    from flax import nnx

    out = {k: 0 for k in ("elements", "bytes", "embedding", "embedding_bytes", "routed", "routed_bytes")}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf = var.get_value()
        size, nbytes = int(np.prod(leaf.shape)), int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        names = [str(p) for p in path]
        if names[-1].endswith(("_packed", "_scale")):  # MXFP4 experts: 2 weights per code byte
            size = 2 * size if names[-1].endswith("_packed") else 0
        out["elements"] += size
        out["bytes"] += nbytes
        if "embed_tokens" in names:
            out["embedding"] += size
            out["embedding_bytes"] += nbytes
        elif "experts" in names and "shared_experts" not in names:
            out["routed"] += size
            out["routed_bytes"] += nbytes
    return out


def active_params(cfg: Any, params: dict[str, int]) -> tuple[float, float]:
    """(parameters one token uses: routed experts at top-k of E; of those, the matmul weights: all but the
    embedding table) from `param_bytes`."""
    routed = params["routed"] * cfg.num_experts_per_token / max(cfg.num_experts, 1)
    active = params["elements"] - params["routed"] + routed
    return active, active - params["embedding"]


def prefill_flops(cfg: Any, matmul_params: float, tokens: int, start: int = 0) -> dict[str, float]:
    """Model FLOPs of a prefill of `tokens` tokens after `start` tokens already in the cache (see COUNTING;
    each new token attends to every cached one and to the new ones up to itself)."""
    dense = 2.0 * matmul_params * tokens
    mla = (
        cfg.num_mla_layers
        * 2.0
        * cfg.num_attention_heads
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        * (tokens * start + tokens * (tokens + 1) / 2)
    )
    kda = cfg.num_kda_layers * 6.0 * cfg.kda_num_heads * cfg.kda_head_dim**2 * tokens
    return {
        "matmul_flops": dense,
        "mla_attention_flops": mla,
        "kda_state_flops": kda,
        "flops": dense + mla + kda,
    }


def decode_bytes(cfg: Any, params: dict[str, int], batch: int, context: int, dtype: str) -> dict[str, float]:
    """Bytes one decode step reads for `batch` rows at `context` tokens (see COUNTING)."""
    k, e = cfg.num_experts_per_token, max(cfg.num_experts, 1)
    touched = 1.0 - (1.0 - k / e) ** batch if params["routed"] else 0.0
    weights = (
        params["bytes"]
        - params["embedding_bytes"]
        - params["routed_bytes"]
        + touched * params["routed_bytes"]
    )
    kv = batch * mla_kv_bytes(cfg, context, dtype)
    state = batch * kda_state_bytes(cfg, dtype)["total"]
    return {"weight_bytes": weights, "kv_bytes": kv, "state_bytes": state, "bytes": weights + kv + state}


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Analytic FLOPs of the model and the rate a step's FLOPs are computed at."""

    cfg: ModelConfig
    matmul_params: float  # active params per token without the embedding (`jaxhybrid.counting`)
    flops_per_s: float

    @classmethod
    def of(cls, cfg: ModelConfig, flops_per_s: float) -> CostModel:
        return cls(cfg, float(count_params(cfg)["active_params_without_embedding"]), flops_per_s)

    def flops(self, start: int, tokens: int) -> float:
        return prefill_flops(self.cfg, self.matmul_params, tokens, start)["flops"]
