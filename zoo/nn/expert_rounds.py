"""Dropless expert parallelism in rounds: every assignment reaches its expert, and no buffer is sized
for the worst case.

Under expert parallelism each device sends its assignments to the expert shards that hold their
experts. A dropless exchange in one go must land them in receiving blocks sized for the worst case
(every local token sending `min(k, E/ep)` assignments to one shard: `ep * min(k, E/ep) / k` times the
assignments, 8x for DeepSeek-V3 on 8 shards). Here the exchange runs in rounds instead: round r sends,
from each device to each shard, the next rows of what it has for that shard (sorted by expert),
the first round `block` of them, with `block` a multiple (`model.moe.exchange_factor`) of the mean rows per
(device, shard) pair. Balanced routing takes one round; a pair holding more takes more rounds (of
blocks a quarter the size, `later_block`), and every device in the group runs the same loop (the
round count is the maximum over the devices), so nothing is ever dropped. Memory: one round's
blocks, whatever the routing.

The first round is plain JAX: its experts' intermediates carry the routed-expert tags, so the
checkpoint policy keeps, offloads or recomputes them as it does the capacity kernel's, and JAX
differentiates it. The later rounds (none at balanced load) run in a loop whose length is only known
at run time, which JAX cannot reverse-differentiate, so their reverse mode is written out
(`jax.custom_vjp`): the backward runs the same rounds, sending each round's inputs again with the
output cotangents, recomputing the experts' forward on them and sending the input cotangents back.
Their residuals are the kernel's own inputs (tokens, routing weights, expert weights, integer
routing); their intermediates are never kept and carry no tag, whatever the policy. Forward-mode
derivatives (`jax.jvp`) do not pass a custom VJP: take them on a mesh without an expert axis, where
the routed experts run `zoo.nn.grouped_matmul` directly.
"""

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from zoo._compat import varying_axes
from zoo.nn.grouped_matmul import summed_like, varying_like

# ffn(rows [n, D], expert weights, group_sizes, group_experts, tagged) -> [n, D]: the local experts over
# rows grouped as `zoo.nn.grouped_matmul` takes them (a group whose expert is out of range is padding),
# their intermediates tagged (zoo.tags) or not.
RoundFFN = Callable[[Array, object, Array, Array, bool], Array]


def round_block(tokens: int, top_k: int, ep: int, local_experts: int, factor: float) -> int:
    """Rows one device sends one expert shard per round: `factor` x the mean (`tokens * k / ep`),
    rounded up, at least 1 and at most the worst case (`tokens * min(k, E/ep)`: then one round always)."""
    worst = tokens * min(top_k, local_experts)
    return max(1, min(worst, math.ceil(tokens * top_k / ep * factor)))


class Routing(NamedTuple):
    """Integer bookkeeping of one exchange (no gradient): this device's assignments sorted by expert
    (so each shard's are contiguous), and what every source sends this shard."""

    token: Int[Array, " assignments"]  # sorted assignment -> its token
    assignment: Int[Array, " assignments"]  # sorted assignment -> token * k + slot
    send_offsets: Int[Array, " ep"]  # where each shard's run starts in the sorted order
    per_shard: Int[Array, " ep"]  # its length
    received: Int[Array, "ep local_experts"]  # rows each source sends each local expert
    rounds: Int[Array, ""]  # rounds the expert axis runs (its maximum)
    shard: Int[Array, " assignments"]  # assignment token * k + slot -> the shard its expert lives on
    position: Int[Array, " assignments"]  # -> its row in what this device sends that shard, over the rounds


