"""DeepSeek-V3 MoE: both kernels against a slow dense reference, the router rules, drops, and FLOPs.

The reference runs every expert on every token and combines them with a dense `[tokens, experts]`
weight matrix that is zero for experts a token did not choose. Its routing is written independently of
zoo.nn.moe.route (sorts and ranks instead of lax.top_k, the rule as transformers' DeepseekV3TopkRouter
states it: group score = sum of the two best biased scores), with experts of unselected groups masked to
-inf as DeepSeek's reference does (transformers writes 0.0, which differs once biased scores go negative).
"""

import dataclasses
import math
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from zoo.config import MoEConfig
from zoo.families import SIZES
from zoo.nn import moe_dispatch
from zoo.nn.moe import MoE, route

D, I = 16, 8  # embed, expert intermediate


# --- helpers -------------------------------------------------------------------------------


def random_moe(c: MoEConfig, seed: int, embed: int = D, router_std: float = 1.0, bias_std: float = 0.05) -> MoE:
    """An MoE with random weights, filled from numpy (no per-shape init compilation)."""
    module = eqx.filter_eval_shape(lambda key: MoE(embed, c, key=key), jax.random.key(0))
    rng = np.random.default_rng(seed)
    leaves, treedef = jax.tree_util.tree_flatten(module)
    filled = [
        jnp.asarray(rng.normal(size=leaf.shape) / math.sqrt(leaf.shape[-2] if leaf.ndim >= 2 else 1), leaf.dtype)
        for leaf in leaves
    ]
    m = jax.tree_util.tree_unflatten(treedef, filled)
    m = eqx.tree_at(
        lambda m: m.router,
        m,
        jnp.asarray(rng.normal(size=(embed, c.n_routed_experts)) * router_std / math.sqrt(embed), jnp.float32),
    )
    return eqx.tree_at(
        lambda m: m.e_score_correction_bias, m, jnp.asarray(rng.normal(size=c.n_routed_experts) * bias_std, jnp.float32)
    )


def moe_config(**kw) -> MoEConfig:
    base = dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=I,
        n_shared_experts=1,
        router="sigmoid_grouped",
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        impl="ragged",
        capacity_factor=8.0,
    )
    base.update(kw)
    return MoEConfig(**base)


def ref_choice(scores, bias, c: MoEConfig):
    """Boolean [tokens, experts]: the experts each token selects (numpy or jax arrays)."""
    biased = scores + jax.lax.stop_gradient(bias)
    tokens, experts = biased.shape
    per_group = experts // c.n_group
    if c.n_group > 1:
        grouped = biased.reshape(tokens, c.n_group, per_group)
        group_score = jnp.sort(grouped, axis=-1)[..., -2:].sum(-1)
        group_rank = jnp.argsort(jnp.argsort(-group_score, axis=-1), axis=-1)  # 0 = best
        keep = jnp.repeat(group_rank < c.topk_group, per_group, axis=-1)
        biased = jnp.where(keep, biased, -jnp.inf)
    expert_rank = jnp.argsort(jnp.argsort(-biased, axis=-1), axis=-1)
    return expert_rank < c.num_experts_per_tok


def ref_combine_weights(x, router, bias, c: MoEConfig, keep=None):
    """Dense [tokens, experts] combine weights; `keep` (bool, same shape) zeroes dropped assignments."""
    scores = jax.nn.sigmoid(x @ router)
    chosen = ref_choice(scores, bias, c)
    w = jnp.where(chosen, scores, 0.0)
    if c.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * c.routed_scaling_factor
    return w if keep is None else jnp.where(keep, w, 0.0)


def ref_moe(m: MoE, x, keep=None):
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    w = ref_combine_weights(flat, m.router, m.e_score_correction_bias, m.config, keep)
    gate = jnp.einsum("nd,edi->eni", flat, m.w_gate)
    up = jnp.einsum("nd,edi->eni", flat, m.w_up)
    every = jnp.einsum("eni,eid->end", jax.nn.silu(gate) * up, m.w_down)  # every expert on every token
    y = jnp.einsum("ne,end->nd", w, every)
    if m.shared is not None:
        s = m.shared
        y = y + (jax.nn.silu(flat @ s.w_gate) * (flat @ s.w_up)) @ s.w_down
    return y.reshape(b, t, d)


