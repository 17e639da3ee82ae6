"""Gemma 3 text (`Gemma3ForCausalLM`, model_type `gemma3_text`): the family in one file.

Norms scale by (1 + w) (the file stores w) and wrap both branches: `input_layernorm` and
`post_attention_layernorm` around attention (the latter on its output, before the residual add),
`pre_feedforward_layernorm` and `post_feedforward_layernorm` around the GeGLU MLP
(`gelu_pytorch_tanh`). q/k norms before RoPE; the softmax scale is `query_pre_attn_scalar ** -0.5`;
embeddings are scaled by sqrt(hidden); `final_logit_softcapping` caps the logits.

Per-layer attention: `layer_types`, or in older configs `sliding_window_pattern` P (layer i slides iff
(i + 1) % P != 0). The stale private `_sliding_window_pattern` that transformers writes next to
`layer_types` is ignored. Rope per layer type: transformers 5 nests `rope_parameters` by layer type;
the legacy keys give the global layers `rope_theta` + `rope_scaling` and the sliding layers a default
rope of `rope_local_base_freq`. transformers reads yarn's `truncate` from the top level of
`rope_parameters` only, so a nested yarn always truncates; zoo does the same.

transformers' Gemma 3 stores `attn_logit_softcapping` but never applies it: zoo accepts the key, warns,
and computes what transformers computes. `use_bidirectional_attention` (EmbeddingGemma) is refused.
"""

import warnings
from typing import Optional

from zoo.config import LAYER_TYPES, ModelConfig, RopeConfig
from zoo.errors import CheckpointError
from zoo.families._family import SCALED, FamilyDef, sized
from zoo.families._hf import Family, Keys, common_fields, explicit_layer_types, layer_types_of, rope_from_params
from zoo.families._hf import rope_params, rope_to_params, window_fields

NAME = "gemma3"


def _nested_rope(k: Keys, params: dict, layer_type: str) -> RopeConfig:
    if not isinstance(params.get(layer_type), dict):
        raise k.error(f"rope_parameters is keyed by layer type but has no {layer_type!r} entry")
    p = {key: v for key, v in params[layer_type].items() if key != "truncate"}
    return rope_from_params(p, k, where=f"rope_parameters.{layer_type}")


def _ropes(k: Keys) -> tuple[RopeConfig, RopeConfig]:
    params = k.cfg.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        return _nested_rope(k, params, "full_attention"), _nested_rope(k, params, "sliding_attention")
    # legacy: rope_scaling belongs to the global layers only
    full = {key: v for key, v in rope_params(k).items() if key != "truncate"}
    local = RopeConfig(theta=k.number("rope_local_base_freq"))
    return rope_from_params(full, k), local


def read(k: Keys) -> dict:
    k.choice("hidden_activation", ("gelu_pytorch_tanh",), "Gemma 3's MLP")
    k.refuse_if("use_bidirectional_attention", bool, "zoo's attention is causal")
    if k.cfg.get("attn_logit_softcapping") is not None:
        warnings.warn(f"{k.source}: attn_logit_softcapping is ignored, as transformers' Gemma 3 ignores it")
    fields = common_fields(k)
    n = fields["num_layers"]
    types = explicit_layer_types(k, n)
    if types is None:
        period = k.integer("sliding_window_pattern")
        if period < 1:
            raise k.error(f"sliding_window_pattern must be >= 1, got {period}")
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    rope, rope_local = _ropes(k)
    bias = k.flag("attention_bias")
    return dict(
        fields,
        rope=rope,
        rope_local=rope_local,
        attention_bias=bias,
        attention_out_bias=bias,
        qk_norm=True,
        query_pre_attn_scalar=k.number("query_pre_attn_scalar"),
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        mlp_activation="gelu_tanh",
        final_logit_softcap=k.opt_float("final_logit_softcapping"),
        **window_fields(k, types, k.opt_int("sliding_window")),
    )


