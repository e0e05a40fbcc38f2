"""A naive Kimi Linear / Kimi K3 text model in NumPy float64, written from the model's math (docs/design.md).

Independent of the package: it reads a dict of checkpoint-named tensors (`model.layers.N.self_attn.q_proj.
weight`, ... as the model's state names them; routed experts either stacked `experts.w1` [E, F, L] or per
expert `experts.E.w1.weight`) and a ModelConfig-like object, and evaluates one sequence token by token:
loops over positions for the convolution, the KDA recurrence and the causal attention, and over the chosen
experts of each token. Slow by design; for tiny models only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

F64 = np.float64


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def rmsnorm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (no weight: just the normalisation)."""
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if weight is None else out * weight


def situ(gate: np.ndarray, up: np.ndarray, beta: float | None, linear_beta: float | None) -> np.ndarray:
    """K3's SiTU: beta*tanh(g/beta)*sigmoid(g) times beta_L*tanh(u/beta_L) (u unchanged without beta_L)."""
    b = 1.0 if beta is None else beta
    a = b * np.tanh(gate / b) * sigmoid(gate)
    u = up if linear_beta is None else linear_beta * np.tanh(up / linear_beta)
    return a * u


def act(cfg: Any, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    if cfg.hidden_act == "situ":
        return situ(gate, up, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return silu(gate) * up


def attn_res_mix(
    partial: np.ndarray, blocks: list[np.ndarray], norm_w: np.ndarray, proj_w: np.ndarray, eps: float
) -> np.ndarray:
    """K3.md's mix for one token: V = [B..., p]; K = V / rms(V); s_i = <K_i, norm_w * proj_w>;
    result sum_i softmax(s)_i V_i."""
    values = [np.asarray(b, F64) for b in blocks] + [np.asarray(partial, F64)]
    w = np.asarray(norm_w, F64).reshape(-1) * np.asarray(proj_w, F64).reshape(-1)
    scores = np.array([np.dot(rmsnorm(v, None, eps), w) for v in values])
    p = np.exp(scores - scores.max())
    p /= p.sum()
    return sum(pi * vi for pi, vi in zip(p, values, strict=True))


class NumpyReference:
    """`forward(tokens)` -> logits [T, vocab] float64 for one sequence, from `params` (name -> array)."""

    def __init__(self, cfg: Any, params: Mapping[str, Any]):
        self.cfg = cfg
        self.p = {k: np.asarray(v, F64) for k, v in params.items()}

    def w(self, name: str) -> np.ndarray:
        return self.p[name]

    # --- feed-forward ---------------------------------------------------------------------------------------
    def gated_mlp(self, prefix: str, x: np.ndarray) -> np.ndarray:
        gate = x @ self.w(f"{prefix}.gate_proj.weight").T
        up = x @ self.w(f"{prefix}.up_proj.weight").T
        return act(self.cfg, gate, up) @ self.w(f"{prefix}.down_proj.weight").T

    def expert(self, prefix: str, e: int, z: np.ndarray) -> np.ndarray:
        """Routed expert e on one latent vector: w2 act(w1 z, w3 z)."""
        if f"{prefix}.experts.w1" in self.p:
            w1, w2, w3 = (self.w(f"{prefix}.experts.{n}")[e] for n in ("w1", "w2", "w3"))
        else:
            w1, w2, w3 = (self.w(f"{prefix}.experts.{e}.{n}.weight") for n in ("w1", "w2", "w3"))
        return w2 @ act(self.cfg, w1 @ z, w3 @ z)

    def route(self, prefix: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One token: (expert ids, weights). Sigmoid scores; with groups, a group scores the sum of its two
        best biased scores and only the `topk_group` best groups stay; top-k of score + bias among those;
        weights from the un-biased scores (renormalised with + 1e-20, times routed_scaling_factor)."""
        cfg = self.cfg
        s = sigmoid(self.w(f"{prefix}.gate.weight") @ x)
        biased = s + self.w(f"{prefix}.gate.e_score_correction_bias")
        if cfg.num_expert_group > 1:
            groups = biased.reshape(cfg.num_expert_group, -1)
            best_two = np.sort(groups, axis=-1)[:, ::-1][:, :2].sum(axis=-1)
            kept = np.argsort(-best_two, kind="stable")[: cfg.topk_group]
            allowed = np.zeros(groups.shape, bool)
            allowed[kept] = True
            biased = np.where(allowed.reshape(-1), biased, -np.inf)
        ids = np.argsort(-biased, kind="stable")[: cfg.num_experts_per_token]
        weights = s[ids]
        if cfg.moe_renormalize:
            weights = weights / (weights.sum() + 1e-20)
        return ids, weights * cfg.routed_scaling_factor

    def moe(self, prefix: str, x: np.ndarray) -> np.ndarray:
        """Latent MoE per token: router and shared experts on x, routed experts in the latent."""
        cfg = self.cfg
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            ids, weights = self.route(prefix, x[t])
            latent = cfg.routed_expert_hidden_size is not None
            z = self.w(f"{prefix}.routed_expert_down_proj.weight") @ x[t] if latent else x[t]
            y = sum(wk * self.expert(prefix, int(e), z) for e, wk in zip(ids, weights, strict=True))
            if latent:
                if cfg.latent_moe_use_norm:
                    y = rmsnorm(y, self.w(f"{prefix}.routed_expert_norm.weight"), cfg.rms_norm_eps)
                y = self.w(f"{prefix}.routed_expert_up_proj.weight") @ y
            out[t] = y
        if cfg.num_shared_experts:
            out = out + self.gated_mlp(f"{prefix}.shared_experts", x)
        return out

    # --- mixers ---------------------------------------------------------------------------------------------
    def kda(self, prefix: str, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        T = x.shape[0]
        H, d, K = cfg.kda_num_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        branches = []
        for n in ("q", "k", "v"):
            lin = x @ self.w(f"{prefix}.{n}_proj.weight").T  # [T, H*d]
            conv_w = self.w(f"{prefix}.{n}_conv1d.weight")[:, 0, :]  # [H*d, K], last tap = current token
            out = np.zeros_like(lin)
            for t in range(T):
                for j in range(K):
                    src = t - (K - 1) + j
                    if src >= 0:
                        out[t] += conv_w[:, j] * lin[src]
            branches.append(silu(out).reshape(T, H, d))
        q, k, v = branches
        q = q / np.sqrt(np.sum(q * q, axis=-1, keepdims=True) + 1e-6) * d**-0.5
        k = k / np.sqrt(np.sum(k * k, axis=-1, keepdims=True) + 1e-6)
        raw = x @ self.w(f"{prefix}.f_a_proj.weight").T @ self.w(f"{prefix}.f_b_proj.weight").T
        raw = (raw + self.w(f"{prefix}.dt_bias")).reshape(T, H, d)
        a = np.exp(self.w(f"{prefix}.A_log").reshape(-1)[:H])[None, :, None]  # first H entries: one per head
        if cfg.gate_lower_bound is None:
            g = -a * softplus(raw)
        else:
            g = cfg.gate_lower_bound * sigmoid(a * raw)
        beta = sigmoid(x @ self.w(f"{prefix}.b_proj.weight").T)  # [T, H]
        S = np.zeros((H, d, d))
        o = np.zeros((T, H, d))
        for t in range(T):
            for h in range(H):
                S[h] = np.exp(g[t, h])[:, None] * S[h]
                S[h] = S[h] + beta[t, h] * np.outer(k[t, h], v[t, h] - k[t, h] @ S[h])
                o[t, h] = S[h].T @ q[t, h]
        if cfg.use_full_rank_gate:
            gate = x @ self.w(f"{prefix}.g_proj.weight").T
        else:
            gate = x @ self.w(f"{prefix}.g_a_proj.weight").T @ self.w(f"{prefix}.g_b_proj.weight").T
        o = rmsnorm(o, self.w(f"{prefix}.o_norm.weight"), cfg.rms_norm_eps) * sigmoid(gate.reshape(T, H, d))
        return o.reshape(T, H * d) @ self.w(f"{prefix}.o_proj.weight").T

    def mla(self, prefix: str, x: np.ndarray) -> np.ndarray:
        cfg = self.cfg
        T = x.shape[0]
        H, nope, rope, vd, R = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
            cfg.kv_lora_rank,
        )
        eps = cfg.mla_lora_norm_eps
        if cfg.q_lora_rank is not None:
            qa = rmsnorm(
                x @ self.w(f"{prefix}.q_a_proj.weight").T, self.w(f"{prefix}.q_a_layernorm.weight"), eps
            )
            q = qa @ self.w(f"{prefix}.q_b_proj.weight").T
        else:
            q = x @ self.w(f"{prefix}.q_proj.weight").T
        q = q.reshape(T, H, nope + rope)
        ckr = x @ self.w(f"{prefix}.kv_a_proj_with_mqa.weight").T
        c = rmsnorm(ckr[:, :R], self.w(f"{prefix}.kv_a_layernorm.weight"), eps)
        k_r = ckr[:, R:]
        kv = (c @ self.w(f"{prefix}.kv_b_proj.weight").T).reshape(T, H, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]
        scale = (nope + rope) ** -0.5
        o = np.zeros((T, H, vd))
        for t in range(T):
            for h in range(H):
                keys = np.concatenate([k_nope[: t + 1, h], k_r[: t + 1]], axis=-1)  # [t+1, nope+rope]
                s = keys @ q[t, h] * scale
                p = np.exp(s - s.max())
                o[t, h] = (p / p.sum()) @ v[: t + 1, h]
        o = o.reshape(T, H * vd)
        if cfg.mla_use_output_gate:
            o = o * sigmoid(x @ self.w(f"{prefix}.g_proj.weight").T)
        return o @ self.w(f"{prefix}.o_proj.weight").T

    # --- the stack ------------------------------------------------------------------------------------------
    def layer_parts(self, i: int, h: np.ndarray) -> tuple[np.ndarray, Any]:
        """(mixer output, ffn) of layer i: the mixer on input_layernorm(h), and a function for the FFN."""
        cfg = self.cfg
        prefix = f"model.layers.{i}"
        x = rmsnorm(h, self.w(f"{prefix}.input_layernorm.weight"), cfg.rms_norm_eps)
        mixed = (
            self.mla(f"{prefix}.self_attn", x)
            if cfg.layer_types[i] == "mla"
            else self.kda(f"{prefix}.self_attn", x)
        )

        def ffn(y: np.ndarray) -> np.ndarray:
            y = rmsnorm(y, self.w(f"{prefix}.post_attention_layernorm.weight"), cfg.rms_norm_eps)
            if i >= cfg.first_k_dense_replace:
                return self.moe(f"{prefix}.block_sparse_moe", y)
            return self.gated_mlp(f"{prefix}.mlp", y)

        return mixed, ffn

    def mix_all(self, p: np.ndarray, blocks: list[np.ndarray], name: str) -> np.ndarray:
        """The AttnRes mix of every token with the `{name}_norm` / `{name}_proj` weights."""
        norm_w, proj_w = self.w(f"{name}_norm.weight"), self.w(f"{name}_proj.weight")
        eps = self.cfg.rms_norm_eps
        return np.stack(
            [attn_res_mix(p[t], [b[t] for b in blocks], norm_w, proj_w, eps) for t in range(len(p))]
        )

    def hidden(self, tokens: np.ndarray) -> np.ndarray:
        """Final hidden states [T, D] before the final norm."""
        cfg = self.cfg
        h = self.w("model.embed_tokens.weight")[np.asarray(tokens)]
        if cfg.attn_res_block_size is None:
            for i in range(cfg.num_hidden_layers):
                mixed, ffn = self.layer_parts(i, h)
                h = h + mixed
                h = h + ffn(h)
            return h
        p: np.ndarray | None = h
        blocks: list[np.ndarray] = []
        for i in range(cfg.num_hidden_layers):
            prefix = f"model.layers.{i}"
            assert p is not None
            x = self.mix_all(p, blocks, f"{prefix}.self_attention_res") if blocks else p
            if i % cfg.attn_res_block_size == 0:
                blocks.append(p)
                p = None
            mixed, ffn = self.layer_parts(i, x)
            p = mixed if p is None else p + mixed
            p = p + ffn(self.mix_all(p, blocks, f"{prefix}.mlp_res"))
        assert p is not None
        return self.mix_all(p, blocks, "model.output_attn_res")

    def forward(self, tokens: np.ndarray) -> np.ndarray:
        h = rmsnorm(self.hidden(tokens), self.w("model.norm.weight"), self.cfg.rms_norm_eps)
        head = self.p.get("lm_head.weight", self.w("model.embed_tokens.weight"))
        return h @ head.T