def ref_keep(chosen: np.ndarray, capacity: int) -> np.ndarray:
    """Per expert, the first `capacity` tokens (in token order) that chose it are kept."""
    keep = np.zeros_like(chosen)
    used = np.zeros(chosen.shape[1], dtype=int)
    for n in range(chosen.shape[0]):
        for e in np.flatnonzero(chosen[n]):
            if used[e] < capacity:
                keep[n, e] = True
                used[e] += 1
    return keep


def random_x(seed, b=2, t=12, embed=D):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(b, t, embed)), jnp.float32)


# --- kernels against the reference -----------------------------------------------------------

KERNEL_CASES = {
    "ragged": dict(impl="ragged"),
    "capacity": dict(impl="capacity", capacity_factor=8.0),  # capacity = all tokens: nothing drops
    "ragged_no_groups_no_shared": dict(
        impl="ragged", n_group=1, topk_group=1, n_shared_experts=0, num_experts_per_tok=3
    ),
    "capacity_no_norm": dict(impl="capacity", norm_topk_prob=False, routed_scaling_factor=1.0, num_experts_per_tok=3),
}


@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_kernel_matches_dense_reference(case):
    c = moe_config(**KERNEL_CASES[case])
    m = random_moe(c, seed=1)
    x = random_x(2)
    y, aux = jax.jit(lambda m, x: m(x))(m, x)
    expected = ref_moe(m, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=1e-5, atol=1e-5)
    tokens = x.shape[0] * x.shape[1]
    chosen = np.asarray(ref_choice(jax.nn.sigmoid(x.reshape(tokens, D) @ m.router), m.e_score_correction_bias, c))
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), chosen.sum(0))
    assert int(aux.tokens_per_expert.sum()) == tokens * c.num_experts_per_tok
    assert int(aux.dropped) == 0


@pytest.mark.parametrize("impl", ["ragged", "capacity"])
def test_kernel_gradients_match_dense_reference(impl):
    c = moe_config(impl=impl)
    m = random_moe(c, seed=3)
    x = random_x(4)
    cotangent = random_x(5)

    def loss(fn):
        def f(params, x):
            return jnp.sum(fn(params, x) * cotangent)

        return f

    params = (m.router, m.w_gate, m.w_up, m.w_down)

    def with_params(p):
        return eqx.tree_at(lambda m: (m.router, m.w_gate, m.w_up, m.w_down), m, p)

    got = jax.jit(jax.grad(loss(lambda p, x: with_params(p)(x)[0]), argnums=(0, 1)))(params, x)
    expected = jax.jit(jax.grad(loss(lambda p, x: ref_moe(with_params(p), x)), argnums=(0, 1)))(params, x)
    for name, g, e in zip(("router", "w_gate", "w_up", "w_down", "x"), (*got[0], got[1]), (*expected[0], expected[1])):
        assert float(jnp.abs(e).max()) > 0, name
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=1e-5, err_msg=name)


def test_correction_bias_gets_zero_gradient():
    c = moe_config()
    m = random_moe(c, seed=6, bias_std=0.3)
    x = random_x(7)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m, x: jnp.sum(m(x)[0] ** 2)))(m, x)
    assert np.all(np.asarray(grads.e_score_correction_bias) == 0)
    assert float(jnp.abs(grads.router).max()) > 0


# --- the router on crafted scores -----------------------------------------------------------


def _logit(p):
    p = np.asarray(p, np.float64)
    return np.log(p / (1 - p))


def route_scores(scores, bias, c: MoEConfig):
    """route() with the router chosen so that sigmoid(logits) == scores (tokens = identity rows)."""
    scores = np.atleast_2d(scores)
    tokens, experts = scores.shape
    x = jnp.eye(tokens, dtype=jnp.float32)
    ids, weights = route(x, jnp.asarray(_logit(scores), jnp.float32), jnp.asarray(bias, jnp.float32), c)
    return np.asarray(ids), np.asarray(weights)


