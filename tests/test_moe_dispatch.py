"""Routed-expert dispatch: the single-program kernels against a dense reference, expert parallelism
against the single program, what the compiled program communicates, and checkpoint policies.

The dense reference runs every expert on every token and combines with a dense [tokens, experts]
weight matrix (zero where a token did not choose an expert, or where its assignment was dropped).
Expert parallelism runs on the 8 simulated CPU devices of conftest.py, on the mesh
(data=1, fsdp=2, tensor=1, expert=4) with the default rules unless a test says otherwise.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from zoo import sharding as zs
from zoo import tags
from zoo.hlo import collectives
from zoo.nn.expert_rounds import later_block, round_block
from zoo.nn.moe_dispatch import ExpertWeights, check_expert_parallel, expert_capacity, expert_specs, routed_experts
from zoo.nn.moe_dispatch import swiglu

E, D, I, K = 8, 16, 8, 2
EP_MESH = zs.MeshShape(data=1, fsdp=2, tensor=1, expert=4)
MOE_TAGS = (tags.MOE_MLPWI_0, tags.MOE_MLPWI_1, tags.MOE_MLPWO)


def clamped_swiglu(gate, up, limit=7.0, alpha=1.702):
    """A GPT-OSS-style activation: a non-default activation exercises the `activation` argument."""
    gate = jnp.minimum(gate, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (jnp.clip(up, -limit, limit) + 1)


def random_experts(seed, biases=False, n_experts=E, layers=None) -> ExpertWeights:
    rng = np.random.default_rng(seed)
    lead = () if layers is None else (layers,)

    def arr(*shape, scale):
        return jnp.asarray(rng.normal(size=lead + shape) * scale, jnp.float32)

    w = dict(
        w_gate=arr(n_experts, D, I, scale=D**-0.5),
        w_up=arr(n_experts, D, I, scale=D**-0.5),
        w_down=arr(n_experts, I, D, scale=I**-0.5),
    )
    if biases:
        w.update(
            b_gate=arr(n_experts, I, scale=0.3), b_up=arr(n_experts, I, scale=0.3), b_down=arr(n_experts, D, scale=0.3)
        )
    return ExpertWeights(**w)


def random_routing(seed, tokens, n_experts=E, k=K, skew=0.0):
    """Distinct expert ids per token and positive weights; `skew` > 0 crowds the low expert ids."""
    rng = np.random.default_rng(seed)
    p = np.exp(-skew * np.arange(n_experts))
    p /= p.sum()
    ids = np.stack([rng.choice(n_experts, size=k, replace=False, p=p) for _ in range(tokens)])
    return jnp.asarray(ids, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, size=(tokens, k)), jnp.float32)


def random_x(seed, tokens, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(tokens, D)), dtype)


def dense_reference(x, ids, weights, w: ExpertWeights, activation=swiglu, keep=None):
    tokens = x.shape[0]
    n_experts = w.w_gate.shape[0]
    kept = weights if keep is None else jnp.where(keep, weights, 0.0)
    dense = jnp.zeros((tokens, n_experts), jnp.float32).at[jnp.arange(tokens)[:, None], ids].add(kept)
    gate = jnp.einsum("nd,edi->eni", x, w.w_gate)
    up = jnp.einsum("nd,edi->eni", x, w.w_up)
    if w.b_gate is not None:
        gate, up = gate + w.b_gate[:, None], up + w.b_up[:, None]
    out = jnp.einsum("eni,eid->end", activation(gate, up), w.w_down)
    if w.b_down is not None:
        out = out + w.b_down[:, None]  # inside the expert, so scaled by the combine weight
    return jnp.einsum("ne,end->nd", dense, out)


def keep_first(ids: np.ndarray, capacity: int, shards: int = 1) -> np.ndarray:
    """[tokens, k] bool: within each contiguous token shard, each expert keeps its first `capacity`
    assignments in token order; the rest are dropped."""
    ids = np.asarray(ids)
    keep = np.zeros(ids.shape, bool)
    per = ids.shape[0] // shards
    for s in range(shards):
        used: dict[int, int] = {}
        for n in range(s * per, (s + 1) * per):
            for j, e in enumerate(ids[n]):
                if used.get(int(e), 0) < capacity:
                    keep[n, j] = True
                    used[int(e)] = used.get(int(e), 0) + 1
    return keep


def ep_mesh(shape=EP_MESH):
    return zs.make_mesh(shape)


def place(layout: zs.Layout, x, ids, weights, w: ExpertWeights):
    """Put the inputs where a trainer has them: tokens split over the batch axes, experts by the rules."""
    tok = NamedSharding(layout.mesh, PartitionSpec(layout.spec(("batch",))[0], None))
    specs = expert_specs(layout, w)
    w = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(layout.mesh, s)), w, specs)
    return jax.device_put(x, tok), jax.device_put(ids, tok), jax.device_put(weights, tok), w


def loss_fn(cotangent, **kw):
    def loss(x, weights, w, ids):
        y = routed_experts(x, ids, weights, w, **kw).y
        return jnp.sum(y.astype(jnp.float32) * cotangent)

    return loss


GRAD_ARGS = (0, 1, 2)  # x, routing weights, every expert leaf


# --- one program ------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["capacity", "ragged"])
@pytest.mark.parametrize("biases", [False, True])
def test_single_program_matches_dense_reference(impl, biases):
    tokens = 24
    w = random_experts(0, biases=biases)
    ids, weights = random_routing(1, tokens)
    x = random_x(2, tokens)
    act = clamped_swiglu if biases else swiglu
    y, counts, dropped, _ = jax.jit(
        lambda x, w: routed_experts(x, ids, weights, w, impl=impl, capacity_factor=E, activation=act)
    )(x, w)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(dense_reference(x, ids, weights, w, act)), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(np.asarray(ids).ravel(), minlength=E))
    assert int(dropped) == 0


def test_single_program_capacity_drops_later_tokens():
    tokens, cf = 32, 0.75
    w = random_experts(3, biases=True)
    ids, weights = random_routing(4, tokens, skew=0.6)
    x = random_x(5, tokens)
    y, counts, dropped, _ = jax.jit(lambda x: routed_experts(x, ids, weights, w, capacity_factor=cf))(x)
    capacity = expert_capacity(tokens, K, E, cf)
    keep = keep_first(ids, capacity)
    assert 0 < (~keep).sum() == int(dropped)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(np.asarray(ids).ravel(), minlength=E))
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(dense_reference(x, ids, weights, w, keep=jnp.asarray(keep))), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_matmul_differentiates_as_the_einsum(dtype):
    """zoo's expert matmul against `jnp.einsum`: reverse mode for each operand alone and for both,
    forward mode, per-example gradients under jax.vmap, and, for float32 weights cast to bfloat16 inside (the MoE
    layer's case), a compiled weight gradient with no transpose after its dot, where the einsum's has one."""
    from zoo.nn.moe_dispatch import expert_matmul

    rng = np.random.default_rng(11)
    h, w = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((E, 6, D), (E, D, I)))
    th, tw = (jnp.asarray(rng.normal(size=a.shape), jnp.float32) for a in (h, w))
    cot = jnp.asarray(rng.normal(size=(E, 6, I)), jnp.float32)

    def loss(fn, argnums):
        return jax.grad(
            lambda h, w: (fn(h.astype(dtype), w.astype(dtype)).astype(jnp.float32) * cot).sum(), argnums=argnums
        )

    def reference(h, w):
        return jnp.einsum("ECD,EDF->ECF", h, w)

    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-2, atol=1e-2)
    for argnums in (0, 1, (0, 1)):
        got, want = loss(expert_matmul, argnums)(h, w), loss(reference, argnums)(h, w)
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert float(jnp.abs(r).max()) > 0
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), **tol)
    primals, tangents = (h.astype(dtype), w.astype(dtype)), (th.astype(dtype), tw.astype(dtype))
    (out, tangent), (ref_out, ref_tangent) = (
        jax.jvp(expert_matmul, primals, tangents),
        jax.jvp(reference, primals, tangents),
    )
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref_out, np.float32))
    np.testing.assert_allclose(np.asarray(tangent, np.float32), np.asarray(ref_tangent, np.float32), **tol)
    # per-example gradients (jax.vmap of the reverse mode; the weight shared by every example)
    hs = jnp.stack([h, jnp.cos(h), h * 0.5])
    per_example = {fn: jax.vmap(loss(fn, (0, 1)), in_axes=(0, None))(hs, w) for fn in (expert_matmul, reference)}
    for g, r in zip(jax.tree.leaves(per_example[expert_matmul]), jax.tree.leaves(per_example[reference])):
        assert g.shape[0] == 3
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **tol)
    if dtype == jnp.bfloat16:

        def transposes(fn):
            hlo = jax.jit(loss(fn, 1)).lower(h, w).compile().as_text()
            return [line for line in hlo.splitlines() if " transpose(" in line]

        assert transposes(reference)  # what the custom rule is for: if XLA folds it one day, the rule can go
        assert not transposes(expert_matmul)


# --- expert parallelism -----------------------------------------------------------------------


EXPERTS_OVER_FSDP_AND_EXPERT = {**zs.DEFAULT_RULES, "experts": ["fsdp", "expert"]}


@pytest.mark.parametrize(
    "mesh_shape,biases,rules,impl",
    [
        (EP_MESH, False, zs.DEFAULT_RULES, "capacity"),
        (EP_MESH, True, zs.DEFAULT_RULES, "capacity"),
        (
            zs.MeshShape(data=1, fsdp=2, tensor=2, expert=2),
            True,
            zs.DEFAULT_RULES,
            "capacity",
        ),  # mlp split over tensor inside the experts
        (
            zs.MeshShape(data=2, fsdp=1, tensor=1, expert=4),
            False,
            zs.DEFAULT_RULES,
            "capacity",
        ),  # weights replicated over data: grads summed
        (
            EP_MESH,
            False,
            EXPERTS_OVER_FSDP_AND_EXPERT,
            "capacity",
        ),  # 8-way expert parallelism over two mesh axes, no gather
        # the dropless exchange; slow: test_dropless_rounds_match_the_single_program runs it on this mesh with biases
        pytest.param(EP_MESH, True, zs.DEFAULT_RULES, "ragged", marks=pytest.mark.slow),
        (EP_MESH, False, EXPERTS_OVER_FSDP_AND_EXPERT, "ragged"),  # one local expert per shard: min(k, E/ep) = 1
    ],
    ids=[
        "fsdp2_ep4",
        "fsdp2_ep4_biases",
        "fsdp2_tp2_ep2_biases",
        "data2_ep4",
        "ep_over_fsdp_and_expert",
        "ragged_fsdp2_ep4_biases",
        "ragged_ep_over_fsdp_and_expert",
    ],
)
def test_expert_parallel_matches_single_program(mesh_shape, biases, rules, impl):
    """Capacity E (every buffer holds every local assignment) or the dropless ragged exchange: nothing
    drops, so expert parallelism must reproduce the single program's outputs, counts and gradients."""
    tokens = 64
    w = random_experts(6, biases=biases)
    ids, weights = random_routing(
        7, tokens, skew=0.8 if impl == "ragged" else 0.0
    )  # ragged: crowded experts, uneven blocks
    x = random_x(8, tokens)
    cot = random_x(9, tokens)
    act = clamped_swiglu if biases else swiglu
    kw = dict(capacity_factor=float(E), activation=act, impl=impl)

    def programs():
        # Fresh functions per layout: jit's trace cache does not know about the active layout.
        return jax.jit(lambda x, weights, w, ids: routed_experts(x, ids, weights, w, **kw)), jax.jit(
            jax.grad(loss_fn(cot, **kw), argnums=GRAD_ARGS)
        )

    fwd, grad = programs()
    ref_out, ref_grads = fwd(x, weights, w, ids), grad(x, weights, w, ids)
    with zs.activate(ep_mesh(mesh_shape), rules) as layout:
        fwd, grad = programs()
        px, pids, pweights, pw = place(layout, x, ids, weights, w)
        out = fwd(px, pweights, pw, pids)
        grads = grad(px, pweights, pw, pids)
        assert "all-to-all" in fwd.lower(px, pweights, pw, pids).compile().as_text()  # really the EP path
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref_out[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref_out[1]))
    assert int(out[2]) == int(ref_out[2]) == 0
    names = ["x", "weights"] + [f"experts.{p}" for p, _ in jax.tree_util.tree_leaves_with_path(w)]
    for name, g, r in zip(names, jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.abs(r).max()) > 0, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5, err_msg=name)


