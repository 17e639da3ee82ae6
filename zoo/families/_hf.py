"""The kit a family's Hugging Face mapping is written with: config.json key access (`Keys`), the common
keys, both rope styles (transformers 5's `rope_parameters` and the hub's legacy `rope_theta` +
`rope_scaling`), per-layer attention types, the `Rule`s pairing hub tensors with zoo leaves (q/k/v/o
with optional biases, q/k norms, sinks, the norms around each block, the gated MLP, per-expert tensor
lists) and the `Family` record. The family modules (`zoo.families.llama`, `zoo.families.mistral`, ...)
write their mapping with it; the loader, `zoo.hf`, finds the families through the registry
(`zoo.families`) and dispatches on them. It stands below both, so the families need nothing of the loader.

Hub linear weights are `[out, in]`; zoo weights are einsum layouts `[in, ..., out]`. A `Rule` converts
both ways by transposing, reshaping, splitting or stacking only, so a round trip is exact.
"""

import dataclasses
import json
import math
from collections.abc import Callable, Sequence
from typing import Optional

import numpy as np

from zoo.config import LAYER_TYPES, ROPE_TYPES, ModelConfig, RopeConfig
from zoo.errors import CheckpointError
from zoo.nn.mlp import GatedMLP

# --- config.json values --------------------------------------------------------------------------

_REQUIRED = object()


class Keys:
    """A parsed config.json, read with the family's defaults: what its transformers config class
    assumes for an absent key. A null counts as absent, except through `opt_int` / `opt_float`, for
    keys where null means "none" (a window, a softcap, head_dim). A missing required key or a value of
    the wrong type raises a CheckpointError naming the file and the key."""

    def __init__(self, cfg: dict, defaults: dict, source: str):
        self.cfg, self.defaults, self.source = cfg, defaults, source

    def error(self, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {message}")

    def has(self, key: str) -> bool:
        return self.cfg.get(key) is not None

    def raw(self, key: str, default=_REQUIRED):
        value = self.cfg.get(key)
        if value is None:
            value = self.defaults.get(key, default)
        if value is _REQUIRED:
            raise self.error(f"{key!r} is missing; the model cannot be built without it")
        return value

    def _number(self, key: str, value, integer: bool):
        if value is None:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (integer and not float(value).is_integer())
        ):
            raise self.error(f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}")
        return int(value) if integer else float(value)

    def integer(self, key: str, default=_REQUIRED) -> Optional[int]:
        return self._number(key, self.raw(key, default), integer=True)

    def number(self, key: str, default=_REQUIRED) -> Optional[float]:
        return self._number(key, self.raw(key, default), integer=False)

    def opt_int(self, key: str) -> Optional[int]:
        """Absent: the family's default (None without one); null: None."""
        return self._number(key, self.cfg[key] if key in self.cfg else self.defaults.get(key), integer=True)

    def opt_float(self, key: str) -> Optional[float]:
        return self._number(key, self.cfg[key] if key in self.cfg else self.defaults.get(key), integer=False)

    def flag(self, key: str, default=_REQUIRED) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {value!r}")
        return value

    def choice(self, key: str, allowed: Sequence[str], what: str) -> str:
        value = self.raw(key)
        if value not in allowed:
            raise self.error(f"{key} {value!r} is not supported: {what} uses {' or '.join(map(repr, allowed))}")
        return value

    def refuse_if(self, key: str, bad: Callable[[object], bool], why: str) -> None:
        value = self.cfg.get(key)
        if value is not None and bad(value):
            raise self.error(f"{key}={json.dumps(value)} is not supported: {why}")


SILU = ("silu", "swish")  # transformers maps both names to SiLU


def common_fields(k: Keys) -> dict:
    """The ModelConfig fields every grouped-query family reads from the same keys."""
    heads = k.integer("num_attention_heads")
    hidden = k.integer("hidden_size")
    head_dim = k.opt_int("head_dim")
    if head_dim is None:  # transformers: `getattr(config, "head_dim", None) or hidden_size // num_attention_heads`
        if hidden % heads:
            raise k.error(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}; give head_dim")
        head_dim = hidden // heads
    return dict(
        vocab_size=k.integer("vocab_size"),
        hidden_size=hidden,
        num_layers=k.integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=k.integer("num_key_value_heads", heads),
        head_dim=head_dim,
        intermediate_size=k.integer("intermediate_size"),
        rms_norm_eps=k.number("rms_norm_eps"),
        max_position_embeddings=k.integer("max_position_embeddings"),
        tie_word_embeddings=k.flag("tie_word_embeddings", False),
        pad_token_id=pad_token_id(k),
    )