def test_group_limited_selection_on_crafted_scores():
    c = moe_config(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3)
    # groups (sum of best two): g0 = .99 + .01 = 1.00, g1 = 1.20, g2 = 1.10, g3 = 0.60
    scores = [0.99, 0.01, 0.60, 0.60, 0.56, 0.54, 0.30, 0.30]
    ids, _ = route_scores(scores, np.zeros(8), c)
    assert set(ids[0]) == {2, 3, 4}  # expert 0 has the best score but its group loses
    # the same scores without group limiting pick expert 0
    ids_flat, _ = route_scores(scores, np.zeros(8), moe_config(n_group=1, topk_group=1, num_experts_per_tok=3))
    assert 0 in set(ids_flat[0])


def test_experts_outside_the_best_groups_are_never_chosen():
    c = moe_config(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    rng = np.random.default_rng(8)
    scores = rng.uniform(0.05, 0.95, size=(64, 16))
    bias = rng.uniform(-1.5, 0.2, size=16)  # mostly negative: masked experts must still never win
    ids, _ = route_scores(scores, bias, c)
    grouped = (scores + bias).reshape(64, 4, 4)
    group_score = np.sort(grouped, axis=-1)[..., -2:].sum(-1)
    best_groups = np.argsort(-group_score, axis=-1)[:, :2]
    for n in range(64):
        assert set(ids[n] // 4) <= set(best_groups[n]), n
        assert len(set(ids[n])) == 4


def test_negative_biases_never_route_outside_the_selected_groups():
    # The case where transformers' 0.0 mask goes wrong: every kept expert's biased score is below 0,
    # so 0.0-masked experts of the losing group would outrank them. DeepSeek's reference masks to -inf.
    c = moe_config(n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2)
    ids, _ = route_scores([0.95, 0.5, 0.5, 0.5], [-1.5, -1.5, -2.0, -2.0], c)
    assert set(ids[0]) == {0, 1}  # group 0 wins (-0.55 - 1.0 > -1.5 - 1.5); its two experts are chosen


def test_bias_changes_selection_not_weights():
    c = moe_config(
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
    )
    scores = [0.9, 0.8, 0.7, 0.2]
    ids, weights = route_scores(scores, [0.0, 0.0, 0.0, 0.0], c)
    assert dict(zip(ids[0], weights[0])) == pytest.approx({0: 0.9 * 2.5, 1: 0.8 * 2.5})
    ids, weights = route_scores(scores, [0.0, 0.0, 0.0, 0.8], c)
    # expert 3 is selected through its bias, but weighted by its unbiased score
    assert dict(zip(ids[0], weights[0])) == pytest.approx({0: 0.9 * 2.5, 3: 0.2 * 2.5})


def test_norm_topk_prob_and_routed_scaling_factor():
    scores = [0.9, 0.8, 0.7, 0.2]
    bias = [0.0, 0.0, 0.0, 0.8]
    base = dict(n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)
    ids, w = route_scores(scores, bias, moe_config(norm_topk_prob=True, routed_scaling_factor=2.5, **base))
    assert dict(zip(ids[0], w[0])) == pytest.approx({0: 0.9 / 1.1 * 2.5, 3: 0.2 / 1.1 * 2.5})
    assert w.sum() == pytest.approx(2.5)
    _, w1 = route_scores(scores, bias, moe_config(norm_topk_prob=True, routed_scaling_factor=1.0, **base))
    np.testing.assert_allclose(w, 2.5 * w1, rtol=1e-6)


# --- the capacity path with drops -----------------------------------------------------------


@pytest.mark.parametrize("capacity_factor", [0.7, 1.1])  # capacities ceil(5.6) and ceil(8.8)
def test_capacity_drops_match_independent_count(capacity_factor):
    c = moe_config(impl="capacity", capacity_factor=capacity_factor, n_group=1, topk_group=1)
    # a wide router and a strong bias on expert 0 make the load uneven, so some experts overflow
    m = random_moe(c, seed=9, router_std=3.0)
    m = eqx.tree_at(lambda m: m.e_score_correction_bias, m, jnp.asarray([0.6] + [0.0] * 7, jnp.float32))
    x = random_x(10, b=2, t=16)
    tokens = 32
    y, aux = jax.jit(lambda m, x: m(x))(m, x)

    chosen = np.asarray(ref_choice(jax.nn.sigmoid(x.reshape(tokens, D) @ m.router), m.e_score_correction_bias, c))
    counts = chosen.sum(0)
    capacity = math.ceil(tokens * c.num_experts_per_tok / c.n_routed_experts * capacity_factor)
    expected_dropped = int(np.maximum(counts - capacity, 0).sum())
    assert expected_dropped > 0  # the case really drops
    assert int(aux.dropped) == expected_dropped
    np.testing.assert_array_equal(np.asarray(aux.tokens_per_expert), counts)  # counted before the drop
    assert int(aux.tokens_per_expert.sum()) == tokens * c.num_experts_per_tok

    keep = ref_keep(chosen, capacity)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref_moe(m, x, keep=jnp.asarray(keep))), rtol=1e-5, atol=1e-5)
    # and the dropped assignments did matter: without dropping the output differs
    assert not np.allclose(np.asarray(y), np.asarray(ref_moe(m, x)), atol=1e-3)


