"""A plain-numpy forward pass of Llama and DeepSeek-V3, written from transformers' formulas and
reading hub-named weights (`[out, in]` matrices), independent of zoo's layouts and code.

Used where no transformers-computed fixture exists: the llama3 and yarn rope rules and MLA with
`q_lora_rank: null`. Float64 throughout.
"""

import math

import numpy as np
from numpy_ref_families import inv_freq


def rope_inv_freq(cfg: dict, dim: int) -> tuple[np.ndarray, float]:
    """The rotary inverse frequencies and attention scale of `cfg`'s rope (either style), by the rules
    of numpy_ref_families (which the transformers fixtures check)."""
    p = dict(cfg.get("rope_parameters") or {})
    if not p:
        p = dict(cfg.get("rope_scaling") or {})
        p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    return inv_freq(cfg, p, p.get("truncate", True), dim)


def _rms(x, w, eps):
    return w * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _rotate(x, cos, sin, interleave):
    # x [B, heads, T, d]; cos/sin [T, d] in the [freqs | freqs] layout
    if interleave:
        b, h, t, d = x.shape
        x = x.reshape(b, h, t, d // 2, 2).transpose(0, 1, 2, 4, 3).reshape(b, h, t, d)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def _attend(q, k, v, scale):
    t = q.shape[2]
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


def _mlp(x, w, prefix):
    g = x @ w[prefix + "gate_proj.weight"].T
    return ((g / (1 + np.exp(-g))) * (x @ w[prefix + "up_proj.weight"].T)) @ w[prefix + "down_proj.weight"].T


def _moe(x, w, p, cfg):
    b, t, d = x.shape
    flat = x.reshape(-1, d)
    scores = 1 / (1 + np.exp(-(flat @ w[p + "gate.weight"].T)))
    biased = scores + w[p + "gate.e_score_correction_bias"]
    e, g = cfg["n_routed_experts"], cfg["n_group"]
    grouped = np.sort(biased.reshape(-1, g, e // g), axis=-1)[..., -2:].sum(-1)
    out = np.zeros_like(flat)
    for n in range(flat.shape[0]):
        groups = np.argsort(-grouped[n], kind="stable")[: cfg["topk_group"]]
        # Experts of unselected groups can never win: DeepSeek's reference masks them to -inf
        # (transformers writes 0.0, which differs once biased scores go negative).
        masked = np.full(e, -np.inf)
        for gi in groups:
            masked[gi * (e // g) : (gi + 1) * (e // g)] = biased[n, gi * (e // g) : (gi + 1) * (e // g)]
        chosen = np.argsort(-masked, kind="stable")[: cfg["num_experts_per_tok"]]
        weights = scores[n, chosen]
        if cfg.get("norm_topk_prob", True):
            weights = weights / (weights.sum() + 1e-20)
        weights = weights * cfg["routed_scaling_factor"]
        for ex, wt in zip(chosen, weights):
            out[n] += wt * _mlp(flat[n], w, f"{p}experts.{ex}.")
    y = out.reshape(b, t, d)
    if cfg.get("n_shared_experts"):
        y = y + _mlp(x, w, p + "shared_experts.")
    return y


def forward(cfg: dict, weights: dict, tokens: np.ndarray) -> np.ndarray:
    """Logits `[B, T, V]` of a hub-format Llama or DeepSeek-V3 model."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    ds = cfg["model_type"] == "deepseek_v3"
    b, t = tokens.shape
    heads = cfg["num_attention_heads"]
    eps = cfg["rms_norm_eps"]
    x = w["model.embed_tokens.weight"][tokens]
    rope_dim = cfg["qk_rope_head_dim"] if ds else cfg.get("head_dim") or cfg["hidden_size"] // heads
    inv, att = rope_inv_freq(cfg, rope_dim)
    ang = np.arange(t)[:, None] * inv[None, :]
    cos = np.concatenate([np.cos(ang)] * 2, -1) * att
    sin = np.concatenate([np.sin(ang)] * 2, -1) * att
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"], eps)
        a = p + "self_attn."
        if not ds:
            hd, kvh = rope_dim, cfg["num_key_value_heads"]
            q = (h @ w[a + "q_proj.weight"].T).reshape(b, t, heads, hd).transpose(0, 2, 1, 3)
            k = (h @ w[a + "k_proj.weight"].T).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
            v = (h @ w[a + "v_proj.weight"].T).reshape(b, t, kvh, hd).transpose(0, 2, 1, 3)
            q, k = _rotate(q, cos, sin, False), _rotate(k, cos, sin, False)
            k, v = np.repeat(k, heads // kvh, axis=1), np.repeat(v, heads // kvh, axis=1)
            scale = hd**-0.5
        else:
            nope, rd, vd, kvl = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
            if cfg.get("q_lora_rank") is None:
                q = h @ w[a + "q_proj.weight"].T
            else:
                q = (
                    _rms(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], 1e-6)
                    @ w[a + "q_b_proj.weight"].T
                )
            q = q.reshape(b, t, heads, nope + rd).transpose(0, 2, 1, 3)
            kv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
            latent, k_rot = kv[..., :kvl], kv[..., kvl:]
            kvb = _rms(latent, w[a + "kv_a_layernorm.weight"], 1e-6) @ w[a + "kv_b_proj.weight"].T
            kvb = kvb.reshape(b, t, heads, nope + vd).transpose(0, 2, 1, 3)
            k_nope, v = kvb[..., :nope], kvb[..., nope:]
            interleave = cfg.get("rope_interleave", True)
            q_rot = _rotate(q[..., nope:], cos, sin, interleave)
            k_rot = _rotate(k_rot[:, None], cos, sin, interleave)
            q = np.concatenate([q[..., :nope], q_rot], -1)
            k = np.concatenate([k_nope, np.broadcast_to(k_rot, (b, heads, t, rd))], -1)
            scale = (nope + rd) ** -0.5
            p_rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
            if (p_rope.get("rope_type") or p_rope.get("type")) == "yarn" and p_rope.get("mscale_all_dim"):
                m = 0.1 * p_rope["mscale_all_dim"] * math.log(p_rope["factor"]) + 1.0
                scale *= m * m
        ctx = _attend(q, k, v, scale).transpose(0, 2, 1, 3).reshape(b, t, -1)
        x = x + ctx @ w[a + "o_proj.weight"].T
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        if ds and i >= cfg.get("first_k_dense_replace", 0):
            x = x + _moe(h, w, p + "mlp.", cfg)
        else:
            x = x + _mlp(h, w, p + "mlp.")
    x = _rms(x, w["model.norm.weight"], eps)
    head = w["model.embed_tokens.weight"] if cfg.get("tie_word_embeddings") else w["lm_head.weight"]
    return x @ head.T
