"""Qwen3 (`Qwen3ForCausalLM`), the family in one file: Llama's blocks with a per-head q/k RMSNorm before
RoPE. `attention_bias` puts biases on q, k, v and o alike; `head_dim` defaults to 128 when the key is
absent. Sliding windows by depth (`use_sliding_window`, `max_window_layers`; zoo/families/_qwen.py).
"""

from zoo.config import ModelConfig
from zoo.families._family import SCALED, FamilyDef, sized
from zoo.families._hf import Family, Keys, rope_hf
from zoo.families._qwen import DEFAULTS, QWEN3_SIZE, read_dense, window_by_depth_hf

NAME = "qwen3"


def read(k: Keys) -> dict:
    bias = k.flag("attention_bias")
    return dict(read_dense(k), qk_norm=True, attention_bias=bias, attention_out_bias=bias)


def write(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", attention_bias=c.attention_bias, **window_by_depth_hf(c), **rope_hf(c.rope))


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(NAME, "qwen3", "Qwen3ForCausalLM", dict(DEFAULTS, head_dim=128), read, write)


# --- the named sizes -------------------------------------------------------------------------------


def sizes() -> dict[str, ModelConfig]:
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "qwen3_tiny_a": sized(NAME, (256, 64, 2, 4, 2, 16, 128, 256), tie_word_embeddings=True, **QWEN3_SIZE),
        # ~100M for a CPU run (docs/models.md records one).
        "qwen3_100m": sized(NAME, (32000, 768, 12, 12, 4, 64, 2048, 4096), tie_word_embeddings=True, **QWEN3_SIZE),
        "qwen3_8b": sized(NAME, (151936, 4096, 36, 32, 8, 128, 12288, 40960), compute_dtype="bfloat16", **QWEN3_SIZE),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=HF,
    sizes=sizes,
    recipes={"qwen3_8b": SCALED},
    published={"qwen3_8b": (8.2e9, None, 0.01, "Qwen3-8B model card: 8.2B")},
    like="llama",  # + q/k norms
)