# --- compiled cost --------------------------------------------------------------------------


def compiled_flops(experts: int, impl: str, tokens=256, embed=64, inter=256, top_k=2) -> float:
    c = MoEConfig(
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=inter,
        n_shared_experts=0,
        n_group=1,
        topk_group=1,
        impl=impl,
        capacity_factor=1.25,
    )
    m = eqx.filter_eval_shape(lambda key: MoE(embed, c, key=key), jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, tokens, embed), jnp.float32)
    cost = jax.jit(lambda m, x: m(x)[0]).lower(m, x).compile().cost_analysis()
    return float(cost["flops"])


def test_capacity_flops_do_not_grow_with_experts():
    # expert matmuls (6 * tokens * top_k * capacity_factor * embed * inter ~ 63 MFLOP) dominate the router
    # (2 * tokens * embed * experts <= 2 MFLOP)
    f8, f64 = compiled_flops(8, "capacity"), compiled_flops(64, "capacity")
    expert_matmuls = 6 * 256 * 2 * 1.25 * 64 * 256
    assert f8 > 0.9 * expert_matmuls
    assert abs(f64 - f8) / f8 < 0.10, (f8, f64)


def test_dropless_memory_does_not_grow_with_experts_as_ragged_dot_does():
    # lax.ragged_dot, which XLA lowers dense over all experts, is what zoo.nn.grouped_matmul replaces in
    # the dropless path. (Its loop's FLOPs are not in cost_analysis, which counts a loop body once.)
    def temp_bytes(experts, matmul):
        m = eqx.filter_eval_shape(
            lambda key: MoE(
                64,
                MoEConfig(
                    n_routed_experts=experts,
                    num_experts_per_tok=2,
                    moe_intermediate_size=256,
                    n_shared_experts=0,
                    n_group=1,
                    topk_group=1,
                    impl="ragged",
                ),
                key=key,
            ),
            jax.random.key(0),
        )
        x = jax.ShapeDtypeStruct((1, 256, 64), jnp.float32)
        with mock.patch.object(moe_dispatch, "grouped_matmul", matmul):
            return jax.jit(lambda m, x: m(x)[0]).lower(m, x).compile().memory_analysis().temp_size_in_bytes

    def dense(h, w, group_sizes, tile, impl):
        return jax.lax.ragged_dot(h, w, group_sizes)

    tiled = moe_dispatch.grouped_matmul
    assert temp_bytes(64, dense) > 4 * temp_bytes(8, dense)  # the premise
    assert temp_bytes(64, tiled) < 1.25 * temp_bytes(8, tiled), (temp_bytes(8, tiled), temp_bytes(64, tiled))


# --- against transformers' routing (tests/data) ----------------------------------------------


@pytest.mark.parametrize("layer", [1, 2])
def test_route_matches_transformers_reference(layer, ref_dir):
    c = SIZES["dsv3_tiny_a"].moe
    extras = np.load(ref_dir("dsv3_tiny_a") / "extras.npz")
    bias = load_file(ref_dir("dsv3_tiny_a") / "model.safetensors")[
        f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
    ]
    logits = extras[f"layer_{layer}_router_logits"]  # [tokens, experts], before the sigmoid
    # identity tokens turn the router matrix into the logits themselves
    ids, weights = route(jnp.eye(len(logits), dtype=jnp.float32), jnp.asarray(logits), jnp.asarray(bias), c)
    ids, weights = np.asarray(ids), np.asarray(weights)
    order = np.argsort(ids, axis=-1)  # the reference lists each token's experts by id
    np.testing.assert_array_equal(np.take_along_axis(ids, order, -1), extras[f"layer_{layer}_topk_idx"])
    np.testing.assert_allclose(
        np.take_along_axis(weights, order, -1), extras[f"layer_{layer}_topk_weight"], rtol=1e-5, atol=1e-6
    )