def later_block(block: int) -> int:
    """Rows per (device, shard) of the rounds after the first: a quarter of the first's. They carry
    only what exceeds the first block, and their loop's buffers are reserved for the whole step
    whether it runs or not (XLA sizes a loop body statically)."""
    return max(1, -(-block // 4))


def routing(
    expert_ids: Int[Array, "tokens k"],
    order: Int[Array, " assignments"],
    counts: Int[Array, " experts"],
    *,
    ep: int,
    axis,
    block: int,
) -> Routing:
    """The exchange's bookkeeping inside the shard_map body, from `zoo.nn.moe_dispatch.sorted_assignments`."""
    k = expert_ids.shape[1]
    local = counts.shape[0] // ep
    per_shard = counts.reshape(ep, local).sum(-1)
    send_offsets = (jnp.cumsum(per_shard) - per_shard).astype(jnp.int32)
    shard = (expert_ids.reshape(-1) // local).astype(jnp.int32)
    sorted_position = (
        jnp.zeros_like(order, dtype=jnp.int32)
        .at[order]
        .set(jnp.arange(order.shape[0], dtype=jnp.int32), unique_indices=True)
    )
    received = jax.lax.all_to_all(counts.reshape(ep, local), axis, 0, 0, tiled=True)
    later = later_block(block)
    needed = 1 + (jnp.maximum(jnp.max(per_shard) - block, 0) + later - 1) // later
    # Every device whose tokens differ runs the same rounds: the loop holds collectives over the expert
    # axis and, through the experts' weights, over the axes that split them (fsdp).
    everywhere = tuple(sorted(varying_axes(expert_ids) | set(_names(axis))))
    return Routing(
        token=(order // k).astype(jnp.int32),
        assignment=order.astype(jnp.int32),
        send_offsets=send_offsets,
        per_shard=per_shard.astype(jnp.int32),
        received=received.astype(jnp.int32),
        rounds=jax.lax.pmax(needed, everywhere).astype(jnp.int32),
        shard=shard,
        position=sorted_position - send_offsets[shard],
    )


def _names(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The static half: the expert-axis name(s), its size, the first round's block and the local
    experts' FFN (the later rounds' block is `later_block(block)`)."""

    ffn: RoundFFN
    ep: int
    axis: object
    block: int

    def later_window(self, r) -> tuple:
        """Round r's rows `[lo, lo + size)` of each (device, shard) run, for r >= 1 (the first round's
        are `[0, block)`); `size` is static."""
        later = later_block(self.block)
        return self.block + (r - 1) * later, later


def _window(rt: Routing, lo, size: int, tokens: int, assignments: int):
    """The send blocks `[ep, size]` of rows `[lo, lo + size)`: each row's token and flat assignment
    index, out of range (`tokens`, `assignments`) where the shard's run has ended."""
    position = lo + jnp.arange(size, dtype=jnp.int32)
    valid = position[None, :] < rt.per_shard[:, None]
    at = jnp.where(valid, rt.send_offsets[:, None] + position[None, :], 0)
    return jnp.where(valid, rt.token[at], tokens), jnp.where(valid, rt.assignment[at], assignments)


def _groups(rt: Routing, lo, size: int):
    """The received blocks of rows `[lo, lo + size)` as grouped-matmul groups: per source, its rows for
    each local expert inside the window, then the block's padding (the group with no expert)."""
    local = rt.received.shape[1]
    ends = jnp.cumsum(rt.received, axis=-1)
    inside = jnp.clip(ends - lo, 0, size) - jnp.clip(ends - rt.received - lo, 0, size)
    padding = size - inside.sum(-1, keepdims=True)
    sizes = jnp.concatenate([inside, padding], axis=-1).reshape(-1)
    experts = jnp.tile(jnp.arange(local + 1, dtype=jnp.int32), rt.received.shape[0])
    return sizes, experts


def _there(ex: Exchange, a):
    return jax.lax.all_to_all(a, ex.axis, 0, 0, tiled=True)


def _round(ex: Exchange, x, weights, w, rt: Routing, lo, size: int, *, tagged: bool):
    """The contribution to y ([tokens, D], in the compute dtype) of the round that sends rows
    `[lo, lo + size)` of each (device, shard) run: those rows there, the local experts, back, then each
    assignment's row picked from what came back (zero for those of other rounds) and combined with
    its routing weight, as the capacity kernel combines its buffers."""
    tokens, d = x.shape
    token, _ = _window(rt, lo, size, tokens, rt.assignment.shape[0])
    received = _there(ex, x.at[token].get(mode="fill", fill_value=0))
    sizes, experts = _groups(rt, lo, size)
    out = ex.ffn(received.reshape(-1, d), w, sizes, experts, tagged).reshape(ex.ep, size, d)
    back = _there(ex, out)
    row = rt.position - lo
    row = jnp.where((row >= 0) & (row < size), row, size)  # out of range (a negative one would wrap): zero
    per_assignment = back.at[rt.shard, row].get(mode="fill", fill_value=0)
    return jnp.einsum("NKD,NK->ND", per_assignment.reshape(tokens, -1, d), weights.astype(back.dtype))


def _later_rounds(ex: Exchange, x, weights, w, rt: Routing):
    def round_(r, y):
        return y + _round(ex, x, weights, w, rt, *ex.later_window(r), tagged=False).astype(jnp.float32)

    y = jax.lax.fori_loop(1, rt.rounds, round_, varying_like(jnp.zeros(x.shape, jnp.float32), x))
    return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _overflow(ex: Exchange, x, weights, w, rt: Routing):
    """Rounds 1, 2, ... (none at balanced load), accumulated in float32, in x's dtype."""
    return _later_rounds(ex, x, weights, w, rt)


def _overflow_fwd(ex: Exchange, x, weights, w, rt: Routing):
    return _later_rounds(ex, x, weights, w, rt), (x, weights, w, rt)


def _overflow_bwd(ex: Exchange, res, dy):
    x, weights, w_in, rt = res
    tokens, d = x.shape
    flat_weights = weights.reshape(-1)
    # The weights' gradient varies with the tokens: summed over the devices once, after the rounds,
    # not inside each round's grouped matmuls.
    w = jax.tree.map(lambda a: varying_like(a, x), w_in)

    def round_(r, carry):
        dx, d_weights, dw = carry
        lo, size = ex.later_window(r)
        token, assignment = _window(rt, lo, size, tokens, flat_weights.shape[0])
        h = _there(ex, x.at[token].get(mode="fill", fill_value=0)).reshape(-1, d)
        g = _there(ex, dy.at[token].get(mode="fill", fill_value=0)).reshape(-1, d)  # dy: x's dtype
        weight = (
            _there(ex, flat_weights.at[assignment].get(mode="fill", fill_value=0)).reshape(-1, 1).astype(jnp.float32)
        )
        sizes, experts = _groups(rt, lo, size)
        out, pullback = jax.vjp(lambda h, w: ex.ffn(h, w, sizes, experts, False), h, w)
        dh, dw_round = pullback((g.astype(jnp.float32) * weight).astype(out.dtype))
        d_weight = jnp.sum(
            out.astype(jnp.float32) * g.astype(jnp.float32), axis=-1
        )  # d y / d weight = the expert's output
        dx = dx.at[token].add(_there(ex, dh.reshape(ex.ep, size, d)).astype(jnp.float32), mode="drop")
        d_weights = d_weights.at[assignment].add(_there(ex, d_weight.reshape(ex.ep, size)), mode="drop")
        dw = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), dw, dw_round)
        return dx, d_weights, dw

    zeros = lambda a: varying_like(jnp.zeros(a.shape, jnp.float32), a)  # noqa: E731
    dx, d_weights, dw = jax.lax.fori_loop(1, rt.rounds, round_, (zeros(x), zeros(flat_weights), jax.tree.map(zeros, w)))
    dw = jax.tree.map(lambda g, a: summed_like(g, a).astype(a.dtype), dw, w_in)
    return dx.astype(x.dtype), d_weights.reshape(weights.shape).astype(weights.dtype), dw, None


_overflow.defvjp(_overflow_fwd, _overflow_bwd)


def exchange_in_rounds(
    x: Float[Array, "tokens embed"], weights: Float[Array, "tokens k"], w, rt: Routing, ex: Exchange
) -> Float[Array, "tokens embed"]:
    """y[n] = sum_j weights[n, j] * expert_{e(n, j)}(x[n]) inside the shard_map body, the experts living
    on their shards of the expert axis (see the module docstring). `w`: this shard's expert weights."""
    first = _round(ex, x, weights, w, rt, 0, ex.block, tagged=True)
    return (first + _overflow(ex, x, weights, w, rt)).astype(x.dtype)
