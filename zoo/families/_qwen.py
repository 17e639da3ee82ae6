"""What the Qwen families share (zoo/families/qwen2.py, qwen3.py, qwen3_moe.py): the transformers config
classes' defaults, Qwen2's and Qwen3's sliding window by depth, and the fields every Qwen3 size has.

Sliding windows by depth: `use_sliding_window` false nulls the window; layer i then slides iff a window
is left and i >= `max_window_layers`, unless `layer_types` lists the types.
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._hf import SILU, Keys, common_fields, explicit_layer_types, layer_types_of, rope_from_params
from zoo.families._hf import rope_params, window_fields

# The transformers config classes' defaults (Qwen2Config, Qwen3Config, Qwen3MoeConfig).
DEFAULTS = dict(
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
    rope_theta=10000.0,
    hidden_act="silu",
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    attention_bias=False,
)

# Every Qwen3 and Qwen3-MoE size: q/k norms, eps 1e-6, rope theta 1e6.
QWEN3_SIZE = dict(qk_norm=True, rms_norm_eps=1e-6, rope=RopeConfig(theta=1000000.0))


def window_by_depth(k: Keys, num_layers: int) -> dict:
    window = k.opt_int("sliding_window") if k.flag("use_sliding_window") else None
    types = explicit_layer_types(k, num_layers)
    if types is None:
        first = k.integer("max_window_layers")
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)
        ]
    return window_fields(k, types, window)


def window_by_depth_hf(c: ModelConfig) -> dict:
    types = layer_types_of(c)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return dict(
        use_sliding_window=bool(sliding),
        sliding_window=c.sliding_window if sliding else None,
        max_window_layers=sliding[0] if sliding else c.num_layers,
        layer_types=types,
    )


def read_dense(k: Keys) -> dict:
    """The fields of Qwen2 and Qwen3 (dense SwiGLU, windows by depth) before their attention flags."""
    k.choice("hidden_act", SILU, "the Qwen MLP")
    fields = common_fields(k)
    return dict(fields, rope=rope_from_params(rope_params(k), k), **window_by_depth(k, fields["num_layers"]))
