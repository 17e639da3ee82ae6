"""zoo.nn.attention_kernels: the blockwise path against the XLA reference (outputs and gradients),
both against a plain-numpy reference written from the formulas, decoding against a cache, the
choice of implementation, and what blockwise saves (compiled temporary memory, FLOPs under a window).
"""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jex_core

from zoo.nn import attention_kernels as A
from zoo.nn.attention_kernels import attend, resolve_impl, segments_to_packed

SCALE = 0.3


def make(batch=2, q_len=21, kv_len=None, heads=4, kv_heads=2, qk=8, v=8, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    kv_len = q_len if kv_len is None else kv_len
    return (
        jnp.asarray(rng.normal(size=(batch, q_len, heads, qk)), dtype),
        jnp.asarray(rng.normal(size=(batch, kv_len, kv_heads, qk)), dtype),
        jnp.asarray(rng.normal(size=(batch, kv_len, kv_heads, v)), dtype),
    )


def packed_segments(batch, seq, seed=3):
    """Contiguous runs of increasing ids, as packed documents are."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq)), axis=1), jnp.int32)


def sinks_for(heads, seed=4):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(heads,)) * 2, jnp.float32)


# --- plain-numpy reference --------------------------------------------------------------------


def numpy_attention(q, k, v, *, scale, causal=True, window=None, sinks=None, segment_ids=None, kv_segment_ids=None,
                    q_offset=0, kv_valid_len=None):
    """One query and one head at a time, in float64, from the definition."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    offsets = np.broadcast_to(np.asarray(q_offset), (batch,))
    out = np.zeros((batch, q_len, heads, v.shape[-1]))
    for b in range(batch):
        for t in range(q_len):
            pos = offsets[b] + t
            seen = []
            for s in range(kv_len):
                ok = (not causal or s <= pos) and (window is None or s > pos - window)
                ok = ok and (kv_valid_len is None or s < kv_valid_len[b])
                ok = ok and (segment_ids is None or segment_ids[b, t] == kv_segment_ids[b, s])
                if ok:
                    seen.append(s)
            for n in range(heads):
                kh = n // (heads // kv_heads)
                logits = [scale * float(q[b, t, n] @ k[b, s, kh]) for s in seen]
                extra = [] if sinks is None else [float(sinks[n])]
                if not logits and not extra:
                    continue
                top = max(logits + extra)
                weights = [math.exp(x - top) for x in logits]
                denom = sum(weights) + sum(math.exp(x - top) for x in extra)
                for w, s in zip(weights, seen):
                    out[b, t, n] += w / denom * v[b, s, kh]
    return out


# --- blockwise against the XLA reference ---------------------------------------------------------

CASES = {
    # name: (make kwargs, attend kwargs, blocks)
    "gqa": (dict(heads=6, kv_heads=2), {}, (8, 8)),
    "mla_dims": (dict(heads=3, kv_heads=3, qk=24, v=16), {}, (8, 8)),
    "window": (dict(q_len=40), dict(window=9), (8, 8)),
    "window_unaligned": (dict(q_len=37), dict(window=5), (16, 8)),
    "sinks": (dict(), dict(sinks=True), (8, 8)),
    "segments": (dict(q_len=30), dict(segments=True), (8, 16)),
    "not_causal": (dict(), dict(causal=False), (8, 8)),
    "non_divisible": (dict(q_len=19), {}, (7, 5)),
    "block_longer_than_seq": (dict(q_len=11), {}, (64, 64)),
    "everything": (dict(q_len=45, heads=4, kv_heads=1, qk=24, v=16), dict(window=11, sinks=True, segments=True), (16, 8)),
    "offset_chunk": (dict(q_len=12, kv_len=29), dict(q_offset=17), (8, 8)),
}


def case_inputs(name, dtype=jnp.float32):
    make_kw, attend_kw, blocks = CASES[name]
    q, k, v = make(dtype=dtype, **make_kw)
    kw = dict(attend_kw)
    heads = q.shape[2]
    sinks = sinks_for(heads) if kw.pop("sinks", False) else None
    if kw.pop("segments", False):
        kw["segment_ids"] = packed_segments(q.shape[0], q.shape[1])
    return (q, k, v, sinks), kw, blocks


def loss_of(impl, kw, blocks):
    """A scalar that weighs every output element differently, so gradients see every element."""

    def loss(q, k, v, sinks):
        out = attend(q, k, v, scale=SCALE, impl=impl, sinks=sinks, block_q=blocks[0], block_k=blocks[1], **kw)
        weights = jnp.cos(jnp.arange(out.size, dtype=jnp.float32).reshape(out.shape))
        return (out.astype(jnp.float32) * weights).sum()

    return loss


def outputs_and_gradients(impl, args, kw, blocks):
    """(output, d/dq, d/dk, d/dv[, d/dsinks]) of `loss_of`, in one compiled program."""
    argnums = (0, 1, 2, 3) if args[3] is not None else (0, 1, 2)

    def both(*args):
        out = attend(*args[:3], scale=SCALE, impl=impl, sinks=args[3], block_q=blocks[0], block_k=blocks[1], **kw)
        return out, jax.grad(loss_of(impl, kw, blocks), argnums=argnums)(*args)

    out, grads = jax.jit(both)(*args)
    return (out, *grads)


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_matches_xla_outputs_and_gradients(name):
    args, kw, blocks = case_inputs(name)
    results = {impl: outputs_and_gradients(impl, args, kw, blocks) for impl in ("xla", "blockwise")}
    for want, got in zip(results["xla"], results["blockwise"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def _stacked_case(name, n=3):
    """`n` draws of a case's (q, k, v, sinks), stacked on a new leading axis (a vmap's examples)."""
    make_kw, _, _ = CASES[name]
    draws = [make(seed=10 + i, **make_kw) for i in range(n)]
    q, k, v = (jnp.stack(x) for x in zip(*draws))
    sinks = None
    if CASES[name][1].get("sinks"):
        sinks = jnp.stack([sinks_for(q.shape[3], seed=20 + i) for i in range(n)])
    _, kw, blocks = case_inputs(name)
    return (q, k, v, sinks), kw, blocks


TRANSFORMS = {
    # name: f(loss, args) -> a pytree, with loss(q, k, v, sinks) -> scalar and args stacked per example
    "vmap_grad": lambda loss, a: jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)))(*a),
    # keys, values and sinks shared: their per-example gradients come from broadcast linear operands
    "vmap_grad_shared_kv": lambda loss, a: jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3)), in_axes=(0, None, None, None))(a[0], a[1][0], a[2][0], a[3][0]),
    "grad_vmap": lambda loss, a: jax.grad(lambda *x: jax.vmap(loss)(*x).sum(), argnums=(0, 1, 2, 3))(*a),
    "vmap_jvp": lambda loss, a: jax.vmap(lambda *x: jax.jvp(loss, x, tuple(jnp.cos(t) for t in x)))(*a),
    "vmap_vmap_grad": lambda loss, a: jax.vmap(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(*(x.reshape(1, *x.shape) for x in a)),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_blockwise_under_vmap_matches_xla(transform):
    """jax.vmap through the blockwise kernel's reverse mode (a linear_call, batched by
    zoo._compat.linear_call_vmappable): per-example gradients and the rest equal the XLA path's."""
    args, kw, blocks = _stacked_case("everything")
    got, want = (jax.jit(lambda *a, impl=impl: TRANSFORMS[transform](loss_of(impl, kw, blocks), a))(*args) for impl in ("blockwise", "xla"))
    leaves_got, leaves_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(leaves_got) == len(leaves_want) >= 2
    for g, w in zip(leaves_got, leaves_want):
        assert g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5)


