"""Model configs: typed, validated dataclasses, and parameter / FLOP counts.

One config describes every family: a family is a choice of blocks and a few flags (which attention,
which MLP or MoE router, which norms, which layers slide), never a copy of the model. The dataclasses
use only types OmegaConf understands (str, int, float, bool, Optional, lists, nested dataclasses), so
the same classes are the schema of Hydra's model group (zoo.train.run_config registers every named size as an option). A
config is a static part of the model, so it hashes (its list fields as tuples). Validation runs in
`__post_init__` and raises a ValueError that names the field and the fix.

This module is the ground floor of the model code: it imports no block and no family. `family` is a
name here; the registry (`zoo.families`) knows the families, their named sizes (`zoo.families.SIZES`)
and which sections each one's kind has (`zoo.families.check`).
"""

import dataclasses
import math
from typing import Any, Optional

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so np.dtype("bfloat16") resolves)
import numpy as np

from zoo.ranges import ranged


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
MAX_LAYERS = 10000
MOE_IMPLS = ("auto", "ragged", "capacity")
# sigmoid_grouped: DeepSeek-V3 (sigmoid scores + correction bias, group-limited top-k, renormalised, scaled).
# softmax: Mixtral, Qwen3-MoE (softmax over all experts, top-k, renormalised when norm_topk_prob).
# topk_softmax: GPT-OSS (top-k of the raw logits, softmax over those k).
ROUTERS = ("sigmoid_grouped", "softmax", "topk_softmax")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
ATTENTION_IMPLS = ("auto", "xla", "blockwise", "cudnn", "splash")
LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = ("float32", "bfloat16", "float16")
# What a dtype argument accepts: a name of DTYPES, a numpy / jnp dtype or a scalar type (jnp.bfloat16);
# `dtype_name` checks it (a type hint cannot: jnp.bfloat16 is a class, np.dtype("bfloat16") an instance).
DTypeLike = Any


def dtype_name(value, argument: str = "dtype") -> str:
    """'float32', 'bfloat16' or 'float16' from a string, a jnp / numpy dtype or a scalar type
    (`jnp.bfloat16`, `np.float32`); anything else is a ValueError naming `argument`. Zoo keeps the
    name, not the dtype object, so configs and static fields hash, compare and serialise as text."""
    try:
        name = np.dtype(value).name if value is not None else None
    except TypeError:
        name = None
    if name not in DTYPES:
        raise ValueError(
            f"{argument}={value!r}: not a parameter dtype zoo keeps; use one of {', '.join(DTYPES)} (a string, jnp or "
            "numpy dtype)"
        )
    return name


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"model.{field}: {message}")


def _choices(values) -> str:
    return ", ".join(values)


def _as_list(obj, name: str) -> None:
    """Store a sequence field as a list, whether it came from YAML (a ListConfig or list) or Python."""
    value = getattr(obj, name)
    if value is not None and not isinstance(value, list):
        object.__setattr__(obj, name, list(value))


