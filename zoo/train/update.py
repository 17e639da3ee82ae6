"""The optimizer update streamed layer by layer, for parameters or optimizer state in host memory.

With `offload.opt_state: pinned_host` (or `offload.params: pinned_host`) the step does not bring the
whole state to the device for the update. It computes the global gradient norm first, then updates
one slice at a time:

- every block position of every layer stack (`params.stacks[s].layers[j]`, leaves with a leading
  `repeats` axis) in a loop over that axis: the layer's parameter, gradient and moment slices come
  to the device, are clipped by the global norm and updated, and the new values go back to where
  they live (host or device), written in place into the stacked arrays;
- everything outside the stacks (embeddings, final norm, head) one leaf at a time, and a leaf larger
  than the largest layer slice (a 128k-vocabulary embedding is 263M parameters: its two float32
  moments alone are 2.1 GB) in runs of rows along an axis its sharding leaves whole (`chunk_axes`).

So the update holds about one layer of host-resident state in HBM, where the whole-tree update
holds parameters, gradients and both moments at once.

The maths is optax's, unchanged: each slice goes through the same `multi_transform` (weight-decay
mask, frozen buffers) with the tree's other leaves left out (`None`), built with `clip=False` so
that clipping uses the norm of the whole gradient (the same formula as `optax.clip_by_global_norm`).
The step counts (scalars shared by every slice) advance once: each slice computes the same new
count, and the one outside the stacks is kept.

Gradients of host-resident stacks come back from the backward pass in host memory; across
microbatches they are summed layer by layer the same way (`accumulate`), so no whole-tree copy of
them ever reaches the device.
"""

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax

from zoo import sharding as zs

# The update's ops carry this name (jax.named_scope), so zoo.tools.inspect_step can find them in the program.
UPDATE_SCOPE = "optimizer_update"

Group = Optional[tuple[int, int]]  # (stack index, block position), None outside the stacks

_DEVICE = jax.memory.Space.Device
_HOST = jax.memory.Space.Host


def group_of(path) -> Group:
    """`(s, j)` for a leaf under `stacks[s].layers[j]` (parameters, or optimizer state mirroring
    them); None elsewhere."""
    names = [zs._key_name(k) for k in path]
    for i in range(len(names) - 3):
        if names[i] == "stacks" and names[i + 2] == "layers":
            return int(names[i + 1]), int(names[i + 3])
    return None


def layer_groups(params) -> list[tuple[int, int]]:
    """Every block position of every stack, in tree order."""
    found = []
    for path, _ in jax.tree_util.tree_leaves_with_path(params):
        g = group_of(path)
        if g is not None and g not in found:
            found.append(g)
    return found


def _is_hole(x) -> bool:
    return x is None or isinstance(x, optax.MaskedNode)


def _select(tree, keep: Callable[[Any, Any], bool]):
    """`tree` with the leaves `keep(path, leaf)` rejects replaced by None (a hole: optax and
    tree_map skip it; merged back with `_merge`). optax's placeholders for masked-out leaves count
    as leaves here, so every tree cut from one structure has its holes in the same places."""

    def one(path, x):
        if isinstance(x, optax.MaskedNode):
            return x if keep(path, None) else None
        return x if x is not None and keep(path, x) else None

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_hole)


def _merge(*trees):
    """Fill the holes of the first tree from the others (all of one structure, holes as leaves)."""

    def first(*xs):
        return next((x for x in xs if x is not None), None)

    return jax.tree.map(first, *trees, is_leaf=_is_hole)


def _is_count(path, x) -> bool:
    """A scalar of the optimizer state that no parameter mirrors: a step count."""
    return getattr(x, "ndim", None) == 0 and group_of(path) is None


def _home(x) -> jax.memory.Space:
    space = getattr(jax.typeof(x), "memory_space", None)
    return _HOST if space == _HOST else _DEVICE


def _to(tree, homes):
    """Move each leaf of `tree` to the memory space in `homes` (same structure, holes skipped)."""
    return jax.tree.map(lambda x, h: x if _is_hole(x) else jax.device_put(x, h), tree, homes, is_leaf=_is_hole)


def _homes(tree):
    return jax.tree.map(lambda x: x if _is_hole(x) else _home(x), tree, is_leaf=_is_hole)


def _index(tree, r):
    return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, r, keepdims=False), tree)


def _write(tree, new, r):
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(x, y, r, 0), tree, new)


