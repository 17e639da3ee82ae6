"""Model configs: typed, validated dataclasses, the named sizes, and parameter / FLOP counts.

The dataclasses use only types OmegaConf understands (str, int, float, bool, Optional, nested
dataclasses), so the same classes are the Hydra structured-config schema of `conf/model/`.
Validation runs in `__post_init__` and raises a ValueError that names the field and the fix.
"""

import dataclasses
import math
from typing import Optional

from zoo.tags import DEEPSEEK_V3, LLAMA

FAMILIES = (LLAMA, DEEPSEEK_V3)
ROPE_TYPES = ("default", "llama3", "yarn")
MOE_IMPLS = ("ragged", "capacity")
ATTENTION_IMPLS = ("auto", "xla", "cudnn")
DTYPES = ("float32", "bfloat16", "float16")


def _require(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ValueError(f"model.{field}: {message}")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies. `type` picks the rule; the other fields belong to one rule each."""

    type: str = "default"
    theta: float = 10000.0
    # Pairs (x[2i], x[2i+1]) rotate together (DeepSeek-V3); otherwise halves (Llama's rotate_half).
    interleaved: bool = False
    # llama3 and yarn
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
        _require(self.type in ROPE_TYPES, "rope.type", f"got {self.type!r}; choose one of {ROPE_TYPES}")
        _require(self.theta > 0, "rope.theta", f"must be positive, got {self.theta}")
        if self.type in ("llama3", "yarn"):
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
        if self.q_lora_rank is not None:
            _require(self.q_lora_rank > 0, "mla.q_lora_rank", "must be positive or null")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            _require(getattr(self, name) > 0, f"mla.{name}", "must be positive")
        _require(self.qk_rope_head_dim % 2 == 0, "mla.qk_rope_head_dim", f"RoPE needs an even dim, got {self.qk_rope_head_dim}")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3 mixture of experts: sigmoid router, group-limited top-k, shared experts."""

    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    # ragged: dropless, sorted tokens through lax.ragged_dot. capacity: per-expert buffers, one batched matmul.
    impl: str = "ragged"
    capacity_factor: float = 1.25

    def __post_init__(self):
        _require(self.impl in MOE_IMPLS, "moe.impl", f"got {self.impl!r}; choose one of {MOE_IMPLS}")
        _require(self.n_routed_experts > 0, "moe.n_routed_experts", "must be positive")
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
        per_group = self.n_routed_experts // self.n_group
        _require(
            per_group >= 2 or self.n_group == 1,
            "moe.n_group",
            f"each group needs at least 2 experts (its score is the sum of its top-2), got {per_group}",
        )
        _require(
            self.topk_group * per_group >= self.num_experts_per_tok,
            "moe.topk_group",
            f"topk_group={self.topk_group} groups of {per_group} experts cannot supply top_k={self.num_experts_per_tok}",
        )
        _require(self.capacity_factor > 0, "moe.capacity_factor", "must be positive")
        _require(self.n_shared_experts >= 0, "moe.n_shared_experts", "must be >= 0")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str = LLAMA
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2  # Llama GQA; MLA has one latent, every head its own k/v
    head_dim: int = 16  # Llama; MLA's head dims live in `mla`
    intermediate_size: int = 128  # dense MLP (DeepSeek-V3: the first_k_dense_replace layers)
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)
    mla: Optional[MLAConfig] = None
    moe: Optional[MoEConfig] = None
    first_k_dense_replace: int = 0
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    # xla: XLA's fused attention, any backend. cudnn: flash attention (GPU, bf16/fp16). auto: cudnn where it applies.
    attention_impl: str = "auto"

    def __post_init__(self):
        _require(self.family in FAMILIES, "family", f"got {self.family!r}; choose one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
            _require(getattr(self, name) > 0, name, f"must be positive, got {getattr(self, name)}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "must be positive")
        for name in ("param_dtype", "compute_dtype"):
            _require(getattr(self, name) in DTYPES, name, f"got {getattr(self, name)!r}; choose one of {DTYPES}")
        _require(self.attention_impl in ATTENTION_IMPLS, "attention_impl", f"got {self.attention_impl!r}; choose one of {ATTENTION_IMPLS}")
        if self.family == LLAMA:
            _require(self.mla is None and self.moe is None, "family", "llama has no mla/moe sections; set family=deepseek_v3")
            _require(self.num_kv_heads > 0, "num_kv_heads", "must be positive")
            _require(
                self.num_heads % self.num_kv_heads == 0,
                "num_heads",
                f"num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}",
            )
            _require(self.head_dim > 0 and self.head_dim % 2 == 0, "head_dim", f"RoPE needs an even head_dim, got {self.head_dim}")
            _require(self.first_k_dense_replace == 0, "first_k_dense_replace", "only deepseek_v3 has a dense prefix")
            _require(not self.rope.interleaved, "rope.interleaved", "Llama rotates halves; set rope.interleaved=false")
        else:
            _require(self.mla is not None, "mla", "deepseek_v3 needs an mla section")
            _require(self.moe is not None, "moe", "deepseek_v3 needs a moe section")
            _require(
                0 <= self.first_k_dense_replace <= self.num_layers,
                "first_k_dense_replace",
                f"must be in 0..num_layers={self.num_layers}, got {self.first_k_dense_replace}",
            )

    # --- derived sizes -------------------------------------------------------------------------

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers if self.family == LLAMA else self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.family == LLAMA else self.mla.qk_rope_head_dim

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


# --- parameter and FLOP counts ---------------------------------------------------------------


def _attention_params(c: ModelConfig) -> int:
    d = c.hidden_size
    if c.family == LLAMA:
        return d * c.num_heads * c.head_dim * 2 + d * c.num_kv_heads * c.head_dim * 2
    m = c.mla
    n = c.num_heads
    if m.q_lora_rank is None:
        q = d * n * m.qk_head_dim
    else:
        q = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
    kv = d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
    return q + kv + n * m.v_head_dim * d


def _moe_params(c: ModelConfig, active: bool) -> int:
    m = c.moe
    experts = m.num_experts_per_tok if active else m.n_routed_experts
    expert = 3 * c.hidden_size * m.moe_intermediate_size
    router = m.n_routed_experts * c.hidden_size + m.n_routed_experts  # weight + correction bias
    return router + experts * expert + m.n_shared_experts * expert


def count_params(c: ModelConfig, active: bool = False) -> int:
    """Parameters of the model (`active`: those one token uses, counting top_k routed experts)."""
    d = c.hidden_size
    attention_and_norms = _attention_params(c) + 2 * d
    dense = c.num_dense_layers * (attention_and_norms + 3 * d * c.intermediate_size)
    moe = c.num_moe_layers * (attention_and_norms + _moe_params(c, active)) if c.num_moe_layers else 0
    embed = c.vocab_size * d
    head = 0 if c.tie_word_embeddings else c.vocab_size * d
    return embed + dense + moe + d + head


def flops_per_token(c: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs (forward + backward = 3x forward) per token, counted analytically.

    Matmuls: 6 per active matmul weight (the embedding lookup is no matmul). Attention: the score and
    context products, 12 * layers * seq * heads * (qk_dim + v_dim) / 2 per token, halved again when causal.
    """
    # Drop the embedding table and, when untied, the head's own copy; the head matmul is added back below.
    matmul_weights = count_params(c, active=True) - c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    matmul_weights -= c.num_layers * 2 * c.hidden_size + c.hidden_size  # norms
    if c.family == DEEPSEEK_V3:
        m = c.mla
        matmul_weights -= c.num_layers * (m.kv_lora_rank + (m.q_lora_rank or 0))
        matmul_weights -= c.num_moe_layers * c.moe.n_routed_experts  # correction bias
        qk, v = m.qk_head_dim, m.v_head_dim
    else:
        qk = v = c.head_dim
    matmul_weights += c.vocab_size * c.hidden_size  # the output head is a matmul, tied or not
    attention = 6 * c.num_layers * seq_len * c.num_heads * (qk + v)
    if causal:
        attention /= 2
    return 6.0 * matmul_weights + attention


# --- named sizes -----------------------------------------------------------------------------


def _llama31(hidden, layers, heads, ffn) -> ModelConfig:
    return ModelConfig(
        family=LLAMA,
        vocab_size=128256,
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=ffn,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope=RopeConfig(type="llama3", theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        param_dtype="float32",
        compute_dtype="bfloat16",
    )


def _dsv3_like(**kw) -> ModelConfig:
    mla = kw.pop("mla")
    moe = kw.pop("moe")
    base = dict(family=DEEPSEEK_V3, rms_norm_eps=1e-6, num_kv_heads=kw.get("num_heads", 1), param_dtype="float32", compute_dtype="bfloat16")
    base.update(kw)
    return ModelConfig(mla=mla, moe=moe, **base)


SIZES: dict[str, ModelConfig] = {
    # The two reference models of tests/data (Hugging Face transformers computed their outputs).
    "llama_tiny_a": ModelConfig(
        family=LLAMA, vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=128, rope=RopeConfig(theta=10000.0),
    ),
    "dsv3_tiny_a": ModelConfig(
        family=DEEPSEEK_V3, vocab_size=256, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=4,
        intermediate_size=128, rms_norm_eps=1e-6, max_position_embeddings=128, first_k_dense_replace=1,
        rope=RopeConfig(theta=10000.0, interleaved=True),
        mla=MLAConfig(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                      n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5),
    ),
    # ~1.2B Llama shaped like Llama 3.2 1B (tied embeddings); fits one GPU with room for activations.
    "llama_1b": ModelConfig(
        family=LLAMA, vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, rms_norm_eps=1e-5, max_position_embeddings=131072, tie_word_embeddings=True,
        rope=RopeConfig(type="llama3", theta=500000.0, factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192),
        compute_dtype="bfloat16",
    ),
    # ~85M Llama: big enough on CPU that matmuls dominate (benchmarks, memory ordering tests).
    "llama_100m": ModelConfig(
        family=LLAMA, vocab_size=32000, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
        intermediate_size=2048, max_position_embeddings=4096, rope=RopeConfig(theta=500000.0),
    ),
    "llama3.1_8b": _llama31(4096, 32, 32, 14336),
    "llama3.1_70b": _llama31(8192, 80, 64, 28672),
    "llama3.1_405b": _llama31(16384, 126, 128, 53248),
    # ~2B total / ~0.6B active DeepSeek-V3-shaped MoE (MLA, 64 experts, group-limited top-6).
    "dsv3_2b": _dsv3_like(
        vocab_size=32000, hidden_size=1024, num_layers=12, num_heads=16, intermediate_size=4096,
        max_position_embeddings=8192, first_k_dense_replace=1, rope=RopeConfig(theta=10000.0, interleaved=True),
        mla=MLAConfig(q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
        moe=MoEConfig(n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=704, n_shared_experts=2,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5),
    ),
    # ~90M DeepSeek-V3-shaped MoE for CPU benchmarks.
    "dsv3_100m": _dsv3_like(
        vocab_size=32000, hidden_size=512, num_layers=6, num_heads=8, intermediate_size=2048,
        max_position_embeddings=4096, first_k_dense_replace=1, rope=RopeConfig(theta=10000.0, interleaved=True),
        mla=MLAConfig(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
        moe=MoEConfig(n_routed_experts=16, num_experts_per_tok=2, moe_intermediate_size=512, n_shared_experts=1,
                      n_group=4, topk_group=2, routed_scaling_factor=2.5),
    ),
    "deepseek_v3_671b": _dsv3_like(
        vocab_size=129280, hidden_size=7168, num_layers=61, num_heads=128, intermediate_size=18432,
        max_position_embeddings=163840, first_k_dense_replace=3,
        rope=RopeConfig(type="yarn", theta=10000.0, interleaved=True, factor=40.0, original_max_position_embeddings=4096,
                        beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5),
    ),
}


def get_size(name: str) -> ModelConfig:
    if name not in SIZES:
        raise ValueError(f"unknown model size {name!r}; known sizes: {sorted(SIZES)}")
    return SIZES[name]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def moe_capacity(tokens: int, c: MoEConfig) -> int:
    """Per-expert buffer size of the capacity path: ceil(tokens * top_k / experts * capacity_factor)."""
    return max(1, math.ceil(tokens * c.num_experts_per_tok / c.n_routed_experts * c.capacity_factor))
