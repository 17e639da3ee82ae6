"""DeepSeek-V3 (`DeepseekV3ForCausalLM`), the family in one file: multi-head latent attention, a dense
prefix, then MoE layers with a sigmoid router over expert groups, a correction bias and shared experts.
Kimi K2 is this architecture (`kimi_k2_1t`).

In its config.json `head_dim` is the rope dim (`qk_rope_head_dim`); the MLA dims have their own keys.
Multi-token-prediction layers stored past num_hidden_layers (`num_nextn_predict_layers`) are skipped,
as transformers skips them.
"""

from typing import Optional

import numpy as np

from zoo.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from zoo.families._family import FamilyDef, Recipe, routed, sized
from zoo.families._hf import SILU, Family, Keys, Rule, expert_list_rules, linear, mlp_rules, pad_token_id
from zoo.families._hf import rope_from_params, rope_hf, rope_params, same

NAME = "deepseek_v3"

# The config.json keys of `_mla`'s arguments after q_lora_rank (which may be null), and of `_moe`'s: the
# names of their MLAConfig and MoEConfig fields too.
_MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MOE_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group")
_MOE_KEYS += ("topk_group",)


def read(k: Keys) -> dict:
    k.choice("scoring_func", ("sigmoid",), "DeepSeek-V3's router")
    k.choice("hidden_act", SILU, "DeepSeek-V3's MLP")
    k.refuse_if("attention_bias", bool, "zoo's MLA projections have no biases")
    heads = k.integer("num_attention_heads")
    return dict(
        vocab_size=k.integer("vocab_size"),
        hidden_size=k.integer("hidden_size"),
        num_layers=k.integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=heads,  # MLA: every head its own k/v from the shared latent
        intermediate_size=k.integer("intermediate_size"),
        rms_norm_eps=k.number("rms_norm_eps"),
        max_position_embeddings=k.integer("max_position_embeddings"),
        tie_word_embeddings=k.flag("tie_word_embeddings", False),
        pad_token_id=pad_token_id(k),
        first_k_dense_replace=k.integer("first_k_dense_replace"),
        rope=rope_from_params(rope_params(k), k, interleaved=k.flag("rope_interleave")),
        mla=_mla(k.opt_int("q_lora_rank"), *(k.integer(key) for key in _MLA_KEYS)),
        moe=_moe(
            *(k.integer(key) for key in _MOE_KEYS),
            norm_topk_prob=k.flag("norm_topk_prob"),
            scale=k.number("routed_scaling_factor"),
        ),
    )


def write(c: ModelConfig) -> dict:
    m, e = c.mla, c.moe
    return dict(
        head_dim=m.qk_rope_head_dim,
        q_lora_rank=m.q_lora_rank,
        **{key: getattr(m, key) for key in _MLA_KEYS},
        rope_interleave=c.rope.interleaved,
        first_k_dense_replace=c.first_k_dense_replace,
        **{key: getattr(e, key) for key in (*_MOE_KEYS, "norm_topk_prob", "routed_scaling_factor")},
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        num_nextn_predict_layers=0,
        hidden_act="silu",
        attention_bias=False,
        **rope_hf(c.rope),
    )


def _kv_b(heads: int, nope: int, v: int) -> Rule:
    """kv_b_proj `[heads*(nope+v), kv_lora]`, rows per head `[k_nope | v]` <-> wk_b, wv_b `[kv_lora, heads, .]`."""

    def to_zoo(w, shape_k, shape_v):
        per_head = w.reshape(heads, nope + v, -1)
        return per_head[:, :nope].transpose(2, 0, 1), per_head[:, nope:].transpose(2, 0, 1)

    def to_hub(wk, wv):
        both = np.concatenate([np.asarray(wk).transpose(1, 2, 0), np.asarray(wv).transpose(1, 2, 0)], axis=1)
        return (both.reshape(heads * (nope + v), -1),)

    return Rule(("self_attn.kv_b_proj.weight",), ("attn.wk_b", "attn.wv_b"), to_zoo, to_hub)


def attention_rules(c: ModelConfig) -> list[Rule]:
    m, a = c.mla, "self_attn."
    if m.q_lora_rank is None:
        rules = [linear(a + "q_proj.weight", "attn.wq_b")]
    else:
        rules = [
            linear(a + "q_a_proj.weight", "attn.wq_a"),
            same(a + "q_a_layernorm.weight", "attn.q_norm.weight"),
            linear(a + "q_b_proj.weight", "attn.wq_b"),
        ]
    return rules + [
        linear(a + "kv_a_proj_with_mqa.weight", "attn.wkv_a"),
        same(a + "kv_a_layernorm.weight", "attn.kv_norm.weight"),
        _kv_b(c.num_heads, m.qk_nope_head_dim, m.v_head_dim),
        linear(a + "o_proj.weight", "attn.wo", in_axes=2),
    ]


