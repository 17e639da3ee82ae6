"""Routed experts: dispatch token assignments to experts, run them, combine the results.

`routed_experts(x, expert_ids, weights, experts, ...)` is the whole kernel; the router and the shared
experts stay in zoo.nn.moe. It is pure and reads the mesh only from the active layout
(`zoo.sharding.active()`):

- No active layout, or one whose batch is on a single device: one program.
  * `capacity`: assignments scattered into per-expert buffers of `expert_capacity(tokens)` rows and
    multiplied as one batched matmul, so FLOPs grow with top_k * capacity_factor, not with the expert
    count. Assignments past an expert's capacity are dropped (earlier tokens win) and counted.
  * `ragged` (dropless, exact): assignments sorted by expert, three grouped matmuls
    (`zoo.nn.grouped_matmul`: tiles of rows, each times its expert's weight; XLA's own lowering of
    `lax.ragged_dot` is a dense product whose cost grows with the expert count).
- Tokens split over devices: a `shard_map` over the whole mesh, every device routing only its own
  tokens (left to GSPMD, the sorts and scatters over tokens gather every device's assignments).
  * Expert parallelism (the `experts` dim sharded over `ep` > 1 devices), `capacity`: capacity
    buffers for all experts from the LOCAL token count, one `all_to_all` over the expert axes sends
    each expert shard its buffers, the shard runs its `E/ep` experts on the `ep * C` rows it received,
    and the reverse `all_to_all` returns the outputs, which are combined where the tokens live. The
    global batch never travels.
  * Expert parallelism, `ragged` (dropless, exact): the local assignments sorted by expert go to
    their shards in rounds of fixed blocks, `exchange_factor` x the mean rows per (device, shard),
    as many rounds as the fullest pair needs (`zoo.nn.expert_rounds`: one round at balanced load,
    no buffer sized for the worst case, the same all_to_all on every platform). The first round is
    tagged and differentiated as the capacity kernel is; the later ones recompute their experts in
    the backward. The shard runs grouped matmuls over its local experts on the blocks where they landed.
  * `ep` == 1 (data parallel / FSDP): each device runs every expert on its own buffers (`capacity`)
    or its own sorted tokens (`ragged`, dropless).
  Weights enter as their shards (`[E/ep, D/fsdp, I/tensor]`); the `embed` shards are gathered inside,
  after the cast to the compute dtype, so a bf16 model moves bf16 weights (and reduce-scatters bf16
  gradients: the gather's transpose). An `mlp` dim on a tensor axis stays split: gate/up act on the
  local slice of I and the down projection is summed over the tensor axes (Megatron style).

Drops on a sharded batch are decided per device (each device's tokens compete for its own
`ceil(local_tokens * k / E * capacity_factor)` rows per expert), so they differ from the
single-program count on the same global batch whenever some expert overflows.

The intermediates keep the routed-expert tags (`MOE_MLPWI_0` gate after its bias, `MOE_MLPWI_1` up,
`MOE_MLPWO` down output before combining; under the dropless expert-parallel exchange, those of its
first round). Under expert parallelism they are tagged inside the shard_map body; jax's shard_map
partial evaluation honours an enclosing `jax.checkpoint` policy for them (saved, offloaded to
pinned_host, or recomputed together with the all_to_all that produced their inputs), which
tests/test_moe_dispatch.py reads back from the jaxpr.
"""

import dataclasses
import math
from typing import Callable, ClassVar, Literal, NamedTuple, Optional, Union

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from zoo import sharding as zs
from zoo import tags as zoo_tags
from zoo._compat import linear_call_vmappable
from zoo.backend import choices as backend_choices
from zoo.nn.expert_rounds import Exchange, exchange_in_rounds, round_block
from zoo.nn.expert_rounds import routing as exchange_routing
from zoo.nn._init import normal
from zoo.nn.grouped_matmul import grouped_matmul, summed_like
from zoo.nn.mlp import gated, swiglu

Impl = Literal["auto", "capacity", "ragged"]
Activation = Callable[[Array, Array], Array]
Tagger = Callable[[Array, str], Array]


