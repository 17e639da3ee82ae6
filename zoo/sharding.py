"""Meshes, logical-axis rules and memory-kind shardings.

Every parameter dim and every activation dim has a logical name (batch, seq, embed, heads, kv_heads,
mlp, experts, vocab, ...). The rules map each logical name to zero or more mesh axes (data, fsdp,
tensor, expert); a PartitionSpec is the rules applied dim by dim, where a mesh axis already used by
an earlier dim of the same array is skipped (so `batch -> [data, fsdp]` and `embed -> [fsdp]` give
activations `[batch seq embed]` the spec `((data, fsdp), None, None)` and weights `[embed mlp]` the
spec `(fsdp, tensor)`).

Parameters get their logical axes and their dtype in use from the block that holds them: each
block class declares its array fields in `PARAMS` (field -> `Leaf`, beside its maths), and
`param_logical_axes` / `cast_for_compute` ask the owning module of each leaf; an undeclared field is
an error. Leaves of a scanned layer stack carry a leading `layers` axis that is never sharded.
"""

import contextlib
import contextvars
import dataclasses
import math
from typing import Iterator, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor", "expert")
LOGICAL_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "mlp", "experts", "vocab", "latent")
LAYERS = "layers"  # the leading axis of stacked layer leaves: never sharded

# The default rules (every mesh preset of conf/mesh uses them).
DEFAULT_RULES: dict[str, list[str]] = {
    "batch": ["data", "fsdp", "expert"],
    "seq": [],
    "embed": ["fsdp"],
    "heads": ["tensor"],
    "kv_heads": ["tensor"],
    "mlp": ["tensor"],
    "experts": ["expert"],
    "vocab": ["tensor"],
    "latent": ["fsdp"],  # MLA's q/kv latent dims (the up-projections' inputs)
}


@dataclasses.dataclass(frozen=True)
class Leaf:
    """What one array field of a block is, declared beside the block's maths (its `PARAMS`, a dict
    field name -> Leaf): its logical axes (without a stack's leading `layers` axis; `None` a dim never
    sharded) and its dtype in use. `compute`: a matmul weight, or a bias added to its output, cast to
    the compute dtype where it lies, before any gather (`cast_for_compute`); otherwise it stays in its
    own (float32) dtype where it is used: norm scales, routers, correction biases, sinks.
    `axes=None`: a leaf that is never sharded by `param_specs` (asking for its axes is an error).
    `inputs`: a projection of the block (`projection`), whose first `inputs` axes are what it reads:
    LoRA adapts it (zoo.lora) and its hub matrix is `[out, in]` (zoo.families._hf); 0: no projection
    (a bias, a norm, a router, the routed experts' stacked weights). `hub`: its module's name in
    transformers (the tensor `<hub>.weight`), where the block is transformers' module too.
    `matmul`: a weight that multiplies the activations (every projection, the routed experts' weights,
    a router), as opposed to a bias, scale or table: zoo.counts counts 6 training FLOPs per token for
    each of its (active) elements."""

    axes: Optional[tuple[Optional[str], ...]]
    compute: bool
    inputs: int = 0
    hub: Optional[str] = None
    matmul: bool = False

    @property
    def output_axes(self) -> tuple[Optional[str], ...]:
        """A projection's output axes (those past its `inputs`): with the activations' leading axes
        before them, the axes of what it computes."""
        return self.axes[self.inputs :]

    def widths(self, shape: Sequence[int]) -> tuple[int, int]:
        """A projection of `shape` as one matmul: (what it reads, what it writes), its `inputs` axes
        and the rest flattened; the first is its initialisation's fan-in."""
        return math.prod(shape[: self.inputs]), math.prod(shape[self.inputs :])


def compute(*axes: Optional[str], matmul: bool = False) -> Leaf:
    """A leaf cast to the compute dtype before it is gathered (a matmul weight or its output bias)."""
    return Leaf(tuple(axes), True, matmul=matmul)


def projection(*axes: Optional[str], inputs: int = 1, hub: Optional[str] = None) -> Leaf:
    """A block's projection weight: cast like `compute`, its first `inputs` axes read (see `Leaf`)."""
    return Leaf(tuple(axes), True, inputs, hub, matmul=True)


def float32(*axes: Optional[str], matmul: bool = False) -> Leaf:
    """A leaf used in its own dtype (float32): never cast, gathered as it is."""
    return Leaf(tuple(axes), False, matmul=matmul)


