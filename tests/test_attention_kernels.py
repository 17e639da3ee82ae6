"""zoo.nn.attention_kernels: the blockwise path against the XLA reference (outputs and gradients),
both against a plain-numpy reference written from the formulas, decoding against a cache, the
choice of implementation, and what blockwise saves (compiled temporary memory, FLOPs under a window).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo.nn import attention_kernels as A
from zoo.nn.attention_kernels import attend, resolve_impl
from zoo.nn.blockwise_attention import _Tiling

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


def numpy_attention(
    q,
    k,
    v,
    *,
    scale,
    causal=True,
    window=None,
    sinks=None,
    segment_ids=None,
    kv_segment_ids=None,
    q_offset=0,
    kv_valid_len=None,
):
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
    "everything": (
        dict(q_len=45, heads=4, kv_heads=1, qk=24, v=16),
        dict(window=11, sinks=True, segments=True),
        (16, 8),
    ),
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
    "vmap_grad_shared_kv": lambda loss, a: jax.vmap(
        jax.grad(loss, argnums=(0, 1, 2, 3)), in_axes=(0, None, None, None)
    )(a[0], a[1][0], a[2][0], a[3][0]),
    "grad_vmap": lambda loss, a: jax.grad(lambda *x: jax.vmap(loss)(*x).sum(), argnums=(0, 1, 2, 3))(*a),
    "vmap_jvp": lambda loss, a: jax.vmap(lambda *x: jax.jvp(loss, x, tuple(jnp.cos(t) for t in x)))(*a),
    "vmap_vmap_grad": lambda loss, a: jax.vmap(jax.vmap(jax.grad(loss, argnums=(0, 1, 2, 3))))(
        *(x.reshape(1, *x.shape) for x in a)
    ),
}


@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_blockwise_under_vmap_matches_xla(transform):
    """jax.vmap through the blockwise kernel's reverse mode (a linear_call, batched by
    zoo._compat.linear_call_vmappable): per-example gradients and the rest equal the XLA path's."""
    args, kw, blocks = _stacked_case("everything")
    got, want = (
        jax.jit(lambda *a, impl=impl: TRANSFORMS[transform](loss_of(impl, kw, blocks), a))(*args)
        for impl in ("blockwise", "xla")
    )
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
    tiles = len(_Tiling(64, 64, 8, 8, SCALE, True, None, 0).pairs()[0])  # 36 of the 8 x 8

    def f(x, ks):
        def body(x, layer_k):
            return jnp.tanh(
                attend(x, layer_k, v, scale=SCALE, impl="blockwise", segment_ids=segments, block_q=8, block_k=8) + x
            ), None

        return jax.lax.scan(jax.checkpoint(body), x, ks)[0].sum()

    grad = jax.grad(f, argnums=(0, 1))
    ks = jnp.stack([k, -0.5 * k])
    traced = str(jax.make_jaxpr(grad)(q, ks))
    compiled = jax.jit(grad).lower(q, ks).compile().as_text()
    assert "bool[" in traced and "pred[" in compiled  # the per-tile masks are there, and readable
    assert not re.search(rf"bool\[{tiles},", traced)
    assert not re.search(rf"pred\[{tiles},", compiled)


# --- against numpy -------------------------------------------------------------------------------

NUMPY_CASES = [
    "gqa",
    "mla_dims",
    "window_unaligned",
    "sinks",
    "segments",
    "not_causal",
    "non_divisible",
    "everything",
    "offset_chunk",
]


