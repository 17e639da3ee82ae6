"""What the model's tags and layers cost, from its config and the traced records: FLOPs of each
tag's producer (its block's `EMITS`), its op's measured slowness (`OpSlowness`, hardware.op_rates),
and each tag's bytes on one device under the run's sharding (`per_device_shape`, `tag_costs`)."""

import dataclasses
import math
from typing import Optional, Sequence


from zoo.config import attended_keys, moe_capacity
from zoo.model import block_classes, stack_layout
from zoo.nn.expert_rounds import round_block
from zoo.nn.moe_dispatch import exchanges_in_rounds
from zoo.offload import CHECKPOINT_INPUTS, backward_never_reads
from zoo.op_rates import FORWARD_KIND
from zoo.op_rates import rate as op_rate
from zoo.plan.problem import CHOICES, PlanError, TagCost
from zoo.sharding import CONTEXT, logical_to_spec, logical_ways
from zoo.tags import MOE, TAGS, FlopShape, Op, emitted_tags


def stack_layers(config, stack: str) -> list[int]:
    """The layer indices of a named stack of the model `config` builds."""
    for name, first, period, repeats in stack_layout(config):
        if name == stack:
            return list(range(first, first + period * repeats))
    return list(range(config.num_layers))


def producer_flops(config, tag: str, stack: str, batch: int, seq: int) -> float:
    """Forward FLOPs, per layer and device, of the op that produces `tag` from its inputs: the formula
    its block declares beside its maths (`EMITS` of the blocks this stack is built of, `stack_emits`),
    given this stack's shapes (`zoo.tags.FlopShape`). Matmuls: 2 * output elements * contraction;
    attention (`context`) over the keys a query attends, averaged over the stack's layers; the layer
    input cannot be recomputed: 0.
    """
    c = config
    table = stack_emits(c, stack)
    if tag not in table:
        # A tag this stack emits that no block declares a formula for would cost 0 FLOPs to recompute.
        raise ValueError(
            f"zoo.plan.pricing.producer_flops: no FLOP count for tag {tag!r} on stack {stack!r}; declare it in its "
            "block's EMITS"
        )
    return float(table[tag].flops(_flop_shape(c, stack, batch, seq)))


def producer_op(config, tag: str, stack: str, batch: int, seq: int) -> Optional[Op]:
    """The kind and shape of the op producing `tag` on `stack` (`zoo.tags.Emit.op`): what its
    measured rate is looked up by (`zoo.op_rates.rate`); None: no measured rate applies."""
    emit = stack_emits(config, stack).get(tag)
    return None if emit is None or emit.op is None else emit.op(_flop_shape(config, stack, batch, seq))


def _flop_shape(c, stack: str, batch: int, seq: int) -> FlopShape:
    n = batch * seq
    layers = stack_layers(c, stack)
    keys = sum(attended_keys(seq, c.layer_spec(i).window) for i in layers) / len(layers)
    if all(c.is_moe_layer(i) for i in layers):
        mo = c.moe
        ffn = mo.moe_intermediate_size * mo.n_shared_experts
        if mo.impl == "capacity":  # the config as the run builds it: `auto` resolved (zoo.train.run_config.as_built)
            rows = mo.n_routed_experts * moe_capacity(n, mo)
        else:
            rows = n * mo.num_experts_per_tok
    else:
        ffn, rows = c.intermediate_size, 0
    return FlopShape(c, batch, seq, n, keys, ffn, rows)


def stack_emits(config, stack: str) -> dict:
    """Tag -> its `zoo.tags.Emit` (FLOP formula and op), of the blocks this stack's layers are built
    of (`EMITS` of zoo.model.block_classes: its attention, its feed-forward, a MoE's shared experts)."""
    layers = stack_layers(config, stack)
    blocks = dict.fromkeys(b for i in layers for b in block_classes(config, config.layer_spec(i)))
    return {e.tag.name: e for b in blocks for e in getattr(b, "EMITS", ())}


