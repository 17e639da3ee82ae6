"""Zoo modules in research code: tagged intermediates per layer (`zoo.capture`), forward-mode AD
through every family, dtype arguments, and the plain model API."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo import tags
from zoo.families import SIZES
from zoo.nn.mlp import MLPWI_0, MLPWI_1, MLPWO

from test_model import QWEN3_MOE_MIXED, filled, random_tokens

# --- zoo.capture -------------------------------------------------------------------------------


def layer_block(model, i):
    """Layer i's DecoderBlock, its weights taken out of the stack that holds it."""
    for s in model.stacks:
        for r in range(s.repeats):
            for j in range(s.period):
                if s.layer_index(r, j) == i:
                    return jax.tree.map(lambda a: a[r], s.layers[j])
    raise KeyError(i)


def rms_norm(x, norm):
    x = np.asarray(x, np.float64)
    return (
        x
        / np.sqrt((x * x).mean(-1, keepdims=True) + norm.eps)
        * (np.asarray(norm.weight, np.float64) + norm.weight_offset)
    )


def projection(x, w, b=None):
    y = np.einsum("btd,dkh->btkh", x, np.asarray(w, np.float64))
    return y if b is None else y + np.asarray(b, np.float64)


run_block = eqx.filter_jit(lambda block, x: block(x, jnp.arange(x.shape[1]))[0])

CAPTURE_CONFIGS = {
    "gemma3_tiny_a": SIZES["gemma3_tiny_a"],  # two stacks; (1 + w) norms
    "gpt_oss_tiny_a": SIZES["gpt_oss_tiny_a"],  # a period of 2 (sliding, full); q biases
    "qwen3_moe_mixed": QWEN3_MOE_MIXED,  # dense MLPs in layers 0 and 2 only
}


@pytest.mark.parametrize("name", sorted(CAPTURE_CONFIGS))
def test_capture_gives_each_layers_values_in_model_order(name):
    c = CAPTURE_CONFIGS[name]
    model, tokens = filled(c, std=0.2), random_tokens(c)
    wanted = [tags.DECODER_LAYER_INPUT, tags.QUERY_PROJ, tags.OUT_PROJ] + ([MLPWI_0] if c.has_dense_mlp else [])
    got = zoo.capture(model, tokens, tags=wanted)
    assert set(got) == set(wanted)
    x = got[tags.DECODER_LAYER_INPUT]
    assert x.shape == (c.num_layers, *tokens.shape, c.hidden_size)
    assert got[tags.QUERY_PROJ].shape == (c.num_layers, *tokens.shape, c.num_heads, c.head_dim)
    np.testing.assert_allclose(x[0], model.embed_tokens(tokens), rtol=1e-6)
    for i in range(c.num_layers):
        block = layer_block(model, i)
        # query_proj of layer i: the normed layer input times that layer's wq (plus its bias)
        q = projection(rms_norm(x[i], block.attn_norm), block.attn.wq, block.attn.bq)
        np.testing.assert_allclose(got[tags.QUERY_PROJ][i], q, rtol=2e-4, atol=2e-5, err_msg=f"layer {i}")
        if i + 1 < c.num_layers:  # the next layer's input is this block's output: the order is the model's
            np.testing.assert_allclose(x[i + 1], run_block(block, x[i]), rtol=2e-4, atol=2e-5)
    if c.has_dense_mlp:
        dense = zoo.capture_layers(c, MLPWI_0)
        assert dense == tuple(i for i in range(c.num_layers) if not c.is_moe_layer(i))
        assert got[MLPWI_0].shape[0] == len(dense)
        for row, i in enumerate(dense):  # gate = ffn_norm(x + attention output) @ w_gate
            block = layer_block(model, i)
            attn_out = got[tags.OUT_PROJ][i]
            if block.post_attn_norm is not None:  # sandwich norms
                attn_out = rms_norm(attn_out, block.post_attn_norm)
            h = np.asarray(x[i], np.float64) + np.asarray(attn_out, np.float64)
            gate = rms_norm(h, block.ffn_norm) @ np.asarray(block.ffn.w_gate, np.float64)
            np.testing.assert_allclose(got[MLPWI_0][row], gate, rtol=2e-4, atol=2e-5, err_msg=f"layer {i}")


