"""Mixtral (`MixtralForCausalLM`), the family in one file: grouped-query attention, a softmax router over all experts
whose top-k weights are always renormalised, SwiGLU experts of `intermediate_size`.

`sliding_window` (null by default) applies to every layer. Hub tensors: the router
`block_sparse_moe.gate`, experts `block_sparse_moe.experts.E.{w1,w3,w2}` (gate, up, down).
`router_jitter_noise` only perturbs the router's input while training in transformers; zoo has no
jitter, so a non-zero value is accepted with a warning (inference is unaffected).
"""

import warnings

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import SCALED, FamilyDef, sized
from zoo.families._hf import SILU, Family, Keys, Rule, common_fields, every_layer_window, expert_list_rules, linear
from zoo.families._hf import rope_from_params, rope_hf, rope_params
from zoo.families.qwen3_moe import softmax_moe

NAME = "mixtral"


def read(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "Mixtral's experts")
    if k.number("router_jitter_noise"):
        warnings.warn(
            f"{k.source}: router_jitter_noise={k.cfg['router_jitter_noise']} is ignored (zoo's router has no training "
            "jitter)"
        )
    fields = common_fields(k)
    window = k.opt_int("sliding_window")
    experts = k.integer("num_local_experts") if k.has("num_local_experts") else k.integer("num_experts")
    return dict(
        fields,
        rope=rope_from_params(rope_params(k), k),
        moe=softmax_moe(experts, k.integer("num_experts_per_tok"), fields["intermediate_size"]),
        **every_layer_window(k, fields["num_layers"], window),
    )


def write(c: ModelConfig) -> dict:
    m = c.moe
    return dict(
        hidden_act="silu",
        sliding_window=c.sliding_window,
        num_local_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        router_jitter_noise=0.0,
        **rope_hf(c.rope),
    )


def moe_rules(c: ModelConfig) -> list[Rule]:
    p = "block_sparse_moe."
    return [linear(p + "gate.weight", "ffn.router")] + expert_list_rules(
        c, p + "experts.{e}.{proj}.weight", "w1", "w3", "w2"
    )


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    name=NAME,
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    # MixtralConfig's defaults: the model's, its experts'
    defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=4096 * 32, rope_theta=1000000.0, hidden_act="silu")
    | dict(num_local_experts=8, num_experts_per_tok=2, router_jitter_noise=0.0),
    read=read,
    write=write,
    moe_rules=moe_rules,
)


# --- the named sizes -------------------------------------------------------------------------------


def _size(dims: tuple, **fields) -> ModelConfig:
    """Every Mixtral size: 8 experts of the MLP's width, top-2, rope theta 1e6."""
    return sized(NAME, dims, rope=RopeConfig(theta=1000000.0), moe=softmax_moe(8, 2, dims[6]), **fields)


def sizes() -> dict[str, ModelConfig]:
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        "mixtral_tiny_a": _size((256, 64, 2, 4, 2, 16, 64, 256), rms_norm_eps=1e-5),
        "mixtral_100m": _size((32000, 512, 6, 8, 4, 64, 896, 4096)),
        "mixtral_8x7b": _size((32000, 4096, 32, 32, 8, 128, 14336, 32768), rms_norm_eps=1e-5, compute_dtype="bfloat16"),
        "mixtral_8x22b": _size(
            (32768, 6144, 56, 48, 8, 128, 16384, 65536), rms_norm_eps=1e-5, compute_dtype="bfloat16"
        ),
    }


# The published parameter counts of the real sizes (FamilyDef.published).
PUBLISHED = {
    "mixtral_8x7b": (46.7e9, 12.9e9, 0.01, "Mistral AI, 'Mixtral of experts': 46.7B total, 12.9B per token"),
    "mixtral_8x22b": (141e9, 39e9, 0.01, "Mistral AI, 'Cheaper, Better, Faster, Stronger': 141B total, 39B active"),
}

# Like Qwen3-MoE: the same softmax routing and SwiGLU experts, no q/k norm.
FAMILY = FamilyDef(
    NAME,
    moe=True,
    hf=HF,
    sizes=sizes,
    published=PUBLISHED,
    like="qwen3_moe",
    dropless=True,
    recipes={"mixtral_8x7b": SCALED, "mixtral_8x22b": SCALED},
)