def test_blockwise_bf16_is_close_to_xla():
    args, kw, blocks = case_inputs("everything", jnp.bfloat16)
    want_all, got_all = (outputs_and_gradients(impl, args, kw, blocks) for impl in ("xla", "blockwise"))
    assert got_all[0].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got_all[0], np.float32), np.asarray(want_all[0], np.float32), atol=3e-2)
    for want, got in zip(want_all[1:], got_all[1:]):
        want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_gradients_inside_a_checkpointed_scan():
    """As in the model: attention in a scanned, rematerialised layer body, under jit."""
    q, k, v = make(q_len=24)
    sinks = sinks_for(q.shape[2])

    def stack(impl):
        def body(x, layer_k):
            out = attend(x, layer_k, v, scale=SCALE, impl=impl, sinks=sinks, window=7, block_q=8, block_k=8)
            return jnp.tanh(out + x), None

        def f(x, ks):
            return jax.lax.scan(jax.checkpoint(body), x, ks)[0].sum()

        return jax.jit(jax.grad(f, argnums=(0, 1)))

    ks = jnp.stack([k, -0.5 * k])
    for want, got in zip(stack("xla")(q, ks), stack("blockwise")(q, ks)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_the_tile_mask_is_built_per_tile_inside_a_layer_scan():
    """The mask depends on the tile indices and segment ids alone, never on q/k/v: in a layer scan's
    backward, partial evaluation once built it for every tile at once, hoisted out of the layers
    (pred[tiles, batch, kv_heads, group, block_q, block_k])."""
    import re

    q, k, v = make(q_len=64)
    segments = packed_segments(2, 64)
    tiles = len(A._Tiling(64, 64, 8, 8, SCALE, True, None, 0).pairs()[0])  # 36 of the 8 x 8

    def f(x, ks):
        def body(x, layer_k):
            return jnp.tanh(attend(x, layer_k, v, scale=SCALE, impl="blockwise", segment_ids=segments, block_q=8, block_k=8) + x), None

        return jax.lax.scan(jax.checkpoint(body), x, ks)[0].sum()

    grad = jax.grad(f, argnums=(0, 1))
    ks = jnp.stack([k, -0.5 * k])
    traced = str(jax.make_jaxpr(grad)(q, ks))
    compiled = jax.jit(grad).lower(q, ks).compile().as_text()
    assert "bool[" in traced and "pred[" in compiled  # the per-tile masks are there, and readable
    assert not re.search(rf"bool\[{tiles},", traced)
    assert not re.search(rf"pred\[{tiles},", compiled)


# --- against numpy -------------------------------------------------------------------------------

NUMPY_CASES = ["gqa", "mla_dims", "window_unaligned", "sinks", "segments", "not_causal", "non_divisible", "everything", "offset_chunk"]


@pytest.mark.parametrize("name", NUMPY_CASES)
@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_matches_numpy(name, impl):
    (q, k, v, sinks), kw, blocks = case_inputs(name)
    got = attend(q, k, v, scale=SCALE, impl=impl, sinks=sinks, block_q=blocks[0], block_k=blocks[1], **kw)
    seg = kw.get("segment_ids")
    want = numpy_attention(q, k, v, scale=SCALE, causal=kw.get("causal", True), window=kw.get("window"), sinks=sinks,
                           segment_ids=seg, kv_segment_ids=seg, q_offset=kw.get("q_offset", 0))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_a_query_that_sees_nothing_gets_zero_and_finite_gradients(impl):
    q, k, v = make(q_len=12)
    seg = jnp.zeros((2, 12), jnp.int32).at[:, 5:].set(1)
    kv_seg = jnp.zeros((2, 12), jnp.int32).at[:, 5:].set(2)  # no key has segment 1

    def f(q, k, v):
        return attend(q, k, v, scale=SCALE, impl=impl, segment_ids=seg, kv_segment_ids=kv_seg, block_q=4, block_k=4)

    out = f(q, k, v)
    np.testing.assert_array_equal(np.asarray(out[:, 5:]), 0.0)
    want = numpy_attention(q, k, v, scale=SCALE, segment_ids=seg, kv_segment_ids=kv_seg)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
    grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


# --- decoding (XLA path) -------------------------------------------------------------------------


@pytest.mark.parametrize("feature", [{}, dict(window=4), dict(sinks=True)])
def test_decoding_against_a_cache_matches_full_attention(feature):
    """The last queries of a causal pass equal the same queries run against a cache that holds the
    keys so far (valid length per row) followed by garbage, at a per-row traced offset."""
    batch, seq, cache = 2, 13, 20
    q, k, v = make(batch=batch, q_len=seq)
    sinks = sinks_for(q.shape[2]) if feature.get("sinks") else None
    window = feature.get("window")
    full = attend(q, k, v, scale=SCALE, impl="xla", window=window, sinks=sinks)

    new = 3  # each row decodes 3 tokens; row 1 has 2 fewer tokens in its cache
    valid = jnp.asarray([seq, seq - 2], jnp.int32)
    offset = valid - new
    garbage = make(batch=batch, q_len=cache, seed=9)
    k_cache = garbage[1].at[:, :seq].set(k)
    v_cache = garbage[2].at[:, :seq].set(v)
    q_new = jnp.stack([jax.lax.dynamic_slice_in_dim(q[b], offset[b], new) for b in range(batch)])

    step = jax.jit(lambda q, kc, vc, o, n: attend(q, kc, vc, scale=SCALE, impl="auto", window=window, sinks=sinks,
                                                  q_offset=o, kv_valid_len=n))
    # Row 1 sees a cache truncated at seq - 2: its reference is a causal pass over that prefix.
    short = attend(q[:, : seq - 2], k[:, : seq - 2], v[:, : seq - 2], scale=SCALE, impl="xla", window=window, sinks=sinks)
    got = step(q_new, k_cache, v_cache, offset, valid)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(full[0, seq - new:]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(short[1, seq - 2 - new:]), rtol=1e-5, atol=1e-6)
    want = numpy_attention(q_new, k_cache, v_cache, scale=SCALE, window=window, sinks=sinks, q_offset=np.asarray(offset),
                           kv_valid_len=np.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    # a scalar traced offset too
    got0 = step(q_new[:1], k_cache[:1], v_cache[:1], offset[0], valid[:1])
    np.testing.assert_allclose(np.asarray(got0), np.asarray(got[:1]), rtol=1e-6, atol=1e-6)


def test_decoding_is_refused_outside_xla():
    q, k, v = make()
    with pytest.raises(ValueError, match="model.attention_impl.*decoding.*valid choices"):
        attend(q, k, v, scale=SCALE, impl="blockwise", kv_valid_len=jnp.asarray([3, 4], jnp.int32))


# --- choosing the implementation -----------------------------------------------------------------


def test_resolve_impl():
    cpu = dict(backend="cpu", dtype=jnp.float32, qk_dim=64, v_dim=64)
    threshold = A.min_blockwise_seq("cpu")
    assert resolve_impl("auto", seq_len=threshold - 1, **cpu) == "xla"
    assert resolve_impl("auto", seq_len=threshold, **cpu) == "blockwise"
    assert resolve_impl("auto", seq_len=threshold, decoding=True, **cpu) == "xla"
    assert resolve_impl("blockwise", seq_len=16, **cpu) == "blockwise"
    hopper = dict(backend="gpu", dtype=jnp.bfloat16, seq_len=4096, compute_capability=(9, 0))
    assert resolve_impl("auto", qk_dim=192, v_dim=128, **hopper) == "cudnn"
    assert resolve_impl("auto", qk_dim=128, v_dim=128, has_segments=True, max_segments=8, **hopper) == "cudnn"
    # what cuDNN cannot do falls back
    assert resolve_impl("auto", qk_dim=64, v_dim=64, has_sinks=True, **hopper) == "blockwise"
    assert resolve_impl("auto", qk_dim=512, v_dim=512, **hopper) == "blockwise"
    assert resolve_impl("auto", qk_dim=192, v_dim=128, **{**hopper, "compute_capability": (8, 0)}) == "blockwise"
    assert resolve_impl("auto", qk_dim=64, v_dim=64, **{**hopper, "dtype": jnp.float32}) == "blockwise"
    assert resolve_impl("auto", qk_dim=64, v_dim=64, has_segments=True, **hopper) == "blockwise"


@pytest.mark.parametrize(
    "impl, kw, reason",
    [
        ("cudnn", dict(backend="cpu"), "needs a GPU"),
        ("cudnn", dict(qk_dim=512, v_dim=512), "head dims"),
        ("cudnn", dict(has_sinks=True), "sinks"),
        ("cudnn", dict(dtype=jnp.float32), "bfloat16 or float16"),
        ("cudnn", dict(decoding=True), "decoding"),
        ("flash", {}, "'flash'"),
    ],
)
def test_bad_choices_name_the_setting_and_the_valid_ones(impl, kw, reason):
    base = dict(backend="gpu", dtype=jnp.bfloat16, qk_dim=128, v_dim=128, seq_len=4096, compute_capability=(9, 0))
    with pytest.raises(ValueError) as err:
        resolve_impl(impl, **{**base, **kw})
    message = str(err.value)
    assert message.startswith("model.attention_impl: ") and reason in message and "\n" not in message
    assert message.endswith("valid choices: auto, xla, blockwise, cudnn")


def test_cudnn_on_cpu_is_refused_by_attend():
    q, k, v = make()
    with pytest.raises(ValueError, match="model.attention_impl: cudnn needs a GPU"):
        attend(q, k, v, scale=SCALE, impl="cudnn")


def test_bad_blocks_and_shapes_are_refused():
    q, k, v = make()
    with pytest.raises(ValueError, match="block_q and block_k must be positive"):
        attend(q, k, v, scale=SCALE, impl="blockwise", block_q=0)
    with pytest.raises(ValueError, match="window"):
        attend(q, k, v, scale=SCALE, impl="xla", window=4, causal=False)
    with pytest.raises(ValueError, match="kv_segment_ids"):
        attend(q, k[:, :5], v[:, :5], scale=SCALE, impl="xla", segment_ids=jnp.zeros(q.shape[:2], jnp.int32))


@pytest.mark.parametrize("impl, balanced", [pytest.param("xla", False, marks=pytest.mark.slow), ("blockwise", False),  # xla: 11 s
                                            pytest.param("xla", True, marks=pytest.mark.slow), ("blockwise", True)])
def test_context_shards_match_the_whole_sequence(impl, balanced):
    # Context parallelism's kernel: 4 chunks of 12 queries, each against all 48 keys, with a window,
    # sinks and packed segments. Blocks of 5 x 7 give several tiles per chunk, unaligned with the chunks,
    # and the shards see different tile counts (the shorter rows padded with tiles that count for
    # nothing). The shard index is traced, as a device's axis index is. Each chunk's rows, and the
    # gradients summed over the chunks, equal attention over the whole sequence. Balanced: shard r's
    # queries are the pieces r and 7 - r of 6 positions (blocks of 5 shrink to 3, dividing a piece).
    shards, chunk = 4, 12
    q, k, v = make(q_len=shards * chunk)
    sinks, segments = sinks_for(q.shape[2]), packed_segments(q.shape[0], q.shape[1])
    kw = dict(scale=SCALE, window=15)
    half = chunk // 2

    def rows(r):  # the sequence positions of shard r's queries, in its order
        if not balanced:
            return np.arange(r * chunk, (r + 1) * chunk)
        return np.concatenate([np.arange(r * half, (r + 1) * half), np.arange((2 * shards - 1 - r) * half, (2 * shards - r) * half)])

    @jax.jit
    def one_chunk(q_chunk, seg, k, v, sinks, shard):
        return A.context_shard_attention(q_chunk, k, v, shard=shard, shards=shards, impl=impl, sinks=sinks, segment_ids=seg,
                                         kv_segment_ids=segments, block_q=5, block_k=7, balanced=balanced, **kw)

    def chunked(q, k, v, sinks):
        outs = [one_chunk(q[:, rows(r)], segments[:, rows(r)], k, v, sinks, jnp.int32(r)) for r in range(shards)]
        order = np.argsort(np.concatenate([rows(r) for r in range(shards)]))
        return jnp.concatenate(outs, axis=1)[:, order]

    def whole(q, k, v, sinks):
        return attend(q, k, v, impl="xla", sinks=sinks, segment_ids=segments, **kw)

    def loss(f):
        def scalar(*args):  # weighs every output element differently, so the gradients see each
            out = f(*args)
            return (out * jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape)).sum()

        return scalar

    np.testing.assert_allclose(chunked(q, k, v, sinks), whole(q, k, v, sinks), atol=1e-5)
    got, want = (jax.grad(loss(f), argnums=(0, 1, 2, 3))(q, k, v, sinks) for f in (chunked, whole))
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_balanced_context_shards_share_the_causal_work():
    # 131,072 positions over 16 context ranks in 256 x 256 tiles (docs/scale.md's long-context run):
    # contiguous chunks make every device wait for the last one's tiles, about twice the average;
    # the balanced pieces (r and 31 - r) give every device nearly the same count.
    def steps(pieces):
        t = A._Tiling(8192, 131072, 256, 256, 1.0, True, None, 0, 16, pieces)
        ii, _, ok = t.shard_pairs()
        return ii.shape[1], ok.sum(axis=1)

    (plain, plain_rows), (balanced, balanced_rows) = steps(1), steps(2)
    assert plain_rows.sum() == balanced_rows.sum()  # the same tiles, dealt out differently
    assert plain == plain_rows.max() > 1.9 * plain_rows.mean()
    assert balanced == balanced_rows.max() < 1.01 * balanced_rows.mean()


def test_context_shards_refuse_cudnn():
    q, k, v = make(q_len=8, kv_len=16)
    with pytest.raises(ValueError, match=r"^model.attention_impl: cudnn cannot run context-parallel attention"):
        A.context_shard_attention(q, k, v, shard=jnp.int32(1), shards=2, scale=SCALE, impl="cudnn")


@pytest.mark.parametrize("dims", [(8, 8), (16, 8)])
def test_cudnn_plumbing_with_xla_in_place_of_cudnn(monkeypatch, dims):
    """What cudnn_attention passes on (the window as jax.nn's (left, 0) window, v zero-padded to the
    q/k dim and sliced back where cuDNN lacks unequal dims) checked with JAX's XLA implementation
    standing in for cuDNN. cuDNN itself needs a GPU: not run here."""
    from zoo._compat import cudnn_fused_attention

    fa = cudnn_fused_attention()

    real = jax.nn.dot_product_attention

    def public(*args, implementation=None, **kw):
        assert implementation == "cudnn"
        return real(*args, implementation="xla", **kw)

    def lowering(q, k, v, *, scale, mask_type, sliding_window_length=None):
        assert mask_type == fa.MaskType.CAUSAL
        window = None if sliding_window_length is None else (sliding_window_length - 1, 0)
        return real(q, k, v, scale=scale, is_causal=True, local_window_size=window, implementation="xla")

    monkeypatch.setattr(jax.nn, "dot_product_attention", public)
    monkeypatch.setattr(fa, "dot_product_attention", lowering)
    q, k, v = make(q_len=17, heads=4, kv_heads=2, qk=dims[0], v=dims[1])
    for window in (None, 5):
        got = A.cudnn_attention(q, k, v, scale=SCALE, window=window)
        want = attend(q, k, v, scale=SCALE, impl="xla", window=window)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_segments_to_packed():
    ids = np.array([[0, 0, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5], [0, 1, 2, 3, 4, 5, 6, 7]])
    lengths, starts = segments_to_packed(jnp.asarray(ids, jnp.int32), 3)
    want_lengths, want_starts = [], []
    for row in ids:
        runs = []  # [start, length] of each run of equal ids
        for i, x in enumerate(row):
            if i and x == row[i - 1]:
                runs[-1][1] += 1
            else:
                runs.append([i, 1])
        runs = runs[:3]
        want_lengths.append([r[1] for r in runs] + [-1] * (3 - len(runs)))
        want_starts.append([r[0] for r in runs] + [-1] * (4 - len(runs)))
    np.testing.assert_array_equal(np.asarray(lengths), want_lengths)
    np.testing.assert_array_equal(np.asarray(starts), want_starts)


# --- what blockwise saves ------------------------------------------------------------------------


def grad_program(impl, seq, window=None, batch=1, heads=2, kv_heads=1, dim=32):
    def loss(q, k, v):
        return attend(q, k, v, scale=dim**-0.5, impl=impl, window=window, block_q=512, block_k=512).sum()

    shapes = [(batch, seq, heads, dim), (batch, seq, kv_heads, dim), (batch, seq, kv_heads, dim)]
    return jax.value_and_grad(loss, argnums=(0, 1, 2)), [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]


def test_compiled_temporary_memory_grows_linearly_for_blockwise():
    temp = {}
    for impl in ("xla", "blockwise"):
        for seq in (2048, 8192):
            fn, args = grad_program(impl, seq)
            temp[impl, seq] = jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes
    growth = {impl: temp[impl, 8192] / temp[impl, 2048] for impl in ("xla", "blockwise")}
    assert growth["blockwise"] < 6, f"blockwise temp bytes grew {growth['blockwise']:.1f}x (T=2048->8192): {temp}"
    assert growth["xla"] > 12, f"the XLA reference was expected to grow ~16x, got {growth['xla']:.1f}x: {temp}"


def dot_flops(jaxpr) -> int:
    """Matmul FLOPs of a jaxpr, loop bodies times their trip counts.

    (XLA's compiled cost_analysis() counts a while loop's body once, whatever its trip count, so it
    cannot see how many tiles the scan visits.)"""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        times = eqn.params["length"] if eqn.primitive.name == "scan" else 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, jex_core.Jaxpr):
                    assert eqn.primitive.name != "while", "a while loop's trip count is unknown here"
                    total += times * dot_flops(sub)
    return total