def test_capture_under_balanced_context_parallelism_is_in_sequence_order():
    # The layers run on the sequence in its balanced order (chunks r and 2s-1-r per device): the
    # captured values, like the hidden states, come back in sequence order, equal to one device's.
    from zoo import sharding as zs

    c = SIZES["llama_tiny_a"]
    model, tokens = filled(c, std=0.2), random_tokens(c, batch=4, seq=32)
    wanted = [tags.DECODER_LAYER_INPUT, tags.QUERY_PROJ, MLPWO]
    want = zoo.capture(model, tokens, tags=wanted)
    rules = {
        **zs.DEFAULT_RULES,
        "batch": ["fsdp"],
        "seq": ["data"],
        zs.CONTEXT: ["data"],
        zs.CONTEXT_BALANCED: ["data"],
    }
    with zs.activate(zs.make_mesh(zs.resolve_mesh_shape({"data": 2, "fsdp": 4}, 8)), rules):
        assert zs.context_balanced() == 2
        got = zoo.capture(model, tokens, tags=wanted)
    for name in wanted:
        np.testing.assert_allclose(
            got[name], want[name], rtol=1e-4, atol=1e-4, err_msg=name
        )  # float32 sums in another order


def test_capture_layers_of_each_block_kind():
    mixed = QWEN3_MOE_MIXED  # dense, MoE, dense, MoE
    assert zoo.capture_layers(mixed, tags.QUERY_PROJ) == (0, 1, 2, 3)
    assert zoo.capture_layers(mixed, MLPWI_1) == (0, 2)
    assert zoo.capture_layers(mixed, tags.MOE_MLPWI_0) == (1, 3)
    dsv3 = SIZES["dsv3_tiny_a"]  # a dense layer, then MoE layers with a shared expert (a dense MLP)
    assert zoo.capture_layers(dsv3, MLPWI_0) == (0, 1, 2)
    assert zoo.capture_layers(dsv3, tags.MOE_MLPWO) == (1, 2)


def test_capture_of_moe_and_mla_tags_under_jit():
    c = SIZES["dsv3_tiny_a"]
    model, tokens = filled(c), random_tokens(c)
    wanted = (tags.MLA_KV, tags.MOE_MLPWI_0)
    got = jax.jit(lambda m, t: zoo.capture(m, t, tags=wanted))(model, tokens)
    eager = zoo.capture(model, tokens, tags=wanted)
    assert got[tags.MLA_KV].shape == (3, *tokens.shape, c.mla.kv_lora_rank)
    assert got[tags.MOE_MLPWI_0].shape[0] == 2
    for name in wanted:
        np.testing.assert_array_equal(got[name], eager[name])
    # The dense layer's MLP and the MoE layers' shared expert both emit mlpwi_0, at different widths:
    # stitching refuses, the per-stack pieces come as scanned.
    with pytest.raises(
        ValueError, match=r"tag 'mlpwi_0' has different shapes .*layers \[0\]: \(2, 16, 128\).*stitch=False"
    ):
        zoo.capture(model, tokens, tags=[MLPWI_0])
    pieces = zoo.capture(model, tokens, tags=[MLPWI_0], stitch=False)[MLPWI_0]
    assert [(layers, v.shape) for layers, v in pieces] == [((0,), (1, 2, 16, 128)), ((1, 2), (2, 2, 16, 32))]