class Routed(NamedTuple):
    """What `routed_experts` returns."""

    y: Float[Array, "tokens embed"]
    tokens_per_expert: Int[Array, " experts"]  # assignments routed to each expert, before any drop
    dropped: Int[Array, ""]  # assignments the capacity buffers refused (0 for `ragged`)
    # Rounds the dropless expert-parallel exchange ran (zoo.nn.expert_rounds; 1 everywhere else).
    exchange_rounds: Int[Array, ""]


def _one_round():
    return jnp.ones((), jnp.int32)


def _rows_flops(s: zoo_tags.FlopShape) -> int | float:
    return 2 * s.rows * s.config.hidden_size * s.config.moe.moe_intermediate_size


def _rows_kind(s: zoo_tags.FlopShape) -> str:
    # The capacity path is a batched einsum over equal buffers; the dropless ones a grouped matmul.
    return "capacity_einsum" if s.config.moe.impl == "capacity" else "grouped_matmul"


def _rows_in_op(s: zoo_tags.FlopShape) -> zoo_tags.Op:
    return (_rows_kind(s), s.config.hidden_size, s.config.moe.moe_intermediate_size)


def _rows_out_op(s: zoo_tags.FlopShape) -> zoo_tags.Op:
    return (_rows_kind(s), s.config.moe.moe_intermediate_size, s.config.hidden_size)


def _rows_emit(name: str, shape: str, doc: str, last: str, op: Callable[[zoo_tags.FlopShape], zoo_tags.Op]):
    """A routed-expert tag, laid out as the ragged rows `A ...` or the capacity buffers `E C ...` with
    `last` (a logical axis) their last dim, produced by a matmul over the routed rows."""
    axes = (("rows", last), ("rows", "rows", last))
    return zoo_tags.Emit(zoo_tags.TagInfo(name, shape, doc, zoo_tags.MOE, axes), _rows_flops, op)


@zoo_tags.declares
class ExpertLeaves(eqx.Module):
    """The routed experts' parameters, stacked over experts (biases optional: GPT-OSS has them), their
    axes and the tags the kernel emits on them, declared here only: an abstract base of the kernel's
    argument (`ExpertWeights`) and of the block that holds them (`zoo.nn.moe.MoE`, whose fields they
    are). A stack of layers may add leading dims; the kernel takes one layer's."""

    w_gate: Float[Array, "*layers experts embed moe_mlp"]
    w_up: Float[Array, "*layers experts embed moe_mlp"]
    w_down: Float[Array, "*layers experts moe_mlp embed"]
    b_gate: Optional[Float[Array, "*layers experts moe_mlp"]] = None
    b_up: Optional[Float[Array, "*layers experts moe_mlp"]] = None
    b_down: Optional[Float[Array, "*layers experts embed"]] = None

    # zoo.sharding: the routed experts' leaves, all cast to the compute dtype; the biases as GPT-OSS
    # lays them out, one row per expert. Their shapes follow from the axes (`init`).
    PARAMS: ClassVar[dict[str, zs.Leaf]] = {
        "w_gate": zs.compute("experts", "embed", "mlp", matmul=True),
        "w_up": zs.compute("experts", "embed", "mlp", matmul=True),
        "w_down": zs.compute("experts", "mlp", "embed", matmul=True),
        "b_gate": zs.compute("experts", "mlp"),
        "b_up": zs.compute("experts", "mlp"),
        "b_down": zs.compute("experts", "embed"),
    }
    # zoo.tags: the tags `_ffn` emits and their producers' FLOPs over `FlopShape.rows`, the routed rows.
    EMITS: ClassVar[tuple[zoo_tags.Emit, ...]] = (
        _rows_emit(
            zoo_tags.MOE_MLPWI_0,
            "A I | E C I",
            "routed experts' gate projection (and bias), tokens sorted or dispatched by expert",
            "mlp",
            _rows_in_op,
        ),
        _rows_emit(zoo_tags.MOE_MLPWI_1, "A I | E C I", "routed experts' up projection (and bias)", "mlp", _rows_in_op),
        _rows_emit(
            zoo_tags.MOE_MLPWO,
            "A D | E C D",
            "routed experts' down projection output (and bias), before combining",
            "embed",
            _rows_out_op,
        ),
    )

    def leaves(self) -> dict[str, Optional[Array]]:
        """The routed experts' leaves by name (of a module that may hold more)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(ExpertLeaves)}

    @property
    def n_experts(self) -> int:
        return self.w_gate.shape[-3]


class ExpertWeights(ExpertLeaves):
    """The routed experts' leaves alone: what `routed_experts` takes."""

    @classmethod
    def init(
        cls, keys: tuple[PRNGKeyArray, ...], experts: int, embed: int, mlp: int, *, bias: bool, dtype
    ) -> "ExpertWeights":
        """New weights (normal, fan-in scaled, one key each: gate, up, down) and zero biases when
        `bias`, each shaped by its declared axes."""
        sizes = {"experts": experts, "embed": embed, "mlp": mlp}
        shapes = {name: tuple(sizes[a] for a in leaf.axes) for name, leaf in cls.PARAMS.items()}
        weights = [name for name, leaf in cls.PARAMS.items() if leaf.matmul]
        made = {
            name: normal(key, shapes[name], shapes[name][1], dtype) for name, key in zip(weights, keys, strict=True)
        }
        made.update({name: jnp.zeros(shapes[name], dtype) for name in cls.PARAMS if name not in made and bias})
        return cls(**made)

    @classmethod
    def of(cls, module: ExpertLeaves) -> "ExpertWeights":
        """The routed experts' leaves alone, of a module holding more (`zoo.nn.moe.MoE`)."""
        return cls(**module.leaves())