def _repeats(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def _divided(tree, divide: int):
    return jax.tree.map(lambda g: g / divide, tree) if divide > 1 else tree


def sum_of_squares(x: jax.Array) -> jax.Array:
    """sum(x ** 2) in float32, as one dot of `x` with itself over all of its dims.

    Under train.py's `xla.cpu_ynn_fusions: dot`, a square followed by a sum (optax.tree.norm) costs
    XLA:CPU a new buffer the size of the leaf: the square is an op of its own. XLA turns this dot
    into a multiply and a reduce fused in one pass over the leaf. No reshape: flattening a leaf
    sharded on an inner dim would make GSPMD gather it, where a contraction over sharded dims is a
    partial sum and an all-reduce of one scalar (on a mesh of explicit axes jax asks where that scalar goes:
    everywhere).
    HIGHEST keeps float32 dots out of reduced-precision (TF32) units."""
    dims = tuple(range(x.ndim))
    sharding = jax.typeof(x).sharding
    explicit = jax.sharding.AxisType.Explicit in getattr(sharding.mesh, "axis_types", ())
    where = (
        {"out_sharding": jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())} if explicit else {}
    )
    return jax.lax.dot_general(
        x, x, ((dims, dims), ((), ())), precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32, **where
    )


def _sum_of_squares(tree, divide: int) -> jax.Array:
    total = jnp.float32(0)
    for x in jax.tree.leaves(_divided(zs.to_device(tree), divide)):
        total = total + sum_of_squares(x)
    return total


def global_norm(trainable, *, divide: int = 1) -> jax.Array:
    """The L2 norm of the gradient leaves in `trainable` (the others None) divided by `divide` (the
    microbatches summed into them); host-resident stacks are read one layer at a time."""
    total = _sum_of_squares(_select(trainable, lambda p, x: _home(x) == _DEVICE), divide)
    host = _select(trainable, lambda p, x: _home(x) == _HOST)
    for g in layer_groups(host):
        part = _select(host, lambda p, x, g=g: group_of(p) == g)

        def body(r, acc, part=part):
            return acc + _sum_of_squares(_index(part, r), divide)

        total = total + jax.lax.fori_loop(0, _repeats(part), body, jnp.zeros((), total.dtype))
    return jnp.sqrt(total + _sum_of_squares(_select(host, lambda p, x: group_of(p) is None), divide))


def zeros_where(tree):
    """Zeros shaped like `tree`'s leaves, each in its leaf's memory space (a gradient accumulator
    for parameters that live there)."""
    return jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype), _home(x)), tree)


def accumulate(total, new):
    """`total + new` leaf by leaf; host-resident stacked leaves are summed one layer at a time on
    the device and written back in place in host memory."""
    on_device = jax.tree.map(lambda a, b: a + b if _home(a) == _DEVICE else None, total, new)
    total_host = _select(total, lambda p, x: _home(x) == _HOST)
    # Chosen by where the sum lives, not where `new` arrived: gradients computed inside a shard_map
    # (expert-parallel experts) come back in device memory even for host-resident parameters.
    new_host = jax.tree.map(lambda a, b: b if _home(a) == _HOST else None, total, new)
    parts = [on_device]
    for g in layer_groups(total_host) + [None]:
        a = _select(total_host, lambda p, x, g=g: group_of(p) == g)
        b = _select(new_host, lambda p, x, g=g: group_of(p) == g)
        if not jax.tree.leaves(a):
            continue
        if g is None:
            parts.append(_to(jax.tree.map(jnp.add, zs.to_device(a), zs.to_device(b)), _homes(a)))
            continue

        def body(r, acc, b=b):
            layer = jax.tree.map(jnp.add, zs.to_device(_index(acc, r)), zs.to_device(_index(b, r)))
            return _write(acc, _to(layer, _homes(_index(acc, r))), r)

        parts.append(jax.lax.fori_loop(0, _repeats(a), body, a))
    return _merge(*parts)


def clip_by_norm(tree, norm, max_norm: float):
    """optax.clip_by_global_norm's rescaling, with the norm of the whole gradient given."""
    trigger = jnp.squeeze(norm < max_norm)
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm), tree)


def whole_tree_update(
    tx: optax.GradientTransformation, grads, opt_state, params, *, trainable, max_norm: float, divide: int = 1
):
    """`(new params, new opt_state, norm)` with the state on the device, updated at once: the
    streamed update's norm (`global_norm` of `trainable`, the gradient leaves that are trained, the
    others None) and clipping, so that both paths use one formula. `tx` is the optimizer built with
    `clip=False`; `max_norm` <= 0 turns clipping off."""
    norm = global_norm(trainable, divide=divide)
    grads = _divided(grads, divide)
    if max_norm > 0:
        grads = clip_by_norm(grads, norm, max_norm)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, norm


def _names(path) -> tuple[str, ...]:
    return tuple(zs._key_name(k) for k in path)


def _slice_rows(tree, start, size: int, axis: int):
    return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, start, size, axis), tree)


def _write_rows(tree, new, start, axis: int):
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_slice_in_dim(x, y, start, axis), tree, new)