@pytest.mark.parametrize("name", NUMPY_CASES)
@pytest.mark.parametrize("impl", ["xla", "blockwise"])
def test_matches_numpy(name, impl):
    (q, k, v, sinks), kw, blocks = case_inputs(name)
    got = attend(q, k, v, scale=SCALE, impl=impl, sinks=sinks, block_q=blocks[0], block_k=blocks[1], **kw)
    seg = kw.get("segment_ids")
    want = numpy_attention(
        q,
        k,
        v,
        scale=SCALE,
        causal=kw.get("causal", True),
        window=kw.get("window"),
        sinks=sinks,
        segment_ids=seg,
        kv_segment_ids=seg,
        q_offset=kw.get("q_offset", 0),
    )
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

    step = jax.jit(
        lambda q, kc, vc, o, n: attend(
            q, kc, vc, scale=SCALE, impl="auto", window=window, sinks=sinks, q_offset=o, kv_valid_len=n
        )
    )
    # Row 1 sees a cache truncated at seq - 2: its reference is a causal pass over that prefix.
    short = attend(
        q[:, : seq - 2], k[:, : seq - 2], v[:, : seq - 2], scale=SCALE, impl="xla", window=window, sinks=sinks
    )
    got = step(q_new, k_cache, v_cache, offset, valid)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(full[0, seq - new :]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(short[1, seq - 2 - new :]), rtol=1e-5, atol=1e-6)
    want = numpy_attention(
        q_new,
        k_cache,
        v_cache,
        scale=SCALE,
        window=window,
        sinks=sinks,
        q_offset=np.asarray(offset),
        kv_valid_len=np.asarray(valid),
    )
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
    # TPU: splash wherever the sequence tiles in 128s (sinks, segments, odd head dims included)
    tpu = dict(backend="tpu", dtype=jnp.bfloat16, qk_dim=72, v_dim=40, has_sinks=True, has_segments=True)
    assert resolve_impl("auto", seq_len=2048, **tpu) == "splash"
    assert (
        resolve_impl("auto", seq_len=2000, **tpu) == "blockwise" and resolve_impl("auto", seq_len=200, **tpu) == "xla"
    )
    assert resolve_impl("auto", seq_len=2048, decoding=True, **tpu) == "xla"


# Splash in Pallas' interpret mode (the TPU kernel, run as XLA loops on the CPU) against the XLA path:
# GQA with odd head dims, a window shorter than the sequence, sinks, packed documents, no causality.
SPLASH_CASES = {
    "gqa_odd_dims": {},
    "window_shorter_than_sequence": dict(window=37),
    "sinks_window_segments": dict(window=130, sinks=True, segments=True),
    "not_causal": dict(causal=False),
}


@pytest.mark.parametrize(
    "case,fused",
    [(c, True) for c in SPLASH_CASES] + [("gqa_odd_dims", False), ("sinks_window_segments", False)],
)
def test_splash_matches_xla_outputs_and_gradients(case, fused, monkeypatch):
    """Both backwards: the fused dq/dk/dv kernel and the dq and dk/dv kernels."""
    from zoo.backend import pallas_interpreted

    made = []
    chosen = A._splash_kernel.__wrapped__

    def kernel(*args):  # what splash_attention asked for, the cache bypassed
        made.append(args[-1])
        return chosen(*args)

    monkeypatch.setattr(A, "splash_fused_backward", lambda *shape: fused)
    monkeypatch.setattr(A, "_splash_kernel", kernel)
    kw = dict(SPLASH_CASES[case])
    q, k, v = make(q_len=256, heads=4, kv_heads=2, qk=72, v=40)
    args = [q, k, v]
    if kw.pop("sinks", False):
        args.append(jnp.linspace(-1.0, 2.0, 4))
    if kw.pop("segments", False):
        kw["segment_ids"] = jnp.asarray(np.repeat([[0] * 100 + [1] * 156], 2, axis=0), jnp.int32)

    def loss(impl):
        def f(q, k, v, sinks=None):
            out = attend(q, k, v, scale=0.3, impl=impl, sinks=sinks, **kw)
            return jnp.sum(jnp.sin(out) * out)

        return jax.value_and_grad(f, argnums=tuple(range(len(args))))

    with pytest.raises(ValueError, match="splash is a TPU kernel"):
        loss("splash")(*args)  # refused outside the interpreted block on a CPU
    with pytest.raises(ValueError, match="not a multiple of 128"):
        with pallas_interpreted():
            attend(q[:, :100], k[:, :100], v[:, :100], scale=0.3, impl="splash")
    with pallas_interpreted():
        value, grads = jax.jit(loss("splash"))(*args)
    want_value, want_grads = jax.jit(loss("xla"))(*args)
    assert made and set(made) == {fused}
    assert np.isclose(value, want_value, rtol=1e-5)
    for g, want in zip(grads, want_grads):
        np.testing.assert_allclose(g, want, atol=2e-5 * float(jnp.abs(want).max()))


