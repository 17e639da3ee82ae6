"""Llama (`LlamaForCausalLM`), the family in one file: plain grouped-query attention, SwiGLU, no windows.

`attention_bias` puts biases on q, k, v and o alike; `mlp_bias` (biases on the MLP) has no zoo leaf
and is refused.
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import FamilyDef, Recipe, sized
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


def _llama3_rope(factor: float) -> RopeConfig:
    return RopeConfig(
        type="llama3",
        theta=500000.0,
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


def _llama31(hidden, layers, heads, ffn) -> ModelConfig:
    return sized(
        NAME,
        (128256, hidden, layers, heads, 8, 128, ffn, 131072),
        rms_norm_eps=1e-5,
        rope=_llama3_rope(8.0),
        param_dtype="float32",
        compute_dtype="bfloat16",
    )


def sizes() -> dict[str, ModelConfig]:
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "llama_tiny_a": sized(NAME, (256, 64, 2, 4, 2, 16, 128, 128), rms_norm_eps=1e-5, rope=RopeConfig(theta=1e4)),
        # ~1.2B Llama shaped like Llama 3.2 1B (tied embeddings); fits one GPU with room for activations.
        "llama_1b": sized(
            NAME,
            (128256, 2048, 16, 32, 8, 64, 8192, 131072),
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope=_llama3_rope(32.0),
            compute_dtype="bfloat16",
        ),
        # A 64M Llama (its name is the size class): big enough on CPU that matmuls dominate
        # (benchmarks, memory ordering tests).
        "llama_100m": sized(NAME, (32000, 512, 8, 8, 4, 64, 2048, 4096), rope=RopeConfig(theta=500000.0)),
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
