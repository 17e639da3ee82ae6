"""A grouped matmul that touches only the rows each group holds: `lax.ragged_dot`'s contract,
computed a tile of rows at a time.

`grouped_matmul(h, w, group_sizes)[r] = h[r] @ w[g]` for every row r of group g, the groups being
contiguous runs of rows in order (`group_sizes[g]` rows each); rows past the groups' total come out
zero. That is `lax.ragged_dot(h, w, group_sizes)`.

Why not ragged_dot itself: XLA:CPU and the XLA:GPU of jax 0.10-0.11 lower it to a dense product over
every group, so its memory and FLOPs grow with the expert count (an H200 compiled one DeepSeek-V3
MoE layer of 32 experts to 95.3 GiB of temporaries against 16.2 GiB for the capacity kernel,
docs/scale.md). Here a loop visits each (tile of rows, group) pair that holds rows of that group:
at most `tiles + groups - 1` visits, each one `[tile, d_in] x [d_in, d_out]` product written into the
output where the rows are the group's. The loop runs as many visits as the routing needs (the count is
its bound), so rows a worst-case buffer holds but nobody sent cost nothing. Memory: the output.

Reverse mode is written out, as a custom JVP whose tangent is a `linear_call` (as `expert_matmul`):
letting JAX differentiate the loop would stack every visit's weight slice as a residual.

On a TPU the same contract has native kernels (`impl`, chosen per backend by `zoo.backend`):
`lax.ragged_dot` and Pallas' megablox `gmm`, both with their own reverse mode. megablox's is a
custom VJP, so forward mode (`jax.jvp`) through it is not defined; ragged_dot and the tiles take it.
"""

import functools
from typing import Optional

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, linear_call
from jaxtyping import Array, Float, Int

from zoo._compat import linear_call_vmappable, varying_axes
from zoo.backend import pallas_interpret

IMPLS = ("tiles", "ragged_dot", "megablox")

# Rows per tile at most (see `fitted_tile`). A visit is one [tile, d_in] x [d_in, d_out] product; a
# group's first and last tiles also compute the rows of their neighbours (discarded), at most
# 2 x (tile - 1) rows per group.
DEFAULT_TILE = 256


