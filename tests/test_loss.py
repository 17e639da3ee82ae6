"""zoo.loss: the chunked head + next-token loss equals next_token_loss of the whole logits (value and
gradients wrt hidden and head), inside larger differentiated programs too, and keeps far less memory."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.loss import chunked_next_token_loss, chunked_next_token_nll
from zoo.model import next_token_loss

BATCH, SEQ, EMBED, VOCAB = 2, 13, 16, 50


def inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.normal(size=(BATCH, SEQ, EMBED)), dtype)
    head = jnp.asarray(rng.normal(size=(EMBED, VOCAB)), dtype)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (BATCH, SEQ)), jnp.float32)
    return hidden, head, tokens, mask


def whole_loss(hidden, head, tokens, mask=None, softcap=None, cdt=None):
    cdt = hidden.dtype if cdt is None else cdt
    logits = jnp.einsum("BTD,DV->BTV", hidden.astype(cdt), head.astype(cdt), preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    return next_token_loss(logits, tokens, mask)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.abs(got - want).max() / np.abs(want).max()


@pytest.mark.parametrize("method", ["fused", "recompute"])
@pytest.mark.parametrize(
    "chunk", [5, 13, 1000]
)  # positions: does not divide 13; exactly one chunk; longer than the sequence
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_matches_the_whole_logits_loss(method, chunk, masked, softcap):
    hidden, head, tokens, mask = inputs()
    mask = mask if masked else None
    want, want_grads = jax.value_and_grad(whole_loss, argnums=(0, 1))(hidden, head, tokens, mask, softcap)
    loss = jax.jit(
        jax.value_and_grad(
            lambda h, w: chunked_next_token_loss(
                h, w, tokens, mask, chunk_size=chunk, final_softcap=softcap, method=method
            ),
            argnums=(0, 1),
        )
    )
    got, got_grads = loss(hidden, head)
    assert rel_err(got, want) <= 1e-6
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and rel_err(g, w) <= 1e-6


def test_inside_a_larger_differentiated_program():
    """Hidden states from a scanned, checkpointed stack, a second loss term, an outer scale: the custom
    VJP must receive and scale the incoming cotangent like plain autodiff."""
    hidden, head, tokens, mask = inputs()
    layers = jnp.asarray(np.random.default_rng(5).normal(size=(3, EMBED, EMBED)) / 4, jnp.float32)

    def program(loss_fn):
        def f(layers, head, hidden):
            h = jax.lax.scan(jax.checkpoint(lambda x, w: (jnp.tanh(x @ w), None)), hidden, layers)[0]
            return 3.0 * loss_fn(h, head) + (h**2).mean()

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))

    want = program(lambda h, w: whole_loss(h, w, tokens, mask, 5.0))(layers, head, hidden)
    got = program(lambda h, w: chunked_next_token_loss(h, w, tokens, mask, chunk_size=5, final_softcap=5.0))(
        layers, head, hidden
    )
    assert rel_err(got[0], want[0]) <= 1e-6
    for g, w in zip(got[1], want[1]):
        assert rel_err(g, w) <= 2e-6


def test_bf16_compute_is_close_to_the_whole_logits_loss():
    hidden, head, tokens, mask = inputs()
    want, want_grads = jax.value_and_grad(whole_loss, argnums=(0, 1))(hidden, head, tokens, mask, None, jnp.bfloat16)
    got, got_grads = jax.value_and_grad(
        lambda h, w: chunked_next_token_loss(h, w, tokens, mask, chunk_size=7, compute_dtype="bfloat16"), argnums=(0, 1)
    )(hidden, head)
    assert got.dtype == jnp.float32 and rel_err(got, want) <= 1e-2
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == jnp.float32 and rel_err(g, w) <= 3e-2


def test_per_token_losses():
    hidden, head, tokens, _ = inputs()
    nll = chunked_next_token_nll(hidden, head, tokens, chunk_size=4)
    logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
    top = logits.max(-1, keepdims=True)
    logz = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    want = logz[:, :-1] - np.take_along_axis(logits[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    assert nll.shape == (BATCH, SEQ - 1)
    np.testing.assert_allclose(np.asarray(nll), want, rtol=1e-5)


def test_the_value_alone_computes_no_gradients():
    """Without differentiation the fused method runs one matmul per chunk (the logits), not three."""
    hidden, head, tokens, _ = inputs()
    jaxpr = jax.make_jaxpr(lambda h, w: chunked_next_token_loss(h, w, tokens, chunk_size=7))(hidden, head)
    grads = jax.make_jaxpr(jax.grad(lambda h, w: chunked_next_token_loss(h, w, tokens, chunk_size=7), argnums=(0, 1)))(
        hidden, head
    )
    assert str(jaxpr).count("dot_general") == 1
    assert str(grads).count("dot_general") == 3


@pytest.mark.parametrize("chunk", [0, -4])
def test_chunk_size_must_be_positive(chunk):
    hidden, head, tokens, _ = inputs()
    with pytest.raises(ValueError, match="loss.chunk_size must be a positive number of positions"):
        chunked_next_token_loss(hidden, head, tokens, chunk_size=chunk)


def test_the_head_gradient_on_cpu_is_a_product_ynnpack_takes():
    """zoo.loss.head_gradient (each chunk's share of the head's gradient): under train.py's XLA:CPU
    default (`xla.cpu_ynn_fusions: dot`) the plain einsum, whose left operand contracts its major
    axis, stays an XLA dot; head_gradient's product over the transposed hidden states goes to
    YNNPACK (a process of its own: XLA flags are fixed when JAX starts). Its value is the product's;
    bfloat16 operands keep the plain einsum."""
    import os
    import pathlib
    import subprocess
    import sys

    from zoo.loss import head_gradient
    from zoo.train.run import YNN_FLAG

    rng = np.random.default_rng(0)
    h, d = rng.normal(size=(64, 32)).astype(np.float32), rng.normal(size=(64, 96)).astype(np.float32)
    assert rel_err(jax.jit(head_gradient)(h, d), h.astype(np.float64).T @ d.astype(np.float64)) <= 1e-6
    # bfloat16 operands keep the plain product (XLA:CPU would write the gradient out in float32 for YNNPACK)
    assert "optimization_barrier" in str(jax.make_jaxpr(head_gradient)(h, d))
    assert "optimization_barrier" not in str(
        jax.make_jaxpr(head_gradient)(h.astype(jnp.bfloat16), d.astype(jnp.bfloat16))
    )

    script = """