def test_capture_refuses_a_tag_the_model_never_emits():
    c = SIZES["llama_tiny_a"]
    model, tokens = filled(c), random_tokens(c)
    with pytest.raises(
        ValueError, match="tag 'moe_mlpwi_0': this llama model never emits it; it emits decoder_layer_input"
    ):
        zoo.capture(model, tokens, tags=["moe_mlpwi_0"])
    with pytest.raises(ValueError, match="unknown tag 'q_proj'"):
        zoo.capture(model, tokens, tags=["q_proj"])


def test_outside_a_capture_the_program_is_unchanged():
    # Layer scopes cost nothing when no capture is asked for: the traced program has no extra outputs.
    c = SIZES["llama_tiny_a"]
    jaxpr = jax.make_jaxpr(lambda m, t: m(t))(zoo.abstract(c), jax.ShapeDtypeStruct((2, 16), jnp.int32))
    (scan,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert len(scan.outvars) == 1  # the residual stream only


# --- the plain model API -------------------------------------------------------------------------


def test_model_api_takes_only_tokens_positions_and_segments():
    import inspect

    for method in (zoo.CausalLM.__call__, zoo.CausalLM.forward_with_aux, zoo.CausalLM.features):
        params = [p for p in inspect.signature(method).parameters if p not in ("self", "model")]
        assert params == ["tokens", "positions", "segment_ids"], method.__qualname__
    # The one loss function also runs the layers under a policy (keywords only, default none).
    params = inspect.signature(zoo.loss_fn).parameters
    assert list(params)[1:] == ["tokens", "positions", "segment_ids", "remat_policy", "layer_transform"]
    assert all(params[k].kind == inspect.Parameter.KEYWORD_ONLY and params[k].default is None for k in list(params)[2:])
    with pytest.raises(TypeError, match="remat_policy"):
        zoo.abstract(SIZES["llama_tiny_a"])(jnp.zeros((1, 4), jnp.int32), remat_policy=None)


def test_the_trainers_policy_path_runs_the_same_layers():
    """zoo.model.features (the trainer's remat/offload/host-parameter path) without a policy traces the
    very program of model.features; with one, the forward values are the same bits and every tag is
    still emitted, and its gradients are those of the plain loss."""
    from zoo.model import features
    from zoo.offload import load_preset, remat_policy
    from zoo.sharding import to_device

    c = SIZES["gpt_oss_tiny_a"]  # a period of two blocks, MoE statistics
    # The capacity kernel with room for every assignment: the dropless kernel's maths, a faster compile.
    c = c.replace(moe=dataclasses.replace(c.moe, impl="capacity", capacity_factor=float(c.moe.n_routed_experts)))
    model, tokens = filled(c), random_tokens(c)
    positions = jnp.broadcast_to(jnp.arange(16, dtype=jnp.int32), tokens.shape)[:, ::-1]
    segments = jnp.asarray(np.repeat([[0, 1]], 8, axis=1).repeat(2, 0), jnp.int32)
    kw = dict(positions=positions, segment_ids=segments)
    plain = jax.make_jaxpr(lambda m, t: m.features(t, **kw))(model, tokens)
    assert str(jax.make_jaxpr(lambda m, t: features(m, t, **kw))(model, tokens)) == str(plain)

    rp = remat_policy(load_preset("minimal_offloaded"), c)
    run = eqx.filter_jit(lambda m, t, **extra: features(m, t, **kw, **extra))
    (hidden, aux), (hidden_rp, aux_rp) = (
        run(model, tokens),
        run(model, tokens, remat_policy=rp, layer_transform=to_device),
    )
    np.testing.assert_array_equal(np.asarray(hidden_rp), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(aux_rp.tokens_per_expert), np.asarray(aux.tokens_per_expert))
    np.testing.assert_array_equal(
        np.asarray(hidden), np.asarray(eqx.filter_jit(lambda m, t: m.features(t, **kw))(model, tokens)[0])
    )

    @eqx.filter_jit
    def captured_under_policy(m, t):  # the policy path emits every layer's tags as the plain one does
        with tags.capturing(["query_proj"]) as record:
            features(m, t, remat_policy=rp, layer_transform=to_device)
        return [layers for _, layers, _ in record], [values for _, _, values in record]

    layers, values = captured_under_policy(model, tokens)
    order = np.argsort(np.concatenate(layers))
    np.testing.assert_array_equal(
        np.asarray(jnp.concatenate(values))[order],
        np.asarray(zoo.capture(model, tokens, tags=["query_proj"])["query_proj"]),
    )

    grads = eqx.filter_jit(jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)))(model, tokens)
    grads0 = eqx.filter_jit(jax.grad(zoo.loss_fn))(model, tokens)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads0)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g0), rtol=1e-5, atol=1e-7)


