"""A plain-numpy forward pass of Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 3 and GPT-OSS, written
from transformers' formulas. It reads config.json itself (both styles, each family's defaults and
window rules) and hub-named weights (`[out, in]` matrices; GPT-OSS's fused, input-major experts), and
shares no code with zoo. Float64 throughout.

Used for the options the transformers-computed fixtures do not exercise; `test_numpy_reference_matches_transformers`
checks it against every fixture first.
"""

import math

import numpy as np

FULL, SLIDING = "full_attention", "sliding_attention"

# The transformers config classes' defaults this reference needs.
_DEFAULTS = {
    "llama": dict(rope_theta=10000.0, tie_word_embeddings=False),
    "qwen2": dict(rope_theta=10000.0, sliding_window=4096, max_window_layers=28, tie_word_embeddings=False),
    "qwen3": dict(
        rope_theta=10000.0, sliding_window=4096, max_window_layers=28, head_dim=128, tie_word_embeddings=False
    ),
    "qwen3_moe": dict(
        rope_theta=10000.0, sliding_window=4096, norm_topk_prob=False, decoder_sparse_step=1, tie_word_embeddings=False
    ),
    "mixtral": dict(rope_theta=1e6, tie_word_embeddings=False),
    "gemma3_text": dict(
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        sliding_window_pattern=6,
        tie_word_embeddings=True,
    ),
    "gpt_oss": dict(
        rope_theta=150000.0,
        head_dim=64,
        sliding_window=128,
        attention_bias=True,
        swiglu_limit=7.0,
        swiglu_alpha=1.702,
        tie_word_embeddings=False,
    ),
}


def _get(cfg, key):
    """The config value, or the family default when the key is absent."""
    return cfg[key] if key in cfg else _DEFAULTS[cfg["model_type"]].get(key)


def layer_types_and_window(cfg: dict) -> tuple[list[str], int]:
    mt, n = cfg["model_type"], cfg["num_hidden_layers"]
    if mt == "llama":
        return [FULL] * n, None
    if mt == "mixtral":
        w = cfg.get("sliding_window")
        return [SLIDING if w else FULL] * n, w
    if mt == "qwen3_moe":
        w = _get(cfg, "sliding_window") if cfg.get("use_sliding_window") else None
        return [SLIDING if w else FULL] * n, w
    if mt in ("qwen2", "qwen3"):
        w = _get(cfg, "sliding_window") if cfg.get("use_sliding_window") else None
        types = cfg.get("layer_types") or [
            SLIDING if w is not None and i >= _get(cfg, "max_window_layers") else FULL for i in range(n)
        ]
        return types, w
    if mt == "gemma3_text":
        p = _get(cfg, "sliding_window_pattern")
        return cfg.get("layer_types") or [SLIDING if (i + 1) % p else FULL for i in range(n)], _get(
            cfg, "sliding_window"
        )
    assert mt == "gpt_oss", mt
    return cfg.get("layer_types") or [SLIDING if i % 2 == 0 else FULL for i in range(n)], _get(cfg, "sliding_window")


def rope_params(cfg: dict, layer_type: str) -> tuple[dict, bool]:
    """The rope parameter dict of a layer type, and whether yarn truncates (read from the top level
    of rope_parameters: a Gemma-style nested dict never says false)."""
    mt = cfg["model_type"]
    top = cfg.get("rope_parameters")
    if mt == "gemma3_text":
        if top and FULL in top:
            return dict(top[layer_type]), True
        if layer_type == SLIDING:
            return {"rope_type": "default", "rope_theta": _get(cfg, "rope_local_base_freq")}, True
        p = dict(cfg.get("rope_scaling") or {})
        p.setdefault("rope_theta", _get(cfg, "rope_theta"))
        return p, True
    if top:
        p = dict(top)
    elif mt == "gpt_oss" and cfg.get("rope_scaling") is None:
        p = {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        }
    else:
        p = dict(cfg.get("rope_scaling") or {})
    p.setdefault("rope_theta", _get(cfg, "rope_theta"))
    return p, p.get("truncate", True)