# Logical axes of the routed-expert leaves, as ExpertLeaves declares them (for the kernel and the MoE block).
EXPERT_AXES: dict[str, tuple[Optional[str], ...]] = {name: leaf.axes for name, leaf in ExpertWeights.PARAMS.items()}


def expert_capacity(tokens: int, top_k: int, n_experts: int, capacity_factor: float) -> int:
    """Rows per expert buffer: ceil(tokens * top_k / experts * capacity_factor), at least 1 and at most
    tokens * top_k, every assignment (the formula of zoo.config.moe_capacity, evaluated in the same order)."""
    return min(tokens * top_k, max(1, math.ceil(tokens * top_k / n_experts * capacity_factor)))


# --- bookkeeping shared by every path ---------------------------------------------------------


def sorted_assignments(
    expert_ids: Int[Array, "tokens k"], n_experts: int
) -> tuple[Int[Array, " assignments"], Int[Array, " assignments"], Int[Array, " experts"]]:
    """Assignment a = token * k + slot: its expert, the stable order by expert, and per-expert counts."""
    flat_experts = expert_ids.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)  # stable: earlier tokens first within an expert
    counts = jnp.bincount(flat_experts, length=n_experts).astype(jnp.int32)
    return flat_experts, order, counts


def capacity_slots(
    flat_experts: Int[Array, " assignments"],
    order: Int[Array, " assignments"],
    counts: Int[Array, " experts"],
    capacity: int,
) -> tuple[Int[Array, " assignments"], Bool[Array, " assignments"]]:
    """Each assignment's row in its expert's buffer (`capacity` when dropped) and whether it is kept."""
    # The row is the assignment's rank among its expert's assignments, in token order.
    group_start = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(flat_experts.shape[0], dtype=jnp.int32) - group_start[flat_experts[order]]
    slot = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted, unique_indices=True)
    kept = slot < capacity
    # Out of bounds: dropped by the scatter, read back as zero by the gather.
    return jnp.where(kept, slot, capacity), kept


def combine(
    per_assignment: Float[Array, "assignments embed"], weights: Float[Array, "tokens k"]
) -> Float[Array, "tokens embed"]:
    """y[n] = sum_j weights[n, j] * per_assignment[n * k + j]."""
    tokens, k = weights.shape
    out = per_assignment.reshape(tokens, k, -1)
    return jnp.einsum("NKD,NK->ND", out, weights.astype(out.dtype))


