"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

- Qwen2: biases on q, k, v (never on o or the MLP), added before RoPE.
- Qwen3: per-head q/k RMSNorm before RoPE; `attention_bias` puts biases on q, k, v and o alike;
  `head_dim` defaults to 128 when the key is absent (Qwen2 and Qwen3-MoE derive it, hidden / heads).
- Sliding windows: `use_sliding_window` false nulls the window. Qwen2 and Qwen3 then slide layer i iff
  a window is left and i >= `max_window_layers`, unless `layer_types` lists the types; Qwen3-MoE
  slides every layer when the window is on.
- Qwen3-MoE: layer i is sparse iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step`
  == 0 (dense layers use `intermediate_size`); softmax router over all experts, top-k, renormalised
  only when `norm_topk_prob` (default false); per-expert `mlp.experts.E.{gate,up,down}_proj` and the
  router `mlp.gate`. transformers 5 spells the expert count `num_local_experts`, the hub `num_experts`.
"""

from zoo.config import ModelConfig, MoEConfig
from zoo.hf.rules import (
    SILU, Family, Keys, Rule, common_fields, every_layer_window, explicit_layer_types, expert_list_rules, layer_types_of, linear,
    rope_from_params, rope_hf, rope_params, window_fields,
)
from zoo.tags import QWEN2, QWEN3, QWEN3_MOE


def _window_by_depth(k: Keys, num_layers: int) -> dict:
    window = k.opt_int("sliding_window") if k.flag("use_sliding_window") else None
    types = explicit_layer_types(k, num_layers)
    if types is None:
        first = k.integer("max_window_layers")
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(num_layers)]
    return window_fields(k, types, window)


def _window_by_depth_hf(c: ModelConfig) -> dict:
    types = layer_types_of(c)
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    return dict(use_sliding_window=bool(sliding), sliding_window=c.sliding_window if sliding else None,
                max_window_layers=sliding[0] if sliding else c.num_layers, layer_types=types)


def _dense(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "the Qwen MLP")
    fields = common_fields(k)
    return dict(fields, rope=rope_from_params(rope_params(k), k), **_window_by_depth(k, fields["num_layers"]))


def read_qwen2(k: Keys) -> dict:
    return dict(_dense(k), attention_bias=True)


def read_qwen3(k: Keys) -> dict:
    bias = k.flag("attention_bias")
    return dict(_dense(k), qk_norm=True, attention_bias=bias, attention_out_bias=bias)


def write_qwen2(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", **_window_by_depth_hf(c), **rope_hf(c.rope))


def write_qwen3(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", attention_bias=c.attention_bias, **_window_by_depth_hf(c), **rope_hf(c.rope))


def read_qwen3_moe(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "the Qwen3-MoE MLP")
    fields = common_fields(k)
    n = fields["num_layers"]
    window = k.opt_int("sliding_window") if k.flag("use_sliding_window") else None
    only = k.raw("mlp_only_layers")
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise k.error(f"mlp_only_layers must be a list of layer indices, got {only!r}")
    bias = k.flag("attention_bias")
    experts = k.integer("num_local_experts") if k.has("num_local_experts") else k.integer("num_experts")
    return dict(
        fields,
        qk_norm=True,
        attention_bias=bias,
        attention_out_bias=bias,
        rope=rope_from_params(rope_params(k), k),
        mlp_only_layers=list(only),
        decoder_sparse_step=k.integer("decoder_sparse_step"),
        moe=MoEConfig(
            n_routed_experts=experts, num_experts_per_tok=k.integer("num_experts_per_tok"),
            moe_intermediate_size=k.integer("moe_intermediate_size"), n_shared_experts=0, router="softmax", n_group=1,
            topk_group=1, norm_topk_prob=k.flag("norm_topk_prob"), routed_scaling_factor=1.0,
        ),
        **every_layer_window(k, n, window),
    )


def write_qwen3_moe(c: ModelConfig) -> dict:
    m = c.moe
    return dict(
        hidden_act="silu", attention_bias=c.attention_bias, use_sliding_window=c.sliding_window is not None,
        sliding_window=c.sliding_window, mlp_only_layers=list(c.mlp_only_layers), decoder_sparse_step=c.decoder_sparse_step,
        # transformers 5 reads num_local_experts (num_experts is its alias); transformers 4 only num_experts
        num_experts=m.n_routed_experts, num_local_experts=m.n_routed_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob, **rope_hf(c.rope),
    )


def moe_rules(c: ModelConfig) -> list[Rule]:
    return [linear("mlp.gate.weight", "ffn.router")] + expert_list_rules(c, "mlp.experts.{e}.{proj}.weight", "gate_proj", "up_proj", "down_proj")


# The transformers config classes' defaults (Qwen2Config, Qwen3Config, Qwen3MoeConfig).
_DEFAULTS = dict(rms_norm_eps=1e-6, max_position_embeddings=32768, rope_theta=10000.0, hidden_act="silu",
                 use_sliding_window=False, sliding_window=4096, max_window_layers=28, attention_bias=False)

FAMILIES = (
    Family(QWEN2, "qwen2", "Qwen2ForCausalLM", _DEFAULTS, read_qwen2, write_qwen2),
    Family(QWEN3, "qwen3", "Qwen3ForCausalLM", dict(_DEFAULTS, head_dim=128), read_qwen3, write_qwen3),
    Family(
        QWEN3_MOE, "qwen3_moe", "Qwen3MoeForCausalLM",
        dict(_DEFAULTS, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, num_experts=128,
             num_experts_per_tok=8, moe_intermediate_size=768),
        read_qwen3_moe, write_qwen3_moe, moe_rules=moe_rules,
    ),
)