def test_expert_parallel_drops_are_decided_per_device():
    """Tight capacity: each device's tokens compete for ceil(local_tokens * k / E * cf) rows per
    expert. The drop count and the output follow the per-shard reference, not the global one."""
    tokens, cf, shards = 128, 1.0, EP_MESH.data_parallel
    w = random_experts(10)
    ids, weights = random_routing(11, tokens, skew=0.5)
    x = random_x(12, tokens)
    with zs.activate(ep_mesh(), zs.DEFAULT_RULES) as layout:
        args = place(layout, x, ids, weights, w)
        y, counts, dropped, _ = jax.jit(
            lambda x, ids, weights, w: routed_experts(x, ids, weights, w, capacity_factor=cf)
        )(*args)
    local_capacity = expert_capacity(tokens // shards, K, E, cf)
    keep = keep_first(ids, local_capacity, shards)
    global_keep = keep_first(ids, expert_capacity(tokens, K, E, cf))
    assert (~keep).sum() > 0 and (~keep).sum() != (~global_keep).sum()  # the case tells the two apart
    assert int(dropped) == (~keep).sum()
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(np.asarray(ids).ravel(), minlength=E))
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(dense_reference(x, ids, weights, w, keep=jnp.asarray(keep))), rtol=1e-5, atol=1e-5
    )