# --- at DeepSeek-V3 671B's shapes, and the router's numerics -----------------------------------


def test_a_671b_shaped_moe_layer_costs_about_its_top8_flops():
    """`cost_analysis` of one DeepSeek-V3 671B MoE layer (D 7168, I 2048, 256 experts, top-8, one
    shared expert, bf16 compute) under the capacity kernel: within 1.5x of the top-8 routed
    experts' useful FLOPs (capacity buffers at 1.25x plus the shared expert and the router stay
    under it). (The default, dropless, runs its matmuls in a loop, whose body cost_analysis counts
    once: test_dropless_memory_does_not_grow_with_experts_as_ragged_dot_does.) Abstract weights:
    nothing allocated."""
    c = SIZES["deepseek_v3_671b"]
    assert c.moe.impl == "auto"
    moe = dataclasses.replace(c.moe, impl="capacity")
    m = eqx.filter_eval_shape(
        lambda key: MoE(c.hidden_size, moe, param_dtype="float32", compute_dtype="bfloat16", key=key), jax.random.key(0)
    )
    assert m.impl == "capacity"
    tokens = 1024
    x = jax.ShapeDtypeStruct((1, tokens, c.hidden_size), jnp.bfloat16)
    flops = float(jax.jit(lambda m, x: m(x)[0]).lower(m, x).compile().cost_analysis()["flops"])
    per_expert_token = 2 * 3 * c.hidden_size * c.moe.moe_intermediate_size  # gate, up, down
    top8 = tokens * c.moe.num_experts_per_tok * per_expert_token
    shared = tokens * c.moe.n_shared_experts * per_expert_token
    assert top8 + shared <= flops <= 1.5 * top8, flops / top8


def test_router_matmul_runs_in_float32_at_highest_precision():
    """With bf16 compute and bf16 weights, the [tokens, experts] router logits are one float32
    matmul at precision HIGHEST (a TF32 or bf16 router can choose other experts than the reference)."""
    from jax.extend import core

    c = moe_config(impl="capacity", n_routed_experts=12)  # no other matmul of the layer is [10, 12]
    m = eqx.filter_eval_shape(
        lambda key: MoE(D, c, param_dtype="bfloat16", compute_dtype="bfloat16", key=key), jax.random.key(0)
    )
    x = jax.ShapeDtypeStruct((1, 10, D), jnp.bfloat16)
    closed = jax.make_jaxpr(lambda m, x: m(x)[0])(m, x)

    def walk(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "dot_general":
                yield eqn
            for sub in core.jaxprs_in_params(eqn.params):
                yield from walk(getattr(sub, "jaxpr", sub))

    routers = [e for e in walk(closed.jaxpr) if e.outvars[0].aval.shape == (10, c.n_routed_experts)]
    assert len(routers) == 1, routers
    eqn = routers[0]
    assert {str(v.aval.dtype) for v in eqn.invars} == {"float32"} and str(eqn.outvars[0].aval.dtype) == "float32"
    assert eqn.params["precision"] == (jax.lax.Precision.HIGHEST, jax.lax.Precision.HIGHEST), eqn.params["precision"]


def test_correction_bias_stays_float32_whatever_the_load_dtype(ref_dir):
    """The bias moves by 1e-3 per step: bf16 would swallow that. Built and loaded in bf16, it is
    still float32 while the router and experts take the parameter dtype."""
    from zoo.hf import from_pretrained

    built = MoE(D, moe_config(), param_dtype="bfloat16", key=jax.random.key(0))
    assert built.e_score_correction_bias.dtype == jnp.float32 and built.router.dtype == jnp.bfloat16
    model = from_pretrained(ref_dir("dsv3_tiny_a"), dtype="bfloat16")
    ffn = model.stack("moe_layers").layers[0].ffn
    assert ffn.e_score_correction_bias.dtype == jnp.float32
    assert ffn.router.dtype == jnp.bfloat16 and ffn.w_gate.dtype == jnp.bfloat16
    file_bias = load_file(ref_dir("dsv3_tiny_a") / "model.safetensors")[
        "model.layers.1.mlp.gate.e_score_correction_bias"
    ]
    np.testing.assert_array_equal(np.asarray(ffn.e_score_correction_bias)[0], file_bias.astype(np.float32))


# --- GPT-OSS's clamped SwiGLU: the clamp's derivative at and beyond the limit ------------------


def _clamped_swiglu(limit: float, alpha: float):
    from zoo.nn.moe import expert_activation

    return expert_activation(MoEConfig(activation="clamped_swiglu", swiglu_limit=limit, swiglu_alpha=alpha))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["plain", "gated"])