@ranged(
    "model.rope",
    theta="(0, inf)",
    factor="(0, inf)",
    original_max_position_embeddings="(0, inf)",
    low_freq_factor="(0, inf)",
    high_freq_factor="(0, inf)",
    beta_fast="(0, inf)",
    beta_slow="(0, inf)",
    mscale="[0, inf)",
    mscale_all_dim="[0, inf)",
    attention_factor="(0, inf)",
)
@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies. `type` picks the rule; the other fields belong to one rule each."""

    type: str = "default"
    theta: float = 10000.0
    # Pairs (x[2i], x[2i+1]) rotate together (DeepSeek-V3); otherwise halves (Llama's rotate_half).
    interleaved: bool = False
    # linear, llama3 and yarn
    factor: float = 1.0
    original_max_position_embeddings: Optional[int] = None
    # llama3 wavelength bands
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn ramp and attention scaling
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    attention_factor: Optional[float] = None
    truncate: bool = True

    def __post_init__(self):
        _require(self.type in ROPE_TYPES, "rope.type", f"got {self.type!r}; choose one of {_choices(ROPE_TYPES)}")
        if self.type in ("linear", "llama3", "yarn"):
            _require(self.factor >= 1, "rope.factor", f"must be >= 1 for rope type {self.type}, got {self.factor}")
        if self.type == "llama3":
            _require(
                self.original_max_position_embeddings is not None,
                "rope.original_max_position_embeddings",
                "the llama3 rule needs the pretraining context length (8192 for Llama 3.1)",
            )
            _require(
                self.high_freq_factor > self.low_freq_factor,
                "rope.high_freq_factor",
                f"must exceed rope.low_freq_factor ({self.high_freq_factor} <= {self.low_freq_factor})",
            )


@ranged(
    "model.mla",
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), "(0, inf)"),
)
@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    q_lora_rank: Optional[int] = 1536  # None: a plain q projection
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __post_init__(self):
        _require(
            self.qk_rope_head_dim % 2 == 0,
            "mla.qk_rope_head_dim",
            f"RoPE needs an even dim, got {self.qk_rope_head_dim}",
        )


@ranged(
    "model.moe",
    **dict.fromkeys(
        (
            "n_routed_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "n_group",
            "topk_group",
            "routed_scaling_factor",
            "swiglu_limit",
            "swiglu_alpha",
            "capacity_factor",
            "exchange_factor",
        ),
        "(0, inf)",
    ),
    n_shared_experts="[0, inf)",
)
@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: a router (`router`, see ROUTERS), routed experts, optional shared experts.

    The defaults are a small plain MoE that fits any expert count: 8 experts, the top 2 of a softmax
    over them renormalised (Mixtral's router), no shared expert, no groups. The group fields
    (`n_group`, `topk_group`) and `routed_scaling_factor` belong to the DeepSeek-V3 router
    (`sigmoid_grouped`), whose sizes name them (zoo/families/deepseek_v3.py); `router_bias`,
    `expert_bias` and the clamped SwiGLU to GPT-OSS.
    """

    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    n_shared_experts: int = 0
    router: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_bias: bool = False  # a learned bias on the router logits (GPT-OSS)
    expert_bias: bool = False  # biases on the experts' gate, up and down projections (GPT-OSS)
    activation: str = "silu"  # silu: silu(gate) * up; clamped_swiglu: GPT-OSS's clamped variant
    swiglu_limit: float = 7.0  # clamped_swiglu: gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702  # clamped_swiglu: gate * sigmoid(alpha * gate)
    # ragged: dropless, sorted tokens through a grouped matmul (zoo.nn.grouped_matmul). capacity:
    # per-expert buffers of capacity_factor x the mean load, drops the rest. auto: ragged (zoo.nn.moe).
    impl: str = "auto"
    capacity_factor: float = 1.25
    # ragged under expert parallelism: each exchange round carries, from each device to each expert
    # shard, up to exchange_factor x the mean rows; a fuller pair takes more rounds (zoo.nn.expert_rounds).
    exchange_factor: float = 1.25

    def __post_init__(self):
        _require(self.impl in MOE_IMPLS, "moe.impl", f"got {self.impl!r}; choose one of {_choices(MOE_IMPLS)}")
        _require(self.router in ROUTERS, "moe.router", f"got {self.router!r}; choose one of {_choices(ROUTERS)}")
        _require(
            self.activation in EXPERT_ACTIVATIONS,
            "moe.activation",
            f"got {self.activation!r}; choose one of {_choices(EXPERT_ACTIVATIONS)}",
        )
        _require(
            0 < self.num_experts_per_tok <= self.n_routed_experts,
            "moe.num_experts_per_tok",
            f"top_k={self.num_experts_per_tok} must be in 1..n_routed_experts={self.n_routed_experts}",
        )
        _require(
            self.n_group > 0 and self.n_routed_experts % self.n_group == 0,
            "moe.n_group",
            f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}",
        )
        _require(
            0 < self.topk_group <= self.n_group,
            "moe.topk_group",
            f"topk_group={self.topk_group} must be in 1..n_group={self.n_group}",
        )
        if self.router == "sigmoid_grouped":
            per_group = self.n_routed_experts // self.n_group
            _require(
                per_group >= 2 or self.n_group == 1,
                "moe.n_group",
                f"each group needs at least 2 experts (its score is the sum of its top-2), got {per_group}",
            )
            _require(
                self.topk_group * per_group >= self.num_experts_per_tok,
                "moe.topk_group",
                f"topk_group={self.topk_group} groups of {per_group} experts cannot supply "
                f"top_k={self.num_experts_per_tok}",
            )
        else:
            _require(
                self.n_group == 1 and self.topk_group == 1,
                "moe.n_group",
                "group-limited routing belongs to the sigmoid_grouped router; set n_group=1 and topk_group=1 for "
                f"router {self.router}",
            )


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """What sets one decoder layer apart from another: its attention window, which rope it uses, and
    whether its feed-forward is a mixture of experts. Layers with equal specs have equal structure."""

    window: Optional[int]  # sliding window (keys including the query's own), None: full attention
    local_rope: bool  # the sliding layers' rope (`rope_local`) instead of `rope`
    moe: bool


