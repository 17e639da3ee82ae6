"""Dropless expert parallelism in rounds: every assignment reaches its expert, and no buffer is sized
for the worst case.

Under expert parallelism each device sends its assignments to the expert shards that hold their
experts. A dropless exchange in one go must land them in receiving blocks sized for the worst case
(every local token sending `min(k, E/ep)` assignments to one shard: `ep * min(k, E/ep) / k` times the
assignments, 8x for DeepSeek-V3 on 8 shards). Here the exchange runs in rounds instead: round r sends,
from each device to each shard, the rows `[r * block, (r + 1) * block)` of what it has for that shard
(sorted by expert), with `block` a multiple (`model.moe.exchange_factor`) of the mean rows per
(device, shard) pair. Balanced routing takes one round; a pair holding more takes more rounds, and
every round in the group runs the same loop (the round count is the maximum over the expert axis),
so nothing is ever dropped. Memory: one round's blocks, whatever the routing.

The round count is only known at run time, and JAX cannot reverse-differentiate a loop of unknown
length, so the reverse mode is written out (`jax.custom_vjp`): the backward runs the same rounds,
sending each round's inputs again together with the output cotangent, recomputing the experts'
forward on them and sending the input cotangent back. The residuals are the kernel's own inputs
(tokens, routing weights, expert weights, integer routing), never the experts' intermediates: under
this kernel the routed experts are recomputed in the backward whatever the checkpoint policy says,
so they emit no tags for one to act on (one extra exchange and expert forward per layer).
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

# ffn(rows [n, D], expert weights, group_sizes, group_experts) -> [n, D]: the local experts over rows
# grouped as `zoo.nn.grouped_matmul` takes them (a group whose expert is out of range is padding).
RoundFFN = Callable[[Array, object, Array, Array], Array]


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


def routing(expert_ids: Int[Array, "tokens k"], order, counts, *, ep: int, axis, block: int) -> Routing:
    """The exchange's bookkeeping inside the shard_map body, from `zoo.nn.moe_dispatch.sorted_assignments`."""
    k = expert_ids.shape[1]
    local = counts.shape[0] // ep
    per_shard = counts.reshape(ep, local).sum(-1)
    received = jax.lax.all_to_all(counts.reshape(ep, local), axis, 0, 0, tiled=True)
    needed = (jnp.max(per_shard) + block - 1) // block
    # Every device whose tokens differ runs the same rounds: the loop holds collectives over the expert
    # axis and, through the experts' weights, over the axes that split them (fsdp).
    everywhere = tuple(sorted(varying_axes(expert_ids) | set(_names(axis))))
    return Routing(
        token=(order // k).astype(jnp.int32),
        assignment=order.astype(jnp.int32),
        send_offsets=(jnp.cumsum(per_shard) - per_shard).astype(jnp.int32),
        per_shard=per_shard.astype(jnp.int32),
        received=received.astype(jnp.int32),
        rounds=jax.lax.pmax(needed, everywhere).astype(jnp.int32),
    )


def _names(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


@dataclasses.dataclass(frozen=True)
class Exchange:
    """The static half: the expert-axis name(s), its size, the block and the local experts' FFN."""

    ffn: RoundFFN
    ep: int
    axis: object
    block: int


def _window(rt: Routing, r, block: int, tokens: int, assignments: int):
    """Round r's send blocks `[ep, block]`: each row's token and flat assignment index, out of range
    (`tokens`, `assignments`) where the shard's run has ended."""
    position = r * block + jnp.arange(block, dtype=jnp.int32)
    valid = position[None, :] < rt.per_shard[:, None]
    at = jnp.where(valid, rt.send_offsets[:, None] + position[None, :], 0)
    return jnp.where(valid, rt.token[at], tokens), jnp.where(valid, rt.assignment[at], assignments)


def _groups(rt: Routing, r, block: int):
    """Round r's received blocks as grouped-matmul groups: per source, its rows for each local expert
    inside the window, then the block's padding (the group with no expert)."""
    local = rt.received.shape[1]
    ends = jnp.cumsum(rt.received, axis=-1)
    lo = r * block
    inside = jnp.clip(ends - lo, 0, block) - jnp.clip(ends - rt.received - lo, 0, block)
    padding = block - inside.sum(-1, keepdims=True)
    sizes = jnp.concatenate([inside, padding], axis=-1).reshape(-1)
    experts = jnp.tile(jnp.arange(local + 1, dtype=jnp.int32), rt.received.shape[0])
    return sizes, experts


def _there(ex: Exchange, a):
    return jax.lax.all_to_all(a, ex.axis, 0, 0, tiled=True)


def _forward(ex: Exchange, x, weights, w, rt: Routing):
    tokens, d = x.shape
    flat_weights = weights.reshape(-1)

    def round_(r, y):
        token, assignment = _window(rt, r, ex.block, tokens, flat_weights.shape[0])
        received = _there(ex, x.at[token].get(mode="fill", fill_value=0))
        sizes, experts = _groups(rt, r, ex.block)
        out = ex.ffn(received.reshape(-1, d), w, sizes, experts).reshape(ex.ep, ex.block, d)
        back = _there(ex, out).astype(jnp.float32)
        weight = flat_weights.at[assignment].get(mode="fill", fill_value=0).astype(jnp.float32)
        return y.at[token].add(back * weight[..., None], mode="drop")

    y = jax.lax.fori_loop(0, rt.rounds, round_, varying_like(jnp.zeros((tokens, d), jnp.float32), x))
    return y.astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _exchanged(ex: Exchange, x, weights, w, rt: Routing):
    return _forward(ex, x, weights, w, rt)


def _exchanged_fwd(ex: Exchange, x, weights, w, rt: Routing):
    return _forward(ex, x, weights, w, rt), (x, weights, w, rt)


def _exchanged_bwd(ex: Exchange, res, dy):
    x, weights, w_in, rt = res
    tokens, d = x.shape
    flat_weights = weights.reshape(-1)
    # The weights' gradient varies with the tokens: summed over the devices once, after the rounds,
    # not inside each round's grouped matmuls.
    w = jax.tree.map(lambda a: varying_like(a, x), w_in)

    def round_(r, carry):
        dx, d_weights, dw = carry
        token, assignment = _window(rt, r, ex.block, tokens, flat_weights.shape[0])
        h = _there(ex, x.at[token].get(mode="fill", fill_value=0)).reshape(-1, d)
        g = _there(ex, dy.at[token].get(mode="fill", fill_value=0)).reshape(-1, d).astype(jnp.float32)
        weight = _there(ex, flat_weights.at[assignment].get(mode="fill", fill_value=0)).reshape(-1, 1).astype(jnp.float32)
        sizes, experts = _groups(rt, r, ex.block)
        out, pullback = jax.vjp(lambda h, w: ex.ffn(h, w, sizes, experts), h, w)
        dh, dw_round = pullback((g * weight).astype(out.dtype))
        d_weight = jnp.sum(out.astype(jnp.float32) * g, axis=-1)  # d y / d weight = the expert's output
        dx = dx.at[token].add(_there(ex, dh.reshape(ex.ep, ex.block, d)).astype(jnp.float32), mode="drop")
        d_weights = d_weights.at[assignment].add(_there(ex, d_weight.reshape(ex.ep, ex.block)), mode="drop")
        dw = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), dw, dw_round)
        return dx, d_weights, dw

    zeros = lambda a: varying_like(jnp.zeros(a.shape, jnp.float32), a)  # noqa: E731
    dx, d_weights, dw = jax.lax.fori_loop(0, rt.rounds, round_, (zeros(x), zeros(flat_weights), jax.tree.map(zeros, w)))
    dw = jax.tree.map(lambda g, a: summed_like(g, a).astype(a.dtype), dw, w_in)
    return dx.astype(x.dtype), d_weights.reshape(weights.shape).astype(weights.dtype), dw, None


_exchanged.defvjp(_exchanged_fwd, _exchanged_bwd)


def exchange_in_rounds(
    x: Float[Array, "tokens embed"], weights: Float[Array, "tokens k"], w, rt: Routing, ex: Exchange
) -> Float[Array, "tokens embed"]:
    """y[n] = sum_j weights[n, j] * expert_{e(n, j)}(x[n]) inside the shard_map body, the experts living
    on their shards of the expert axis (see the module docstring). `w`: this shard's expert weights."""
    return _exchanged(ex, x, weights, w, rt)