def test_clamped_swiglu_derivative_at_the_limit_is_torchs(dtype, path):
    """torch.clamp passes the gradient where x <= limit, the limit included (and x >= -limit for up), and
    none beyond; jnp.minimum / jnp.clip pass half of it at a tie. bfloat16 values sit on the limit often,
    so a tie must give the derivative of the unclamped function there, in reverse and forward mode."""
    from functools import partial

    from zoo.nn.mlp import gated

    limit, alpha = 0.75, 1.702
    fn = _clamped_swiglu(limit, alpha)
    f = partial(gated, fn) if path == "gated" else fn
    # gate: below, on and beyond the one-sided limit, on -limit and below it (not clamped there)
    g = np.array([0.5, limit, limit, 1.0, -limit, -1.0])
    u = np.array([0.25, 0.25, limit, -limit, -1.0, 1.0])
    gate, up = jnp.asarray(g, dtype), jnp.asarray(u, dtype)  # all exact in bfloat16

    @jax.jit
    def derivatives(gate, up):
        d_gate, d_up = jax.grad(lambda g, u: f(g, u).astype(jnp.float32).sum(), (0, 1))(gate, up)
        forward = jax.jvp(f, (gate, up), (jnp.ones_like(gate), jnp.ones_like(up)))[1]
        return d_gate, d_up, forward

    d_gate, d_up, forward = (np.asarray(a, np.float64) for a in derivatives(gate, up))
    s = 1 / (1 + np.exp(-alpha * g))
    want_gate = np.where(g <= limit, (np.clip(u, -limit, limit) + 1) * (s + alpha * g * s * (1 - s)), 0.0)
    gc = np.minimum(g, limit)
    want_up = np.where(np.abs(u) <= limit, gc / (1 + np.exp(-alpha * gc)), 0.0)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == "float32" else dict(rtol=2e-2, atol=1e-2)
    np.testing.assert_allclose(d_gate, want_gate, **tol)
    np.testing.assert_allclose(d_up, want_up, **tol)
    np.testing.assert_allclose(forward, want_gate + want_up, **tol)
    assert d_gate[1] != 0 and d_gate[2] != 0 and d_up[2] != 0 and d_up[3] != 0  # the ties pass the gradient
    assert d_gate[3] == 0 and d_up[4] == 0 and d_up[5] == 0  # beyond the limit: none


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_clamped_swiglu_gradient_matches_torch(dtype):
    """The same activation and gradient as transformers' GptOssExperts._apply_gate, on values a third of
    which sit exactly on +-limit (skipped where torch is not installed: the `hf` extra)."""
    torch = pytest.importorskip("torch")
    from zoo.nn.mlp import gated

    limit, alpha = 0.75, 1.702
    rng = np.random.default_rng(0)
    values = rng.normal(size=(2, 64, 16)).astype(np.float32)
    values = np.where(rng.random(values.shape) < 1 / 3, np.sign(values) * limit, values)
    tdt = dict(float32=torch.float32, bfloat16=torch.bfloat16)[dtype]
    gate_t, up_t = (torch.tensor(v).to(tdt).requires_grad_() for v in values)
    g = gate_t.clamp(min=None, max=limit)
    u = up_t.clamp(min=-limit, max=limit)
    out_t = (u + 1) * (g * torch.sigmoid(g * alpha))
    out_t.float().sum().backward()

    fn = _clamped_swiglu(limit, alpha)
    step = jax.jit(jax.value_and_grad(lambda g, u: gated(fn, g, u).astype(jnp.float32).sum(), (0, 1)))
    _, grads = step(*(jnp.asarray(v, dtype) for v in values))
    out = jax.jit(fn)(*(jnp.asarray(v, dtype) for v in values))
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == "float32" else dict(rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), out_t.detach().float().numpy(), **tol)
    for ours, theirs in zip(grads, (gate_t.grad, up_t.grad)):
        np.testing.assert_allclose(np.asarray(ours, np.float32), theirs.float().numpy(), **tol)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral", "gpt_oss"])