def _compiled_ep_step(dtype, tokens, cf=1.25):
    """Compiled forward + backward of the EP kernel on placed inputs, and the placed weights."""
    w = random_experts(13)
    ids, weights = random_routing(14, tokens)
    x = random_x(15, tokens, dtype)
    cot = random_x(16, tokens)
    loss = loss_fn(cot, capacity_factor=cf, compute_dtype=dtype)

    def step(x, weights, w, ids):
        return jax.value_and_grad(loss, argnums=GRAD_ARGS)(x, weights, w, ids)

    with zs.activate(ep_mesh(), zs.DEFAULT_RULES) as layout:
        x, ids, weights, w = place(layout, x, ids, weights, w)
        compiled = jax.jit(step).lower(x, weights, w, ids).compile()
    return compiled, (x, weights, w, ids)


def test_expert_parallel_communication_is_local():
    """The compiled step exchanges capacity buffers with all-to-all and never moves the global batch;
    weights stay 1/ep of the experts per device, and so do their gradients."""
    tokens = 96  # 12 per device; no buffer or weight dim is 96 or 96 * K
    compiled, args = _compiled_ep_step(jnp.float32, tokens)
    found = [c for c in collectives(compiled.as_text()) if not c.trivial]
    kinds = {c.kind for c in found}
    assert "all-to-all" in kinds, kinds
    a2a = [c for c in found if c.kind == "all-to-all"]
    assert len(a2a) >= 4  # dispatch, return, and their transposes
    capacity = expert_capacity(tokens // EP_MESH.data_parallel, K, E, 1.25)
    for c in a2a:  # each exchange is exactly one device's buffers: [E, C, D] in total
        assert c.result_bytes == E * capacity * D * 4, c
        assert c.group_size == EP_MESH.expert
    for c in found:
        for a in c.operands + c.results:
            assert tokens not in a.dims and tokens * K not in a.dims, (c.kind, c.op_name, str(a))
    gathers = [c for c in found if c.kind == "all-gather"]
    assert len(gathers) == 3 and all(c.group_size == EP_MESH.fsdp for c in gathers)
    for c in gathers:  # only the embed dim is gathered: the expert dim stays E/ep
        assert c.results[0].dims[0] == E // EP_MESH.expert, c

    (_, grads) = compiled(*args)
    w = args[2]
    for leaf, g in zip(jax.tree.leaves(w), jax.tree.leaves(grads[2])):
        for arr in (leaf, g):
            shard = arr.addressable_shards[0].data.shape
            assert shard[0] == E // EP_MESH.expert, shard
            assert math.prod(shard) * EP_MESH.expert * EP_MESH.fsdp == arr.size, shard


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (scan, checkpoint, shard_map bodies)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


def _collective_dtypes(closed_jaxpr) -> dict[str, list[str]]:
    """Primitive name -> dtypes of its outputs, for the collectives anywhere in a traced program."""
    found: dict[str, list[str]] = {}
    for eqn in _eqns(closed_jaxpr.jaxpr):
        if eqn.primitive.name in ("all_gather", "reduce_scatter", "all_to_all", "psum"):
            found.setdefault(eqn.primitive.name, []).extend(str(v.aval.dtype) for v in eqn.outvars)
    return found


def test_expert_parallel_gathers_weights_in_compute_dtype():
    """bf16 compute: the weights are cast before their gather, so the gather, its transpose (the
    gradient reduce-scatter) and the token exchange all carry bf16. Read from the traced program:
    XLA:CPU promotes bf16 collectives to f32 when it compiles them (GPU backends keep bf16)."""
    w = random_experts(13)
    ids, weights = random_routing(14, 64)
    x = random_x(15, 64, jnp.bfloat16)
    loss = loss_fn(random_x(16, 64), capacity_factor=1.25, compute_dtype=jnp.bfloat16)
    with zs.activate(ep_mesh(), zs.DEFAULT_RULES) as layout:
        x, ids, weights, w = place(layout, x, ids, weights, w)
        found = _collective_dtypes(jax.make_jaxpr(jax.grad(loss, argnums=GRAD_ARGS))(x, weights, w, ids))
    assert w.w_gate.dtype == jnp.float32  # the parameters themselves stay float32
    assert found["all_gather"] == ["bfloat16"] * 3, found  # w_gate, w_up, w_down
    assert found["reduce_scatter"] == ["bfloat16"] * 3, found
    assert found["all_to_all"] and set(found["all_to_all"]) == {"bfloat16"}, found


# --- checkpoint policies across the shard_map boundary ------------------------------------------

LAYERS, MICROBATCHES = 2, 2
_cp = jax.checkpoint_policies
POLICIES = {
    "nothing_saveable": _cp.nothing_saveable,
    "save_moe": _cp.save_only_these_names(*MOE_TAGS),
    "offload_moe": _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[],
        names_which_can_be_offloaded=list(MOE_TAGS),
        offload_src="device",
        offload_dst="pinned_host",
    ),
}