def _int_scalar(value: Optional[float]) -> Optional[int]:
    """Gemma3TextConfig types query_pre_attn_scalar as an int and refuses 24.0 where 24 is meant; zoo
    keeps a float (it only takes its square root)."""
    if value is None:
        return None  # config_to_hf's read-back refuses it (transformers' default is 256, not head_dim)
    if not float(value).is_integer():
        raise CheckpointError(
            f"a gemma3_text config.json cannot express query_pre_attn_scalar={value!r}: "
            "transformers' Gemma3TextConfig holds an integer there; use a whole number"
        )
    return int(value)


def write(c: ModelConfig) -> dict:
    local = c.rope_local or c.rope
    types = layer_types_of(c)
    out = dict(
        hidden_activation="gelu_pytorch_tanh",
        attention_bias=c.attention_bias,
        query_pre_attn_scalar=_int_scalar(c.query_pre_attn_scalar),
        final_logit_softcapping=c.final_logit_softcap,
        attn_logit_softcapping=None,
        sliding_window=c.sliding_window,
        layer_types=types,
        use_bidirectional_attention=False,
        rope_parameters={"full_attention": rope_to_params(c.rope), "sliding_attention": rope_to_params(local)},
        # transformers 4 reads these instead
        rope_theta=c.rope.theta,
        rope_scaling=None
        if c.rope.type == "default"
        else {key: v for key, v in rope_to_params(c.rope).items() if key != "rope_theta"},
        rope_local_base_freq=local.theta,
    )
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if full and types == [
        "sliding_attention" if (i + 1) % (full[0] + 1) else "full_attention" for i in range(c.num_layers)
    ]:
        out["sliding_window_pattern"] = full[0] + 1
    return out


# --- the Hugging Face mapping --------------------------------------------------------------------

HF = Family(
    name=NAME,
    model_type="gemma3_text",
    architecture="Gemma3ForCausalLM",
    # Gemma3TextConfig's defaults: the model's, its attention's
    defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=131072, tie_word_embeddings=True)
    | dict(hidden_activation="gelu_pytorch_tanh", attention_bias=False, head_dim=256, query_pre_attn_scalar=256)
    | dict(rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window=4096, sliding_window_pattern=6),
    read=read,
    write=write,
)


# --- the named sizes -------------------------------------------------------------------------------


def _pattern(layers: int, period: int = 6) -> list[str]:
    """Every `period`-th layer global, the rest sliding (5 local : 1 global)."""
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(layers)]


def _size(dims: tuple, scalar: float, window: int, period: int = 6, **fields) -> ModelConfig:
    """Every Gemma 3 size: (1 + w) sandwich norms, q/k norms, scaled and tied embeddings, GeGLU, a
    local rope of theta 1e4, `window` on the sliding layers of its pattern; `scalar` the softmax's."""
    return sized(
        NAME,
        dims,
        qk_norm=True,
        norm_weight_offset=1.0,
        sandwich_norms=True,
        scale_embeddings=True,
        mlp_activation="gelu_tanh",
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=scalar,
        sliding_window=window,
        layer_types=_pattern(dims[2], period),
        rope_local=RopeConfig(theta=10000.0),
        **fields,
    )


def sizes() -> dict[str, ModelConfig]:
    rope = RopeConfig(theta=1000000.0)
    return {
        # dims: vocab, hidden, layers, heads, kv heads, head dim, MLP width, context (zoo.families._family.DIMS)
        "gemma3_tiny_a": _size((256, 64, 4, 4, 1, 32, 128, 256), 24.0, 8, period=4, rope=rope),
        "gemma3_100m": _size((32000, 768, 12, 12, 4, 64, 2048, 4096), 64.0, 512, rope=rope),
        "gemma3_27b": _size(
            (262208, 5376, 62, 32, 16, 128, 21504, 131072),
            168.0,
            1024,
            rope=RopeConfig(type="linear", theta=1000000.0, factor=8.0),
            pad_token_id=0,
            compute_dtype="bfloat16",
        ),
    }


FAMILY = FamilyDef(
    name=NAME,
    hf=HF,
    sizes=sizes,
    recipes={"gemma3_27b": SCALED},
    published={
        "gemma3_27b": (27.016e9, None, 0.01, "Gemma 3 report, table 1: 1,416M embedding + 25,600M non-embedding (text)")
    },
)
