"""Llama (`LlamaForCausalLM`), the family in one file: plain grouped-query attention, SwiGLU, no windows.

`attention_bias` puts biases on q, k, v and o alike; `mlp_bias` (biases on the MLP) has no zoo leaf
and is refused.
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import FamilyDef, Recipe
from zoo.families._hf import SILU, Family, Keys, common_fields, rope_from_params, rope_hf, rope_params

NAME = "llama"


def read(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "Llama's MLP")
    k.refuse_if("mlp_bias", bool, "zoo's MLP has no biases")
    bias = k.flag("attention_bias", False)
    return dict(
        common_fields(k), attention_bias=bias, attention_out_bias=bias, rope=rope_from_params(rope_params(k), k)
    )


def write(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", attention_bias=c.attention_bias, mlp_bias=False, **rope_hf(c.rope))


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    name=NAME,
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, hidden_act="silu"),
    read=read,
    write=write,
)


# --- the named sizes -------------------------------------------------------------------------------


def _llama31(hidden, layers, heads, ffn) -> ModelConfig:
    return ModelConfig(
        family=NAME,
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=ffn,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(
            type="llama3",
            theta=500000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        param_dtype="float32",
        compute_dtype="bfloat16",
    )


def sizes() -> dict[str, ModelConfig]:
    return {
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "llama_tiny_a": ModelConfig(
            family=NAME,
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            rms_norm_eps=1e-5,
            max_position_embeddings=128,
            rope=RopeConfig(theta=10000.0),
        ),
        # ~1.2B Llama shaped like Llama 3.2 1B (tied embeddings); fits one GPU with room for activations.
        "llama_1b": ModelConfig(
            family=NAME,
            vocab_size=128256,
            hidden_size=2048,
            num_layers=16,
            num_heads=32,
            num_kv_heads=8,
            head_dim=64,
            intermediate_size=8192,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope=RopeConfig(
                type="llama3",
                theta=500000.0,
                factor=32.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=8192,
            ),
            compute_dtype="bfloat16",
        ),
        # A 64M Llama (its name is the size class): big enough on CPU that matmuls dominate
        # (benchmarks, memory ordering tests).
        "llama_100m": ModelConfig(
            family=NAME,
            vocab_size=32000,
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            head_dim=64,
            intermediate_size=2048,
            max_position_embeddings=4096,
            rope=RopeConfig(theta=500000.0),
        ),
        "llama3.1_8b": _llama31(4096, 32, 32, 14336),
        "llama3.1_70b": _llama31(8192, 80, 64, 28672),
        "llama3.1_405b": _llama31(16384, 126, 128, 53248),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=HF,
    sizes=sizes,
    recipes={
        # Not published (Llama 3.2 1B's is not): on a TPU v5e at 8 x 2048, 3e-3 rose from 12.27 to 13.15 by
        # step 30 before falling; 3e-4 fell steadily (docs/training.md, "Recipes").
        "llama_1b": Recipe(3e-4, 10, "measured: 3e-4 fell steadily on a TPU v5e where 3e-3 rose first"),
        # Meta publishes no peak for Llama 3's 8B and 70B: Llama 2's for its sizes (Llama 2 paper, table 1).
        "llama3.1_8b": Recipe(3e-4, 2000, "Llama 2 paper, table 1 (7B, 13B): peak 3e-4, 2,000 warmup steps"),
        "llama3.1_70b": Recipe(1.5e-4, 2000, "Llama 2 paper, table 1 (70B): peak 1.5e-4, 2,000 warmup steps"),
        "llama3.1_405b": Recipe(8e-5, 8000, "The Llama 3 Herd of Models, 3.4.1: peak 8e-5, 8,000 warmup steps"),
    },
    published={
        "llama3.1_8b": (8.03e9, None, 0.005, "Meta model card (8.03B, hub)"),
        "llama3.1_70b": (70.6e9, None, 0.005, "Meta model card / hub"),
        "llama3.1_405b": (405.9e9, None, 0.005, "Meta model card / hub"),
    },
)