def pad_token_id(k: Keys) -> Optional[int]:
    """transformers builds the embedding with padding_idx=pad_token_id (that row gets no gradient); an id
    outside the vocabulary would be refused there, so it cannot be a padding row here either."""
    pad = k.opt_int("pad_token_id")
    return pad if pad is not None and 0 <= pad < k.integer("vocab_size") else None


def common_hf(c: ModelConfig, family: "Family") -> dict:
    return {
        "model_type": family.model_type,
        "architectures": [family.architecture],
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings,
        "pad_token_id": c.pad_token_id,
        "dtype": c.param_dtype,
    }


# --- rope ---------------------------------------------------------------------------------------

_ROPE_CASTS = {
    f.name: (float if f.type in (float, Optional[float]) else int if f.type in (int, Optional[int]) else bool)
    for f in dataclasses.fields(RopeConfig)
    if f.name not in ("type", "theta", "interleaved")
}
# The keys each rule reads; others a config may carry (an original context length under linear) mean nothing to it.
_ROPE_RULE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
}


def rope_from_params(params: dict, k: Keys, *, where: str = "rope", interleaved: bool = False) -> RopeConfig:
    """A RopeConfig from one rope parameter dict (`rope_type` or the legacy `type`, `rope_theta`, ...)."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise k.error(f"{where}: rope type {kind!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
    if params.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise k.error(
            f"{where}: partial_rotary_factor={params['partial_rotary_factor']} is not supported (zoo rotates the "
            "whole head)"
        )
    if params.get("mrope_section") is not None:
        raise k.error(f"{where}: mrope_section (multimodal rope) is not supported")
    kept = {}
    for key in _ROPE_RULE_KEYS[kind]:
        cast, value = _ROPE_CASTS[key], params.get(key)
        if value is None:
            continue
        ok = (
            isinstance(value, bool) if cast is bool else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if not ok:
            raise k.error(f"{where}: {key} must be {'true or false' if cast is bool else 'a number'}, got {value!r}")
        kept[key] = cast(value)
    if kind in ("linear", "llama3") and "factor" not in kept:
        raise k.error(f"{where}: rope type {kind!r} needs a factor")
    if kind == "yarn" and "factor" not in kept:
        # transformers 5: an absent yarn factor is the ratio of the two context lengths.
        original = kept.get("original_max_position_embeddings") or k.integer("max_position_embeddings")
        kept["factor"] = k.integer("max_position_embeddings") / original
    theta = params.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise k.error(f"{where}: rope_theta must be a number, got {theta!r}")
    try:
        return RopeConfig(type=kind, theta=float(theta), interleaved=interleaved, **kept)
    except ValueError as e:
        raise k.error(f"{where}: {e}") from None


def rope_params(k: Keys) -> dict:
    """The one rope parameter dict of a config: `rope_parameters`, else `rope_scaling` plus `rope_theta`."""
    params = k.cfg.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise k.error(f"rope_parameters must be an object, got {params!r}")
    params = dict(params or k.cfg.get("rope_scaling") or {})
    if k.cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise k.error(
            f"partial_rotary_factor={k.cfg['partial_rotary_factor']} is not supported (zoo rotates the whole head)"
        )
    if params.get("rope_theta") is None:
        params["rope_theta"] = k.number("rope_theta")
    return params


def rope_to_params(rope: RopeConfig) -> dict:
    """A transformers rope parameter dict (with `rope_theta`) for `rope`: the keys its rule reads."""
    out = {"rope_type": rope.type, "rope_theta": rope.theta}
    out.update((key, getattr(rope, key)) for key in _ROPE_RULE_KEYS[rope.type])
    return {key: v for key, v in out.items() if v is not None}


def rope_hf(rope: RopeConfig) -> dict:
    """Both styles: `rope_parameters` (transformers 5) and `rope_theta` + `rope_scaling` (transformers 4)."""
    params = rope_to_params(rope)
    scaling = None if rope.type == "default" else {key: v for key, v in params.items() if key != "rope_theta"}
    return {"rope_parameters": params, "rope_theta": rope.theta, "rope_scaling": scaling}


# --- per-layer attention types ------------------------------------------------------------------


def explicit_layer_types(k: Keys, num_layers: int) -> Optional[list[str]]:
    """`layer_types` when the config gives it, checked; None when it does not."""
    types = k.cfg.get("layer_types")
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        raise k.error(f"layer_types must list one type per layer ({num_layers}), got {types!r}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise k.error(f"layer_types {unknown[0]!r} is not supported; supported: {', '.join(LAYER_TYPES)}")
    return list(types)


def window_fields(k: Keys, layer_types: Sequence[str], window: Optional[int]) -> dict:
    """`sliding_window` and `layer_types` of the ModelConfig: None/None without sliding layers, a window
    and None when every layer slides, both when they mix."""
    sliding = [i for i, t in enumerate(layer_types) if t == "sliding_attention"]
    if not sliding:
        return dict(sliding_window=None, layer_types=None)
    if window is None:
        raise k.error(
            f"layer_types makes layers {sliding} sliding_attention but the config leaves no sliding_window "
            "(null, or use_sliding_window false); transformers refuses this too. Give the window or make them "
            "full_attention"
        )
    if window <= 0:
        raise k.error(f"sliding_window must be positive, got {window}")
    return dict(sliding_window=window, layer_types=None if len(sliding) == len(layer_types) else list(layer_types))


def every_layer_window(k: Keys, num_layers: int, window: Optional[int]) -> dict:
    """The window of families whose `sliding_window` applies to every layer (Mixtral, Qwen3-MoE)."""
    return window_fields(k, ["full_attention" if window is None else "sliding_attention"] * num_layers, window)


def layer_types_of(c: ModelConfig) -> list[str]:
    return [c.layer_type(i) for i in range(c.num_layers)]


# --- rules: hub tensors <-> zoo leaves -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """Hub tensors <-> zoo leaves of one layer (or of the top level).

    `hub`: hub names relative to the layer prefix; `zoo`: attribute paths inside a block (or the
    model). `to_zoo(*hub_arrays, *zoo_shapes)` gives the zoo arrays, `to_hub(*zoo_arrays)` the hub ones.
    `hub_shapes(zoo_shapes)` gives the hub shapes; without it they are found by running `to_hub` on
    zero-stride arrays (fine for rules that only transpose or reshape). `to_zoo` should return views
    of its inputs where it can: a sharded load slices them, and a slice of a view of a memory map
    reads only what it covers. `lazy`: `to_zoo` gets functions that read each hub tensor instead of
    the tensors (per-expert lists, so a slice of the experts reads only those).
    """

    hub: tuple[str, ...]
    zoo: tuple[str, ...]
    to_zoo: Callable[..., tuple]
    to_hub: Callable[..., tuple]
    hub_shapes: Optional[Callable[[Sequence[tuple[int, ...]]], list[tuple[int, ...]]]] = None
    lazy: bool = False


def linear(hub: str, zoo: str, in_axes: int = 1) -> Rule:
    """`[out, in]` hub matrix <-> zoo `[in..., out...]` whose first `in_axes` axes are the input."""

    def to_zoo(w, shape):
        return (w.T.reshape(shape),)

    def to_hub(w):
        n_in = math.prod(w.shape[:in_axes])
        return (w.reshape(n_in, -1).T,)

    return Rule((hub,), (zoo,), to_zoo, to_hub)


def same(hub: str, zoo: str) -> Rule:
    return Rule((hub,), (zoo,), lambda w, shape: (w,), lambda w: (w,))


def flat(hub: str, zoo: str) -> Rule:
    """A hub vector <-> a zoo array of the same elements (a `[heads * head_dim]` bias as `[heads, head_dim]`)."""
    return Rule((hub,), (zoo,), lambda w, shape: (w.reshape(shape),), lambda w: (w.reshape(-1),))


class ExpertStack:
    """The zoo leaf `[experts, in, out]` of per-expert hub matrices, read on indexing: `[e0:e1, ...]`
    reads experts e0..e1 only; `np.asarray` reads them all."""

    def __init__(self, readers: Sequence[Callable[[], np.ndarray]], shape: tuple[int, ...]):
        self.readers, self.shape = readers, tuple(shape)

    def __getitem__(self, index) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        return np.stack([read().T[index[1:]] for read in self.readers[index[0]]])

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self[:], dtype=dtype)


def per_expert(hub_template: str, zoo: str, experts: int) -> Rule:
    """Per-expert hub matrices `[out, in]` (`{e}` in the name) <-> one zoo leaf `[experts, in, out]`."""
    names = tuple(hub_template.format(e=e) for e in range(experts))
    return Rule(
        names,
        (zoo,),
        lambda *readers_and_shape: (ExpertStack(readers_and_shape[:-1], readers_and_shape[-1]),),
        lambda w: tuple(w[e].T for e in range(w.shape[0])),
        lazy=True,
    )


def norm_rules(c: ModelConfig) -> list[Rule]:
    """The block's norms. With sandwich norms (Gemma 3) `post_attention_layernorm` normalises the
    attention output and `pre_feedforward_layernorm` the MLP input; otherwise `post_attention_layernorm`
    is the MLP's input norm."""
    rules = [same("input_layernorm.weight", "attn_norm.weight")]
    if not c.sandwich_norms:
        return rules + [same("post_attention_layernorm.weight", "ffn_norm.weight")]
    return rules + [
        same("post_attention_layernorm.weight", "post_attn_norm.weight"),
        same("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
        same("post_feedforward_layernorm.weight", "post_ffn_norm.weight"),
    ]


def gqa_rules(c: ModelConfig) -> list[Rule]:
    """Grouped-query attention, named alike in every family; optional parts follow the config's flags."""
    a = "self_attn."
    rules = [
        linear(a + "q_proj.weight", "attn.wq"),
        linear(a + "k_proj.weight", "attn.wk"),
        linear(a + "v_proj.weight", "attn.wv"),
        linear(a + "o_proj.weight", "attn.wo", in_axes=2),
    ]
    if c.attention_bias:
        rules += [flat(a + f"{p}_proj.bias", f"attn.b{p}") for p in "qkv"]
    if c.attention_out_bias:
        rules.append(same(a + "o_proj.bias", "attn.bo"))
    if c.qk_norm:
        rules += [same(a + "q_norm.weight", "attn.q_norm.weight"), same(a + "k_norm.weight", "attn.k_norm.weight")]
    if c.attention_sinks:
        rules.append(same(a + "sinks", "attn.sinks"))
    return rules


def mlp_rules(hub: str, zoo: str) -> list[Rule]:
    """The gated MLP under `hub` <-> `zoo`: each of its projections by the name its PARAMS give it."""
    return [
        linear(f"{hub}.{leaf.hub}.weight", f"{zoo}.{field}", in_axes=leaf.inputs)
        for field, leaf in GatedMLP.PARAMS.items()
    ]


def expert_list_rules(c: ModelConfig, template: str, gate: str, up: str, down: str) -> list[Rule]:
    """Per-expert `[out, in]` matrices, `template` naming one with `{e}` and `{proj}` (gate, up, down names)."""
    e = c.moe.n_routed_experts
    return [
        per_expert(template.format(e="{e}", proj=gate), "ffn.w_gate", e),
        per_expert(template.format(e="{e}", proj=up), "ffn.w_up", e),
        per_expert(template.format(e="{e}", proj=down), "ffn.w_down", e),
    ]


def top_rules(c: ModelConfig) -> list[Rule]:
    rules = [same("model.embed_tokens.weight", "embed"), same("model.norm.weight", "final_norm.weight")]
    if not c.tie_word_embeddings:
        rules.append(linear("lm_head.weight", "lm_head"))
    return rules


# --- families -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """One transformers architecture: config.json <-> ModelConfig and its tensor names.

    `defaults`: the transformers config class's values for keys a config.json may leave out or null.
    `read(keys)`: the ModelConfig fields (without dtypes); `write(config)`: the config.json keys beyond
    `common_hf`. `attention_rules` / `moe_rules`: the block's attention and sparse-MLP tensors (norms
    and the dense MLP are shared). `extra_layers_key`: a config key counting layers stored past
    num_hidden_layers that transformers does not run (DeepSeek-V3's multi-token prediction).
    """

    name: str
    model_type: str
    architecture: str
    defaults: dict
    read: Callable[[Keys], dict]
    write: Callable[[ModelConfig], dict]
    attention_rules: Callable[[ModelConfig], list[Rule]] = gqa_rules
    moe_rules: Optional[Callable[[ModelConfig], list[Rule]]] = None
    extra_layers_key: Optional[str] = None

    def block_rules(self, c: ModelConfig, moe: bool) -> list[Rule]:
        return norm_rules(c) + self.attention_rules(c) + (self.moe_rules(c) if moe else mlp_rules("mlp", "ffn"))