def layer_forward_flops(
    config, stack: str, batch: int, seq: int, slowness: Optional["OpSlowness"] = None, op_config=None
) -> float:
    """Forward FLOPs of one layer of a data-parallel rank (the devices sharing its batch split them):
    the sum of its producers (mlpwo included), over the tags the model emits that this stack's blocks
    declare (a dense stack of an MoE model has no routed experts; an MoE stack without shared experts
    no dense MLP); with `slowness`, each weighted by its op's, its shape read from `op_config`
    (default `config`; `per_device_widths`)."""
    declared = stack_emits(config, stack)
    return sum(
        producer_flops(config, t, stack, batch, seq)
        * (slowness(producer_op(op_config or config, t, stack, batch, seq)) if slowness else 1.0)
        for t in emitted_tags(config)
        if t in declared
    )


def per_device_widths(config, rules=None, sizes=None):
    """`config` with the widths one device computes under the sharding `rules` on a mesh of axis
    `sizes` (tensor parallelism splits the heads, the kv heads and the MLP's hidden dim, dense and
    experts'; rounded up, as the partitioner pads): what an op's measured rate is looked up by."""
    if not (rules and sizes):
        return config

    def ways(logical):
        return logical_ways(rules, sizes, logical)

    heads, kv_heads, mlp = ways("heads"), ways("kv_heads"), ways("mlp")
    if heads == kv_heads == mlp == 1:
        return config
    num_heads = -(-config.num_heads // heads)
    num_kv_heads = -(-config.num_kv_heads // kv_heads)
    # The config must stay valid (query heads a multiple of kv heads); where rounding up broke that,
    # the nearest kv width that divides (only a rate lookup reads it).
    changes = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads if num_heads % num_kv_heads == 0 else math.gcd(num_heads, num_kv_heads),
        "intermediate_size": -(-config.intermediate_size // mlp),
    }
    if config.moe is not None:
        changes["moe"] = dataclasses.replace(
            config.moe, moe_intermediate_size=-(-config.moe.moe_intermediate_size // mlp)
        )
    return config.replace(**changes)


class OpSlowness:
    """How many times longer an op takes than its FLOPs at the `reference` rate: `reference` over its
    measured rate (`zoo.op_rates.rate` over the `table` of hardware.op_rates), 1 where none applies
    (no table, an op the table lacks, or a table measured with another kernel than `impls` names,
    e.g. splash's rates for a run on blockwise attention). `used` lists the ops it weighed."""

    def __init__(self, table: Optional[dict], reference: float, impls: dict):
        self.table, self.reference, self.impls = table or {}, reference, impls
        self.used: list[str] = []

    def __call__(self, op: Optional[Op], forward_only: bool = False) -> float:
        """`forward_only`: the op's forward alone (a recompute), at its forward grid where the table
        has one (`zoo.op_rates.FORWARD_KIND`), else at its value-and-gradient rate."""
        if op is None:
            return 1.0
        kind, a, b = op
        impl = self.impls.get(kind)
        if forward_only and FORWARD_KIND.get(kind) in self.table:
            kind = FORWARD_KIND[kind]
        grid = self.table.get(kind)
        if not grid or grid.get("impl", impl) != impl:
            return 1.0
        measured = op_rate(self.table, kind, a, b)
        if not measured:
            return 1.0
        label = kind + (f" ({grid['impl']})" if grid.get("impl") else "")
        if label not in self.used:
            self.used.append(label)
        return self.reference / measured


def per_device_shape(tag: str, shape: Sequence[int], rules=None, sizes=None) -> tuple[int, ...]:
    """The shape one device holds of a tag's traced array `shape` (traced per data-parallel rank:
    batch and routed rows already split), under the logical-axis `rules` on a mesh of axis `sizes`:
    each dim of the tag's logical axes (`zoo.tags.TagInfo.axes`) divided by the mesh axes its rule
    gives it (rounded up, as the partitioner pads), a mesh axis used by an earlier dim skipped as in
    `zoo.sharding.logical_to_spec`. No rules: the traced shape."""
    layouts = [a for a in TAGS[tag].axes if len(a) == len(shape)] if tag in TAGS else []
    if not layouts:
        raise PlanError(
            f"model: tag {tag!r} traced as shape {tuple(shape)}, which none of its logical axes in zoo.tags "
            f"({TAGS[tag].axes if tag in TAGS else 'none'}) describes; give the tag its layout in its block's EMITS"
        )
    if rules is None:
        return tuple(shape)
    rules = {k: list(v) for k, v in rules.items()}
    logical = tuple("batch" if a == "rows" else a for a in layouts[0])
    # Context parallelism (rules[CONTEXT]) keeps the sequence split inside the blocks too: a block's
    # whole-sequence dim (None after batch) is its chunk there, and routed rows (the flattened
    # tokens, traced per data-parallel rank) are the chunk's tokens (zoo.nn.moe.MoE).
    context = rules.get(CONTEXT, [])
    rows_ways = 1
    if context and logical[:2] == ("batch", None):
        rules["_context"] = context
        logical = ("batch", "_context", *logical[2:])
    elif context and TAGS[tag].axes[0][0] == "rows":
        rows_ways = math.prod(int(sizes.get(a, 1)) for a in context)
    spec = logical_to_spec(logical, rules)
    out = []
    for i, (dim, name, entry) in enumerate(zip(shape, logical, spec)):
        axes = () if name == "batch" or entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways = math.prod(int(sizes.get(a, 1)) for a in axes) * (rows_ways if i == len(shape) - 2 else 1)
        out.append(-(-int(dim) // ways))
    return tuple(out)


def round_rows_factor(config, ep: int, assignments: int) -> float:
    """Rows one round of the dropless expert-parallel exchange runs the local experts on, against the
    device's `assignments` (tokens * k): `ep` blocks of `exchange_factor` x the mean (zoo.nn.expert_rounds)."""
    m = config.moe
    k = m.num_experts_per_tok
    tokens = max(1, assignments // k)
    return ep * round_block(tokens, k, ep, m.n_routed_experts // ep, m.exchange_factor) / (tokens * k)


def tiled_elements(shape: Sequence[int], tile: int) -> int:
    """Elements an array of `shape` occupies when its two minor dimensions are stored in whole tiles
    of `tile` elements (`zoo.backend.BackendChoices.layout_tile_elements`; 1: as it is)."""
    minor = math.prod(shape[-2:])
    return math.prod(shape[:-2]) * -(-minor // tile) * tile


def tag_costs(config, records, batch: int, seq: int, rules=None, sizes=None, tile: int = 1) -> list[TagCost]:
    """TagCosts from the inspector's records (traced shapes and dtypes, per data-parallel rank), each
    tag's bytes per device as `per_device_shape` splits it under `rules` on a mesh of axis `sizes`
    (tensor parallelism: the heads and the MLP hidden dim; sequence parallelism: the kept layer input),
    stored in the compiler's tiles of `tile` elements. Tags the backward never reads are left out; the
    layer input can be kept or offloaded, not recomputed."""
    by_tag: dict[str, TagCost] = {}
    # The dropless expert-parallel exchange's tagged intermediates are its first round's blocks,
    # `exchange_factor` x the mean rows per (device, shard): more than the traced program's assignments.
    rounds = config.moe is not None and bool(rules and sizes) and exchanges_in_rounds(config.moe.impl, rules, sizes)
    for r in records:
        if r.tag in backward_never_reads(config):
            continue
        choices = ("device", "offload") if r.tag in CHECKPOINT_INPUTS else CHOICES
        t = by_tag.setdefault(r.tag, TagCost(r.tag, {}, {}, choices))
        device_shape = per_device_shape(r.tag, r.shape, rules, sizes)
        share = tiled_elements(device_shape, tile) / max(1, math.prod(r.shape))
        if (
            rounds and TAGS[r.tag].block == MOE and len(r.shape) == 2
        ):  # a routed-expert tag traced as [assignments, ...]
            share *= round_rows_factor(config, logical_ways(rules, sizes, "experts"), device_shape[0])
        t.bytes_per_layer[r.stack] = t.bytes_per_layer.get(r.stack, 0.0) + r.bytes_per_layer * share
        t.recompute_flops_per_layer[r.stack] = (
            0.0 if r.tag in CHECKPOINT_INPUTS else producer_flops(config, r.tag, r.stack, batch, seq)
        )
    return list(by_tag.values())
