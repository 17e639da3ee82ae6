"""GPT-OSS (`GptOssForCausalLM`, float checkpoints; MXFP4-quantised ones are refused): the family in one file.

Attention: biases on q, k, v and o (`attention_bias`, default true), one learned sink logit per head
(`self_attn.sinks`) that joins each softmax denominator, sliding and full layers per `layer_types`
(default: alternating, sliding first), YaRN rope (gpt-oss: `truncate` false).
MoE on every layer: `mlp.router` (weight and bias) takes the top-k raw logits and a softmax over those
k; experts are stored input-major and fused: `mlp.experts.gate_up_proj [E, H, 2I]` with gate and up in
interleaved columns (gate = [..., ::2], up = [..., 1::2]) and its bias `[E, 2I]` alike,
`mlp.experts.down_proj [E, I, H]` and `down_proj_bias [E, H]`; the clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`). `hidden_act` is not read: the experts' activation is fixed.
"""

import numpy as np

from zoo.config import ModelConfig, MoEConfig, RopeConfig
from zoo.families._family import SCALED, FamilyDef, routed, sized
from zoo.families._hf import Family, Keys, Rule, common_fields, explicit_layer_types, layer_types_of, linear
from zoo.families._hf import rope_from_params, rope_hf, rope_params, same, window_fields

NAME = "gpt_oss"

# GptOssConfig's rope when the config names none
_DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


def _moe(experts: int, inter: int, top_k: int = 4, limit: float = 7.0, alpha: float = 1.702) -> MoEConfig:
    """GPT-OSS's experts: top-k of the biased logits, softmax over those k; biases on the experts;
    the clamped SwiGLU (`limit`, `alpha`)."""
    return routed(
        experts,
        top_k,
        inter,
        "topk_softmax",
        norm_topk_prob=False,
        router_bias=True,
        expert_bias=True,
        activation="clamped_swiglu",
        swiglu_limit=limit,
        swiglu_alpha=alpha,
    )


def read(k: Keys) -> dict:
    fields = common_fields(k)
    n = fields["num_layers"]
    types = explicit_layer_types(k, n) or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    params = (
        rope_params(k)
        if (k.has("rope_parameters") or k.has("rope_scaling"))
        else dict(_DEFAULT_ROPE, rope_theta=k.number("rope_theta"))
    )
    bias = k.flag("attention_bias")
    return dict(
        fields,
        rope=rope_from_params(params, k),
        attention_bias=bias,
        attention_out_bias=bias,
        attention_sinks=True,
        moe=_moe(
            k.integer("num_local_experts"),
            fields["intermediate_size"],
            k.integer("num_experts_per_tok"),
            k.number("swiglu_limit"),
            k.number("swiglu_alpha"),
        ),
        **window_fields(k, types, k.opt_int("sliding_window")),
    )


def write(c: ModelConfig) -> dict:
    m = c.moe
    return dict(
        hidden_act="silu",
        attention_bias=c.attention_bias,
        sliding_window=c.sliding_window,
        layer_types=layer_types_of(c),
        num_local_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        swiglu_limit=m.swiglu_limit,
        swiglu_alpha=m.swiglu_alpha,
        **rope_hf(c.rope),
    )


def _interleaved(hub: str, gate: str, up: str) -> Rule:
    """A fused hub tensor `[..., 2I]` whose even columns are the gate and odd columns up <-> two zoo leaves
    `[..., I]`."""

    def to_zoo(gu, gate_shape, up_shape):
        return gu[..., ::2], gu[..., 1::2]

    def to_hub(g, u):
        return (np.stack([np.asarray(g), np.asarray(u)], axis=-1).reshape(*g.shape[:-1], 2 * g.shape[-1]),)

    return Rule((hub,), (gate, up), to_zoo, to_hub, hub_shapes=lambda shapes: [(*shapes[0][:-1], 2 * shapes[0][-1])])


def moe_rules(c: ModelConfig) -> list[Rule]:
    p = "mlp."
    return [
        linear(p + "router.weight", "ffn.router"),
        same(p + "router.bias", "ffn.router_bias"),
        _interleaved(p + "experts.gate_up_proj", "ffn.w_gate", "ffn.w_up"),
        _interleaved(p + "experts.gate_up_proj_bias", "ffn.b_gate", "ffn.b_up"),
        same(p + "experts.down_proj", "ffn.w_down"),
        same(p + "experts.down_proj_bias", "ffn.b_down"),
    ]


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    name=NAME,
    model_type="gpt_oss",
    architecture="GptOssForCausalLM",
    # GptOssConfig's defaults: the model's, its attention's, its experts'
    defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=131072)
    | dict(rope_theta=150000.0, head_dim=64, sliding_window=128, attention_bias=True)
    | dict(num_local_experts=128, num_experts_per_tok=4, swiglu_limit=7.0, swiglu_alpha=1.702),
    read=read,
    write=write,
    moe_rules=moe_rules,
)

# --- the named sizes -------------------------------------------------------------------------------


def _alternating(layers: int) -> list[str]:
    """Sliding and full attention alternate, starting with sliding."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _rope(original: int) -> RopeConfig:
    return RopeConfig(
        type="yarn",
        theta=150000.0,
        factor=32.0,
        original_max_position_embeddings=original,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    )


def _size(dims: tuple, window: int, rope: int, moe: MoEConfig, **fields) -> ModelConfig:
    """Every GPT-OSS size: biases on q, k, v and o, sinks, sliding and full layers alternating (the
    sliding ones of `window`), yarn from an `rope`-token original context."""
    return sized(
        NAME,
        dims,
        attention_bias=True,
        attention_out_bias=True,
        attention_sinks=True,
        rms_norm_eps=1e-5,
        sliding_window=window,
        layer_types=_alternating(dims[2]),
        rope=_rope(rope),
        moe=moe,
        **fields,
    )


def sizes() -> dict[str, ModelConfig]:
    big = dict(pad_token_id=199999, compute_dtype="bfloat16")
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (transformers computed its outputs).
        "gpt_oss_tiny_a": _size((256, 64, 4, 4, 2, 16, 64, 2048), 8, 64, _moe(4, 64, top_k=2, limit=1.5)),
        # ~100M for a CPU run (docs/models.md records one).
        "gpt_oss_100m": _size((32000, 512, 6, 8, 2, 64, 448, 4096), 128, 4096, _moe(16, 448)),
        "gpt_oss_20b": _size((201088, 2880, 24, 64, 8, 64, 2880, 131072), 128, 4096, _moe(32, 2880), **big),
        "gpt_oss_120b": _size((201088, 2880, 36, 64, 8, 64, 2880, 131072), 128, 4096, _moe(128, 2880), **big),
    }


# The published parameter counts of the real sizes (FamilyDef.published).
# OpenAI counts active parameters without the embedding table (a lookup touches one row).
PUBLISHED = {
    "gpt_oss_20b": (20.91e9, 3.61e9, 0.01, "OpenAI gpt-oss model card: 20.91B total, 3.61B active"),
    "gpt_oss_120b": (116.83e9, 5.13e9, 0.01, "OpenAI gpt-oss model card: 116.83B total, 5.13B active"),
}

FAMILY = FamilyDef(
    NAME,
    moe=True,
    hf=HF,
    sizes=sizes,
    published=PUBLISHED,
    active_without_embedding=True,
    dropless=True,
    recipes={"gpt_oss_20b": SCALED, "gpt_oss_120b": SCALED},
)
