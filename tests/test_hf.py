"""Hugging Face interop: the transformers-computed fixtures, round trips, and bad checkpoints."""

import dataclasses
import json
import shutil

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_ref
import zoo
from zoo import hf

FAMILIES = ["llama_tiny_a", "dsv3_tiny_a"]


def _load_ref(d):
    return (
        jnp.asarray(np.load(d / "inputs.npy")),
        np.load(d / "logits.npy"),
        json.loads((d / "loss.json").read_text())["loss"],
        dict(np.load(d / "grads.npz")),
    )


def _checkpoint_with_config(tmp_path, src, config: dict):
    """A checkpoint directory holding `src`'s weights under another config.json."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(zoo.loss_fn))
_logits = eqx.filter_jit(lambda model, tokens: model(tokens))


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers(name, ref_dir):
    """Logits, loss and gradients as transformers computed them; on DeepSeek-V3 the routing's correction bias
    (a buffer the balancing rule moves, not a parameter) gets no gradient where the router's does."""
    d = ref_dir(name)
    tokens, ref_logits, ref_loss, ref_grads = _load_ref(d)
    impls = ["ragged", "capacity"] if name.startswith("dsv3") else [None]
    for impl in impls:
        # capacity_factor = experts / top_k gives every expert room for every token: nothing drops.
        kw = {} if impl is None else {"moe_impl": impl, "moe_capacity_factor": 4.0}
        model = hf.from_pretrained(d, **kw)
        logits = _logits(model, tokens)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
        loss, grads = _value_and_grad(model, tokens)
        assert abs(float(loss) - ref_loss) < 1e-5
        hub_grads = hf.to_hf_state_dict(grads)
        for key, ref in ref_grads.items():
            np.testing.assert_allclose(hub_grads[key], ref, atol=1e-5, rtol=1e-3, err_msg=key)
        if impl is not None:
            ffn = grads.stack("moe_layers").layers[0].ffn
            assert not np.any(np.asarray(ffn.e_score_correction_bias)), impl
            assert np.any(np.asarray(ffn.router)), impl


@pytest.mark.parametrize("name", FAMILIES)
def test_legacy_config_style_reads_the_same(name, ref_dir):
    d = ref_dir(name)
    new = hf.config_from_hf(json.loads((d / "config.json").read_text()))
    legacy = hf.config_from_hf(json.loads((d / "config_legacy.json").read_text()))
    assert new == legacy
    size = zoo.get_size(name)
    if size.moe is not None:  # a loaded checkpoint runs the exact, dropless kernel
        assert new.moe.impl == "ragged"
        size = size.replace(moe=dataclasses.replace(size.moe, impl="ragged"))
    assert new == size


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_exact(name, ref_dir):
    from safetensors.numpy import load_file

    d = ref_dir(name)
    original = load_file(d / "model.safetensors")
    back = hf.to_hf_state_dict(hf.from_pretrained(d))
    assert set(back) == set(original)
    for key, arr in original.items():
        assert back[key].dtype == arr.dtype and back[key].shape == arr.shape, key
        assert np.array_equal(back[key], arr), key


@pytest.mark.parametrize("name", FAMILIES)
def test_save_then_load_gives_the_same_model(name, ref_dir, tmp_path):
    model = hf.from_pretrained(ref_dir(name))
    hf.save_pretrained(model, tmp_path / "one")
    # A tiny shard limit forces a sharded checkpoint with an index file.
    hf.save_pretrained(model, tmp_path / "many", max_shard_bytes=64 * 1024)
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "many").glob("*.safetensors"))) > 2
    for out in ("one", "many"):
        again = hf.from_pretrained(tmp_path / out)
        assert again.config == model.config
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
            assert np.array_equal(np.asarray(a), np.asarray(b))


