"""Forward-mode AD (jax.jvp, jax.linearize) through every family's model, the chunked loss and the
blockwise attention kernel: the hand-written derivatives (zoo.nn.mlp.dense, zoo.loss's fused loss,
zoo.nn.attention_kernels' flash kernel) are custom JVPs, so forward mode works and reverse mode is
the transpose of the same rule.

Finite differences are float32 here (the model runs in its compute dtype; float64 is not a model
dtype): a central difference over a perturbation of about 3e-5 of each weight's spread (direction
1e-3 x std, step 0.03) agrees with the JVP to ~3e-3 relative on every family (measured), so the
tolerance is 2e-2; a wrong tangent (a missing term, a factor of 2) is off by O(1). The step is kept
that small because a larger one flips the tiny MoE models' top-k routing (a discontinuity of the
function itself, not an error of the JVP); the routing counts at both ends are checked to be equal.
The direction's seed is one at which no family's routing flips: with NumPy's seeds 1 and 3 one
mixtral_tiny_a token sits so near its top-2 boundary that either shift moves it (conftest's LLVM level).
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_attention_kernels import case_inputs
from zoo import families
from zoo.families import SIZES
from zoo.loss import chunked_next_token_loss
from zoo.model import build
from zoo.nn.attention_kernels import attend

from tiers import by_core_family

FAST_COMPILE = {"xla_backend_optimization_level": 0}
TINY = sorted(n for n in SIZES if n.endswith("_tiny_a"))
STEP = 0.03
RTOL = 2e-2


def _rel(a, b) -> float:
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def _direction(params, scale=1e-3, seed=2):
    # In NumPy: drawn with jax.random leaf by leaf, every new shape compiled its own random-normal
    # program (about half a second each on the 2-core machine; the eight family tests in one process:
    # 157 s -> 80 s).
    rng = np.random.default_rng(seed)

    def draw(x):
        x = np.asarray(x)
        return (rng.standard_normal(x.shape) * scale * (x.std() + 1e-3)).astype(x.dtype)

    return jax.tree.map(draw, params)


def test_every_family_has_a_tiny_size():
    assert sorted({SIZES[n].family for n in TINY}) == sorted(families.names()), TINY


@pytest.mark.parametrize("name", by_core_family(TINY))
def test_jvp_through_each_family_matches_finite_differences_and_linearize(name):
    # Blockwise attention (the custom-JVP flash kernel) even at this short length; on CPU `auto`
    # picks it from 256 positions on.
    c = SIZES[name].replace(attention_impl="blockwise")
    if c.moe is not None:
        # The routed experts as the capacity kernel with room for every assignment (the dropless
        # kernel's maths; its grouped matmul's tangents: tests/test_grouped_matmul.py, and under vmap
        # in this file's per-example test), whose compile is a fraction of the tile loops'.
        c = c.replace(moe=dataclasses.replace(c.moe, impl="capacity", capacity_factor=float(c.moe.n_routed_experts)))
    params, static = eqx.partition(build(c, key=jax.random.key(0)), eqx.is_inexact_array)
    v = _direction(params)
    tokens = jax.random.randint(jax.random.key(2), (2, 12), 0, c.vocab_size)

    def logits(p):
        return eqx.combine(p, static)(tokens)

    def derivatives(p, v, u):
        y, tangent = jax.jvp(logits, (p,), (v,))
        linearized = jax.linearize(logits, p)[1](v)
        (g,) = jax.vjp(logits, p)[1](u)
        return y, tangent, linearized, g

    # One compiled program for the three transformations, one for the plain forward (the differences).
    u = jax.random.normal(jax.random.key(3), (2, 12, c.vocab_size))
    y, tangent, linearized, g = jax.jit(derivatives, compiler_options=FAST_COMPILE)(params, v, u)
    forward = jax.jit(lambda p: eqx.combine(p, static).forward_with_aux(tokens), compiler_options=FAST_COMPILE)
    shift = lambda s: jax.tree.map(lambda a, b: np.asarray(a) + np.float32(s) * b, params, v)  # noqa: E731
    (y_plus, aux_plus), (y_minus, aux_minus) = forward(shift(STEP)), forward(shift(-STEP))
    if aux_plus is not None:  # the premise of a finite difference: the same experts at both ends
        np.testing.assert_array_equal(aux_plus.tokens_per_expert, aux_minus.tokens_per_expert)
    fd = (y_plus - y_minus) / (2 * STEP)
    assert float(jnp.linalg.norm(tangent)) > 0
    assert _rel(tangent, fd) < RTOL, (name, _rel(tangent, fd))
    np.testing.assert_allclose(y, forward(params)[0], rtol=1e-5, atol=1e-5)
    assert _rel(linearized, tangent) < 1e-5
    # Forward and reverse mode are one rule: <u, J v> == <J^T u, v>.
    lhs = float((u * tangent).sum())
    rhs = float(sum((np.asarray(a, np.float64) * b).sum() for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(v))))
    assert abs(lhs - rhs) <= 1e-4 * max(abs(lhs), 1.0), (lhs, rhs)


@pytest.mark.parametrize("method", ["fused", "recompute"])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_jvp_through_the_chunked_loss(method, softcap):
    k = jax.random.split(jax.random.key(0), 4)
    h = jax.random.normal(k[0], (2, 11, 16))
    head = jax.random.normal(k[1], (16, 50)) * 0.3
    tokens = jax.random.randint(k[2], (2, 11), 0, 50)
    mask = (jax.random.uniform(k[3], (2, 11)) > 0.3).astype(jnp.float32)
    dh, dhead = jax.random.normal(k[0], h.shape), jax.random.normal(k[1], head.shape)

    def loss(h, head):
        return chunked_next_token_loss(h, head, tokens, mask, chunk_size=4, method=method, final_softcap=softcap)

    val, tangent = jax.jit(lambda *a: jax.jvp(loss, a[:2], a[2:]))(h, head, dh, dhead)
    eps = 1e-2
    fd = (loss(h + eps * dh, head + eps * dhead) - loss(h - eps * dh, head - eps * dhead)) / (2 * eps)
    assert abs(float(tangent - fd)) <= 1e-2 * abs(float(tangent)), (float(tangent), float(fd))
    # The tangent is the gradient's inner product with the direction (reverse mode: the same rule transposed).
    gh, ghead = jax.grad(loss, argnums=(0, 1))(h, head)
    np.testing.assert_allclose(float(tangent), float((gh * dh).sum() + (ghead * dhead).sum()), rtol=1e-5)
    _, f_lin = jax.linearize(loss, h, head)
    np.testing.assert_allclose(float(f_lin(dh, dhead)), float(tangent), rtol=1e-5)
    np.testing.assert_allclose(float(val), float(loss(h, head)), rtol=1e-6)


# "everything" (grouped queries, a window, sinks, segments, blocks that do not divide the sequence) in
# the default tier; its parts one at a time in the slow tier.
@pytest.mark.parametrize(
    "case",
    [pytest.param("gqa", marks=pytest.mark.slow), "everything", pytest.param("non_divisible", marks=pytest.mark.slow)],
)
def test_jvp_of_blockwise_attention_matches_xla_attention(case):
    (q, k, v, sinks), kw, blocks = case_inputs(case)
    primals = (q, k, v) if sinks is None else (q, k, v, sinks)
    keys = jax.random.split(jax.random.key(5), len(primals))
    tangents = tuple(jax.random.normal(key, x.shape, x.dtype) for key, x in zip(keys, primals))

    def f(impl):
        def attention(*a):
            return attend(
                *a[:3],
                scale=0.125,
                impl=impl,
                sinks=a[3] if len(a) > 3 else None,
                block_q=blocks[0],
                block_k=blocks[1],
                **kw,
            )

        return attention

    out_b, t_b = jax.jvp(f("blockwise"), primals, tangents)
    out_x, t_x = jax.jvp(f("xla"), primals, tangents)
    np.testing.assert_allclose(out_b, out_x, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(t_b, t_x, rtol=1e-4, atol=1e-4)
    assert float(jnp.abs(t_x).max()) > 1e-2
    _, f_lin = jax.linearize(f("blockwise"), *primals)
    np.testing.assert_allclose(f_lin(*tangents), t_b, rtol=1e-5, atol=1e-5)


def test_per_example_gradients_with_vmap_through_blockwise_attention_and_the_experts():
    """jax.vmap of jax.grad (per-example gradients) through the two kernels whose reverse mode is a
    linear_call, the blockwise attention and the routed experts' matmul (DeepSeek-V3: MLA and a
    capacity MoE), equals the gradients taken one example at a time."""
    import dataclasses

    c = SIZES["dsv3_tiny_a"].replace(attention_impl="blockwise")
    c = c.replace(moe=dataclasses.replace(c.moe, impl="capacity"))
    params, static = eqx.partition(build(c, key=jax.random.key(0)), eqx.is_inexact_array)
    tokens = jax.random.randint(jax.random.key(2), (3, 1, 12), 0, c.vocab_size)
    u = jax.random.normal(jax.random.key(3), (1, 12, c.vocab_size))

    def grad_of_one(p, tokens):
        return jax.grad(lambda p: (eqx.combine(p, static)(tokens) * u).sum())(p)

    per_example = jax.jit(jax.vmap(grad_of_one, in_axes=(None, 0)), compiler_options=FAST_COMPILE)(params, tokens)
    one = jax.jit(grad_of_one, compiler_options=FAST_COMPILE)
    for i in range(tokens.shape[0]):
        want = one(params, tokens[i])
        got = jax.tree.map(lambda g: g[i], per_example)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # float32 sums in another order
            np.testing.assert_allclose(
                np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5 * max(1.0, float(jnp.abs(w).max()))
            )
    w_gate = [x for x in jax.tree.leaves(per_example) if x.ndim == 5]  # [example, layers, experts, embed, mlp]
    assert w_gate and float(jnp.abs(w_gate[0][0] - w_gate[0][1]).max()) > 0  # the examples differ