def _largest_layer_slice(params) -> int:
    """Elements of the largest leaf slice one layer of a stack holds (0 without stacks)."""
    return max(
        (x.size // x.shape[0] for path, x in jax.tree_util.tree_leaves_with_path(params) if group_of(path) is not None),
        default=0,
    )


def streamed_update(
    tx: optax.GradientTransformation,
    grads,
    opt_state,
    params,
    *,
    norm,
    max_norm: float,
    divide: int = 1,
    chunk_axes=None,
):
    """`(new params, new opt_state)` as `optax.apply_updates(params, tx.update(clip(grads / divide),
    opt_state, params))`, one slice at a time (see the module docstring). `tx` is the optimizer built
    with `clip=False`, `norm` the global norm of `grads / divide` (`global_norm`); `max_norm` <= 0
    turns clipping off. Every leaf goes back to the memory space it came from.

    `chunk_axes`: a tree like `params` giving, per leaf outside the stacks, an axis that no mesh axis
    splits (or None): a leaf larger than the largest layer slice is updated in runs of rows along it
    (`zoo.train.step` derives it from the parameters' shardings). None: axis 0 of every leaf."""

    def update(g, s, p):
        g, s, p = _divided(zs.to_device(g), divide), zs.to_device(s), zs.to_device(p)
        if max_norm > 0:
            g = clip_by_norm(g, norm, max_norm)
        u, s_new = tx.update(g, s, p)
        return optax.apply_updates(p, u), s_new

    counts = _select(opt_state, _is_count)
    new_params, new_state = [], []
    for grp in layer_groups(params):

        def mine(path, x, grp=grp):
            return group_of(path) == grp

        p_g, g_g, s_g = _select(params, mine), _select(grads, mine), _select(opt_state, mine)

        def body(r, carry, g_g=g_g):
            p_all, s_all = carry
            p, s = _index(p_all, r), _index(s_all, r)
            p_new, s_new = update(_index(g_g, r), _merge(s, counts), p)
            s_new = _select(s_new, lambda path, x: not _is_count(path, x))
            return _write(p_all, _to(p_new, _homes(p)), r), _write(s_all, _to(s_new, _homes(s)), r)

        p_g, s_g = jax.lax.fori_loop(0, _repeats(p_g), body, (p_g, s_g))
        new_params.append(p_g)
        new_state.append(s_g)

    def outside(path, x):
        return group_of(path) is None

    limit = max(_largest_layer_slice(params), 1)
    axes = dict(
        (_names(path), a)
        for path, a in jax.tree_util.tree_leaves_with_path(
            chunk_axes if chunk_axes is not None else jax.tree.map(lambda x: 0 if x.ndim else None, params)
        )
    )
    for path, leaf in jax.tree_util.tree_leaves_with_path(_select(params, outside)):
        name = _names(path)

        def this(q, x, name=name):  # the parameter, its gradient, and the moments that mirror it
            return group_of(q) is None and _names(q)[-len(name) :] == name and not _is_count(q, x)

        p_l, g_l, s_l = _select(params, this), _select(grads, this), _select(opt_state, this)
        axis = axes.get(name)
        if axis is None or leaf.size <= limit or leaf.shape[axis] < 2:
            p_new, s_new = update(g_l, _merge(s_l, counts), p_l)
            new_params.append(_to(p_new, _homes(p_l)))
            new_state.append(_to(_select(s_new, lambda q, x: not _is_count(q, x)), _homes(s_l)))
            continue
        rows = leaf.shape[axis]
        size = max(1, min(rows, limit // max(1, leaf.size // rows)))
        runs = -(-rows // size)

        def rows_body(i, carry, p_l=p_l, g_l=g_l, s_l=s_l, axis=axis, size=size, rows=rows):
            # The last run starts early enough to end at the last row; rows it shares with the run
            # before are computed again from the same inputs (the originals), so they come out the same.
            start = jnp.minimum(i * size, rows - size)
            p_all, s_all = carry
            p, s = _slice_rows(p_l, start, size, axis), _slice_rows(s_l, start, size, axis)
            p_new, s_new = update(_slice_rows(g_l, start, size, axis), _merge(s, counts), p)
            s_new = _select(s_new, lambda q, x: not _is_count(q, x))
            return (
                _write_rows(p_all, _to(p_new, _homes(p)), start, axis),
                _write_rows(s_all, _to(s_new, _homes(s)), start, axis),
            )

        p_l, s_l = jax.lax.fori_loop(0, runs, rows_body, (p_l, s_l))
        new_params.append(p_l)
        new_state.append(s_l)

    # The step counts advance once: each slice computed the same new count; this one is kept.
    def none(q, x):
        return False

    _, s_counts = update(_select(grads, none), counts, _select(params, none))
    new_state.append(_to(_select(s_counts, _is_count), _homes(counts)))
    return _merge(*new_params), _merge(*new_state)
