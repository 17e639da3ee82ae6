"""The vocabulary of named intermediates.

Every tensor that a remat/offload policy may keep, offload or recompute is tagged with
`jax.ad_checkpoint.checkpoint_name` under one of the names below, and only through `tag()`, so
a policy can never name a tensor that does not exist (see `emitted_tags`). The names follow
MaxText so its users feel at home.

Each tag belongs to one kind of block, and a model emits the tags of the blocks it has: every model
has `layer` and `attention`; `mlp` needs a dense MLP (dense layers, or DeepSeek's shared experts),
`mla` multi-head latent attention, `moe` routed experts. Offload policies name tags per block kind
(`zoo.offload`), so one policy serves every family.

Shape letters: B batch, T sequence, D embed (hidden), N query heads, K kv heads, H head dim,
F mlp (intermediate), R q_lora_rank, L kv_lora_rank, P rope head dim, V v head dim,
A routed assignments (B*T*top_k, sorted by expert) on the ragged path, E C (experts x capacity
buffers) on the capacity path; I moe intermediate.
"""

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

from jax.ad_checkpoint import checkpoint_name

LLAMA = "llama"
DEEPSEEK_V3 = "deepseek_v3"
QWEN2 = "qwen2"
QWEN3 = "qwen3"
QWEN3_MOE = "qwen3_moe"
MIXTRAL = "mixtral"
GEMMA3 = "gemma3"
GPT_OSS = "gpt_oss"

# Block kinds: what a tag belongs to (see the module docstring).
LAYER, ATTENTION, MLP, MLA, MOE = "layer", "attention", "mlp", "mla", "moe"
# Kinds a model may lack: offload policies name their tags in per-kind sections.
OPTIONAL_KINDS = (MLP, MLA, MOE)


# The logical axes (zoo.sharding) of a tag's array, one tuple per layout it can have (MoE tags: the
# ragged rows `A ...` or the capacity buffers `E C ...`), read by the planner to size each tag per
# device under the run's sharding rules. `batch` and `rows` are the dims the planner traces per
# data-parallel rank already (rows: routed assignments or the experts x capacity buffers, as many per
# device whichever rank computes them: expert parallelism trades experts for capacity); `None` is a
# dim no rule splits. Inside a block the sequence is whole (sequence parallelism
# gathers it before the projections, zoo.sharding.sequence_gathered); only the layer input, between
# blocks, has `seq`.
_IN_BLOCK = ("batch", None)


@dataclasses.dataclass(frozen=True)
class TagInfo:
    name: str
    shape: str
    doc: str
    block: str
    axes: tuple[tuple[Optional[str], ...], ...] = ()