def inv_freq(cfg: dict, p: dict, truncate: bool, dim: int) -> tuple[np.ndarray, float]:
    kind = p.get("rope_type") or p.get("type") or "default"
    base = p["rope_theta"]
    inv = np.array([base ** (-2 * i / dim) for i in range(dim // 2)])
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / p["factor"], 1.0
    if kind == "llama3":
        lo, hi, old, factor = (
            p["low_freq_factor"],
            p["high_freq_factor"],
            p["original_max_position_embeddings"],
            p["factor"],
        )
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < old / hi:
                out.append(f)
            elif wavelen > old / lo:
                out.append(f / factor)
            else:
                s = (old / wavelen - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
        return np.array(out), 1.0
    assert kind == "yarn", kind
    orig = p.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
    factor = p.get("factor") or cfg["max_position_embeddings"] / orig

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.get("attention_factor") is not None:
        att = p["attention_factor"]
    elif p.get("mscale") and p.get("mscale_all_dim"):
        att = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
    else:
        att = mscale(factor)

    def corr(rotations):
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(p.get("beta_fast") or 32), corr(p.get("beta_slow") or 1)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    keep = [1 - min(max((i - low) / (high - low), 0.0), 1.0) for i in range(dim // 2)]
    return np.array([f / factor * (1 - e) + f * e for f, e in zip(inv, keep)]), att


def _rms(x, w, eps, gemma):
    return (1 + w if gemma else w) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _silu(x):
    return x / (1 + np.exp(-x))


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _attention(cfg, w, a, h, layer_type, window, head_dim):
    mt = cfg["model_type"]
    b, t, _ = h.shape
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    bias_qkv = mt == "qwen2" or bool(_get(cfg, "attention_bias"))
    bias_o = mt != "qwen2" and bool(_get(cfg, "attention_bias"))

    def proj(name, n):
        y = h @ w[a + f"{name}_proj.weight"].T + (w[a + f"{name}_proj.bias"] if bias_qkv else 0)
        return y.reshape(b, t, n, head_dim).transpose(0, 2, 1, 3)

    q, k, v = proj("q", heads), proj("k", kv), proj("v", kv)
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        q = _rms(q, w[a + "q_norm.weight"], cfg["rms_norm_eps"], mt == "gemma3_text")
        k = _rms(k, w[a + "k_norm.weight"], cfg["rms_norm_eps"], mt == "gemma3_text")
    p, truncate = rope_params(cfg, layer_type)
    inv, att = inv_freq(cfg, p, truncate, head_dim)
    ang = np.arange(t)[:, None] * inv[None]
    cos, sin = np.concatenate([np.cos(ang)] * 2, -1) * att, np.concatenate([np.sin(ang)] * 2, -1) * att
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)  # query head n reads kv head n // group
    scale = _get(cfg, "query_pre_attn_scalar") ** -0.5 if mt == "gemma3_text" else head_dim**-0.5
    s = q @ k.transpose(0, 1, 3, 2) * scale
    qi, ki = np.arange(t)[:, None], np.arange(t)[None, :]
    allowed = ki <= qi
    if layer_type == SLIDING:
        allowed &= ki > qi - window
    s = np.where(allowed, s, -np.inf)
    if mt == "gpt_oss":  # a sink column per head joins the softmax, then is dropped
        sink = np.broadcast_to(w[a + "sinks"][None, :, None, None], (b, heads, t, 1))
        s = np.concatenate([s, sink], -1)
    e = np.exp(s - s.max(-1, keepdims=True))
    probs = (e / e.sum(-1, keepdims=True))[..., :t]
    ctx = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * head_dim)
    return ctx @ w[a + "o_proj.weight"].T + (w[a + "o_proj.bias"] if bias_o else 0)


def _mlp(x, w, p, act):
    return (act(x @ w[p + "gate_proj.weight"].T) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _moe(cfg, w, p, x):
    """Returns the MoE output and, per token, (chosen experts, their weights)."""
    mt = cfg["model_type"]
    k = cfg["num_experts_per_tok"]
    flat = x.reshape(-1, x.shape[-1])
    out = np.zeros_like(flat)
    if mt == "gpt_oss":
        logits = flat @ w[p + "router.weight"].T + w[p + "router.bias"]
        limit, alpha = _get(cfg, "swiglu_limit"), _get(cfg, "swiglu_alpha")
    else:
        logits = flat @ w[p + "gate.weight"].T
    for n in range(flat.shape[0]):
        if mt == "gpt_oss":
            chosen = np.argsort(-logits[n], kind="stable")[:k]
            weights = _softmax(logits[n, chosen])
        else:
            probs = _softmax(logits[n])
            chosen = np.argsort(-probs, kind="stable")[:k]
            weights = probs[chosen]
            if mt == "mixtral" or _get(cfg, "norm_topk_prob"):
                weights = weights / weights.sum()
        for e, wt in zip(chosen, weights):
            if mt == "gpt_oss":
                gu = flat[n] @ w[p + "experts.gate_up_proj"][e] + w[p + "experts.gate_up_proj_bias"][e]
                g, u = np.minimum(gu[::2], limit), np.clip(gu[1::2], -limit, limit)
                y = ((u + 1) * g / (1 + np.exp(-alpha * g))) @ w[p + "experts.down_proj"][e] + w[
                    p + "experts.down_proj_bias"
                ][e]
            elif mt == "mixtral":
                ep = f"{p}experts.{e}."
                y = (_silu(flat[n] @ w[ep + "w1.weight"].T) * (flat[n] @ w[ep + "w3.weight"].T)) @ w[ep + "w2.weight"].T
            else:
                y = _mlp(flat[n], w, f"{p}experts.{e}.", _silu)
            out[n] += wt * y
    return out.reshape(x.shape)


def is_sparse(cfg: dict, i: int) -> bool:
    mt = cfg["model_type"]
    if mt in ("mixtral", "gpt_oss"):
        return True
    if mt == "qwen3_moe":
        return i not in (cfg.get("mlp_only_layers") or []) and (i + 1) % _get(cfg, "decoder_sparse_step") == 0
    return False


def forward(cfg: dict, weights: dict, tokens: np.ndarray) -> np.ndarray:
    """Logits `[B, T, V]` of a hub-format model of one of the families above."""
    w = {k: np.asarray(v, np.float64) for k, v in weights.items()}
    mt = cfg["model_type"]
    gemma = mt == "gemma3_text"
    eps = cfg["rms_norm_eps"]
    head_dim = _get(cfg, "head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]  # a null head_dim is derived
    types, window = layer_types_and_window(cfg)
    x = w["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * math.sqrt(cfg["hidden_size"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = _attention(
            cfg, w, p + "self_attn.", _rms(x, w[p + "input_layernorm.weight"], eps, gemma), types[i], window, head_dim
        )
        if gemma:
            x = x + _rms(h, w[p + "post_attention_layernorm.weight"], eps, True)
            h = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps, True)
            x = x + _rms(_mlp(h, w, p + "mlp.", _gelu_tanh), w[p + "post_feedforward_layernorm.weight"], eps, True)
            continue
        x = x + h
        h = _rms(x, w[p + "post_attention_layernorm.weight"], eps, False)
        if is_sparse(cfg, i):
            x = x + _moe(cfg, w, p + ("block_sparse_moe." if mt == "mixtral" else "mlp."), h)
        else:
            x = x + _mlp(h, w, p + "mlp.", _silu)
    x = _rms(x, w["model.norm.weight"], eps, gemma)
    head = w["model.embed_tokens.weight"] if _get(cfg, "tie_word_embeddings") else w["lm_head.weight"]
    logits = x @ head.T
    cap = cfg.get("final_logit_softcapping") if gemma else None
    return cap * np.tanh(logits / cap) if cap else logits
