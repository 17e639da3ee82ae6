"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), the family in one file: Llama's blocks with biases on q, k, v
(never on o or the MLP), added before RoPE. `head_dim` is hidden / heads. Sliding windows by depth
(`use_sliding_window`, `max_window_layers`; zoo/families/_qwen.py).
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import SCALED, FamilyDef, sized
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


def _size(dims: tuple, **fields) -> ModelConfig:
    """Every Qwen2 size: q/k/v biases, eps 1e-6, rope theta 1e6."""
    return sized(NAME, dims, rms_norm_eps=1e-6, attention_bias=True, rope=RopeConfig(theta=1000000.0), **fields)


def sizes() -> dict[str, ModelConfig]:
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # The reference model of tests/data (Hugging Face transformers computed its outputs).
        "qwen2_tiny_a": _size((256, 112, 2, 14, 2, 8, 160, 256), tie_word_embeddings=True),
        # ~100M for a CPU run (docs/models.md records one).
        "qwen2_100m": _size((32000, 768, 12, 12, 2, 64, 2048, 4096), tie_word_embeddings=True),
        "qwen2.5_7b": _size((152064, 3584, 28, 28, 4, 128, 18944, 131072), compute_dtype="bfloat16"),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=HF,
    sizes=sizes,
    recipes={"qwen2.5_7b": SCALED},
    published={"qwen2.5_7b": (7.61e9, None, 0.01, "Qwen2.5-7B model card: 7.61B")},
    like="llama",  # + q/k/v biases
)