def _dispatch(x, flat_experts, slot, n_experts: int, capacity: int):
    k = flat_experts.shape[0] // x.shape[0]
    buffers = jnp.zeros((n_experts, capacity, x.shape[-1]), x.dtype)
    return buffers.at[flat_experts, slot].set(jnp.repeat(x, k, axis=0), mode="drop")


def _ffn(h, w: ExpertWeights, matmul, add_bias, activation: Activation, tag: Tagger, reduce_mlp=None):
    """Gate, up, activation, down; biases (if any) through `add_bias`, since their row layout
    depends on the path. `reduce_mlp` sums the down projection over mlp shards before its bias."""
    gate = matmul(h, w.w_gate)
    if w.b_gate is not None:
        gate = add_bias(gate, w.b_gate)
    gate = tag(gate, zoo_tags.MOE_MLPWI_0)
    up = matmul(h, w.w_up)
    if w.b_up is not None:
        up = add_bias(up, w.b_up)
    up = tag(up, zoo_tags.MOE_MLPWI_1)
    out = matmul(gated(activation, gate, up), w.w_down)
    if reduce_mlp is not None:
        out = reduce_mlp(out)
    if w.b_down is not None:
        out = add_bias(out, w.b_down)
    return tag(out, zoo_tags.MOE_MLPWO)


def _cast(w: ExpertWeights, dtype) -> ExpertWeights:
    return jax.tree.map(lambda a: a.astype(dtype), w)


@jax.custom_jvp
def expert_matmul(
    h: Float[Array, "experts rows d_in"], w: Float[Array, "experts d_in d_out"]
) -> Float[Array, "experts rows d_out"]:
    """`ECD,EDF->ECF`: every expert's rows times its weight, with a reverse mode that computes the
    weight's gradient in the weight's own layout.

    jax transposes a dot into a dot ordered [experts, d_out, d_in] and a transpose after it. XLA
    folds that transpose away for float32 weights; for weights cast to bfloat16 a convert sits in
    between, and XLA:CPU ran the transpose fused into the write of each layer's gradient into the
    stacked [layers, experts, d_in, d_out] buffer: three such writes, one per expert weight, a
    sizeable share of the MoE step (docs/benchmarks.md). Here the gradient is `ECD,ECF->EDF`,
    ordered as the weight is. It is a custom JVP whose tangent is a `linear_call` with that
    transpose, so forward mode (jax.jvp, jax.linearize) works as for any dot."""
    return jnp.einsum("ECD,EDF->ECF", h, w)


def _expert_matmul_jvp(primals, tangents):
    h, w = primals
    out = expert_matmul(h, w)
    live = tuple(i for i in range(2) if not isinstance(tangents[i], SymbolicZero))
    if not live:
        return out, jnp.zeros_like(out)

    def forward_tangent(res, lin):
        h, w = res
        given = dict(zip(live, lin))
        parts = []
        if 0 in given:
            parts.append(jnp.einsum("ECD,EDF->ECF", given[0], w))
        if 1 in given:
            parts.append(jnp.einsum("ECD,EDF->ECF", h, given[1]))
        return sum(parts[1:], parts[0])

    def transpose(res, d_out):
        h, w = res
        grads = {}
        if 0 in live:
            grads[0] = summed_like(jnp.einsum("ECF,EDF->ECD", d_out, w), h)
        if 1 in live:
            grads[1] = summed_like(jnp.einsum("ECD,ECF->EDF", h, d_out), w)
        return tuple(grads[i] for i in live)

    linear_call_vmappable()  # jax.vmap through this reverse mode (per-example gradients) needs a rule jax lacks
    return out, linear_call(forward_tangent, transpose, (h, w), tuple(tangents[i] for i in live))


expert_matmul.defjvp(_expert_matmul_jvp, symbolic_zeros=True)


def _buffer_matmul(h, w):
    return expert_matmul(h, w)