def test_splash_fused_backward_while_its_dq_partials_are_small(monkeypatch):
    """The fused backward writes a dq per block of keys; past zoo.backend's limit (set here: the TPU's
    default is none, always fused) the two kernels run, and the kernel is built with the backward asked for."""
    import dataclasses

    from zoo.backend import TPU

    assert TPU.splash_fused_backward_max_bytes is None and A.splash_fused_backward(
        2, 128, 4096, 4096, 192, jnp.bfloat16
    )
    TPU = dataclasses.replace(TPU, splash_fused_backward_max_bytes=2**30)
    monkeypatch.setattr(A, "backend_choices", lambda platform: TPU)
    bf16 = jnp.bfloat16
    # DeepSeek-V3's MLA at 2 x 4096 (128 heads, qk 192 -> 256 lanes): 4 blocks of 1024 keys, 3 extra dq.
    assert A.splash_dq_partial_bytes(2, 128, 4096, 4096, 192, bf16) == 3 * 2 * 128 * 4096 * 256 * 2
    assert TPU.splash_fused_backward_max_bytes < A.splash_dq_partial_bytes(2, 128, 4096, 4096, 192, bf16)
    assert not A.splash_fused_backward(2, 128, 4096, 4096, 192, bf16)
    # llama_1b at 8 x 2048 (32 heads of 64): one extra dq of 134 MB, fused (measured faster there).
    assert A.splash_dq_partial_bytes(8, 32, 2048, 2048, 64, bf16) == 8 * 32 * 2048 * 128 * 2
    assert A.splash_fused_backward(8, 32, 2048, 2048, 64, bf16)
    assert A.splash_dq_partial_bytes(2, 4, 1024, 1024, 64, bf16) == 0  # one block of keys: no partials
    blocks = [
        A._splash_kernel.__wrapped__(256, 256, 2, True, None, None, True, f).kwargs["block_sizes"]
        for f in (True, False)
    ]
    assert [b.use_fused_bwd_kernel for b in blocks] == [True, False]
    assert (blocks[1].block_q_dq, blocks[1].block_kv_dq) == (256, 256)


def test_splash_names_its_residuals_with_the_tag():
    """A policy that keeps the tag keeps splash's output (in its head-major layout) and logsumexp,
    so its backward recomputes no attention; one that keeps nothing keeps neither."""
    from zoo import tags
    from zoo._compat import saved_residuals
    from zoo.backend import pallas_interpreted

    q, k, v = make(q_len=128, heads=2, kv_heads=1, qk=16, v=16)

    def f(q, k, v):
        return jnp.sum(attend(q, k, v, scale=0.3, impl="splash", tag=tags.CONTEXT) ** 2)

    def kernel_outputs(policy):
        with pallas_interpreted():
            saved = saved_residuals()(jax.checkpoint(f, policy=policy), q, k, v)
        return sorted(r[0].shape for r in saved if "_splash_attention" in r[1])

    assert kernel_outputs(jax.checkpoint_policies.save_only_these_names(tags.CONTEXT)) == [
        (2, 1, 2, 128),
        (2, 1, 2, 128, 16),
    ]
    assert kernel_outputs(jax.checkpoint_policies.nothing_saveable) == []


def test_splash_kernel_made_inside_a_trace_holds_numpy_tables():
    """The kernel is cached across traces and its mask tables are embedded in the program: made while
    a step is being traced, they must be concrete numpy arrays (neither that trace's values nor device
    arrays, which XLA takes as extra arguments of a step compiled ahead of time)."""
    A._splash_kernel.cache_clear()
    made = []

    @jax.jit
    def step(x):
        made.append(A._splash_kernel(256, 256, 2, True, None, None, True))
        return x

    step(jnp.zeros(3))
    leaves = jax.tree.leaves(made[0])
    assert leaves and all(isinstance(x, np.ndarray) for x in leaves), {type(x).__name__ for x in leaves}
