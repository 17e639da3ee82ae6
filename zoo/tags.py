"""The vocabulary of named intermediates.

Every tensor that a remat/offload policy may keep, offload or recompute is tagged with
`jax.ad_checkpoint.checkpoint_name` under one of the names of `TAGS`, and only through `tag()`, so
a policy can never name a tensor that does not exist (see `emitted_tags`). The names follow
MaxText so its users feel at home.

Each block declares the tags it emits beside its maths (`EMITS`, a tuple of `Emit`: the tag's record
and the FLOPs of the op producing it) and registers them with `@declares`; `TAGS` is the union of
those declarations, and `tag()` refuses a name no block declares.

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
from typing import Any, Callable, Iterator, Optional, Union

from jax.ad_checkpoint import checkpoint_name

# Block kinds: what a tag belongs to (see the module docstring).
LAYER, ATTENTION, MLP, MLA, MOE = "layer", "attention", "mlp", "mla", "moe"
# Kinds a model may lack: offload policies name their tags in per-kind sections.
OPTIONAL_KINDS = (MLP, MLA, MOE)


# Block kinds in vocabulary order: `TAGS` lists the tags kind by kind, whatever order the blocks
# declaring them were defined in.
KINDS = (LAYER, ATTENTION, MLP, MLA, MOE)

# The logical axes (zoo.sharding) of a tag's array, one tuple per layout it can have (MoE tags: the
# ragged rows `A ...` or the capacity buffers `E C ...`), read by the planner to size each tag per
# device under the run's sharding rules. `batch` and `rows` are the dims the planner traces per
# data-parallel rank already (rows: routed assignments or the experts x capacity buffers, as many per
# device whichever rank computes them: expert parallelism trades experts for capacity); `None` is a
# dim no rule splits. Inside a block the sequence is whole (sequence parallelism
# gathers it before the projections, zoo.sharding.sequence_gathered); only the layer input, between
# blocks, has `seq`.
IN_BLOCK = ("batch", None)


@dataclasses.dataclass(frozen=True)
class TagInfo:
    name: str
    shape: str
    doc: str
    block: str
    axes: tuple[tuple[Optional[str], ...], ...] = ()
    # The block's output, which only the residual add after it reads: the backward pass never reads it,
    # unless a norm after the block does (Gemma 3's sandwich norms; zoo.offload.backward_never_reads).
    only_feeds_residual: bool = False


@dataclasses.dataclass(frozen=True)
class FlopShape:
    """What a tag's FLOP formula reads (`Emit.flops`), for one layer of a stack on one device:
    `tokens` = batch * seq; `keys` the keys a query attends, averaged over the stack's layers
    (`zoo.config.attended_keys`); `ffn` the dense MLP's width on this stack (the shared experts' on an
    MoE stack); `rows` the routed experts' rows (assignments, or experts x capacity), 0 on a dense stack."""

    config: Any
    batch: int
    seq: int
    tokens: int
    keys: float
    ffn: int
    rows: int


# An op's kind and shape, which its measured rate is looked up by (zoo.op_rates.rate).
Op = tuple[str, Union[int, float], Union[int, float]]


@dataclasses.dataclass(frozen=True)
class Emit:
    """A tag a block emits, and the forward FLOPs of the op that produces it from its inputs
    (`zoo.plan.pricing.producer_flops`: what recomputing it costs)."""

    tag: TagInfo
    flops: Callable[[FlopShape], int | float]  # an int for exact counts; producer_flops makes it a float
    # The kind and shape of that op, which its measured rate depends on (zoo.op_rates): ("matmul",
    # "grouped_matmul" or "capacity_einsum", contraction width, output width) or ("attention",
    # sequence, query head dim).
    # None (norms, elementwise ops): counted at the step's rate.
    op: Optional[Callable[[FlopShape], Op]] = None


# The vocabulary: every tag some block declares (`declares`), kind by kind. Filled as the blocks are
# defined: importing the blocks (zoo.nn, which everything that runs or reads a model imports) defines them all.
TAGS: dict[str, TagInfo] = {}


# The tag names that several modules name (each block declares its tags' records, `EMITS`; a block's
# own tags are named in its file, as zoo.nn.mlp names the gated MLP's).
DECODER_LAYER_INPUT = "decoder_layer_input"
QUERY_PROJ = "query_proj"
KEY_PROJ = "key_proj"
VALUE_PROJ = "value_proj"
CONTEXT = "context"
OUT_PROJ = "out_proj"
QUERY_WA_PROJ = "query_wa_proj"
MLA_Q = "mla_q"
KV_WA_PROJ = "kv_wa_proj"
MLA_KV = "mla_kv"
MOE_MLPWI_0 = "moe_mlpwi_0"
MOE_MLPWI_1 = "moe_mlpwi_1"
MOE_MLPWO = "moe_mlpwo"


def declares(cls):
    """Class decorator of a block: add the tags of its `EMITS` (a tuple of `Emit`) to the vocabulary.
    Two blocks may emit one tag (GQA and MLA both emit the attention tags) with one TagInfo."""
    found = dict(TAGS)
    for e in cls.EMITS:
        if e.tag.block not in KINDS:
            raise ValueError(
                f"{cls.__name__}: tag {e.tag.name!r} has block kind {e.tag.block!r}; the kinds are {KINDS}"
            )
        if found.setdefault(e.tag.name, e.tag) != e.tag:
            raise ValueError(f"{cls.__name__}: tag {e.tag.name!r} declared twice, differently")
    TAGS.clear()
    TAGS.update(sorted(found.items(), key=lambda kv: KINDS.index(kv[1].block)))  # stable within a kind
    return cls


def tag(x, name: str, *, checkpoint: bool = True):
    """Name an intermediate for checkpoint policies. Only names of the vocabulary are allowed.

    While `zoo.capture` traces a model and asks for `name`, the value is also kept for it (see
    `layer_scope`). `checkpoint=False` only keeps it for a capture: for a value whose policy-visible
    residuals a kernel names itself (splash attention), which a second name would save twice."""
    if name not in TAGS:
        raise ValueError(
            f"unknown tag {name!r}: no block declares it (a block's EMITS); the vocabulary is {sorted(TAGS)}"
        )
    scope = _LAYER_SCOPE.get()
    if scope is not None and name in _WANTED.get():
        if name in scope:
            raise ValueError(f"tag {name!r} was emitted twice in one layer; a capture holds one value per layer")
        scope[name] = x
    return checkpoint_name(x, name) if checkpoint else x


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
    names = [t.name for t in TAGS.values() if t.block in kinds]
    if config.uses_mla and config.mla.q_lora_rank is None:
        names = [n for n in names if n not in (QUERY_WA_PROJ, MLA_Q)]
    return tuple(names)