def test_streamed_files_are_the_librarys_bytes(tmp_path):
    """SafetensorsStream writes a file tensor by tensor, in any order, with the layout (header, tensor
    order, padding) of the safetensors library's save_file, byte for byte; a tensor of the wrong shape or
    a missing one is refused."""
    import ml_dtypes

    rng = np.random.default_rng(0)
    tensors = {
        "b.w": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "a.w": rng.standard_normal((2, 2)).astype(np.float32),
        "c": np.ones((7,), np.float16),
        "a.a": np.zeros((5,), ml_dtypes.bfloat16),
        "z": np.ones((1,), np.float64),
        "empty": np.zeros((0, 3), np.float32),
        "q": rng.standard_normal((4, 4)).astype(ml_dtypes.float8_e4m3fn),
    }
    hf.write_safetensors(tmp_path / "library.safetensors", tensors, {"format": "pt"})
    stream = hf.SafetensorsStream(
        tmp_path / "stream.safetensors", [(k, v.shape, v.dtype) for k, v in tensors.items()], {"format": "pt"}
    )
    for name in reversed(list(tensors)):
        assert not stream.done
        stream.write(name, tensors[name])
    stream.close()
    assert (tmp_path / "stream.safetensors").read_bytes() == (tmp_path / "library.safetensors").read_bytes()
    assert not (tmp_path / "stream.safetensors.tmp").exists()
    stream = hf.SafetensorsStream(tmp_path / "bad.safetensors", [("w", (2, 2), np.float32)])
    with pytest.raises(ValueError, match=r"tensor 'w' is float32\[2, 3\], the header says float32\[2, 2\]"):
        stream.write("w", np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"tensors \['w'\] were never written"):
        stream.close()
    assert not (tmp_path / "bad.safetensors").exists()


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_save_pretrained_writes_what_the_library_would(dtype, ref_dir, tmp_path):
    """save_pretrained streams leaf by leaf; each of its files holds the bytes the library's save_file
    writes for the same tensors (a float32 correction bias among bfloat16 weights included)."""
    model = hf.from_pretrained(ref_dir("dsv3_tiny_a"))
    hf.save_pretrained(model, tmp_path / "out", dtype=dtype, max_shard_bytes=96 * 1024)
    weight_map = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"]
    state = hf.to_hf_state_dict(model)
    assert sorted(weight_map) == sorted(state) and len(set(weight_map.values())) > 2
    for file in sorted(set(weight_map.values())):
        names = [n for n, f in weight_map.items() if f == file]
        tensors = {n: state[n] if dtype is None else state[n].astype(jnp.dtype(dtype)) for n in names}
        hf.write_safetensors(tmp_path / "library.safetensors", tensors, {"format": "pt"})
        assert (tmp_path / "out" / file).read_bytes() == (tmp_path / "library.safetensors").read_bytes(), file
    assert not list((tmp_path / "out").glob(".*")) and not list((tmp_path / "out").glob("*.tmp"))


def test_bfloat16_checkpoint(ref_dir, tmp_path):
    model = hf.from_pretrained(ref_dir("llama_tiny_a"))
    hf.save_pretrained(model, tmp_path, dtype="bfloat16")
    header = hf.SafetensorsFile(tmp_path / "model.safetensors").header
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    as_bf16 = hf.from_pretrained(tmp_path, dtype="bfloat16")
    assert as_bf16.embed.dtype == jnp.bfloat16
    expected = np.asarray(model.embed).astype(jnp.bfloat16)
    assert np.array_equal(np.asarray(as_bf16.embed), expected)
    # bf16 weights up-cast to float32 master weights lose nothing further.
    as_f32 = hf.from_pretrained(tmp_path, dtype="float32")
    assert np.array_equal(np.asarray(as_f32.embed), expected.astype(np.float32))


def test_tied_embeddings_round_trip(tmp_path):
    config = zoo.get_size("llama_tiny_a").replace(tie_word_embeddings=True)
    model = zoo.build(config, key=jax.random.key(1))
    assert model.lm_head is None
    state = hf.to_hf_state_dict(model)
    assert "lm_head.weight" not in state
    hf.save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    again = hf.from_pretrained(tmp_path)
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(2, 16)
    logits = np.asarray(_logits(model, tokens))
    np.testing.assert_array_equal(logits, np.asarray(_logits(again, tokens)))
    ref = numpy_ref.forward(json.loads((tmp_path / "config.json").read_text()), state, np.asarray(tokens))
    np.testing.assert_allclose(logits, ref, atol=1e-4)