def test_capacity_on_a_family_trained_dropless_is_a_note(family):
    from zoo.train.run import dropless_note as capacity_note

    note = capacity_note(family, "capacity")
    assert note.startswith(f"model.moe.impl=capacity: {family} is trained dropless;") and "\n" not in note
    assert capacity_note(family, "ragged") is None
    assert capacity_note(family, "auto") is None  # the default is dropless


def test_startup_names_the_exchange_rounds_and_the_capacity_note():
    """train.py's startup lines, from the validated config (nothing compiled): `auto` is dropless on
    every mesh; under expert parallelism the kernels line gives the exchange's round block
    (zoo.nn.expert_rounds.round_block of this device's tokens), and an explicit capacity kernel on
    DeepSeek-V3 gets the note."""
    from zoo.nn.expert_rounds import round_block
    from zoo.nn.moe import resolve_moe_impl
    from zoo.tools.kit import compose
    from zoo.train.run import dropless_note, kernels_line, prepare

    assert resolve_moe_impl("auto") == "ragged" and resolve_moe_impl("capacity") == "capacity"

    def startup(*overrides):
        c, plan, _, _ = prepare(
            compose(["model=dsv3_tiny_a", "mesh=fsdp_ep", "data.batch_size=8", "data.seq_len=16", *overrides])
        )
        return c, plan

    c, plan = startup()
    ep = plan.mesh.sizes["expert"]
    assert ep > 1 and plan.moe_impl == "ragged"
    m = c.model.moe
    tokens = 8 // (ep * plan.mesh.sizes["fsdp"]) * 16
    block = round_block(tokens, m.num_experts_per_tok, ep, m.n_routed_experts // ep, 1.25)
    assert (
        f"routed experts ragged (model.moe.impl=auto), exchanged over the expert axis in rounds of {block} rows "
        "per device and shard (model.moe.exchange_factor=1.25),"
    ) in kernels_line(c, plan)
    assert dropless_note(c.model.family, m.impl) is None
    c, plan = startup("model.moe.exchange_factor=0.5")
    assert (
        f"in rounds of {round_block(tokens, m.num_experts_per_tok, ep, m.n_routed_experts // ep, 0.5)} rows"
        in kernels_line(c, plan)
    )
    c, plan = startup("model.moe.impl=capacity")
    assert "routed experts capacity (model.moe.impl=capacity)," in kernels_line(c, plan)
    assert dropless_note(c.model.family, c.model.moe.impl).startswith(
        "model.moe.impl=capacity: deepseek_v3 is trained dropless;"
    )
    c, plan = startup("mesh=fsdp")
    assert plan.moe_impl == "ragged" and "rounds" not in kernels_line(c, plan)


def test_the_run_builds_its_model_with_the_resolved_kernel():
    """model.moe.impl is resolved once, by validation (Plan.moe_impl), and the Trainer builds every MoE
    layer with the result; the config as given keeps `auto`, which the startup line names."""
    from zoo.nn.moe import MoE
    from zoo.tools.kit import compose
    from zoo.train.run import kernels_line, prepare
    from zoo.train.run_config import as_built
    from zoo.train.step import Trainer

    c, plan, devices, _ = prepare(compose(["model=dsv3_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16"]))
    assert c.model.moe.impl == "auto" and plan.moe_impl == "ragged"
    assert as_built(c, plan).model.moe.impl == "ragged" and "(model.moe.impl=auto)" in kernels_line(c, plan)
    trainer = Trainer(c, plan, devices)
    moe_layers = [
        m for m in jax.tree.leaves(trainer.static, is_leaf=lambda x: isinstance(x, MoE)) if isinstance(m, MoE)
    ]
    assert moe_layers and {m.impl for m in moe_layers} == {"ragged"}