def _buffer_bias(v, b):
    return v + b[:, None, :]


def grouped_matmul_tile() -> int:
    """zoo.backend's tile for the backend tracing the step (a cuda lowering on a CPU host takes
    CPU's: the tile changes speed, never the result)."""
    return backend_choices().grouped_matmul_tile


# --- one program ------------------------------------------------------------------------------


def _capacity_local(x, expert_ids, weights, w: ExpertWeights, *, activation, capacity_factor, tag):
    tokens, k = expert_ids.shape
    experts = w.n_experts
    capacity = expert_capacity(tokens, k, experts, capacity_factor)
    flat_experts, order, counts = sorted_assignments(expert_ids, experts)
    slot, kept = capacity_slots(flat_experts, order, counts, capacity)
    buffers = _dispatch(x, flat_experts, slot, experts, capacity)
    out = _ffn(buffers, w, _buffer_matmul, _buffer_bias, activation, tag)
    per_assignment = out.at[flat_experts, slot].get(mode="fill", fill_value=0)
    dropped = (tokens * k - kept.sum()).astype(jnp.int32)
    return combine(per_assignment, weights), counts, dropped


def _ragged_local(x, expert_ids, weights, w: ExpertWeights, *, activation, tag, reduce_mlp=None):
    k = expert_ids.shape[1]
    flat_experts, order, counts = sorted_assignments(expert_ids, w.n_experts)
    sorted_x = x[order // k]  # [A D], grouped by expert
    sorted_experts = flat_experts[order]

    def matmul(h, wt):
        return grouped_matmul(h, wt, counts, tile=grouped_matmul_tile(), impl=backend_choices().grouped_matmul)

    def add_bias(v, b):
        return v + b[sorted_experts]

    sorted_out = _ffn(sorted_x, w, matmul, add_bias, activation, tag, reduce_mlp)
    unsorted = jnp.zeros_like(sorted_out).at[order].set(sorted_out, unique_indices=True)
    return combine(unsorted, weights), counts, jnp.zeros((), jnp.int32)


# --- expert parallelism -----------------------------------------------------------------------


def _entry_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class _EPLayout:
    """How the active layout splits the routed experts."""

    layout: zs.Layout
    ep_axes: tuple[str, ...]  # the experts dim's mesh axes
    mlp_axes: tuple[str, ...]  # kept split; the down projection is summed over them
    batch_axes: tuple[str, ...]

    @property
    def ep(self) -> int:
        return math.prod(self.layout.axis_size(a) for a in self.ep_axes)


def _ep_layout(layout: zs.Layout) -> _EPLayout:
    spec = layout.spec(EXPERT_AXES["w_gate"])
    ep_axes, _, mlp_axes = (_entry_axes(e) for e in spec)
    # Under context parallelism the tokens are split over the context axes too (zoo.nn.moe.MoE puts
    # them first in its flattened token order).
    batch_axes = zs.context_axes() + _entry_axes(layout.spec(("batch",))[0])
    return _EPLayout(layout, ep_axes, mlp_axes, batch_axes)


def expert_specs(layout: zs.Layout, experts: ExpertWeights) -> ExpertWeights:
    """The PartitionSpec of each present leaf of `experts` under `layout` (absent biases stay None)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: layout.spec(EXPERT_AXES[path[-1].name]), experts)


def _round_ffn(activation: Activation, reduce_mlp, tag: Tagger):
    """The local experts over one round's received blocks (`zoo.nn.expert_rounds`): tagged in the
    first round, untagged in the later ones, whose reverse mode recomputes them (no policy acts there)."""

    def ffn(h, w: ExpertWeights, group_sizes, group_experts, tagged: bool):
        row_experts = jnp.repeat(group_experts, group_sizes, total_repeat_length=h.shape[0])

        def matmul(a, wt):
            return grouped_matmul(a, wt, group_sizes, group_experts, tile=grouped_matmul_tile())

        def add_bias(v, b):
            return v + b.at[row_experts].get(mode="fill", fill_value=0)

        return _ffn(h, w, matmul, add_bias, activation, tag if tagged else _untagged, reduce_mlp)

    return ffn


def _untagged(a, name):
    return a


def _ragged_exchange(
    x, expert_ids, weights, w: ExpertWeights, *, ep: int, ep_axis, activation, exchange_factor, tag, reduce_mlp
):
    """Dropless expert parallelism inside the shard_map body (`ragged`): this device's assignments,
    sorted by expert, go to their expert shards in rounds of fixed blocks, `exchange_factor` x the
    mean rows per (device, shard) pair, as many rounds as the fullest pair needs
    (`zoo.nn.expert_rounds`). Each shard runs grouped matmuls over its E/ep experts on the blocks
    where they landed and sends the rows back."""
    tokens, k = expert_ids.shape
    local_experts = w.n_experts
    block = round_block(tokens, k, ep, local_experts, exchange_factor)
    _, order, counts = sorted_assignments(expert_ids, local_experts * ep)
    rt = exchange_routing(expert_ids, order, counts, ep=ep, axis=ep_axis, block=block)
    ex = Exchange(ffn=_round_ffn(activation, reduce_mlp, tag), ep=ep, axis=ep_axis, block=block)
    return exchange_in_rounds(x, weights, w, rt, ex), counts, jnp.zeros((), jnp.int32), rt.rounds


def _sharded(
    x,
    expert_ids,
    weights,
    w: ExpertWeights,
    plan: _EPLayout,
    *,
    impl,
    activation,
    capacity_factor,
    exchange_factor,
    compute_dtype,
    tag,
):
    """The routed experts as one program per device (`shard_map`): each device routes its own tokens.
    With `ep` > 1 its capacity buffers travel to the experts' devices and back (all_to_all); with
    `ep` == 1 every device runs every expert on its own buffers (or, `ragged`, its own sorted tokens)."""
    mesh = plan.layout.mesh
    ep, n_experts = plan.ep, w.n_experts
    local_experts = n_experts // ep
    k = expert_ids.shape[1]
    token_spec = P(plan.batch_axes or None, None)
    names = [f for f in EXPERT_AXES if getattr(w, f) is not None]
    w_specs = expert_specs(plan.layout, w)
    ep_axis = (plan.ep_axes if len(plan.ep_axes) > 1 else plan.ep_axes[0]) if plan.ep_axes else None

    def gather_embed(a, name):
        # The cast comes first so the gather (and its transpose, the gradient reduce-scatter) moves compute-dtype bytes.
        a = a.astype(compute_dtype)
        logical = EXPERT_AXES[name]
        if "embed" not in logical:
            return a
        dim = logical.index("embed")
        axes = _entry_axes(plan.layout.spec(logical)[dim])
        return jax.lax.all_gather(a, axes, axis=dim, tiled=True) if axes else a

    def body(x, expert_ids, weights, w):
        local = ExpertWeights(**{f: gather_embed(getattr(w, f), f) for f in names})
        reduce_mlp = (lambda v: jax.lax.psum(v, plan.mlp_axes)) if plan.mlp_axes else None
        if impl == "ragged" and ep > 1:
            y, counts, dropped, rounds = _ragged_exchange(
                x,
                expert_ids,
                weights,
                local,
                ep=ep,
                ep_axis=ep_axis,
                activation=activation,
                exchange_factor=exchange_factor,
                tag=tag,
                reduce_mlp=reduce_mlp,
            )
        elif impl == "ragged":  # dropless on this device's tokens, every expert here
            y, counts, dropped = _ragged_local(
                x, expert_ids, weights, local, activation=activation, tag=tag, reduce_mlp=reduce_mlp
            )
            rounds = _one_round()
        else:
            tokens = x.shape[0]
            capacity = expert_capacity(tokens, k, n_experts, capacity_factor)
            flat_experts, order, counts = sorted_assignments(expert_ids, n_experts)
            slot, kept = capacity_slots(flat_experts, order, counts, capacity)
            buffers = _dispatch(x, flat_experts, slot, n_experts, capacity)  # [E C D], experts in shard order
            d = x.shape[-1]
            if ep > 1:
                # Block s of dim 0 (experts s*E/ep ...) goes to expert shard s; what comes back is block per source.
                received = jax.lax.all_to_all(buffers, ep_axis, 0, 0, tiled=True)  # [ep*E/ep C D], by source
                rows = (
                    received.reshape(ep, local_experts, capacity, d)
                    .transpose(1, 0, 2, 3)
                    .reshape(local_experts, ep * capacity, d)
                )
            else:
                rows = buffers
            out = _ffn(rows, local, _buffer_matmul, _buffer_bias, activation, tag, reduce_mlp)
            if ep > 1:
                out = out.reshape(local_experts, ep, capacity, d).transpose(1, 0, 2, 3).reshape(n_experts, capacity, d)
                out = jax.lax.all_to_all(out, ep_axis, 0, 0, tiled=True)  # [E C D], back in global expert order
            per_assignment = out.at[flat_experts, slot].get(mode="fill", fill_value=0)
            y = combine(per_assignment, weights)
            dropped = (tokens * k - kept.sum()).astype(jnp.int32)
            rounds = _one_round()
        if plan.batch_axes:
            counts = jax.lax.psum(counts, plan.batch_axes)
            dropped = jax.lax.psum(dropped, plan.batch_axes)
        return y, counts, dropped, rounds

    fn = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec, token_spec, token_spec, w_specs),
        out_specs=(token_spec, P(), P(), P()),
    )
    return Routed(*fn(x, expert_ids, weights, w))


def _check_layout(plan: _EPLayout, n_experts: int) -> None:
    ep_desc = "*".join(f"{a}={plan.layout.axis_size(a)}" for a in plan.ep_axes)
    if n_experts % plan.ep:
        raise ValueError(
            f"model.moe.n_routed_experts: {n_experts} experts cannot be split over {ep_desc}; "
            f"make mesh.expert divide the expert count"
        )
    shared = [a for a in plan.mlp_axes if a in plan.batch_axes]
    if shared:
        # Summing the down projection over an axis that also splits the batch would add up different tokens.
        raise ValueError(
            f"mesh.rules.mlp: the experts' mlp dim is split over {shared[0]}, which also splits the batch; "
            f"map mlp to axes outside mesh.rules.batch (e.g. tensor)"
        )
    missing = [a for a in plan.ep_axes if a not in plan.batch_axes]
    if missing:
        raise ValueError(
            f"mesh.rules.batch: expert parallelism needs the batch split over the expert axes too ({missing[0]} is "
            f"missing from {list(plan.batch_axes)}); add it to mesh.rules.batch"
        )


def resolve_moe_impl(impl: str) -> str:
    """`auto` -> `ragged`: dropless, as every MoE family Zoo has was trained (`zoo.families`'
    `dropless`), its grouped matmul costing the routed rows only (zoo.nn.grouped_matmul), and under
    expert parallelism exchanging in rounds of fixed blocks (zoo.nn.expert_rounds), never in blocks
    sized for the worst case. An explicit `ragged` or `capacity` is taken as it is."""
    return "ragged" if impl == "auto" else impl


def exchanges_in_rounds(impl: str, rules, sizes) -> bool:
    """Whether the routed experts of kernel `impl`, under logical-axis `rules` on a mesh of axis
    `sizes`, run the dropless expert-parallel exchange (zoo.nn.expert_rounds)."""
    return resolve_moe_impl(impl) == "ragged" and zs.logical_ways(rules, sizes, "experts") > 1


# --- the kernel -------------------------------------------------------------------------------


def routed_experts(
    x: Float[Array, "tokens embed"],
    expert_ids: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    experts: ExpertWeights,
    *,
    activation: Activation = swiglu,
    impl: Impl = "capacity",
    capacity_factor: Union[int, float] = 1.25,
    exchange_factor: Union[int, float] = 1.25,
    compute_dtype=jnp.float32,
    tag: Tagger = zoo_tags.tag,
) -> Routed:
    """`Routed(y, tokens_per_expert, dropped, exchange_rounds)`: y[n] = sum_j weights[n, j] *
    expert_{expert_ids[n, j]}(x[n]).

    `x` is in the compute dtype (the expert weights are cast to it); `tokens_per_expert` counts the
    assignments routed to each expert before any drop, `dropped` those the capacity buffers refused
    (always 0 for `ragged`). Both are global (summed over the batch shards) under expert parallelism.
    `exchange_rounds`: the rounds the dropless expert-parallel exchange took (the most any device
    needed; 1 on every other path). The expert path is chosen from the active layout (see the module
    docstring).
    """
    if impl not in ("auto", "capacity", "ragged"):
        raise ValueError(f"model.moe.impl: unknown kernel {impl!r}; choose auto, capacity or ragged")
    capacity_factor = float(capacity_factor)
    layout = zs.active()
    plan = _ep_layout(layout) if layout is not None else None
    impl = resolve_moe_impl(impl)
    if plan is not None:
        if plan.ep > 1 or math.prod(layout.axis_size(a) for a in plan.batch_axes) > 1:
            # Tokens split over devices: route and dispatch on each device (left to the partitioner,
            # the sorts and scatters over tokens would gather the whole batch's assignments everywhere).
            _check_layout(plan, experts.n_experts)
            return _sharded(
                x,
                expert_ids,
                weights,
                experts,
                plan,
                impl=impl,
                activation=activation,
                capacity_factor=capacity_factor,
                exchange_factor=float(exchange_factor),
                compute_dtype=compute_dtype,
                tag=tag,
            )
    w = _cast(experts, compute_dtype)
    if impl == "ragged":
        return Routed(*_ragged_local(x, expert_ids, weights, w, activation=activation, tag=tag), _one_round())
    return Routed(
        *_capacity_local(x, expert_ids, weights, w, activation=activation, capacity_factor=capacity_factor, tag=tag),
        _one_round(),
    )


# --- configuration checks ---------------------------------------------------------------------


def check_expert_parallel(
    n_experts: int,
    ep: int,
    batch_size: int,
    batch_ways: int,
    *,
    grad_accum: int = 1,
    batch_includes_expert: bool = True,
) -> None:
    """Refuse a configuration expert parallelism cannot run; ValueError, one line starting with the key.

    `n_experts`: routed experts per MoE layer (0 for a dense model); `ep`: the expert axis size;
    `batch_size` / `grad_accum`: sequences per step / microbatches; `batch_ways`: how many ways the
    rules split the batch (data*fsdp*expert by default); `batch_includes_expert`: whether the batch rule
    lists the expert axis.
    """
    if ep < 1:
        raise ValueError(f"mesh.expert: size {ep} is invalid; use a positive size")
    if ep == 1:
        return
    if n_experts == 0:
        raise ValueError(
            f"mesh.expert: {ep} devices on the expert axis, but the model has no MoE layers; "
            f"set mesh.expert=1 and give the devices to mesh.fsdp or mesh.data"
        )
    if n_experts % ep:
        fits = max(d for d in range(1, ep + 1) if n_experts % d == 0)
        raise ValueError(
            f"model.moe.n_routed_experts: {n_experts} experts cannot be split over mesh.expert={ep}; "
            f"use an expert axis that divides {n_experts} (e.g. mesh.expert={fits})"
        )
    if not batch_includes_expert:
        raise ValueError(
            "mesh.rules.batch: expert parallelism needs the batch split over the expert axis; add expert to "
            "mesh.rules.batch"
        )
    micro = batch_size // grad_accum if grad_accum else batch_size
    if batch_size % max(grad_accum, 1) or micro % batch_ways:
        raise ValueError(
            f"data.batch_size: {batch_size} sequences in {grad_accum} microbatch(es) cannot be split over the "
            f"{batch_ways} batch-parallel devices (each expert-parallel device routes its own tokens); "
            f"use a multiple of {batch_ways * max(grad_accum, 1)}"
        )