def test_gradient_with_none_leaves_is_skipped(ref_dir):
    model = hf.from_pretrained(ref_dir("llama_tiny_a"))
    only_embed = jax.tree.map(lambda _: None, model)
    only_embed = eqx.tree_at(lambda m: m.embed, only_embed, model.embed, is_leaf=lambda x: x is None)
    assert list(hf.to_hf_state_dict(only_embed)) == ["model.embed_tokens.weight"]


# --- rope rules and MLA variants without a transformers fixture: the numpy reference ------------


def _compare_with_numpy(ckpt, tokens, **kw):
    model = hf.from_pretrained(ckpt, **kw)
    cfg = json.loads((ckpt / "config.json").read_text())
    state = hf.to_hf_state_dict(model)
    ref = numpy_ref.forward(cfg, state, np.asarray(tokens))
    np.testing.assert_allclose(np.asarray(_logits(model, tokens)), ref, atol=1e-4, rtol=0)
    return model


def test_llama3_rope_against_numpy_reference(ref_dir, tmp_path):
    d = ref_dir("llama_tiny_a")
    cfg = json.loads((d / "config.json").read_text())
    # A short original context puts the tiny model's frequencies in all three wavelength bands.
    cfg["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model = _compare_with_numpy(_checkpoint_with_config(tmp_path, d, cfg), jnp.asarray(np.load(d / "inputs.npy")))
    assert model.config.rope.type == "llama3"
    inv, _ = zoo.nn.rope.rope_frequencies(16, model.config.rope, 128)
    default, _ = zoo.nn.rope.rope_frequencies(16, zoo.RopeConfig(theta=10000.0), 128)
    assert np.any(np.isclose(inv, default)) and np.any(np.isclose(inv, default / 8)), "all three bands present"
    assert np.any(~np.isclose(inv, default) & ~np.isclose(inv, default / 8))


@pytest.mark.parametrize("mscale,mscale_all_dim", [(1.0, 1.0), (1.0, 0.707), (None, None)])
def test_yarn_rope_against_numpy_reference(mscale, mscale_all_dim, ref_dir, tmp_path):
    d = ref_dir("dsv3_tiny_a")
    cfg = json.loads((d / "config_legacy.json").read_text())
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
    if mscale is not None:
        scaling.update(mscale=mscale, mscale_all_dim=mscale_all_dim)
    cfg["rope_scaling"] = scaling
    model = _compare_with_numpy(_checkpoint_with_config(tmp_path, d, cfg), jnp.asarray(np.load(d / "inputs.npy")))
    assert model.config.rope.type == "yarn"


def test_mla_without_q_lora_against_numpy_reference(tmp_path):
    base = zoo.get_size("dsv3_tiny_a")
    config = base.replace(
        mla=zoo.MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    )
    model = zoo.build(config, key=jax.random.key(3))
    assert model.stack("moe_layers").layers[0].attn.wq_a is None
    hf.save_pretrained(model, tmp_path)
    state = hf.to_hf_state_dict(model)
    assert "model.layers.0.self_attn.q_proj.weight" in state
    assert not any("q_a_proj" in k for k in state)
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, config.vocab_size, dtype=jnp.int32)
    loaded = _compare_with_numpy(tmp_path, tokens)
    assert loaded.config.mla.q_lora_rank is None


# --- bad checkpoints: one clear error naming the file or tensor ----------------------------------