import re, jax, jax.numpy as jnp
from zoo.loss import head_gradient
plain = lambda h, d: jnp.einsum("CD,CV->DV", h, d, preferred_element_type=jnp.float32)
for f in (plain, head_gradient):
    entry = jax.jit(f).lower(jnp.ones((64, 32)), jnp.ones((64, 96))).compile().as_text().split("ENTRY", 1)[1]
    print(int(bool(re.search(r"= f32\\[32,96\\]\\S* dot\\(", entry))), int("__ynn_fusion" in entry))
"""
    env = {**os.environ, "XLA_FLAGS": f"{YNN_FLAG}=dot", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=pathlib.Path(__file__).resolve().parents[1],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "0", "0", "1"], (
        out.stdout
    )  # (XLA dot, YNNPACK) for the einsum, then head_gradient


def test_compiled_temporary_memory_is_far_below_the_whole_logits():
    """Llama 3's vocabulary, 2 x 4096 tokens: the whole float32 logits alone are 4 GiB."""
    batch, seq, embed, vocab = 2, 4096, 256, 128256
    args = (
        jax.ShapeDtypeStruct((batch, seq, embed), jnp.float32),
        jax.ShapeDtypeStruct((embed, vocab), jnp.float32),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
    )

    def temp(fn):
        compiled = jax.jit(jax.value_and_grad(fn, argnums=(0, 1))).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    whole = temp(whole_loss)
    chunked = temp(lambda h, w, t: chunked_next_token_loss(h, w, t, chunk_size=512))  # 2 x 512 tokens per chunk
    assert chunked * 4 <= whole, f"temp bytes: chunked {chunked / 2**20:.0f} MiB, whole logits {whole / 2**20:.0f} MiB"


