"""Llama (`LlamaForCausalLM`): plain grouped-query attention, SwiGLU, no windows.

`attention_bias` puts biases on q, k, v and o alike; `mlp_bias` (biases on the MLP) has no zoo leaf
and is refused.
"""

from zoo.config import ModelConfig
from zoo.hf.rules import SILU, Family, Keys, common_fields, rope_from_params, rope_hf, rope_params
from zoo.tags import LLAMA


def read(k: Keys) -> dict:
    k.choice("hidden_act", SILU, "Llama's MLP")
    k.refuse_if("mlp_bias", bool, "zoo's MLP has no biases")
    bias = k.flag("attention_bias", False)
    return dict(common_fields(k), attention_bias=bias, attention_out_bias=bias, rope=rope_from_params(rope_params(k), k))


def write(c: ModelConfig) -> dict:
    return dict(hidden_act="silu", attention_bias=c.attention_bias, mlp_bias=False, **rope_hf(c.rope))


FAMILY = Family(
    name=LLAMA,
    model_type="llama",
    architecture="LlamaForCausalLM",
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=2048, rope_theta=10000.0, hidden_act="silu"),
    read=read,
    write=write,
)