def _accumulated_grads(policy, compute_dtype, impl="capacity"):
    """Gradient accumulation (a scan over microbatches) of a scan over layers whose checkpointed body
    runs the routed experts: the trainer's structure around the kernel."""
    tokens = 32

    def layer(h, lw_ids):
        lw, ids, weights = lw_ids
        y = routed_experts(
            h.astype(compute_dtype), ids, weights, lw, capacity_factor=float(E), compute_dtype=compute_dtype, impl=impl
        ).y
        return h + y.astype(h.dtype), None

    body = layer if policy is None else jax.checkpoint(layer, policy=policy, prevent_cse=False)

    def loss(w, x, ids, weights):
        h, _ = jax.lax.scan(body, x, (w, ids, weights))
        return jnp.sum(jnp.sin(h))

    def accumulate(w, xs, ids, weights):
        # The routing weights are differentiated too, as the router's are in the model: their
        # gradient reads the expert outputs (moe_mlpwo).
        def micro(total, batch):
            gw, g_routing = jax.grad(loss, argnums=(0, 3))(w, *batch)
            return jax.tree.map(jnp.add, total, gw), g_routing

        zero = jax.tree.map(jnp.zeros_like, w)
        return jax.lax.scan(micro, zero, (xs, ids, weights))

    w = random_experts(17, layers=LAYERS)
    routing = [random_routing(18 + i, tokens) for i in range(LAYERS * MICROBATCHES)]
    ids = jnp.stack([r[0] for r in routing]).reshape(MICROBATCHES, LAYERS, tokens, K)
    weights = jnp.stack([r[1] for r in routing]).reshape(MICROBATCHES, LAYERS, tokens, K)
    xs = jnp.stack([random_x(30 + m, tokens) for m in range(MICROBATCHES)])
    return accumulate, (w, xs, ids, weights)