def moe_rules(c: ModelConfig) -> list[Rule]:
    rules = [
        linear("mlp.gate.weight", "ffn.router"),
        same("mlp.gate.e_score_correction_bias", "ffn.e_score_correction_bias"),
        *expert_list_rules(c, "mlp.experts.{e}.{proj}.weight", "gate_proj", "up_proj", "down_proj"),
    ]
    if c.moe.n_shared_experts:
        rules += mlp_rules("mlp.shared_experts", "ffn.shared")
    return rules


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    name=NAME,
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    # DeepseekV3Config's defaults for keys real configs may leave out: the model's, its attention's, its experts'
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=4096, hidden_act="silu", first_k_dense_replace=3)
    | dict(q_lora_rank=1536, rope_theta=10000.0, rope_interleave=True)
    | dict(n_shared_experts=1, n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5)
    | dict(scoring_func="sigmoid"),
    read=read,
    write=write,
    attention_rules=attention_rules,
    moe_rules=moe_rules,
    extra_layers_key="num_nextn_predict_layers",
)


# --- the named sizes -------------------------------------------------------------------------------


def _mla(q_lora: Optional[int], kv_lora: int, nope: int, rope: int, v: int) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v
    )


def _moe(
    experts: int, top_k: int, width: int, shared: int, groups: int, top_groups: int, scale: float = 2.5, **fields
) -> MoEConfig:
    """The sigmoid router over expert groups: `experts` of `width`, `top_k` of the `top_groups` best of
    `groups` groups, `shared` shared experts, the weights scaled by `scale`; other MoEConfig `fields`."""
    grouping = dict(shared=shared, groups=groups, top_groups=top_groups)
    return routed(experts, top_k, width, "sigmoid_grouped", scale=scale, **grouping, **fields)


def _yarn(theta: float, factor: float, beta_fast: float) -> RopeConfig:
    return RopeConfig(
        type="yarn",
        theta=theta,
        interleaved=True,
        factor=factor,
        original_max_position_embeddings=4096,
        beta_fast=beta_fast,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )


def _size(dims: tuple, dense: int, rope: RopeConfig, mla: MLAConfig, moe: MoEConfig, **fields) -> ModelConfig:
    """Every DeepSeek-V3 size: `dense` dense layers first, then MoE ones; eps 1e-6; a kv head per head."""
    return sized(
        NAME,
        dims,
        num_kv_heads=dims[3],
        rms_norm_eps=1e-6,
        first_k_dense_replace=dense,
        rope=rope,
        mla=mla,
        moe=moe,
        **fields,
    )


def sizes() -> dict[str, ModelConfig]:
    small_rope = RopeConfig(theta=10000.0, interleaved=True)
    full_mla = _mla(1536, 512, 128, 64, 128)
    mixed = dict(param_dtype="float32", compute_dtype="bfloat16")
    return {
        # dims: vocab, hidden, layers, heads, kv heads (one per head), head dim (MLA's are its own),
        # MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "dsv3_tiny_a": _size(
            (256, 64, 3, 4, None, None, 128, 128), 1, small_rope, _mla(32, 16, 16, 8, 16), _moe(8, 2, 32, 1, 2, 1)
        ),
        # ~2B total / ~0.6B active DeepSeek-V3-shaped MoE (MLA, 64 experts, group-limited top-6).
        "dsv3_2b": _size(
            (32000, 1024, 12, 16, None, None, 4096, 8192),
            1,
            small_rope,
            _mla(512, 256, 64, 32, 64),
            _moe(64, 6, 704, 2, 8, 4),
            **mixed,
        ),
        # ~90M DeepSeek-V3-shaped MoE for CPU benchmarks.
        "dsv3_100m": _size(
            (32000, 512, 6, 8, None, None, 2048, 4096),
            1,
            small_rope,
            _mla(256, 128, 64, 32, 64),
            _moe(16, 2, 512, 1, 4, 2),
            **mixed,
        ),
        "deepseek_v3_671b": _size(
            (129280, 7168, 61, 128, None, None, 18432, 163840),
            3,
            _yarn(10000.0, 40.0, 32.0),
            full_mla,
            _moe(256, 8, 2048, 1, 8, 4),
            **mixed,
        ),
        # Kimi K2: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, no expert groups.
        "kimi_k2_1t": _size(
            (163840, 7168, 61, 64, None, None, 18432, 131072),
            1,
            _yarn(50000.0, 64.0, 1.0),
            full_mla,
            _moe(384, 8, 2048, 1, 1, 1, scale=2.827),
            **mixed,
        ),
    }


FAMILY = FamilyDef(
    name=NAME,
    moe=True,
    mla=True,
    hf=HF,
    sizes=sizes,
    recipes={
        "deepseek_v3_671b": Recipe(2.2e-4, 2000, "DeepSeek-V3 report, 4.2: 0 to 2.2e-4 over the first 2K steps"),
        "kimi_k2_1t": Recipe(2e-4, 500, "Kimi K2 technical report: 2e-4 after 500 warmup steps (with MuonClip)"),
    },
    published={
        "deepseek_v3_671b": (671e9, None, 0.01, "DeepSeek-V3 report: 671B total without the 14B MTP module"),
        # The hub's 1026.5B includes the FP8 checkpoint's weight_scale_inv blocks (62.5M scales, one per
        # 128 x 128 block of every quantised matrix), which a float model does not have.
        "kimi_k2_1t": (
            1.03e12,
            32e9,
            (0.01, 0.03),
            "hub (moonshotai/Kimi-K2-Instruct): 1.03T total; Kimi K2 model card: '32B' activated (2 significant "
            "figures)",
        ),
    },
    dropless=True,
)