def _visits(group_sizes, group_weights, n_weights: int, tile: int):
    """Per group: its rows [start, end), its first tile, where its visits start and end in the visit
    order (groups in order, each over its tiles in order; a group without a weight has none), its
    weight; and the total number of visits."""
    sizes = group_sizes.astype(jnp.int32)
    weight = group_weights.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // tile
    visited = (sizes > 0) & (weight >= 0) & (weight < n_weights)
    count = jnp.where(visited, (ends - 1) // tile - first + 1, 0)
    visit_end = jnp.cumsum(count)
    return starts, ends, first, visit_end - count, visit_end, weight, visit_end[-1]


def _visit(v, schedule, tile: int, rows: int):
    """Visit v: its weight, the first row of the tile it reads (kept inside the array: the last tile of
    an array whose length is not a multiple of the tile starts early), and its rows' mask."""
    starts, ends, first, visit_start, visit_end, weight, _ = schedule
    group = jnp.searchsorted(visit_end, v, side="right").astype(jnp.int32)
    tile_start = (first[group] + v - visit_start[group]) * tile
    lo = jnp.maximum(starts[group], tile_start)
    hi = jnp.minimum(ends[group], tile_start + tile)
    at = jnp.minimum(tile_start, rows - tile)
    row = at + jnp.arange(tile, dtype=jnp.int32)
    return weight[group], at, (row >= lo) & (row < hi)


def varying_like(x, *likes):
    """`x` (a fresh buffer) marked as varying over the shard_map axes the `likes` vary over: a loop's
    carry must keep one type, and a collective's result takes its output buffer's."""
    axes = set().union(*(varying_axes(a) for a in likes)) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def summed_like(grad, operand):
    """`grad` summed over the shard_map axes it varies over and `operand` does not (the transpose of
    the implicit broadcast of a replicated weight against rows that vary; nothing outside shard_map)."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(operand)))
    return jax.lax.psum(grad, extra) if extra else grad


def _products(h, w, group_sizes, group_weights, tile: int, *, w_transposed: bool):
    """out[r] = h[r] @ w[g] (or `h[r] @ w[g].T` with `w_transposed`) over the visits."""
    rows = h.shape[0]
    tile = min(tile, rows)
    schedule = _visits(group_sizes, group_weights, w.shape[0], tile)
    d_out = w.shape[1] if w_transposed else w.shape[2]
    dtype = jnp.result_type(h.dtype, w.dtype)
    contract = ((1,), (1,)) if w_transposed else ((1,), (0,))

    def visit(v, out):
        group, at, mask = _visit(v, schedule, tile, rows)
        h_tile = jax.lax.dynamic_slice_in_dim(h, at, tile)
        w_group = jax.lax.dynamic_index_in_dim(w, group, keepdims=False)
        y = jax.lax.dot_general(h_tile, w_group, (contract, ((), ())), preferred_element_type=jnp.float32).astype(dtype)
        kept = jax.lax.dynamic_slice_in_dim(out, at, tile)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(mask[:, None], y, kept), at, 0)

    out = varying_like(jnp.zeros((rows, d_out), dtype), h, w, group_sizes, group_weights)
    return jax.lax.fori_loop(0, schedule[-1], visit, out)


def _weight_grad(h, d_out, group_sizes, group_weights, n_weights: int, tile: int, dtype):
    """dw[e] = sum over the rows r of the groups of weight e of outer(h[r], d_out[r]), in float32."""
    rows = h.shape[0]
    tile = min(tile, rows)
    schedule = _visits(group_sizes, group_weights, n_weights, tile)

    def visit(v, dw):
        group, at, mask = _visit(v, schedule, tile, rows)
        h_tile = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(h, at, tile), 0)
        d_tile = jnp.where(mask[:, None], jax.lax.dynamic_slice_in_dim(d_out, at, tile), 0)
        part = jax.lax.dot_general(h_tile, d_tile, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        row = jax.lax.dynamic_index_in_dim(dw, group, keepdims=False)
        return jax.lax.dynamic_update_index_in_dim(dw, row + part, group, 0)

    dw = varying_like(
        jnp.zeros((n_weights, h.shape[1], d_out.shape[1]), jnp.float32), h, d_out, group_sizes, group_weights
    )
    return jax.lax.fori_loop(0, schedule[-1], visit, dw).astype(dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _grouped(h, w, group_sizes, group_weights, tile):
    return _products(h, w, group_sizes, group_weights, tile, w_transposed=False)


def _grouped_jvp(tile, primals, tangents):
    h, w, group_sizes, group_weights = primals
    out = _grouped(h, w, group_sizes, group_weights, tile)
    live = tuple(i for i in range(2) if not isinstance(tangents[i], SymbolicZero))
    if not live:
        return out, jnp.zeros_like(out)

    def forward_tangent(res, lin):
        h, w, group_sizes, group_weights = res
        given = dict(zip(live, lin))
        parts = []
        if 0 in given:
            parts.append(_products(given[0], w, group_sizes, group_weights, tile, w_transposed=False))
        if 1 in given:
            parts.append(_products(h, given[1], group_sizes, group_weights, tile, w_transposed=False))
        return sum(parts[1:], parts[0])

    def transpose(res, d_out):
        h, w, group_sizes, group_weights = res
        grads = {}
        if 0 in live:
            grads[0] = summed_like(
                _products(d_out, w, group_sizes, group_weights, tile, w_transposed=True).astype(h.dtype), h
            )
        if 1 in live:
            grads[1] = summed_like(_weight_grad(h, d_out, group_sizes, group_weights, w.shape[0], tile, w.dtype), w)
        return tuple(grads[i] for i in live)

    linear_call_vmappable()  # jax.vmap through this reverse mode (per-example gradients) needs a rule jax lacks
    return out, linear_call(
        forward_tangent, transpose, (h, w, group_sizes, group_weights), tuple(tangents[i] for i in live)
    )


_grouped.defjvp(_grouped_jvp, symbolic_zeros=True)


def grouped_matmul(
    h: Float[Array, "rows d_in"],
    w: Float[Array, "weights d_in d_out"],
    group_sizes: Int[Array, " groups"],
    group_weights: Optional[Int[Array, " groups"]] = None,
    *,
    tile: int = DEFAULT_TILE,
    impl: str = "tiles",
) -> Float[Array, "rows d_out"]:
    """`lax.ragged_dot(h, w, group_sizes)` computed over the rows the groups hold, a tile at a time
    (see the module docstring): the sum of `group_sizes` must not exceed the rows.

    With `group_weights`, group g's rows take weight `w[group_weights[g]]` (a weight may serve several
    groups), and a group whose index is outside `[0, weights)` is skipped: its rows come out zero and
    are never read. The expert-parallel exchange uses that to run the blocks it received in place, one
    group per (source, expert) and one skipped group per block's padding.

    `impl`: "tiles" (the loop above, any backend), "ragged_dot" or "megablox" (the TPU's kernels; see
    the module docstring). The native kernels take one group per weight: with `group_weights` the
    tiles run."""
    if tile < 1:
        raise ValueError(f"grouped_matmul: tile={tile}; give a positive number of rows")
    if impl not in IMPLS:
        raise ValueError(f"grouped_matmul: impl={impl!r}; choose one of {', '.join(IMPLS)}")
    if group_weights is None and impl != "tiles":
        if impl == "megablox" and megablox_tiling(*h.shape, w.shape[2]) is not None and pallas_interpret() is not None:
            return _megablox(h, w, group_sizes)
        return jax.lax.ragged_dot(
            h, w, group_sizes.astype(jnp.int32), preferred_element_type=jnp.result_type(h.dtype, w.dtype)
        )
    if group_weights is None:
        group_weights = jnp.arange(w.shape[0], dtype=jnp.int32)
    if group_weights.shape != group_sizes.shape:
        raise ValueError(
            f"grouped_matmul: group_weights {group_weights.shape} and group_sizes {group_sizes.shape} differ; give "
            "one weight index per group"
        )
    return _grouped(h, w, group_sizes, group_weights, fitted_tile(h.shape[0], group_sizes.shape[0], int(tile)))


# megablox's tiles: the rows in tiles of up to 512 (the kernel needs a tile that divides them: the
# rows are padded to a multiple of 128), the widths in the largest of these that divides them. TPU
# v5e, 8 x 1024 rows, 4096 -> 8192, value and gradient: 512-tiles 13.3 ms, 128-tiles 160.5 ms.
MEGABLOX_TILES = (512, 256, 128)


def megablox_tiling(rows: int, d_in: int, d_out: int) -> Optional[tuple[int, int, int]]:
    """(rows, d_in, d_out) tile sizes for megablox, or None where a width is not a multiple of 128
    (then ragged_dot runs)."""
    widths = [next((t for t in MEGABLOX_TILES if d % t == 0), None) for d in (d_in, d_out)]
    if None in widths:
        return None
    padded = -(-rows // 128) * 128
    return next(t for t in MEGABLOX_TILES if padded % t == 0), widths[0], widths[1]


def _megablox(h, w, group_sizes):
    """megablox `gmm` over rows padded to its row tile; rows past the groups' total are zeroed on the
    way in (their gradient too) and out: the kernel leaves them unwritten."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm

    rows = h.shape[0]
    tiling = megablox_tiling(rows, h.shape[1], w.shape[2])
    padded = -(-rows // tiling[0]) * tiling[0]
    group_sizes = group_sizes.astype(jnp.int32)
    valid = (jnp.arange(padded) < group_sizes.sum())[:, None]
    h = jnp.where(valid, jnp.pad(h, ((0, padded - rows), (0, 0))), 0)
    dtype = jnp.result_type(h.dtype, w.dtype)
    out = gmm(h.astype(dtype), w.astype(dtype), group_sizes, dtype, tiling, interpret=bool(pallas_interpret()))
    return jnp.where(valid, out, 0)[:rows]


def fitted_tile(rows: int, groups: int, tile: int) -> int:
    """`tile`, or less where the groups average fewer rows: the power of two at least that average
    (8 at least). A group's first and last tiles compute their neighbours' rows too, which tiles much
    longer than a group would multiply (64 experts sharing 1024 rows: 16 each)."""
    mean = max(1, rows // max(1, groups))
    return max(1, min(tile, max(8, 1 << (mean - 1).bit_length())))