def _placed(layout, w, xs, ids, weights):
    batch = layout.spec(("batch",))[0]
    specs = jax.tree.map(
        lambda s: PartitionSpec(None, *s), expert_specs(layout, w), is_leaf=lambda s: isinstance(s, PartitionSpec)
    )
    w = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(layout.mesh, s)), w, specs)
    put = lambda a, spec: jax.device_put(a, NamedSharding(layout.mesh, spec))  # noqa: E731
    return (
        w,
        put(xs, PartitionSpec(None, batch, None)),
        put(ids, PartitionSpec(None, None, batch, None)),
        put(weights, PartitionSpec(None, None, batch, None)),
    )


@pytest.mark.parametrize(
    "policy, impl",
    [(p, "capacity") for p in sorted(POLICIES)]
    # The dropless kernel's first round: offloaded in the default tier, saved and recomputed (as the
    # capacity kernel's tags are) in the slow tier.
    + [
        (p, "ragged") if p == "offload_moe" else pytest.param(p, "ragged", marks=pytest.mark.slow)
        for p in sorted(POLICIES)
    ],
)
def test_checkpoint_policies_reach_tags_inside_the_shard_map(policy, impl):
    """The moe tags live inside the EP shard_map body (for the dropless kernel, its first round's);
    the layer's checkpoint policy still decides their fate: recomputed (nothing_saveable), saved
    (save_only_these_names) or offloaded to pinned host (save_and_offload_only_these_names), read back
    from the traced jaxpr. Gradients agree with the un-checkpointed single program."""
    cdt = jnp.float32
    ref_fn, args = _accumulated_grads(None, cdt, impl)
    expected = jax.jit(ref_fn)(*args)
    fn, _ = _accumulated_grads(POLICIES[policy], cdt, impl)
    with zs.activate(ep_mesh(), zs.DEFAULT_RULES) as layout:
        placed = _placed(layout, *args)
        closed = jax.make_jaxpr(fn)(*placed)
        got = jax.jit(fn)(*placed)
        no_policy = jax.make_jaxpr(_accumulated_grads(_cp.everything_saveable, cdt, impl)[0])(*placed)
    for name, g, e in zip(
        ("w_gate", "w_up", "w_down", "routing weights"), jax.tree.leaves(got), jax.tree.leaves(expected)
    ):
        scale = float(jnp.abs(e).max())
        assert scale > 0, name
        # The dropless exchange adds each token's k outputs and each expert's rows in another order
        # than the single program (float32, through two layers of sin and two microbatches, with or
        # without later rounds: up to 8e-6 of the leaf's largest gradient on an AVX-512 Xeon, 5.1e-5 on
        # an AMD Zen 3, whose XLA:CPU kernels sum in another order); capacity's is the same order.
        atol = 1e-5 if impl == "capacity" else 1e-4 * scale
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-5, atol=atol, err_msg=name)

    # Saving every tag (on device or on host) needs no more matmuls than saving everything; recomputing
    # them runs the three expert projections forward once more.
    jaxpr = str(closed)
    matmuls = sum(e.primitive.name == "dot_general" for e in _eqns(closed.jaxpr))  # per use: nested jaxprs print once
    saved_matmuls = sum(e.primitive.name == "dot_general" for e in _eqns(no_policy.jaxpr))
    moves = [
        (str(e.invars[0].aval), str(e.outvars[0].aval)) for e in _eqns(closed.jaxpr) if e.primitive.name == "device_put"
    ]
    to_host = sorted(o.split("{")[0] for i, o in moves if "<host>" in o and "<host>" not in i)
    from_host = [i for i, o in moves if "<host>" in i and "<host>" not in o]
    if policy == "nothing_saveable":
        assert matmuls == saved_matmuls + 3 and not moves
    elif policy == "save_moe":
        assert matmuls == saved_matmuls and not moves
    else:
        assert matmuls == saved_matmuls
        # Inside the shard_map body, each device moves its own tags to host in the forward pass and
        # back in the backward pass ([E/ep, ep*C, .] capacity buffers; the dropless first round's
        # [ep*block, .] rows); the residuals leave the body in host memory.
        ep, local_tokens = EP_MESH.expert, 32 // EP_MESH.data_parallel
        if impl == "capacity":
            rows = ep * expert_capacity(local_tokens, K, E, float(E))
            lead, stacked = f"{E // ep},{rows}", f"{EP_MESH.data_parallel * E // ep},{rows}"
        else:
            rows = ep * round_block(local_tokens, K, ep, E // ep, 1.25)
            lead, stacked = f"{rows}", f"{EP_MESH.data_parallel * rows}"
        assert to_host == sorted([f"float32<host>[{lead},{I}]"] * 2 + [f"float32<host>[{lead},{D}]"]), moves
        assert len(from_host) == len(to_host), moves
        assert f"f32<host>[{LAYERS},{stacked},{I}]" in jaxpr  # stacked by the layer scan


# --- refusals ---------------------------------------------------------------------------------


def test_expert_count_not_divisible_by_the_expert_axis_is_refused_at_trace_time():
    tokens = 16
    w = random_experts(43, n_experts=6)
    ids, weights = random_routing(44, tokens, n_experts=6)
    with zs.activate(ep_mesh(), zs.DEFAULT_RULES):
        with pytest.raises(ValueError, match=r"^model\.moe\.n_routed_experts: 6 experts cannot be split over expert=4"):
            jax.eval_shape(lambda: routed_experts(random_x(45, tokens), ids, weights, w))


@pytest.mark.parametrize(
    "kwargs,key",
    [
        (dict(n_experts=0, ep=4, batch_size=8, batch_ways=8), "mesh.expert"),
        (dict(n_experts=6, ep=4, batch_size=8, batch_ways=8), "model.moe.n_routed_experts"),
        (dict(n_experts=8, ep=4, batch_size=12, batch_ways=8), "data.batch_size"),
        (dict(n_experts=8, ep=4, batch_size=16, batch_ways=8, grad_accum=4), "data.batch_size"),
        (dict(n_experts=8, ep=4, batch_size=8, batch_ways=2, batch_includes_expert=False), "mesh.rules.batch"),
    ],
)
def test_check_expert_parallel_names_the_key(kwargs, key):
    with pytest.raises(ValueError) as err:
        check_expert_parallel(**kwargs)
    msg = str(err.value)
    assert msg.startswith(key + ":") and "\n" not in msg, msg


def test_check_expert_parallel_accepts_good_configs():
    check_expert_parallel(256, 8, 64, 64)
    check_expert_parallel(8, 4, 16, 8, grad_accum=2)
    check_expert_parallel(0, 1, 3, 1)  # dense model, no expert axis
    check_expert_parallel(8, 4, 8, 8)  # either kernel: both run under expert parallelism


def _all_to_alls(text: str) -> list[tuple[int, ...]]:
    """The operand shape of each all_to_all of a lowered StableHLO module (rank > 1: the row exchanges)."""
    found = []
    for line in text.splitlines():
        if "all_to_all" in line and " : (" in line:
            shape = re.findall(r"tensor<([\dx]+)x[a-z]+\d*>", line.split(" : (", 1)[1])[0]
            found.append(tuple(map(int, shape.split("x"))))
    return [s for s in found if len(s) > 1]


@pytest.mark.parametrize(
    "factor, tokens",
    [
        (0.05, 64),
        pytest.param(1.0, 64, marks=pytest.mark.slow),
        (1.0, 256),
        pytest.param(100.0, 64, marks=pytest.mark.slow),
    ],
    ids=["many_rounds", "about_one_round", "later_blocks_of_several_rows", "one_worst_case_round"],
)  # the two slow ones: what the default tier's EP runs take (tests/test_train_sharding.py, balanced: one round)
def test_dropless_rounds_match_the_single_program(factor, tokens):
    """The dropless exchange in rounds (zoo.nn.expert_rounds) on crowded experts: a block of one row
    (dozens of rounds), about the mean, later rounds of 4-row blocks after a 16-row first, or the
    worst case (one round always). Every assignment must arrive, so outputs and gradients equal the
    single program's, whatever the rounds."""
    w = random_experts(26, biases=True)
    ids, weights = random_routing(27, tokens, skew=1.5)
    x, cot = random_x(28, tokens), random_x(29, tokens)
    kw = dict(activation=clamped_swiglu, impl="ragged", exchange_factor=factor)
    ref_out = routed_experts(x, ids, weights, w, **kw)
    ref_grads = jax.grad(loss_fn(cot, **kw), argnums=GRAD_ARGS)(x, weights, w, ids)
    with zs.activate(ep_mesh(EP_MESH), zs.DEFAULT_RULES) as layout:
        px, pids, pweights, pw = place(layout, x, ids, weights, w)
        out = jax.jit(lambda x, weights, w, ids: routed_experts(x, ids, weights, w, **kw))(px, pweights, pw, pids)
        grads = jax.jit(jax.grad(loss_fn(cot, **kw), argnums=GRAD_ARGS))(px, pweights, pw, pids)
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(ref_out[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(out[1]), np.asarray(ref_out[1]))
    assert int(out[2]) == 0
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert float(jnp.abs(r).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("factor, tokens", [pytest.param(0.05, 64, marks=pytest.mark.slow), (1.0, 256)])
def test_exchange_rounds_are_what_the_fullest_device_and_shard_needs(factor, tokens):
    """`exchange_rounds`: one round of `round_block` rows, then rounds of `later_block` rows until the
    fullest (device, shard) pair of the whole mesh has sent everything; 1 without expert parallelism."""
    w = random_experts(34)
    ids, weights = random_routing(35, tokens, skew=1.5)
    x = random_x(36, tokens)
    kw = dict(impl="ragged", exchange_factor=factor)
    assert int(routed_experts(x, ids, weights, w, **kw).exchange_rounds) == 1
    with zs.activate(ep_mesh(EP_MESH), zs.DEFAULT_RULES) as layout:
        px, pids, pweights, pw = place(layout, x, ids, weights, w)
        got = jax.jit(lambda x, weights, w, ids: routed_experts(x, ids, weights, w, **kw))(px, pweights, pw, pids)
    ep, devices = EP_MESH.expert, EP_MESH.data_parallel
    local = tokens // devices
    fullest = max(
        int(np.sum(np.asarray(ids)[d * local : (d + 1) * local] // (E // ep) == s))
        for d in range(devices)
        for s in range(ep)
    )
    block = round_block(local, K, ep, E // ep, factor)
    expected = 1 + -(-max(0, fullest - block) // later_block(block))
    assert expected > 1  # the routing overflows the first block
    assert int(got.exchange_rounds) == expected


def test_dropless_rounds_in_bfloat16_match_the_single_program():
    """bf16 compute, several rounds: the rounds accumulate outputs and cotangents in float32, so they
    agree with the single program's bf16 kernel to bf16 rounding, and hand back each input's dtype."""
    tokens = 64
    w = random_experts(30)
    ids, weights = random_routing(31, tokens, skew=1.0)
    x, cot = random_x(32, tokens, jnp.bfloat16), random_x(33, tokens)
    kw = dict(impl="ragged", exchange_factor=0.3, compute_dtype=jnp.bfloat16)
    ref_out = routed_experts(x, ids, weights, w, **kw)[0]
    ref_grads = jax.grad(loss_fn(cot, **kw), argnums=GRAD_ARGS)(x, weights, w, ids)
    with zs.activate(ep_mesh(EP_MESH), zs.DEFAULT_RULES) as layout:
        px, pids, pweights, pw = place(layout, x, ids, weights, w)
        out = jax.jit(lambda x, weights, w, ids: routed_experts(x, ids, weights, w, **kw))(px, pweights, pw, pids)[0]
        grads = jax.jit(jax.grad(loss_fn(cot, **kw), argnums=GRAD_ARGS))(px, pweights, pw, pids)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref_out, np.float32), rtol=2e-2, atol=2e-2)
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert g.dtype == r.dtype
        scale = float(jnp.abs(r.astype(jnp.float32)).max())
        assert scale > 0
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(r, np.float32), rtol=0, atol=2e-2 * scale)


def test_dropless_exchange_sends_fixed_blocks_of_the_mean_on_every_platform():
    """Lowered for cuda and for cpu (no GPU needed), the dropless expert-parallel step exchanges
    blocks of `exchange_factor` x the mean rows per (device, shard): `ep * block` rows per exchange,
    within 1.25x of the device's assignments plus rounding, never the worst-case receiving buffer
    (`ep * tokens * min(k, E/ep)` rows, what a one-shot dropless exchange must land in)."""
    from zoo.nn.expert_rounds import round_block

    tokens, ep = 256, EP_MESH.expert
    w = random_experts(6, biases=True)
    ids, weights = random_routing(7, tokens, skew=0.8)
    x, cot = random_x(8, tokens), random_x(9, tokens)
    kw = dict(activation=clamped_swiglu, impl="ragged")
    with zs.activate(ep_mesh(EP_MESH), zs.DEFAULT_RULES) as layout:
        step = jax.jit(jax.value_and_grad(loss_fn(cot, **kw), argnums=GRAD_ARGS))
        args = place(layout, x, ids, weights, w)
        traced = step.trace(args[0], args[2], args[3], args[1])
        lowered = {p: traced.lower(lowering_platforms=(p,)).as_text() for p in ("cuda", "cpu")}
    local_tokens = tokens // (EP_MESH.fsdp * EP_MESH.expert)
    block = round_block(local_tokens, K, ep, E // ep, 1.25)
    assert ep * block <= math.ceil(1.25 * local_tokens * K) + ep
    rows = (ep, block, D)
    for platform, text in lowered.items():
        assert "ragged_all_to_all" not in text, platform
        # The per-expert counts. The first round: rows there and back, and their transposes. The later
        # rounds' loop: rows there and back; its backward: inputs, output cotangents and routing weights
        # there, input cotangents and weight cotangents back.
        small = later_block(block)  # the later rounds' blocks: a quarter of the first's
        first, later = [rows] * 4, [(ep, small, D)] * 5 + [(ep, small)] * 2
        assert sorted(_all_to_alls(text)) == sorted([(ep, E // ep)] + first + later), (platform, _all_to_alls(text))


def test_auto_never_drops_on_any_mesh():
    """`auto` is the dropless kernel on one program and under expert parallelism alike: tight routing
    that a capacity of 1.0 would drop arrives whole."""
    tokens = 128
    w = random_experts(10)
    ids, weights = random_routing(11, tokens, skew=0.5)
    x = random_x(12, tokens)
    kw = dict(impl="auto", capacity_factor=1.0)
    y, _, dropped, _ = routed_experts(x, ids, weights, w, **kw)
    assert int(dropped) == 0
    with zs.activate(ep_mesh(), zs.DEFAULT_RULES) as layout:
        args = place(layout, x, ids, weights, w)
        y_ep, _, dropped, _ = jax.jit(lambda x, ids, weights, w: routed_experts(x, ids, weights, w, **kw))(*args)
        _, _, dropped_capacity, _ = jax.jit(
            lambda x, ids, weights, w: routed_experts(x, ids, weights, w, **{**kw, "impl": "capacity"})
        )(*args)
    assert int(dropped) == 0 and int(dropped_capacity) > 0  # the routing is tight enough to drop
    np.testing.assert_allclose(np.asarray(y_ep), np.asarray(y), rtol=1e-5, atol=1e-5)