# Under context parallelism (zoo.train.run_config.MeshConfig.context_parallel) the rules carry this key too:
# the mesh axes that keep the sequence split through the whole layer, attention included (a subset of
# rules.seq, never of rules.batch). Not a logical axis of LOGICAL_AXES: only that option sets it.
CONTEXT = "context"
# With it, the context axes whose devices hold balanced pieces of the sequence (MeshConfig.context_balance):
# the sequence cut in 2 x shards chunks, device r holding chunks r and 2 x shards - 1 - r, so that
# under causal attention every device has about the same work (contiguous chunks leave the last
# device about twice the average). The model takes its inputs into that order (`to_context_order`).
CONTEXT_BALANCED = "context_balanced"

ACTIVATION_AXES = ("batch", "seq", "embed")
# An activation whose sequence is whole on every device (sequence parallelism gathers it here).
GATHERED_AXES = ("batch", None, "embed")
TOKEN_AXES = ("batch", "seq")
LOGIT_AXES = ("batch", "seq", "vocab")


class ShardingError(ValueError):
    """A mesh or a rule that cannot shard the model; the message starts with the config key."""


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Resolved mesh axis sizes (no -1 left)."""

    data: int
    fsdp: int
    tensor: int
    expert: int

    @property
    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in MESH_AXES}

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes.values())

    @property
    def data_parallel(self) -> int:
        """How many ways the batch is split under the default rules."""
        return self.data * self.fsdp * self.expert


def resolve_mesh_shape(axes: Mapping[str, int], num_devices: int) -> MeshShape:
    """Fill the (at most one) -1 axis so the axes multiply to `num_devices`; ShardingError otherwise."""
    sizes = {a: int(axes.get(a, 1)) for a in MESH_AXES}
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
        raise ShardingError(f"mesh.{unknown[0]}: unknown mesh axis; the axes are {', '.join(MESH_AXES)}")
    fill = [a for a, n in sizes.items() if n == -1]
    bad = [a for a, n in sizes.items() if n == 0 or n < -1]
    if bad:
        raise ShardingError(f"mesh.{bad[0]}: size {sizes[bad[0]]} is invalid; use a positive size or -1 to fill")
    if len(fill) > 1:
        raise ShardingError(f"mesh.{fill[1]}: only one axis may be -1 (also {fill[0]}); give the others sizes")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    formula = "*".join(MESH_AXES)
    if fill:
        if num_devices % fixed:
            raise ShardingError(
                f"mesh.{fill[0]}: -1 cannot fill {num_devices} devices, the other axes multiply to {fixed}; "
                f"make the other axes divide {num_devices}"
            )
        sizes[fill[0]] = num_devices // fixed
    elif fixed != num_devices:
        shown = "*".join(str(sizes[a]) for a in MESH_AXES)
        raise ShardingError(
            f"mesh: {formula} = {shown} = {fixed} does not match the {num_devices} devices; "
            f"make the product {num_devices} or set one axis to -1"
        )
    return MeshShape(**sizes)


def make_mesh(shape: MeshShape, devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A mesh with axes (data, fsdp, tensor, expert), automatic (GSPMD) axis types."""
    devices = list(devices if devices is not None else jax.devices())[: shape.num_devices]
    if len(devices) != shape.num_devices:
        raise ShardingError(f"mesh: needs {shape.num_devices} devices, {len(devices)} are available; shrink the mesh")
    arr = np.asarray(devices, dtype=object).reshape([shape.sizes[a] for a in MESH_AXES])
    return Mesh(arr, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def logical_to_spec(logical: Sequence[Optional[str]], rules: Mapping[str, Sequence[str]]) -> PartitionSpec:
    """Apply the rules dim by dim; a mesh axis used by an earlier dim is skipped, `None`/`layers` stay unsharded."""
    used: set[str] = set()
    out = []
    for name in logical:
        if name is None or name == LAYERS:
            out.append(None)
            continue
        if name not in rules:
            raise ShardingError(f"mesh.rules.{name}: no rule for this logical axis; add one (an empty list replicates)")
        axes = [a for a in rules[name] if a not in used]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def _key_name(k) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(path) -> str:
    return ".".join(_key_name(k) for k in path)


def _child(node, key):
    """The child of pytree node `node` under one path key."""
    if isinstance(key, jax.tree_util.GetAttrKey):
        return getattr(node, key.name)
    if isinstance(key, jax.tree_util.DictKey):
        return node[key.key]
    if isinstance(key, jax.tree_util.SequenceKey):
        return node[key.idx]
    children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return next(c for p, c in children if p == (key,))


def leaf_declaration(tree, path) -> Leaf:
    """The declaration of the leaf of `tree` at `path`: its owner's (the module holding it) `PARAMS`
    entry for its field. A leaf whose owner declares no such field is a ShardingError naming both:
    no weight is sharded, cast or gathered by a guess."""
    owner = tree
    for key in path[:-1]:
        owner = _child(owner, key)
    field = _key_name(path[-1])
    declared = getattr(type(owner), "PARAMS", None)
    if declared is None or field not in declared:
        raise ShardingError(
            f"sharding: {type(owner).__name__}.{field} (leaf {path_str(path)}) is not declared; "
            f"add {field!r} to {type(owner).__name__}.PARAMS (zoo.sharding.compute or float32, with its logical axes)"
        )
    return declared[field]


def param_logical_axes(tree, path, ndim: int) -> tuple[Optional[str], ...]:
    """Logical axes of the leaf of `tree` at `path`, as its block declares them (`leaf_declaration`);
    stacked layer leaves get a leading `layers`."""
    return _logical(leaf_declaration(tree, path), path, ndim)


def _logical(leaf: Leaf, path, ndim: int) -> tuple[Optional[str], ...]:
    stacked = any(_key_name(k) == "layers" for k in path)
    inner = ndim - 1 if stacked else ndim
    axes = leaf.axes
    if axes is None or len(axes) != inner:
        raise ShardingError(
            f"sharding: leaf {path_str(path)} (ndim {ndim}) does not match its declared logical axes {axes}; "
            f"fix its owner's PARAMS entry"
        )
    return ((LAYERS,) if stacked else ()) + tuple(axes)


def _check_divisible(where: str, shape, spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> None:
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        if entry is None:
            continue
        axes = (entry,) if isinstance(entry, str) else entry
        ways = math.prod(mesh_sizes[a] for a in axes)
        if size % ways:
            raise ShardingError(
                f"mesh.{axes[-1]}: dim {dim} of {where} has size {size}, not divisible by {'*'.join(axes)}={ways}; "
                f"pick mesh sizes that divide it or change mesh.rules"
            )


def param_specs(tree, rules: Mapping[str, Sequence[str]], mesh_sizes: Optional[Mapping[str, int]] = None):
    """A PartitionSpec for every array leaf of `tree`, None elsewhere. `tree` is a model (or its
    abstract twin) or any tree whose leaves mirror a model's (optimizer moments end with the
    parameter's path); scalars (step counts) are replicated. With `mesh_sizes`, a dim the mesh does
    not divide is a ShardingError naming the leaf."""

    def one(path, leaf):
        if not hasattr(leaf, "shape"):
            return None
        if len(leaf.shape) == 0:
            return PartitionSpec()
        spec = logical_to_spec(param_logical_axes(tree, path, len(leaf.shape)), rules)
        if mesh_sizes is not None:
            _check_divisible(path_str(path), leaf.shape, spec, mesh_sizes)
        return spec

    return jax.tree_util.tree_map_with_path(one, tree)


def logical_ways(rules: Mapping[str, Sequence[str]], mesh_sizes: Mapping[str, int], logical: str) -> int:
    """How many ways the rules split a logical dim on a mesh of these axis sizes (each axis once)."""
    return math.prod(int(mesh_sizes.get(a, 1)) for a in dict.fromkeys(rules.get(logical, ())))


def shard_ways(spec: PartitionSpec, mesh_sizes: Mapping[str, int]) -> int:
    """How many pieces a leaf with this spec is cut into."""
    ways = 1
    for entry in spec:
        for a in (entry,) if isinstance(entry, str) else (entry or ()):
            ways *= mesh_sizes[a]
    return ways


def check_replication(model, specs, mesh_sizes: Mapping[str, int], limit_bytes: float) -> None:
    """With parameters sharded (fsdp > 1), refuse rules that leave a leaf above `limit_bytes` whole on
    every device: it would cost its full size (with its gradient and AdamW moments, 4x) per device."""
    if mesh_sizes.get("fsdp", 1) <= 1:
        return  # data / tensor parallelism replicate by design
    leaves = jax.tree_util.tree_leaves_with_path(model)
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    for (path, leaf), spec in zip(leaves, spec_leaves):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if nbytes > limit_bytes and shard_ways(spec, mesh_sizes) == 1:
            axes = param_logical_axes(model, path, len(leaf.shape))
            raise ShardingError(
                f"mesh.rules: parameter {path_str(path)} ({nbytes / 2**20:.0f} MiB, logical axes "
                f"{', '.join(a or '-' for a in axes)}) would be "
                "replicated on every device; map one of its axes to fsdp in mesh.rules (or raise "
                "mesh.max_replicated_mb)"
            )


def cast_for_compute(tree, compute_dtype, *, gather_context: bool = False, declared: Optional[Leaf] = None):
    """Cast the matmul weights of `tree` (a block's or the model's parameters) to the compute dtype
    where they lie, before any all-gather: under an active layout each cast is pinned to the leaf's
    own sharding, so FSDP gathers carry the compute dtype (bf16), not the float32 master weights.
    Without a layout, or when the dtypes agree, the tree is returned as it is. `gather_context`
    (a layer's weights, under context parallelism): each is also pinned whole over the context axes.
    `declared`: `tree` is one array taken out of its module, which declares it so (e.g.
    `CausalLM.PARAMS["embed"]`); otherwise each leaf's owner declares it (`leaf_declaration`)."""
    layout = active()
    compute_dtype = np.dtype(compute_dtype)
    ctx = context_axes() if gather_context else ()
    # Under context parallelism an axis that splits the weights (fsdp) may split the sequence too: a
    # weight left split over it let the partitioner keep the weight split and gather whole sequences
    # of the activations instead (the out- and down-projections of Llama 3.1 405B, every layer).
    # Pinned gathered over the context axes here, the weights move once per layer, as FSDP's do.
    gathered = {k: [a for a in v if a not in ctx] for k, v in layout.rules.items()} if ctx else None

    def one(path, x):
        if not isinstance(x, jax.Array):
            return x
        leaf = declared if declared is not None else leaf_declaration(tree, path)
        if not leaf.compute:
            return x
        logical = _logical(leaf, path, x.ndim)
        regather = ctx and "experts" not in logical  # (routed experts gather their own, zoo.nn.moe_dispatch)
        if x.dtype == compute_dtype and not regather:
            return x
        if x.dtype != compute_dtype:
            x = jax.lax.with_sharding_constraint(x.astype(compute_dtype), layout.sharding(logical))
        if regather:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(layout.mesh, logical_to_spec(logical, gathered)))
        return x

    if layout is None:
        return tree
    return jax.tree_util.tree_map_with_path(one, tree)


def named(mesh: Mesh, specs, memory_kind: Optional[str] = None):
    """PartitionSpecs -> NamedShardings (with a memory kind), same tree; None leaves stay None."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind),
        specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def to_device(tree):
    """Move every array of `tree` to device memory, keeping its sharding (a no-op for device arrays)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def memory_kinds(tree) -> set[str]:
    """The memory kinds the (concrete) arrays of `tree` live in."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}


# --- the active mesh and rules ------------------------------------------------------------------
#
# Modules stay free of trainer plumbing: they ask the active context (set by whoever traces them
# on a mesh, e.g. the trainer around its step) how to shard an activation, and do nothing without one.


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and the logical-axis rules in force while a program is traced."""

    mesh: Mesh
    rules: Mapping[str, Sequence[str]]

    def spec(self, logical: Sequence[Optional[str]]) -> PartitionSpec:
        return logical_to_spec(logical, self.rules)

    def sharding(self, logical: Sequence[Optional[str]], memory_kind: Optional[str] = None) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(logical), memory_kind=memory_kind)

    def axis_size(self, axis: str) -> int:
        return int(self.mesh.shape.get(axis, 1))

    def mesh_axes(self, logical: str) -> tuple[str, ...]:
        """The mesh axes a logical dim maps to (sizes of 1 included), in rule order."""
        return tuple(a for a in self.rules.get(logical, ()) if a in self.mesh.shape)


