"""zoo.nn.grouped_matmul against lax.ragged_dot: values, both reverse-mode cotangents, forward mode,
vmap, shard_map, and padding rows that hold garbage."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zoo.nn.grouped_matmul import grouped_matmul

# rows, group sizes, tile: each a boundary the tile walk must get right.
CASES = {
    "groups_across_tiles": (37, [5, 0, 11, 9, 0, 3], 4),  # 28 rows in groups, 9 padding rows; a ragged last tile
    "one_group_many_tiles": (10, [0, 0, 10, 0], 3),
    "tile_longer_than_rows": (7, [3, 4], 16),
    "every_group_empty": (12, [0, 0, 0], 4),
    "one_row_groups": (6, [1, 1, 1, 1, 1, 1], 2),
}


def operands(rows, sizes, dtype=jnp.float32, din=8, dout=6):
    rng = np.random.default_rng(rows + len(sizes))
    h = jnp.asarray(rng.normal(size=(rows, din)), dtype)
    w = jnp.asarray(rng.normal(size=(len(sizes), din, dout)), dtype)
    return h, w, jnp.asarray(sizes, jnp.int32)


def loss(matmul):
    return lambda h, w, gs: jnp.sum(jnp.sin(matmul(h, w, gs).astype(jnp.float32)))


@pytest.mark.parametrize("case", CASES)
def test_values_gradients_and_tangents_equal_ragged_dot(case):
    rows, sizes, tile = CASES[case]
    h, w, gs = operands(rows, sizes)

    def tiled(h, w, gs):
        return grouped_matmul(h, w, gs, tile=tile)

    np.testing.assert_allclose(tiled(h, w, gs), jax.lax.ragged_dot(h, w, gs), rtol=1e-5, atol=1e-5)
    got = jax.grad(loss(tiled), argnums=(0, 1))(h, w, gs)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(h, w, gs)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    tangents = (0.5 * h, -w)
    _, t_got = jax.jvp(lambda h, w: tiled(h, w, gs), (h, w), tangents)
    _, t_want = jax.jvp(lambda h, w: jax.lax.ragged_dot(h, w, gs), (h, w), tangents)
    np.testing.assert_allclose(t_got, t_want, rtol=1e-5, atol=1e-5)


def test_padding_rows_past_the_groups_are_never_read():
    # An expert-parallel receive buffer ends in rows nobody sent; NaN there must reach nothing.
    rows, sizes, tile = CASES["groups_across_tiles"]
    h, w, gs = operands(rows, sizes)
    total = sum(sizes)
    dirty = h.at[total:].set(jnp.nan)
    out = grouped_matmul(dirty, w, gs, tile=tile)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out[total:], 0)
    dh, dw = jax.grad(loss(lambda h, w, gs: grouped_matmul(h, w, gs, tile=tile)), argnums=(0, 1))(dirty, w, gs)
    assert not np.isnan(np.asarray(dw)).any() and not np.isnan(np.asarray(dh[:total])).any()
    np.testing.assert_array_equal(dh[total:], 0)


def test_bfloat16_keeps_its_dtype_and_accumulates_in_float32():
    h, w, gs = operands(64, [20, 0, 30, 14], jnp.bfloat16, din=128, dout=16)
    out = grouped_matmul(h, w, gs, tile=16)
    assert out.dtype == jnp.bfloat16
    exact = jax.lax.ragged_dot(h.astype(jnp.float32), w.astype(jnp.float32), gs)
    np.testing.assert_allclose(np.asarray(out, np.float32), exact, rtol=2e-2, atol=2e-2)
    _, dw = jax.grad(loss(lambda h, w, gs: grouped_matmul(h, w, gs, tile=16)), argnums=(0, 1))(h, w, gs)
    assert dw.dtype == jnp.bfloat16


def test_per_example_gradients_under_vmap():
    rows, sizes, tile = CASES["groups_across_tiles"]
    h, w, gs = operands(rows, sizes)
    batch_h = jnp.stack([h, 2 * h, -h])
    batch_gs = jnp.stack([gs, gs[::-1], jnp.asarray([0, 0, 28, 0, 0, 0], jnp.int32)])

    tiled = jax.grad(loss(lambda h, w, gs: grouped_matmul(h, w, gs, tile=tile)), argnums=1)
    got = jax.vmap(tiled, in_axes=(0, None, 0))(batch_h, w, batch_gs)
    want = [
        jax.grad(loss(jax.lax.ragged_dot), argnums=1)(x, w, g) for x, g in zip(batch_h, batch_gs)
    ]  # ragged_dot has no vmap
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-5, atol=1e-5)


def test_rows_split_over_devices_sum_the_weight_gradient():
    # Inside shard_map each device has its own rows and groups against replicated weights: the weight's
    # cotangent is the sum over devices, as jax's own transpose of ragged_dot gives it.
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    h, w, _ = operands(4 * 16, [0])
    w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 8, 6)), jnp.float32)
    gs = jnp.asarray([[5, 0, 11], [16, 0, 0], [0, 0, 0], [2, 7, 4]], jnp.int32)

    def sharded(matmul):
        def body(h, w, gs):
            return jax.grad(loss(matmul), argnums=(0, 1))(h, w, gs[0])

        return jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=(P("data"), P()))(
            h, w, gs
        )

    h, gs = (jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (h, gs))
    got = sharded(lambda h, w, gs: grouped_matmul(h, w, gs, tile=4))
    want = sharded(jax.lax.ragged_dot)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(got[1])).sum() > 0


def test_a_non_positive_tile_is_refused():
    h, w, gs = operands(4, [4])
    with pytest.raises(ValueError, match="tile=0"):
        grouped_matmul(h, w, gs, tile=0)


def test_groups_that_share_a_weight_or_have_none():
    # The exchange's layout: per source block, one group per expert and one skipped group of padding.
    rng = np.random.default_rng(3)
    w = jnp.asarray(rng.normal(size=(2, 8, 6)), jnp.float32)
    sizes = jnp.asarray([3, 2, 4, 1, 0, 5], jnp.int32)  # block 0: experts 0, 1, padding; block 1: the same
    weights = jnp.asarray([0, 1, -1, 0, 1, 2], jnp.int32)  # -1 and 2 (= the number of weights): skipped
    h = jnp.asarray(rng.normal(size=(15, 8)), jnp.float32)
    h = h.at[5:9].set(jnp.nan).at[10:15].set(jnp.nan)  # the skipped groups' rows are never read
    which = np.repeat(np.asarray(weights), np.asarray(sizes))

    def reference(h, w):
        rows = [jnp.zeros(6) if e not in (0, 1) else h[r] @ w[e] for r, e in enumerate(which)]
        return jnp.stack(rows)

    out = grouped_matmul(h, w, sizes, weights, tile=4)
    np.testing.assert_allclose(out, reference(h, w), rtol=1e-5, atol=1e-5)
    clean = jnp.where(jnp.isnan(h), 0.0, h)
    got = jax.grad(loss(lambda h, w, gs: grouped_matmul(h, w, gs, weights, tile=4)), argnums=(0, 1))(clean, w, sizes)
    want = jax.grad(lambda h, w: jnp.sum(jnp.sin(reference(h, w))), argnums=(0, 1))(clean, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception, match="group_weights"):  # jaxtyping's check in the tests, ValueError without it
        grouped_matmul(h, w, sizes, weights[:3])


@pytest.mark.parametrize("impl", ["ragged_dot", "megablox"])
@pytest.mark.parametrize(
    "shape",
    [(300, [100, 0, 150, 40], 128, 256), (256, [256, 0, 0], 256, 384), (128, [60, 60], 200, 128)],
    ids=["padded_rows_and_garbage", "one_full_group", "width_not_a_tile_multiple"],
)
def test_the_tpu_kernels_equal_the_tiles(impl, shape):
    """The TPU's kernels (megablox in Pallas' interpret mode; widths its tiles cannot cut take
    ragged_dot) against the tile loop: values and both cotangents, rows past the groups zero."""
    from zoo.backend import pallas_interpreted

    rows, sizes, din, dout = shape
    h, w, gs = operands(rows, sizes, din=din, dout=dout)
    h = h.at[sum(sizes) :].set(jnp.nan)  # rows no group holds: never read

    def f(impl):
        return jax.value_and_grad(loss(lambda h, w, gs: grouped_matmul(h, w, gs, impl=impl)), argnums=(0, 1))

    with pallas_interpreted():
        value, (dh, dw) = jax.jit(f(impl))(h, w, gs)
        out = grouped_matmul(h, w, gs, impl=impl)
    want, (want_dh, want_dw) = jax.jit(f("tiles"))(h, w, gs)
    assert np.isclose(value, want, rtol=1e-5)
    assert np.all(np.asarray(out[sum(sizes) :]) == 0) and np.all(np.asarray(dh[sum(sizes) :]) == 0)
    np.testing.assert_allclose(
        dh[: sum(sizes)], want_dh[: sum(sizes)], atol=1e-5 * float(jnp.abs(want_dh[: sum(sizes)]).max())
    )
    np.testing.assert_allclose(dw, want_dw, atol=1e-4 * float(jnp.abs(want_dw).max()))
