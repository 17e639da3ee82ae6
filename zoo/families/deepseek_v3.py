"""DeepSeek-V3 (`DeepseekV3ForCausalLM`), the family in one file: multi-head latent attention, a dense
prefix, then MoE layers with a sigmoid router over expert groups, a correction bias and shared experts.
Kimi K2 is this architecture (`kimi_k2_1t`).

In its config.json `head_dim` is the rope dim (`qk_rope_head_dim`); the MLA dims have their own keys.
Multi-token-prediction layers stored past num_hidden_layers (`num_nextn_predict_layers`) are skipped,
as transformers skips them.
"""

import numpy as np

from zoo.config import MLAConfig, ModelConfig, MoEConfig, RopeConfig
from zoo.families._family import FamilyDef, Recipe
from zoo.families._hf import (
    SILU,
    Family,
    Keys,
    Rule,
    expert_list_rules,
    linear,
    mlp_rules,
    pad_token_id,
    rope_from_params,
    rope_hf,
    rope_params,
    same,
)

NAME = "deepseek_v3"


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
        mla=MLAConfig(
            q_lora_rank=k.opt_int("q_lora_rank"),
            kv_lora_rank=k.integer("kv_lora_rank"),
            qk_nope_head_dim=k.integer("qk_nope_head_dim"),
            qk_rope_head_dim=k.integer("qk_rope_head_dim"),
            v_head_dim=k.integer("v_head_dim"),
        ),
        moe=MoEConfig(
            router="sigmoid_grouped",
            n_routed_experts=k.integer("n_routed_experts"),
            num_experts_per_tok=k.integer("num_experts_per_tok"),
            moe_intermediate_size=k.integer("moe_intermediate_size"),
            n_shared_experts=k.integer("n_shared_experts"),
            n_group=k.integer("n_group"),
            topk_group=k.integer("topk_group"),
            norm_topk_prob=k.flag("norm_topk_prob"),
            routed_scaling_factor=k.number("routed_scaling_factor"),
        ),
    )


def write(c: ModelConfig) -> dict:
    m, e = c.mla, c.moe
    return dict(
        head_dim=m.qk_rope_head_dim,
        q_lora_rank=m.q_lora_rank,
        kv_lora_rank=m.kv_lora_rank,
        qk_nope_head_dim=m.qk_nope_head_dim,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        rope_interleave=c.rope.interleaved,
        first_k_dense_replace=c.first_k_dense_replace,
        n_routed_experts=e.n_routed_experts,
        num_experts_per_tok=e.num_experts_per_tok,
        moe_intermediate_size=e.moe_intermediate_size,
        n_shared_experts=e.n_shared_experts,
        n_group=e.n_group,
        topk_group=e.topk_group,
        norm_topk_prob=e.norm_topk_prob,
        routed_scaling_factor=e.routed_scaling_factor,
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
    # DeepseekV3Config's defaults for keys real configs may leave out
    defaults=dict(
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        q_lora_rank=1536,
        rope_theta=10000.0,
        rope_interleave=True,
        first_k_dense_replace=3,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        scoring_func="sigmoid",
        hidden_act="silu",
    ),
    read=read,
    write=write,
    attention_rules=attention_rules,
    moe_rules=moe_rules,
    extra_layers_key="num_nextn_predict_layers",
)


# --- the named sizes -------------------------------------------------------------------------------


def _dsv3_like(**kw) -> ModelConfig:
    mla = kw.pop("mla")
    moe = kw.pop("moe")
    base = dict(
        family=NAME,
        rms_norm_eps=1e-6,
        num_kv_heads=kw.get("num_heads", 1),
        param_dtype="float32",
        compute_dtype="bfloat16",
    )
    base.update(kw)
    return ModelConfig(mla=mla, moe=moe, **base)


def sizes() -> dict[str, ModelConfig]:
    return {
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "dsv3_tiny_a": ModelConfig(
            family=NAME,
            vocab_size=256,
            hidden_size=64,
            num_layers=3,
            num_heads=4,
            num_kv_heads=4,
            intermediate_size=128,
            rms_norm_eps=1e-6,
            max_position_embeddings=128,
            first_k_dense_replace=1,
            rope=RopeConfig(theta=10000.0, interleaved=True),
            mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
            moe=MoEConfig(
                router="sigmoid_grouped",
                n_routed_experts=8,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                n_shared_experts=1,
                n_group=2,
                topk_group=1,
                norm_topk_prob=True,
                routed_scaling_factor=2.5,
            ),
        ),
        # ~2B total / ~0.6B active DeepSeek-V3-shaped MoE (MLA, 64 experts, group-limited top-6).
        "dsv3_2b": _dsv3_like(
            vocab_size=32000,
            hidden_size=1024,
            num_layers=12,
            num_heads=16,
            intermediate_size=4096,
            max_position_embeddings=8192,
            first_k_dense_replace=1,
            rope=RopeConfig(theta=10000.0, interleaved=True),
            mla=MLAConfig(q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
            moe=MoEConfig(
                router="sigmoid_grouped",
                n_routed_experts=64,
                num_experts_per_tok=6,
                moe_intermediate_size=704,
                n_shared_experts=2,
                n_group=8,
                topk_group=4,
                routed_scaling_factor=2.5,
            ),
        ),
        # ~90M DeepSeek-V3-shaped MoE for CPU benchmarks.
        "dsv3_100m": _dsv3_like(
            vocab_size=32000,
            hidden_size=512,
            num_layers=6,
            num_heads=8,
            intermediate_size=2048,
            max_position_embeddings=4096,
            first_k_dense_replace=1,
            rope=RopeConfig(theta=10000.0, interleaved=True),
            mla=MLAConfig(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
            moe=MoEConfig(
                router="sigmoid_grouped",
                n_routed_experts=16,
                num_experts_per_tok=2,
                moe_intermediate_size=512,
                n_shared_experts=1,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
            ),
        ),
        "deepseek_v3_671b": _dsv3_like(
            vocab_size=129280,
            hidden_size=7168,
            num_layers=61,
            num_heads=128,
            intermediate_size=18432,
            max_position_embeddings=163840,
            first_k_dense_replace=3,
            rope=RopeConfig(
                type="yarn",
                theta=10000.0,
                interleaved=True,
                factor=40.0,
                original_max_position_embeddings=4096,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            mla=MLAConfig(
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                router="sigmoid_grouped",
                n_routed_experts=256,
                num_experts_per_tok=8,
                moe_intermediate_size=2048,
                n_shared_experts=1,
                n_group=8,
                topk_group=4,
                routed_scaling_factor=2.5,
            ),
        ),
        # Kimi K2: DeepSeek-V3's architecture with 384 experts, 64 heads, one dense layer, no expert groups.
        "kimi_k2_1t": _dsv3_like(
            vocab_size=163840,
            hidden_size=7168,
            num_layers=61,
            num_heads=64,
            intermediate_size=18432,
            max_position_embeddings=131072,
            first_k_dense_replace=1,
            rope=RopeConfig(
                type="yarn",
                theta=50000.0,
                interleaved=True,
                factor=64.0,
                original_max_position_embeddings=4096,
                beta_fast=1.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=1.0,
            ),
            mla=MLAConfig(
                q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
            ),
            moe=MoEConfig(
                router="sigmoid_grouped",
                n_routed_experts=384,
                num_experts_per_tok=8,
                moe_intermediate_size=2048,
                n_shared_experts=1,
                n_group=1,
                topk_group=1,
                routed_scaling_factor=2.827,
            ),
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