def test_sliding_window_blockwise_flops_grow_linearly():
    flops = {}
    for impl in ("xla", "blockwise"):
        for seq in (2048, 8192):
            fn, args = grad_program(impl, seq, window=256)
            flops[impl, seq] = dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)
    growth = {impl: flops[impl, 8192] / flops[impl, 2048] for impl in ("xla", "blockwise")}
    assert growth["blockwise"] < 4.5, f"windowed blockwise FLOPs grew {growth['blockwise']:.2f}x for 4x tokens: {flops}"
    assert growth["xla"] > 15, f"the XLA reference was expected to grow 16x, got {growth['xla']:.2f}x: {flops}"
    # Causal: 16 x 16 tiles of 512, of which the 136 on or below the diagonal are visited, each with
    # 7 matmuls (2 forward, 5 backward: Q K^T is recomputed) against the reference's 6.
    causal = {}
    for impl in ("xla", "blockwise"):
        fn, args = grad_program(impl, 8192)
        causal[impl] = dot_flops(jax.make_jaxpr(fn)(*args).jaxpr)
    assert causal["blockwise"] == pytest.approx(causal["xla"] * 7 / 6 * 136 / 256, rel=1e-3), causal


@pytest.mark.parametrize("name", ["llama_tiny_a", "dsv3_tiny_a"])
def test_one_layers_forward_and_backward_temp_bytes_grow_linearly_with_blockwise(name):
    """A whole decoder layer (norms, q/k/v or MLA projections, RoPE, attention, MLP or MoE), value and
    gradients with respect to its weights and input: with the XLA path the T x T scores dominate the
    compiled temporary memory (16x for 4x the tokens); with blockwise only the linear parts grow."""
    from zoo.families import SIZES
    from zoo.model import make_block

    temp = {}
    for impl in ("xla", "blockwise"):
        config = SIZES[name].replace(attention_impl=impl, max_position_embeddings=8192)
        spec = config.layer_spec(config.num_layers - 1)  # the MoE layer of DeepSeek-V3's tiny size
        block = eqx.filter_eval_shape(make_block, config, spec, jax.random.key(0))

        def loss(block, x):
            return block(x, jnp.arange(x.shape[1]))[0].astype(jnp.float32).sum()

        for seq in (2048, 8192):
            x = jax.ShapeDtypeStruct((1, seq, config.hidden_size), jnp.dtype(config.compute_dtype))
            fn = jax.jit(lambda b, x: jax.value_and_grad(loss, argnums=(0, 1))(b, x))
            temp[impl, seq] = fn.lower(block, x).compile().memory_analysis().temp_size_in_bytes
    growth = {impl: temp[impl, 8192] / temp[impl, 2048] for impl in ("xla", "blockwise")}
    assert growth["blockwise"] < 6, f"{name}: one layer's temp bytes grew {growth['blockwise']:.1f}x with blockwise: {temp}"
    assert growth["xla"] > 12, f"{name}: the XLA path was expected to grow ~16x, got {growth['xla']:.1f}x: {temp}"
    assert temp["blockwise", 8192] * 4 < temp["xla", 8192], temp
