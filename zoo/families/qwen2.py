"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), the family in one file: Llama's blocks with biases on q, k, v
(never on o or the MLP), added before RoPE. `head_dim` is hidden / heads. Sliding windows by depth
(`use_sliding_window`, `max_window_layers`; zoo/families/_qwen.py).
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import SCALED, FamilyDef
from zoo.families._hf import Family, Keys, rope_hf
from zoo.families._qwen import DEFAULTS, read_dense, window_by_depth_hf

NAME = "qwen2"


def read(k: Keys) -> dict:
    return dict(read_dense(k), attention_bias=True)


def write(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", **window_by_depth_hf(c), **rope_hf(c.rope))


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(NAME, "qwen2", "Qwen2ForCausalLM", DEFAULTS, read, write)


# --- the named sizes -------------------------------------------------------------------------------


def sizes() -> dict[str, ModelConfig]:
    return {
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "qwen2_tiny_a": ModelConfig(
            family=NAME,
            vocab_size=256,
            hidden_size=112,
            num_layers=2,
            num_heads=14,
            num_kv_heads=2,
            head_dim=8,
            intermediate_size=160,
            rms_norm_eps=1e-6,
            max_position_embeddings=256,
            tie_word_embeddings=True,
            attention_bias=True,
            rope=RopeConfig(theta=1000000.0),
        ),
        # ~100M for a CPU run (docs/models.md records one).
        "qwen2_100m": ModelConfig(
            family=NAME,
            vocab_size=32000,
            hidden_size=768,
            num_layers=12,
            num_heads=12,
            num_kv_heads=2,
            head_dim=64,
            intermediate_size=2048,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            attention_bias=True,
            rope=RopeConfig(theta=1000000.0),
        ),
        "qwen2.5_7b": ModelConfig(
            family=NAME,
            vocab_size=152064,
            hidden_size=3584,
            num_layers=28,
            num_heads=28,
            num_kv_heads=4,
            head_dim=128,
            intermediate_size=18944,
            rms_norm_eps=1e-6,
            max_position_embeddings=131072,
            attention_bias=True,
            rope=RopeConfig(theta=1000000.0),
            compute_dtype="bfloat16",
        ),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=HF,
    sizes=sizes,
    recipes={"qwen2.5_7b": SCALED},
    published={"qwen2.5_7b": (7.61e9, None, 0.01, "Qwen2.5-7B model card: 7.61B")},
    like="llama",  # + q/k/v biases
)