# --- dtype arguments -----------------------------------------------------------------------------


def test_model_config_takes_jnp_and_numpy_dtypes_and_keeps_their_names():
    from omegaconf import OmegaConf

    base = SIZES["llama_tiny_a"]
    named = base.replace(param_dtype="bfloat16", compute_dtype="float32")
    for param, compute in (
        (jnp.bfloat16, np.float32),
        (jnp.dtype("bfloat16"), jnp.float32),
        (np.dtype("bfloat16"), "float32"),
    ):
        c = base.replace(param_dtype=param, compute_dtype=compute)
        assert (c.param_dtype, c.compute_dtype) == ("bfloat16", "float32")
        assert c == named and hash(c) == hash(
            named
        )  # a static field of the model: equal configs share compiled programs
    # The normalised config is what Hydra's YAML holds.
    yaml = OmegaConf.to_yaml(OmegaConf.structured(base.replace(param_dtype=np.float16)))
    assert "param_dtype: float16" in yaml
    for field, bad in (("param_dtype", jnp.int32), ("compute_dtype", "bf16"), ("param_dtype", np.float64)):
        with pytest.raises(ValueError, match=rf"^model\.{field}: got .*; choose one of float32, bfloat16, float16"):
            base.replace(**{field: bad})


def test_blocks_take_jnp_and_numpy_dtypes():
    from zoo.nn import GatedMLP, GQAttention, MLAttention, MoE, RMSNorm

    c = SIZES["dsv3_tiny_a"]
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (1, 4, c.hidden_size))
    makers = {
        "mlp": lambda **dt: GatedMLP(c.hidden_size, 32, key=key, **dt),
        "moe": lambda **dt: MoE(c.hidden_size, c.moe, key=key, **dt),
        "mla": lambda **dt: MLAttention(c.hidden_size, c.num_heads, c.mla, c.rope, 16, key=key, **dt),
        "gqa": lambda **dt: GQAttention(c.hidden_size, 4, 2, 8, c.rope, 16, key=key, **dt),
    }
    for name, make in makers.items():
        by_name = make(param_dtype="bfloat16", compute_dtype="float32")
        by_dtype = make(param_dtype=jnp.bfloat16, compute_dtype=np.float32)
        assert by_dtype.compute_dtype == "float32", name
        assert bool(eqx.tree_equal(by_name, by_dtype)), name  # same weights and the same static fields
        assert {leaf.dtype for leaf in jax.tree.leaves(eqx.filter(by_dtype, eqx.is_array))} >= {
            jnp.dtype("bfloat16")
        }, name
        with pytest.raises(
            ValueError, match=r"^compute_dtype=<class 'jax.numpy.int8'>: not a parameter dtype zoo keeps"
        ):
            make(compute_dtype=jnp.int8)
        with pytest.raises(ValueError, match=r"^param_dtype='bf16': not a parameter dtype zoo keeps"):
            make(param_dtype="bf16")
    mlp = makers["mlp"](param_dtype=jnp.bfloat16, compute_dtype=jnp.bfloat16)
    assert mlp(x.astype(jnp.bfloat16)).dtype == jnp.bfloat16
    assert RMSNorm(8, dtype=jnp.bfloat16).weight.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"^dtype='half-ish': not a parameter dtype"):
        RMSNorm(8, dtype="half-ish")
