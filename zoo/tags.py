"""The vocabulary of named intermediates.

Every tensor that a remat/offload policy may keep, offload or recompute is tagged with
`jax.ad_checkpoint.checkpoint_name` under one of the names below, and only through `tag()`, so
a policy can never name a tensor that does not exist (see `emitted_tags`). The names follow
MaxText so its users feel at home.

Shape letters: B batch, T sequence, D embed (hidden), N query heads, K kv heads, H head dim,
F mlp (intermediate), R q_lora_rank, L kv_lora_rank, P rope head dim, V v head dim,
A routed assignments (B*T*top_k, sorted by expert) on the ragged path, E C (experts x capacity
buffers) on the capacity path; I moe intermediate.
"""

import dataclasses

from jax.ad_checkpoint import checkpoint_name


@dataclasses.dataclass(frozen=True)
class TagInfo:
    name: str
    shape: str
    doc: str
    families: tuple[str, ...]


LLAMA = "llama"
DEEPSEEK_V3 = "deepseek_v3"
_BOTH = (LLAMA, DEEPSEEK_V3)

_VOCABULARY = (
    TagInfo("decoder_layer_input", "B T D", "residual stream entering a decoder layer", _BOTH),
    TagInfo("query_proj", "B T N H", "queries after the q projection, before RoPE (MLA: q_b_proj output)", _BOTH),
    TagInfo("key_proj", "B T K H", "keys after the k projection, before RoPE (MLA: per-head nope keys from kv_b_proj)", _BOTH),
    TagInfo("value_proj", "B T K H", "values after the v projection (MLA: per-head values from kv_b_proj)", _BOTH),
    TagInfo("context", "B T N V", "attention output, before the out projection", _BOTH),
    TagInfo("out_proj", "B T D", "attention output after the out projection", _BOTH),
    TagInfo("mlpwi_0", "B T F", "dense SwiGLU gate projection (before SiLU); DeepSeek-V3: dense layers and shared experts", _BOTH),
    TagInfo("mlpwi_1", "B T F", "dense SwiGLU up projection", _BOTH),
    TagInfo("mlpwo", "B T D", "dense SwiGLU down projection output", _BOTH),
    TagInfo("query_wa_proj", "B T R", "MLA q down-projection (q_a_proj) output; absent when q_lora_rank is null", (DEEPSEEK_V3,)),
    TagInfo("mla_q", "B T R", "MLA q latent after its RMSNorm; absent when q_lora_rank is null", (DEEPSEEK_V3,)),
    TagInfo("kv_wa_proj", "B T L+P", "MLA kv down-projection (kv_a_proj_with_mqa) output: kv latent and the shared rope key", (DEEPSEEK_V3,)),
    TagInfo("mla_kv", "B T L", "MLA kv latent after its RMSNorm", (DEEPSEEK_V3,)),
    TagInfo("moe_mlpwi_0", "A I | E C I", "routed experts' gate projection, tokens sorted or dispatched by expert", (DEEPSEEK_V3,)),
    TagInfo("moe_mlpwi_1", "A I | E C I", "routed experts' up projection", (DEEPSEEK_V3,)),
    TagInfo("moe_mlpwo", "A D | E C D", "routed experts' down projection output, before combining", (DEEPSEEK_V3,)),
)

TAGS: dict[str, TagInfo] = {t.name: t for t in _VOCABULARY}

DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
CONTEXT = "context"
OUT_PROJ = "out_proj"
MLPWI_0 = "mlpwi_0"
MLPWI_1 = "mlpwi_1"
MLPWO = "mlpwo"
QUERY_WA_PROJ = "query_wa_proj"
MLA_Q = "mla_q"
KV_WA_PROJ = "kv_wa_proj"
MLA_KV = "mla_kv"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"


def tag(x, name: str):
    """Name an intermediate for checkpoint policies. Only names of the vocabulary are allowed."""
    if name not in TAGS:
        raise ValueError(f"unknown tag {name!r}; the vocabulary is {sorted(TAGS)}")
    return checkpoint_name(x, name)


def emitted_tags(config) -> tuple[str, ...]:
    """The tags a model built from `config` emits in its forward pass, in vocabulary order."""
    names = [t.name for t in _VOCABULARY if config.family in t.families]
    if config.family == DEEPSEEK_V3 and config.mla.q_lora_rank is None:
        names = [n for n in names if n not in (QUERY_WA_PROJ, MLA_Q)]
    if config.family == DEEPSEEK_V3 and config.moe.n_shared_experts == 0 and config.first_k_dense_replace == 0:
        names = [n for n in names if n not in (MLPWI_0, MLPWI_1, MLPWO)]
    return tuple(names)