def test_target_weights_drop_segment_starts_and_unmasked_tokens():
    from zoo.loss import target_weights

    seg = np.array([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]])
    mask = np.array([[1, 1, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    want = np.zeros(seg.shape)
    for b in range(2):
        for t in range(1, seg.shape[1]):  # token t is a target when it counts and follows a token of its document
            want[b, t] = float(mask[b, t] == 1 and seg[b, t] == seg[b, t - 1])
    got = target_weights(jnp.asarray(mask), jnp.asarray(seg))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert got.dtype == jnp.float32 and want[0].tolist() == [0, 1, 0, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("method", ["fused", "recompute"])
def test_a_denominator_replaces_the_masks_count(method):
    hidden, head, tokens, mask = inputs(3)
    count = mask[:, 1:].sum()

    @jax.jit
    def both(h, denominator):
        got = jax.value_and_grad(
            lambda h: chunked_next_token_loss(
                h, head, tokens, mask, chunk_size=5, method=method, denominator=denominator
            )
        )(h)
        want = jax.value_and_grad(lambda h: whole_loss(h, head, tokens, mask) * count / denominator)(h)
        return got, want

    for denominator in (1.0, 7.5):
        (value, grad), (want_value, want_grad) = both(hidden, jnp.float32(denominator))
        np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
        assert rel_err(grad, want_grad) < 1e-5


@pytest.mark.parametrize(
    "axes, vocab_rule",
    [
        ({"fsdp": 2, "tensor": 4}, None),
        ({"fsdp": 8}, None),
        ({"fsdp": 2, "expert": 4}, ["expert"]),
        ({"fsdp": 2, "tensor": 2, "expert": 2}, ["tensor", "expert"]),
    ],
)
def test_vocab_parallel_loss_matches_unsharded(axes, vocab_rule):
    # Under a mesh the fused loss is a shard_map: rows split over the batch axes, the head's columns over
    # tensor (the logsumexp and the target logit combined across them), the head gradient summed once.
    # A vocab axis that also splits the rows (expert here) gathers its group's rows chunk by chunk.
    from zoo import sharding as zs

    rng = np.random.default_rng(1)
    batch, vocab = 8, 48  # 48 columns: 12 per tensor shard; the embed dim (16) splits over fsdp
    hidden = jnp.asarray(rng.normal(size=(batch, SEQ, EMBED)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(EMBED, vocab)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, SEQ)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (batch, SEQ)), jnp.float32)

    def f(h, w):
        return chunked_next_token_loss(h, w, tokens, mask, chunk_size=5, final_softcap=3.0)

    want = jax.value_and_grad(f, argnums=(0, 1))(hidden, head)
    rules = {**zs.DEFAULT_RULES, **({"vocab": vocab_rule} if vocab_rule else {})}
    with zs.activate(zs.make_mesh(zs.resolve_mesh_shape(axes, 8)), rules):
        fn = jax.jit(jax.value_and_grad(f, argnums=(0, 1)))
        assert "manual_computation" in fn.lower(hidden, head).as_text()  # the vocabulary-parallel shard_map ran
        got = fn(hidden, head)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "axes, vocab_rule",
    [({"fsdp": 2, "expert": 4}, ["expert"]), ({"fsdp": 2, "tensor": 2, "expert": 2}, ["tensor", "expert"])],
)
def test_vocab_parallel_lookup_matches_take(axes, vocab_rule):
    """Where a vocab axis also splits the batch, the embedding lookup runs split over the vocabulary
    (zoo.loss.vocab_parallel_lookup): the same rows and the same table gradient as jnp.take, and no
    such lookup under the default rules (the partitioner's, as before)."""
    from zoo import sharding as zs
    from zoo.loss import vocab_parallel_lookup

    rng = np.random.default_rng(2)
    vocab, embed, batch = 48, 16, 8
    table = jnp.asarray(rng.normal(size=(vocab, embed)), jnp.float32)
    tokens = (
        jnp.asarray(rng.integers(0, vocab, (batch, SEQ)), jnp.int32).at[0, :3].set(vocab - 1)
    )  # last row of the last shard
    probe = jnp.asarray(rng.normal(size=(batch, SEQ, embed)), jnp.float32)
    want = jax.value_and_grad(lambda t: (jnp.take(t, tokens, axis=0) * probe).sum())(table)
    mesh = zs.make_mesh(zs.resolve_mesh_shape(axes, 8))
    with zs.activate(mesh, {**zs.DEFAULT_RULES, "vocab": vocab_rule}):
        fn = jax.jit(jax.value_and_grad(lambda t: (vocab_parallel_lookup(t, tokens) * probe).sum()))
        got = fn(table)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6)
    with zs.activate(mesh, zs.DEFAULT_RULES):
        assert vocab_parallel_lookup(table, tokens) is None


# Context parallelism (mesh.context_parallel): the sequence split over `ctx`, which leaves the batch rules.
CONTEXT_CASES = [({"fsdp": 4, "data": 2}, "data"), ({"fsdp": 4, "tensor": 2}, "fsdp")]


def _context_rules(ctx):
    from zoo import sharding as zs

    return {
        **zs.DEFAULT_RULES,
        "batch": [a for a in zs.DEFAULT_RULES["batch"] if a != ctx],
        "seq": [ctx],
        zs.CONTEXT: [ctx],
    }


@pytest.mark.parametrize("axes, ctx", CONTEXT_CASES)
def test_context_parallel_loss_works_on_each_devices_chunk(axes, ctx):
    # Each device's sequence chunk becomes rows of its own (zoo.loss._fold_context): the same loss and
    # gradients, and the hidden states never cross devices (chunked as they came, the partitioner
    # all-gathered the whole sequence and every context rank computed the whole loss). 24 positions:
    # local chunks of 12 or 6 against loss chunks of 5, so the last loss chunk is padded.
    from zoo import hlo
    from zoo import sharding as zs

    rng = np.random.default_rng(3)
    batch, seq, vocab = 4, 24, 48
    hidden = jnp.asarray(rng.normal(size=(batch, seq, EMBED)), jnp.float32)
    head = jnp.asarray(rng.normal(size=(EMBED, vocab)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32)
    mask = jnp.asarray(rng.integers(0, 2, (batch, seq)), jnp.float32)

    def f(h, w):
        return chunked_next_token_loss(h, w, tokens, mask, chunk_size=5, final_softcap=3.0)

    want = jax.value_and_grad(f, argnums=(0, 1))(hidden, head)
    with zs.activate(zs.make_mesh(zs.resolve_mesh_shape(axes, 8)), _context_rules(ctx)) as layout:
        h = jax.device_put(hidden, layout.sharding(zs.ACTIVATION_AXES))
        compiled, text = hlo.compile_with_partitioned_hlo(jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(h, head))
        got = compiled(h, head)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5)
    moved = [
        c
        for c in hlo.collectives(text)
        if c.kind in ("all-gather", "all-to-all", "collective-permute") and c.operands[0].dims[-1:] == (EMBED,)
    ]
    assert not moved, [(c.kind, c.operands[0].dims, c.results[0].dims) for c in moved]


@pytest.mark.parametrize("axes, ctx", CONTEXT_CASES)
def test_context_parallel_lookup_keeps_each_devices_tokens(axes, ctx):
    # The embedding lookup under context parallelism (zoo.loss.vocab_parallel_lookup): each device its
    # own chunk of tokens in its own vocabulary rows; the same rows and table gradient as jnp.take
    # (the partitioner's lookup gathered the whole table on every device).
    from zoo import hlo
    from zoo import sharding as zs
    from zoo.loss import vocab_parallel_lookup

    rng = np.random.default_rng(4)
    vocab, batch, seq = 48, 4, 24
    table = jnp.asarray(rng.normal(size=(vocab, EMBED)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq)), jnp.int32).at[0, :3].set(vocab - 1)
    probe = jnp.asarray(rng.normal(size=(batch, seq, EMBED)), jnp.float32)
    want = jax.value_and_grad(lambda t: (jnp.take(t, tokens, axis=0) * probe).sum())(table)
    with zs.activate(zs.make_mesh(zs.resolve_mesh_shape(axes, 8)), _context_rules(ctx)) as layout:
        tok = jax.device_put(tokens, layout.sharding(zs.TOKEN_AXES))
        fn = jax.jit(jax.value_and_grad(lambda t, tok: (vocab_parallel_lookup(t, tok) * probe).sum()))
        compiled, text = hlo.compile_with_partitioned_hlo(fn.lower(table, tok))
        got = compiled(table, tok)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-6)
    # Each device gathers only its own vocabulary rows' embed shards, and their gradient goes back as a
    # reduce-scatter, never an all-reduce of those rows (nor the whole table, where tensor splits it).
    own_rows = (vocab // axes.get("tensor", 1), EMBED)
    found = [(c.kind, c.operands[0].dims, c.results[0].dims) for c in hlo.collectives(text) if not c.trivial]
    assert not [f for f in found if f[2] == (vocab, EMBED) and own_rows != (vocab, EMBED)], found
    assert not [f for f in found if f[0] == "all-reduce" and f[1] == own_rows], found
    assert ("reduce-scatter", own_rows, (own_rows[0], EMBED // axes["fsdp"])) in found, found