_ACTIVE: contextvars.ContextVar[Optional[Layout]] = contextvars.ContextVar("zoo_layout", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Mapping[str, Sequence[str]]) -> Iterator[Layout]:
    """Make `(mesh, rules)` the layout modules see while tracing inside this block."""
    layout = Layout(mesh, {k: tuple(v) for k, v in rules.items()})
    token = _ACTIVE.set(layout)
    try:
        yield layout
    finally:
        _ACTIVE.reset(token)


def active() -> Optional[Layout]:
    """The layout in force (None outside `activate`: single device, or the caller shards by hand)."""
    return _ACTIVE.get()


def constrain(x, logical: Sequence[Optional[str]]):
    """Pin `x` to the sharding its logical axes map to under the active layout; a no-op without one."""
    layout = active()
    if layout is None:
        return x
    return jax.lax.with_sharding_constraint(x, layout.sharding(logical))


def sequence_parallel() -> bool:
    """Whether the active layout splits the sequence of the activations between blocks (rules `seq`
    mapped to a mesh axis of size > 1): sequence parallelism, Megatron-style."""
    layout = active()
    return layout is not None and any(layout.axis_size(a) > 1 for a in layout.mesh_axes("seq"))


def context_axes() -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split the sequence inside attention under the active layout:
    context parallelism (rules[CONTEXT]); () without it."""
    layout = active()
    if layout is None:
        return ()
    return tuple(a for a in layout.rules.get(CONTEXT, ()) if a in layout.mesh.shape and layout.axis_size(a) > 1)


def context_shards() -> int:
    """How many chunks the context axes cut the sequence in under the active layout (1 without)."""
    layout = active()
    return math.prod(layout.axis_size(a) for a in context_axes()) if layout is not None else 1


def context_balanced() -> int:
    """Under balanced context parallelism, the number of context shards; 0 otherwise."""
    return context_shards() if context_axes() and active().rules.get(CONTEXT_BALANCED) else 0


def to_context_order(x, shards: int, axis: int = 1):
    """`x` with its sequence dim (`axis`) in the balanced order of `shards` context shards: cut in
    2 x shards chunks, ordered 0, 2s-1, 1, 2s-2, ..., so that contiguous shards hold chunks r and
    2s-1-r. A reshape and a flip, no gather."""
    x = jnp.moveaxis(x, axis, -1)
    lead, seq = x.shape[:-1], x.shape[-1]
    halves = x.reshape(*lead, 2, shards, seq // (2 * shards))
    pairs = jnp.stack(
        [halves[..., 0, :, :], jnp.flip(halves[..., 1, :, :], axis=-2)], axis=-2
    )  # [..., shards, 2, chunk]
    return jnp.moveaxis(pairs.reshape(*lead, seq), -1, axis)


def from_context_order(x, shards: int, axis: int = 1):
    """The inverse of `to_context_order`: the sequence back in order."""
    x = jnp.moveaxis(x, axis, -1)
    lead, seq = x.shape[:-1], x.shape[-1]
    pairs = x.reshape(*lead, shards, 2, seq // (2 * shards))
    halves = jnp.stack(
        [pairs[..., :, 0, :], jnp.flip(pairs[..., :, 1, :], axis=-2)], axis=-3
    )  # [..., 2, shards, chunk]
    return jnp.moveaxis(halves.reshape(*lead, seq), -1, axis)


def context_spec(logical: Sequence[Optional[str]]) -> PartitionSpec:
    """The spec of `logical` (dim 1 the sequence, None) under the active layout with the sequence split
    over the context axes: what each device holds under context parallelism."""
    layout = active()
    rules = {**layout.rules, "_context": context_axes()}
    return logical_to_spec((logical[0], "_context", *logical[2:]), rules)


def sequence_gathered(x, logical: Sequence[Optional[str]] = GATHERED_AXES, *, whole: bool = False):
    """Under sequence parallelism, pin `x` to `logical` (whose sequence dim is None: whole), so that
    the partitioner all-gathers the sequence once here (forward) and reduce-scatters the gradient
    (backward), rather than leaving sequence shards inside attention, where the blockwise kernel
    would gather q/k/v at every tile. A no-op otherwise, so the other layouts' programs are unchanged.

    Under context parallelism the sequence stays split over the context axes (only the other seq
    axes, tensor's, are gathered): attention takes its chunks as they are (zoo.nn.context_parallel).
    `whole=True` gathers it over those too (the segment ids that every chunk's keys need).

    An activation `[batch seq embed]` is first pinned to its sequence shards as it is: left free,
    the partitioner gathered a norm's float32 input and cast it after, moving twice the bytes."""
    if not sequence_parallel():
        return x
    if tuple(logical) == GATHERED_AXES:
        x = constrain(x, ACTIVATION_AXES)
    if whole or not context_axes():
        return constrain(x, logical)
    return context_constrain(x, logical)


def context_constrain(x, logical: Sequence[Optional[str]]):
    """Under context parallelism, pin `x` (dim 1 its sequence, None in `logical`) to its chunk over
    the context axes and the rest of `logical` as the rules say; a no-op otherwise."""
    if not context_axes():
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(active().mesh, context_spec(logical)))


def sequence_scattered(x):
    """Under sequence parallelism, pin a block's out-projection output `[batch seq embed]` back to
    sequence shards: the partial sums over the tensor axis become one reduce-scatter rather than an
    all-reduce. A no-op otherwise."""
    return constrain(x, ACTIVATION_AXES) if sequence_parallel() else x
