"""Qwen3-MoE (`Qwen3MoeForCausalLM`), the family in one file: Qwen3's attention (per-head q/k RMSNorm,
`attention_bias` on q, k, v and o; `head_dim` is hidden / heads when absent) and routed SwiGLU experts.

Layer i is sparse iff i is not in `mlp_only_layers` and (i + 1) % `decoder_sparse_step` == 0 (dense
layers use `intermediate_size`); a softmax router over all experts, top-k, renormalised only when
`norm_topk_prob` (default false); per-expert `mlp.experts.E.{gate,up,down}_proj` and the router
`mlp.gate`. transformers 5 spells the expert count `num_local_experts`, the hub `num_experts`. Every
layer slides when `use_sliding_window` is on.
"""

from zoo.config import ModelConfig, MoEConfig
from zoo.families._family import SCALED, FamilyDef, routed, sized
from zoo.families._hf import SILU, Family, Keys, Rule, common_fields, every_layer_window, expert_list_rules, linear
from zoo.families._hf import rope_from_params, rope_hf, rope_params
from zoo.families._qwen import DEFAULTS, QWEN3_SIZE

NAME = "qwen3_moe"


def read(k: Keys) -> dict:
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
        moe=softmax_moe(
            experts, k.integer("num_experts_per_tok"), k.integer("moe_intermediate_size"), norm=k.flag("norm_topk_prob")
        ),
        **every_layer_window(k, n, window),
    )


def write(c: ModelConfig) -> dict:
    m = c.moe
    return dict(
        hidden_act="silu",
        attention_bias=c.attention_bias,
        use_sliding_window=c.sliding_window is not None,
        sliding_window=c.sliding_window,
        mlp_only_layers=list(c.mlp_only_layers),
        decoder_sparse_step=c.decoder_sparse_step,
        # transformers 5 reads num_local_experts (num_experts is its alias); transformers 4 only num_experts
        num_experts=m.n_routed_experts,
        num_local_experts=m.n_routed_experts,
        num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size,
        norm_topk_prob=m.norm_topk_prob,
        **rope_hf(c.rope),
    )


def moe_rules(c: ModelConfig) -> list[Rule]:
    return [linear("mlp.gate.weight", "ffn.router")] + expert_list_rules(
        c, "mlp.experts.{e}.{proj}.weight", "gate_proj", "up_proj", "down_proj"
    )


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    NAME,
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    dict(
        DEFAULTS,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=False,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    read,
    write,
    moe_rules=moe_rules,
)


# --- the named sizes -------------------------------------------------------------------------------


def softmax_moe(experts: int, top_k: int, inter: int, norm: bool = True) -> MoEConfig:
    """A softmax router over every expert, the top-k weights renormalised when `norm`; no groups, no
    shared experts (Mixtral's sizes route so too)."""
    return routed(experts, top_k, inter, "softmax", norm_topk_prob=norm)


def sizes() -> dict[str, ModelConfig]:
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "qwen3_moe_tiny_a": sized(NAME, (256, 64, 2, 4, 2, 24, 128, 256), moe=softmax_moe(8, 2, 32), **QWEN3_SIZE),
        # ~100M total, ~50M active, for a CPU run (docs/models.md records one).
        "qwen3_moe_100m": sized(NAME, (32000, 512, 6, 8, 4, 64, 2048, 4096), moe=softmax_moe(16, 4, 416), **QWEN3_SIZE),
        "qwen3_30b_a3b": sized(
            NAME,
            (151936, 2048, 48, 32, 4, 128, 6144, 40960),
            moe=softmax_moe(128, 8, 768),
            compute_dtype="bfloat16",
            **QWEN3_SIZE,
        ),
        "qwen3_235b_a22b": sized(
            NAME,
            (151936, 4096, 94, 64, 4, 128, 12288, 40960),
            moe=softmax_moe(128, 8, 1536),
            compute_dtype="bfloat16",
            **QWEN3_SIZE,
        ),
    }


# The published parameter counts of the real sizes (FamilyDef.published).
PUBLISHED = {
    "qwen3_30b_a3b": (
        30.5e9,
        3.3e9,
        0.02,
        "Qwen3-30B-A3B model card: 30.5B total, 3.3B activated (2 significant figures)",
    ),
    "qwen3_235b_a22b": (235e9, 22e9, 0.01, "Qwen3-235B-A22B model card: 235B total, 22B activated"),
}

FAMILY = FamilyDef(
    NAME,
    moe=True,
    hf=HF,
    sizes=sizes,
    published=PUBLISHED,
    dropless=True,
    recipes={"qwen3_30b_a3b": SCALED, "qwen3_235b_a22b": SCALED},
)
