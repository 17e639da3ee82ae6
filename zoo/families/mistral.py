"""Mistral (`MistralForCausalLM`, model_type `mistral`): Llama with a sliding window on every layer.

transformers' Mistral masks every layer with `sliding_window` (4096 by default; null means full causal
attention) and takes `head_dim` from the config, or hidden / heads when it is absent or null (Mistral-Nemo
gives 128 where hidden / heads = 160). No biases anywhere; `layer_types` is not a Mistral key (transformers
warns and points to Ministral), so zoo refuses it rather than run a pattern transformers would not.
"""

from zoo.config import ModelConfig, RopeConfig
from zoo.families._family import SCALED, FamilyDef, sized
from zoo.families._hf import SILU, Family, Keys, common_fields, every_layer_window, rope_from_params, rope_hf
from zoo.families._hf import rope_params

NAME = "mistral"


def read(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "Mistral's MLP")
    k.refuse_if(
        "layer_types", lambda v: v is not None, "Mistral slides every layer; a per-layer pattern is Ministral's"
    )
    fields = common_fields(k)
    return dict(
        fields,
        rope=rope_from_params(rope_params(k), k),
        **every_layer_window(k, fields["num_layers"], k.opt_int("sliding_window")),
    )


def write(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", sliding_window=c.sliding_window, **rope_hf(c.rope))


def sizes() -> dict[str, ModelConfig]:
    rope = RopeConfig(theta=1e4)
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        # head_dim 10 (not hidden / heads = 16, and an odd number of rotated pairs), window 8 < a 32-token row
        "mistral_tiny_a": sized(
            NAME, (256, 64, 2, 4, 2, 10, 128, 2048), rms_norm_eps=1e-5, sliding_window=8, rope=rope
        ),
        # Mistral-7B-v0.1
        "mistral_7b": sized(
            NAME,
            (32000, 4096, 32, 32, 8, 128, 14336, 32768),
            rms_norm_eps=1e-5,
            sliding_window=4096,
            rope=rope,
            compute_dtype="bfloat16",
        ),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=Family(
        NAME,
        "mistral",
        "MistralForCausalLM",
        # MistralConfig's defaults for the keys a config.json may leave out
        dict(
            rms_norm_eps=1e-6,
            max_position_embeddings=4096 * 32,
            rope_theta=10000.0,
            hidden_act="silu",
            sliding_window=4096,
        ),
        read,
        write,
    ),
    sizes=sizes,
    recipes={"mistral_7b": SCALED},
    published={"mistral_7b": (7.24e9, None, 0.005, "hub (mistralai/Mistral-7B-v0.1): 7.24B")},
    like="llama",
)