@ranged(
    "model",
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "max_position_embeddings",
            "query_pre_attn_scalar",
            "sliding_window",
            "final_logit_softcap",
        ),
        "(0, inf)",
    ),
    # No published model has more than 126 layers; judging a deeper one's size (zoo.train.machine_fit)
    # takes zoo minutes per hundred thousand layers.
    num_layers=f"[1, {MAX_LAYERS}]: beyond that, building the model to judge its size takes minutes",
    rms_norm_eps="(0, 1)",
    pad_token_id="[0, inf)",
    first_k_dense_replace="[0, inf)",
    decoder_sparse_step="[1, inf)",
    norm_weight_offset="0 or 1: Gemma's norms scale by 1 + w",
)
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = "llama"  # a module of zoo/families/ (zoo.families.check holds a config to it)
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # GQA; MLA has one latent, every head its own k/v
    head_dim: int = 16  # GQA; MLA's head dims live in `mla`
    intermediate_size: int = 128  # dense MLP (DeepSeek-V3: the first_k_dense_replace layers)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # The embedding row of this token gets no gradient from its lookups (PyTorch's padding_idx, which
    # every transformers family sets from config.json): training parity with transformers.
    pad_token_id: Optional[int] = None
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    mla: Optional[MLAConfig] = None
    moe: Optional[MoEConfig] = None
    # Which layers are sparse (MoE families): layer i is, iff i >= first_k_dense_replace,
    # i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0.
    first_k_dense_replace: int = 0
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    decoder_sparse_step: int = 1
    # --- attention options (GQA families) ---
    attention_bias: bool = False  # biases on q, k, v (Qwen2, GPT-OSS)
    attention_out_bias: bool = False  # bias on the output projection (GPT-OSS)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k, before RoPE (Qwen3, Gemma 3)
    attention_sinks: bool = False  # a learned per-head logit in the softmax denominator (GPT-OSS)
    query_pre_attn_scalar: Optional[float] = None  # softmax scale = this ** -0.5 (Gemma 3); null: head_dim
    # Sliding windows: with layer_types null, every layer slides when sliding_window is set (Mistral).
    sliding_window: Optional[int] = None
    layer_types: Optional[list[str]] = None  # per layer: full_attention | sliding_attention
    rope_local: Optional[RopeConfig] = None  # the rope of sliding layers (Gemma 3); null: `rope`
    # --- norms, embeddings, head ---
    norm_weight_offset: float = 0.0  # RMSNorm scales by (offset + w): 1.0 for Gemma's (1 + w)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    mlp_activation: str = "silu"  # dense MLP gate: silu (SwiGLU) or gelu_tanh (Gemma's GeGLU)
    final_logit_softcap: Optional[float] = None  # logits = c * tanh(logits / c)
    # A name of DTYPES in YAML; from Python also a jnp / numpy dtype, which __post_init__ turns into its
    # name (so `Any`, not `str`: OmegaConf and the type checker would refuse jnp.bfloat16 before that).
    param_dtype: DTypeLike = "float32"
    compute_dtype: DTypeLike = "float32"
    # xla: the reference einsum path (materialises the T x T scores). blockwise: flash-style online
    # softmax in JAX. cudnn: cuDNN's fused kernel (GPU). splash: Pallas splash attention (TPU). auto: see
    # zoo.nn.attention_kernels.resolve_impl.
    attention_impl: str = "auto"

    def __post_init__(self):
        _as_list(self, "mlp_only_layers")
        _as_list(self, "layer_types")
        for name in ("param_dtype", "compute_dtype"):
            try:  # jnp / numpy dtypes become their names: the config stays hashable and YAML-serialisable
                object.__setattr__(self, name, dtype_name(getattr(self, name), name))
            except ValueError:
                _require(
                    False,
                    name,
                    f"got {getattr(self, name)!r}; choose one of {_choices(DTYPES)} (a string, jnp or numpy dtype)",
                )
        _require(
            self.attention_impl in ATTENTION_IMPLS,
            "attention_impl",
            f"got {self.attention_impl!r}; choose one of {_choices(ATTENTION_IMPLS)}",
        )
        _require(
            self.mlp_activation in MLP_ACTIVATIONS,
            "mlp_activation",
            f"got {self.mlp_activation!r}; choose one of {_choices(MLP_ACTIVATIONS)}",
        )
        if self.uses_mla:
            for flag in ("attention_bias", "attention_out_bias", "qk_norm", "attention_sinks"):
                _require(
                    not getattr(self, flag),
                    flag,
                    "belongs to grouped-query attention; this model's mla section makes it latent attention",
                )
        else:
            _require(self.num_kv_heads > 0, "num_kv_heads", "must be positive")
            _require(
                self.num_heads % self.num_kv_heads == 0,
                "num_heads",
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}",
            )
            _require(
                self.head_dim > 0 and self.head_dim % 2 == 0,
                "head_dim",
                f"RoPE needs an even head_dim, got {self.head_dim}",
            )
        if self.moe is None:
            _require(
                self.first_k_dense_replace == 0,
                "first_k_dense_replace",
                "the model has no moe section, so no MoE layers and no dense prefix",
            )
            _require(not self.mlp_only_layers, "mlp_only_layers", "the model has no moe section, so no MoE layers")
        _require(
            0 <= self.first_k_dense_replace <= self.num_layers,
            "first_k_dense_replace",
            f"must be in 0..num_layers={self.num_layers}, got {self.first_k_dense_replace}",
        )
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        _require(not bad, "mlp_only_layers", f"layer {bad[0] if bad else ''} is not in 0..{self.num_layers - 1}")
        if self.rope.interleaved:
            _require(
                self.uses_mla, "rope.interleaved", "grouped-query attention rotates halves; set rope.interleaved=false"
            )
        if self.pad_token_id is not None:
            _require(
                0 <= self.pad_token_id < self.vocab_size,
                "pad_token_id",
                f"must be in 0..{self.vocab_size - 1} or null, got {self.pad_token_id}",
            )
        if self.layer_types is not None:
            _require(
                len(self.layer_types) == self.num_layers,
                "layer_types",
                f"has {len(self.layer_types)} entries for num_layers={self.num_layers}; give one per layer",
            )
            unknown = [t for t in self.layer_types if t not in LAYER_TYPES]
            _require(
                not unknown,
                "layer_types",
                f"unknown type {unknown[0] if unknown else ''!r}; choose from {_choices(LAYER_TYPES)}",
            )
            _require(
                self.sliding_window is not None or "sliding_attention" not in self.layer_types,
                "sliding_window",
                "layer_types has sliding_attention layers but sliding_window is null; give the window size",
            )

    # --- derived structure ---------------------------------------------------------------------

    def is_moe_layer(self, i: int) -> bool:
        if self.moe is None:
            return False
        return (
            i >= self.first_k_dense_replace
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def layer_type(self, i: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[i]
        return "full_attention" if self.sliding_window is None else "sliding_attention"

    def layer_spec(self, i: int) -> LayerSpec:
        sliding = self.layer_type(i) == "sliding_attention"
        return LayerSpec(
            window=self.sliding_window if sliding else None,
            local_rope=sliding and self.rope_local is not None,
            moe=self.is_moe_layer(i),
        )

    def layer_rope(self, spec: LayerSpec) -> RopeConfig:
        return self.rope_local if spec.local_rope else self.rope

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - self.num_moe_layers

    @property
    def uses_mla(self) -> bool:
        return self.mla is not None

    @property
    def has_dense_mlp(self) -> bool:
        """Whether any dense MLP runs: a dense layer, or DeepSeek-style shared experts."""
        return self.num_dense_layers > 0 or (
            self.moe is not None and self.moe.n_shared_experts > 0 and self.num_moe_layers > 0
        )

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim if self.uses_mla else self.head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.mla.qk_head_dim if self.uses_mla else self.head_dim

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.uses_mla else self.head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        return hash(
            tuple(tuple(v) if isinstance(v, list) else v for v in dataclasses.astuple(self, tuple_factory=tuple))
        )


# --- counts the configuration alone gives (parameter and FLOP counts: zoo.counts) ---------------


def attended_keys(seq_len: int, window: Optional[int], causal: bool = True) -> float:
    """Mean number of keys a query attends to: T/2 causal (the convention of the attention FLOP count),
    and with a sliding window of W keys, the mean of min(i + 1, W) over the positions."""
    if not causal:
        return float(seq_len)
    if window is None or window >= seq_len:
        return seq_len / 2
    full = window * (window + 1) / 2 + (seq_len - window) * window  # sum over i of min(i + 1, W)
    return full / seq_len


def moe_capacity(tokens: int, c: MoEConfig) -> int:
    """Per-expert buffer size of the capacity path: ceil(tokens * top_k / experts * capacity_factor), at most
    tokens * top_k (every assignment: a larger factor drops nothing more, and its buffer overflowed the
    32-bit size JAX gives it)."""
    k = c.num_experts_per_tok
    return min(tokens * k, max(1, math.ceil(tokens * k / c.n_routed_experts * c.capacity_factor)))