_VOCABULARY = (
    TagInfo("decoder_layer_input", "B T D", "residual stream entering a decoder layer", LAYER, (("batch", "seq", "embed"),)),
    TagInfo("query_proj", "B T N H", "queries after the q projection (and its bias), before q-norm and RoPE (MLA: q_b_proj output)", ATTENTION, ((*_IN_BLOCK, "heads", None),)),
    TagInfo("key_proj", "B T K H", "keys after the k projection (and its bias), before k-norm and RoPE (MLA: per-head nope keys from kv_b_proj)", ATTENTION, ((*_IN_BLOCK, "kv_heads", None),)),
    TagInfo("value_proj", "B T K H", "values after the v projection (MLA: per-head values from kv_b_proj)", ATTENTION, ((*_IN_BLOCK, "kv_heads", None),)),
    TagInfo("context", "B T N V", "attention output, before the out projection", ATTENTION, ((*_IN_BLOCK, "heads", None),)),
    TagInfo("out_proj", "B T D", "attention output after the out projection", ATTENTION, ((*_IN_BLOCK, "embed"),)),
    TagInfo("mlpwi_0", "B T F", "dense MLP gate projection (before the activation); DeepSeek-V3: dense layers and shared experts", MLP, ((*_IN_BLOCK, "mlp"),)),
    TagInfo("mlpwi_1", "B T F", "dense MLP up projection", MLP, ((*_IN_BLOCK, "mlp"),)),
    TagInfo("mlpwo", "B T D", "dense MLP down projection output", MLP, ((*_IN_BLOCK, "embed"),)),
    TagInfo("query_wa_proj", "B T R", "MLA q down-projection (q_a_proj) output; absent when q_lora_rank is null", MLA, ((*_IN_BLOCK, None),)),
    TagInfo("mla_q", "B T R", "MLA q latent after its RMSNorm; absent when q_lora_rank is null", MLA, ((*_IN_BLOCK, None),)),
    TagInfo("kv_wa_proj", "B T L+P", "MLA kv down-projection (kv_a_proj_with_mqa) output: kv latent and the shared rope key", MLA, ((*_IN_BLOCK, None),)),
    TagInfo("mla_kv", "B T L", "MLA kv latent after its RMSNorm", MLA, ((*_IN_BLOCK, None),)),
    TagInfo("moe_mlpwi_0", "A I | E C I", "routed experts' gate projection (and bias), tokens sorted or dispatched by expert", MOE, (("rows", "mlp"), ("rows", "rows", "mlp"))),
    TagInfo("moe_mlpwi_1", "A I | E C I", "routed experts' up projection (and bias)", MOE, (("rows", "mlp"), ("rows", "rows", "mlp"))),
    TagInfo("moe_mlpwo", "A D | E C D", "routed experts' down projection output (and bias), before combining", MOE, (("rows", "embed"), ("rows", "rows", "embed"))),
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
    """Name an intermediate for checkpoint policies. Only names of the vocabulary are allowed.

    While `zoo.capture` traces a model and asks for `name`, the value is also kept for it (see
    `layer_scope`)."""
    if name not in TAGS:
        raise ValueError(f"unknown tag {name!r}; the vocabulary is {sorted(TAGS)}")
    scope = _LAYER_SCOPE.get()
    if scope is not None and name in _WANTED.get():
        if name in scope:
            raise ValueError(f"tag {name!r} was emitted twice in one layer; a capture holds one value per layer")
        scope[name] = x
    return checkpoint_name(x, name)


# --- capturing tagged values (`zoo.capture`) ----------------------------------------------------
#
# Tags live inside scanned (and possibly checkpointed) layer bodies, where a traced value cannot be
# taken out sideways. So the layer body opens a `layer_scope`, returns what was kept in it as an
# output of the body (the scan stacks it over the layers), and the stack hands the stacked values to
# the capture in progress (`record`). Outside a capture all of this is empty and costs nothing.

_WANTED: contextvars.ContextVar[frozenset] = contextvars.ContextVar("zoo_capture_wanted", default=frozenset())
_LAYER_SCOPE: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("zoo_capture_layer", default=None)
_RECORD: contextvars.ContextVar[Optional[list]] = contextvars.ContextVar("zoo_capture_record", default=None)


@contextlib.contextmanager
def capturing(names) -> Iterator[list]:
    """While traced inside this block, the layers keep the values of the tags `names`; the list it
    yields fills with `(tag, layer indices, values with a leading layer axis)`, one entry per stack
    and period position that emits the tag."""
    record: list = []
    wanted, rec = _WANTED.set(frozenset(names)), _RECORD.set(record)
    try:
        yield record
    finally:
        _WANTED.reset(wanted)
        _RECORD.reset(rec)


@contextlib.contextmanager
def layer_scope() -> Iterator[dict]:
    """Around one layer's body: the dict it yields holds tag -> value for the tags a capture in
    progress asks for (empty outside a capture). Return it from the body as an output."""
    kept: dict = {}
    if not _WANTED.get():
        yield kept
        return
    token = _LAYER_SCOPE.set(kept)
    try:
        yield kept
    finally:
        _LAYER_SCOPE.reset(token)


def record(name: str, layers: tuple[int, ...], values) -> None:
    """Hand a stack's values of tag `name` (leading axis: `layers`) to the capture in progress."""
    rec = _RECORD.get()
    if rec is not None:
        rec.append((name, tuple(layers), values))


def block_kinds(config) -> tuple[str, ...]:
    """The block kinds a model built from `config` has."""
    kinds = [LAYER, ATTENTION]
    if config.has_dense_mlp:
        kinds.append(MLP)
    if config.uses_mla:
        kinds.append(MLA)
    if config.num_moe_layers:
        kinds.append(MOE)
    return tuple(kinds)


def emitted_tags(config) -> tuple[str, ...]:
    """The tags a model built from `config` emits in its forward pass, in vocabulary order."""
    kinds = block_kinds(config)
    names = [t.name for t in _VOCABULARY if t.block in kinds]
    if config.uses_mla and config.mla.q_lora_rank is None:
        names = [n for n in names if n not in (QUERY_WA_PROJ, MLA_Q)]
    return tuple(names)