def test_unknown_model_type(ref_dir, tmp_path):
    cfg = json.loads((ref_dir("llama_tiny_a") / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    with pytest.raises(hf.CheckpointError, match="model_type 'gpt2' is not supported"):
        hf.from_pretrained(_checkpoint_with_config(tmp_path, ref_dir("llama_tiny_a"), cfg))


def test_missing_and_misshaped_tensors(ref_dir, tmp_path):
    from safetensors.numpy import load_file

    state = load_file(ref_dir("llama_tiny_a") / "model.safetensors")
    (tmp_path / "config.json").write_text((ref_dir("llama_tiny_a") / "config.json").read_text())
    missing = dict(state)
    del missing["model.layers.1.mlp.up_proj.weight"]
    hf.write_safetensors(tmp_path / "model.safetensors", missing)
    with pytest.raises(
        hf.CheckpointError, match=r"missing tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape \[128, 64\]\)"
    ):
        hf.from_pretrained(tmp_path)
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    hf.write_safetensors(tmp_path / "model.safetensors", bad)
    with pytest.raises(
        hf.CheckpointError,
        match=r"'model.layers.0.self_attn.k_proj.weight' .* shape \[16, 64\], the config implies \[32, 64\]",
    ):
        hf.from_pretrained(tmp_path)


def test_truncated_file(ref_dir, tmp_path):
    ckpt = _checkpoint_with_config(
        tmp_path, ref_dir("llama_tiny_a"), json.loads((ref_dir("llama_tiny_a") / "config.json").read_text())
    )
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(hf.CheckpointError, match="model.safetensors: truncated"):
        hf.from_pretrained(ckpt)
    (ckpt / "model.safetensors").write_bytes(data[:4])
    with pytest.raises(hf.CheckpointError, match="truncated or not a safetensors file"):
        hf.from_pretrained(ckpt)


def test_missing_config_and_shard(ref_dir, tmp_path):
    with pytest.raises(hf.CheckpointError, match="not a directory"):
        hf.from_pretrained(tmp_path / "nope")
    with pytest.raises(hf.CheckpointError, match="config.json: missing"):
        hf.from_pretrained(tmp_path)
    model = hf.from_pretrained(ref_dir("llama_tiny_a"))
    hf.save_pretrained(model, tmp_path / "sharded", max_shard_bytes=64 * 1024)
    victim = sorted((tmp_path / "sharded").glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(hf.CheckpointError, match=f"names shard '{victim.name}', which is missing"):
        hf.from_pretrained(tmp_path / "sharded")


def test_unsupported_rope_type(ref_dir, tmp_path):
    cfg = json.loads((ref_dir("llama_tiny_a") / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    with pytest.raises(hf.CheckpointError, match="rope type 'longrope' is not supported"):
        hf.from_pretrained(_checkpoint_with_config(tmp_path, ref_dir("llama_tiny_a"), cfg))


# --- dtypes, the capacity kernel, FP8 blocks -----------------------------------------------------


def test_dtype_arguments_take_jnp_and_numpy_dtypes(ref_dir):
    d = ref_dir("llama_tiny_a")
    by_name = hf.from_pretrained(d, dtype="bfloat16")
    for dtype in (jnp.bfloat16, jnp.dtype("bfloat16")):
        model = hf.from_pretrained(d, dtype=dtype, compute_dtype=np.float32)
        assert model.embed.dtype == jnp.bfloat16 and model.config.compute_dtype == "float32"
        np.testing.assert_array_equal(np.asarray(model.embed), np.asarray(by_name.embed))
    assert hf.from_pretrained(d, dtype=np.float16).config == hf.from_pretrained(d, dtype="float16").config
    # A bad dtype names the argument, not config.json.
    with pytest.raises(
        ValueError,
        match=(
            r"^dtype=<class 'jax.numpy.int32'>: not a parameter dtype zoo keeps; use one of float32, bfloat16, "
            r"float16"
        ),
    ):
        hf.from_pretrained(d, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"^compute_dtype='fp8': not a parameter dtype"):
        hf.from_pretrained(d, compute_dtype="fp8")


def test_capacity_kernel_warns_that_it_drops_tokens(ref_dir):
    import warnings

    d = ref_dir("dsv3_tiny_a")
    tokens, ref_logits, _, _ = _load_ref(d)
    with pytest.warns(
        UserWarning,
        match=r"moe_impl=capacity with moe_capacity_factor=1.25 keeps ceil\(1.25 x tokens x top_k / experts\) "
        r"tokens per expert and drops the rest.*moe_capacity_factor=4 \(experts / top_k\) drops nothing",
    ):
        dropping = hf.from_pretrained(d, moe_impl="capacity")
    # The warning is earned: at capacity factor 1.25 the fixture's logits move far past float noise.
    assert np.abs(np.asarray(_logits(dropping, tokens)) - ref_logits).max() > 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.from_pretrained(d, moe_impl="capacity", moe_capacity_factor=4.0)  # room for every token: silent
        hf.from_pretrained(d)  # ragged: dropless


def _quantize_fp8(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's scheme: per tile, scale_inv = max|w| / 448 and q = float8_e4m3fn(w / scale_inv)."""
    import ml_dtypes

    b0, b1 = block
    scale = np.zeros((-(-w.shape[0] // b0), -(-w.shape[1] // b1)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            tile = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = np.abs(tile).max() / 448.0
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (tile / scale[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scale


def _fp8_checkpoint(src, dst, block):
    from safetensors.numpy import load_file

    dst.mkdir()
    state = load_file(src / "model.safetensors")
    out, quantized = {}, {}
    for name, w in state.items():
        if name.startswith("model.layers.") and name.endswith(("proj.weight", "proj_with_mqa.weight")):
            out[name], out[name + "_scale_inv"] = _quantize_fp8(w, block)
            quantized[name] = w
        else:
            out[name] = w
    hf.write_safetensors(dst / "model.safetensors", out)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    return out, quantized


@pytest.mark.parametrize("block", [(128, 128), (16, 32)], ids=["published", "partial-tiles"])
def test_fp8_block_quantised_weights_are_dequantised(block, ref_dir, tmp_path):
    d = ref_dir("dsv3_tiny_a")
    saved, originals = _fp8_checkpoint(d, tmp_path / "fp8", block)
    assert len(originals) > 20 and any(saved[n + "_scale_inv"].size > 1 for n in originals) == (block == (16, 32))
    model = hf.from_pretrained(tmp_path / "fp8")
    back = hf.to_hf_state_dict(model)
    assert not any(k.endswith("_scale_inv") for k in back)
    for name, w in originals.items():
        q, s = saved[name], saved[name + "_scale_inv"]
        scale = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: w.shape[0], : w.shape[1]]
        np.testing.assert_array_equal(back[name], q.astype(np.float32) * scale, err_msg=name)  # q * scale_inv per tile
        # within e4m3's rounding: half of 2^-3 relative, or half its smallest subnormal step (2^-9) times the scale
        assert np.all(np.abs(back[name] - w) <= 2.0**-4 * np.abs(w) * (1 + 1e-6) + 2.0**-10 * scale), name
    # (The logits are not compared: the fixture's routing margins, ~1e-3, sit far below FP8's rounding.)


def test_fp8_needs_its_scales_and_its_quantization_config(ref_dir, tmp_path):
    d = ref_dir("dsv3_tiny_a")
    saved, _ = _fp8_checkpoint(d, tmp_path / "fp8", (128, 128))
    name = "model.layers.0.self_attn.q_a_proj.weight"
    hf.write_safetensors(
        tmp_path / "fp8" / "model.safetensors", {k: v for k, v in saved.items() if k != name + "_scale_inv"}
    )
    with pytest.raises(
        hf.CheckpointError, match=rf"model.safetensors: FP8 tensor '{name}' has no '{name}_scale_inv' block scales"
    ):
        hf.from_pretrained(tmp_path / "fp8")
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        hf.CheckpointError,
        match=(
            r"has dtype F8_E4M3; a floating-point tensor .* \(an FP8 checkpoint's config.json names its "
            r"quantization_config\)"
        ),
    ):
        hf.from_pretrained(tmp_path / "fp8")
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        hf.CheckpointError, match=r"config.json: quantization_config .* is not supported: zoo dequantises fmt e4m3"
    ):
        hf.from_pretrained(tmp_path / "fp8")
