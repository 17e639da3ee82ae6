"""Hugging Face interop for Qwen2, Qwen3, Qwen3-MoE, Mixtral, Gemma 3 and GPT-OSS.

The fixtures of tests/data/families (tests/data/families/README.md) are what transformers computed:
logits, loss, gradients and intermediates must match, files round-trip bit for bit, both config styles
read alike. Options the fixtures do not exercise are checked against `numpy_ref_families`, a plain
numpy forward pass that is itself checked against every fixture first. Then bad input: one
CheckpointError naming the file and what is wrong.
"""

import dataclasses
import json
import pathlib
import shutil
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import numpy_ref_families
import zoo
from zoo import families, hf
from zoo.families import SIZES
from zoo.nn.attention import attend
from zoo.nn.moe import route, router_logits
from zoo.nn.rope import rope_frequencies

DATA = pathlib.Path(__file__).parent / "data"
# The families with a `*_tiny_a` fixture of the earlier generator (with config_legacy.json, rope tables
# and routing records); a family added since has the fixtures tests/make_fixtures.py writes, which
# test_hard_fixture_matches_transformers and test_registered_family_checkpoints_round_trip pick up.
FAMILIES = [f.name for f in hf.families() if (DATA / "families" / f"{f.name}_tiny_a").is_dir()]
MOE_FAMILIES = [name for name in FAMILIES if families.get(name).moe]


def fixture(name: str) -> pathlib.Path:
    return DATA / "families" / f"{name}_tiny_a"


def read_json(path) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def tokens_of(name: str) -> jnp.ndarray:
    return jnp.asarray(np.load(fixture(name) / "inputs.npy"))


_logits = eqx.filter_jit(lambda model, tokens: model(tokens))
_value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(zoo.loss_fn))


def checkpoint(tmp_path, src: pathlib.Path, edit=None, tensors=None, config_file: str = "config.json") -> pathlib.Path:
    """A copy of the checkpoint `src` under tmp_path, its config.json passed through `edit(cfg)` and its
    tensors through `tensors(state)` (each edits in place)."""
    dst = tmp_path / "ckpt"
    dst.mkdir()
    cfg = read_json(src / config_file)
    if edit is not None:
        edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is None:
        shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    else:
        state = load_file(src / "model.safetensors")
        tensors(state)
        hf.write_safetensors(dst / "model.safetensors", state)
    return dst


def rand(seed: int, *shape) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def check_against_numpy(ckpt: pathlib.Path, tokens) -> tuple[zoo.CausalLM, np.ndarray]:
    """Load `ckpt`, and match its logits with the numpy reference run on the file's own tensors."""
    model = hf.from_pretrained(ckpt)
    logits = np.asarray(_logits(model, tokens))
    ref = numpy_ref_families.forward(
        read_json(ckpt / "config.json"), load_file(ckpt / "model.safetensors"), np.asarray(tokens)
    )
    np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=0)
    hf.config_to_hf(model.config)  # and the option can be written back (it raises if the family cannot say it)
    return model, logits


def assert_changes_logits(logits: np.ndarray, name: str) -> None:
    """The option under test must matter here, or matching the reference proves nothing about it."""
    assert np.abs(logits - np.load(fixture(name) / "logits.npy")).max() > 1e-2


# --- the transformers fixtures ------------------------------------------------------------------


def assert_matches_transformers(
    d: pathlib.Path, *, kernels: tuple = ("ragged",), grads_on_every_kernel: bool = False
) -> None:
    """Logits, loss and every recorded gradient of the fixture in `d` as transformers computed them.

    MoE models also run the capacity kernel with capacity_factor = experts / top_k, which gives every
    expert room for every token (nothing drops): its logits, and with `grads_on_every_kernel` its loss and
    gradients too, must match as well."""
    tokens = jnp.asarray(np.load(d / "inputs.npy"))
    meta = read_json(d / "loss.json")
    ref_logits, ref_grads = np.load(d / "logits.npy"), dict(np.load(d / "grads.npz"))
    assert set(ref_grads) == set(meta["grad_keys"])
    model = hf.from_pretrained(d)
    moe = model.config.moe
    for impl in kernels if moe is not None else kernels[:1]:
        if impl != "ragged":
            model = hf.from_pretrained(
                d, moe_impl=impl, moe_capacity_factor=moe.n_routed_experts / moe.num_experts_per_tok
            )
        logits = _logits(model, tokens)
        assert logits.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0, err_msg=impl)
        if impl != "ragged" and not grads_on_every_kernel:
            continue
        loss, grads = _value_and_grad(model, tokens)
        assert abs(float(loss) - meta["loss"]) < 1e-5, impl
        hub_grads = hf.to_hf_state_dict(grads)
        for key, ref in ref_grads.items():
            np.testing.assert_allclose(hub_grads[key], ref, atol=1e-5, rtol=1e-3, err_msg=f"{impl}: {key}")


@pytest.mark.parametrize("name", FAMILIES)
def test_matches_transformers(name):
    assert_matches_transformers(fixture(name), kernels=("ragged", "capacity"))


# Every other fixture folder: the hard ones that tests/make_fixtures.py writes (activations past their
# clamps and caps, windows shorter than the sequence). A new folder is picked up without a list to edit.
HARD = sorted(p.name for p in (DATA / "families").iterdir() if p.is_dir() and not p.name.endswith("_tiny_a"))


@pytest.mark.parametrize("name", HARD)
def test_hard_fixture_matches_transformers(name):
    assert_matches_transformers(DATA / "families" / name, kernels=("ragged", "capacity"))


@pytest.mark.parametrize(
    "name", [p.name for f in families.registered() for p in sorted((DATA / "families").glob(f"{f.name}_tiny_*"))]
)
def test_registered_family_checkpoints_round_trip(name, tmp_path):
    """A family of zoo/families/: its fixture's tensors come back bit for bit, its config.json reads back
    to the same ModelConfig from what config_to_hf writes, and save_pretrained loads to the same model."""
    d = DATA / "families" / name
    original = load_file(d / "model.safetensors")
    model = hf.from_pretrained(d)
    back = hf.to_hf_state_dict(model)
    assert set(back) == set(original)
    for key, arr in original.items():
        assert back[key].dtype == arr.dtype and np.array_equal(back[key], arr), key
    written = hf.config_to_hf(model.config)
    assert written["model_type"] == read_json(d / "config.json")["model_type"]
    assert hf.config_from_hf(written) == model.config
    hf.save_pretrained(model, tmp_path / "out")
    again = hf.from_pretrained(tmp_path / "out")
    assert again.config == model.config
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again))
    )


def _blocks(model: zoo.CausalLM) -> list:
    """Every layer's block, unstacked, in model order."""
    out = {}
    for s in model.stacks:
        params, static = eqx.partition(s.layers, eqx.is_array)
        for r in range(s.repeats):
            for j in range(s.period):
                out[s.layer_index(r, j)] = eqx.combine(jax.tree.map(lambda a, r=r: a[r], params[j]), static[j])
    return [out[i] for i in range(len(out))]


@pytest.mark.parametrize("name", FAMILIES)
def test_intermediates_match_transformers(name):
    """Layer by layer, so that a mismatch shows where it starts: rope, window mask, embeddings, each
    layer's residual stream, and each MoE layer's router logits, chosen experts and weights."""
    d = fixture(name)
    extras = dict(np.load(d / "extras.npz"))
    model = hf.from_pretrained(d)
    c = model.config
    scaling = read_json(d / "loss.json")["rope_attention_scaling"]
    for i in range(c.num_layers):
        spec = c.layer_spec(i)
        inv, factor = rope_frequencies(c.head_dim, c.layer_rope(spec), c.max_position_embeddings)
        key = f"_{c.layer_type(i)}" if name == "gemma3" else ""
        np.testing.assert_allclose(inv, extras[f"rope_inv_freq{key}"], rtol=1e-6)
        assert factor == pytest.approx(scaling[c.layer_type(i)] if name == "gemma3" else scaling["all"], rel=1e-6)
        if "sliding_window_mask" in extras and spec.window is not None:
            # Equal scores spread each query's weight evenly over the keys it may see; an identity v reads them out.
            q = jnp.zeros((1, 32, 1, 2))
            seen = (
                attend(q, q, jnp.eye(32)[None, :, None, :], scale=1.0, impl="xla", window=spec.window)[0, :, 0, :] > 0
            )
            np.testing.assert_array_equal(np.asarray(seen), extras["sliding_window_mask"])
    tokens = tokens_of(name)
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)
    x = model.embed_tokens(tokens)
    np.testing.assert_allclose(np.asarray(x), extras["embeddings"], atol=1e-5, rtol=0)
    for i, block in enumerate(_blocks(model)):
        if c.is_moe_layer(i):
            h = block.attn(block.attn_norm(x), positions)
            mid = x + (h if block.post_attn_norm is None else block.post_attn_norm(h))
            flat = block.ffn_norm(mid).reshape(-1, c.hidden_size)
            ffn = block.ffn
            logits = router_logits(flat, ffn.router) + (0 if ffn.router_bias is None else ffn.router_bias)
            np.testing.assert_allclose(np.asarray(logits), extras[f"layer_{i}_router_logits"], atol=1e-5, rtol=0)
            ids, weights = route(flat, ffn.router, ffn.router_bias, ffn.config)
            order = np.argsort(np.asarray(ids), axis=1)
            np.testing.assert_array_equal(np.take_along_axis(np.asarray(ids), order, 1), extras[f"layer_{i}_topk_idx"])
            np.testing.assert_allclose(
                np.take_along_axis(np.asarray(weights), order, 1), extras[f"layer_{i}_topk_weight"], atol=1e-5
            )
        x, _ = block(x, positions)
        np.testing.assert_allclose(np.asarray(x), extras[f"layer_{i}_output"], atol=1e-4, rtol=0, err_msg=f"layer {i}")


@pytest.mark.parametrize("config_file", ["config.json", "config_legacy.json"])
@pytest.mark.parametrize("name", FAMILIES)
def test_numpy_reference_matches_transformers(name, config_file):
    d = fixture(name)
    ref = numpy_ref_families.forward(
        read_json(d / config_file), load_file(d / "model.safetensors"), np.load(d / "inputs.npy")
    )
    np.testing.assert_allclose(ref, np.load(d / "logits.npy"), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", FAMILIES)
def test_legacy_config_style_reads_the_same(name):
    d = fixture(name)
    new = hf.config_from_hf(read_json(d / "config.json"))
    legacy = hf.config_from_hf(read_json(d / "config_legacy.json"))
    assert new == legacy
    size = zoo.get_size(f"{name}_tiny_a")
    if size.moe is not None:  # a loaded checkpoint runs the exact, dropless kernel
        assert new.moe.impl == "ragged"
        size = size.replace(moe=dataclasses.replace(size.moe, impl="ragged"))
    assert new == size


@pytest.mark.parametrize("name", FAMILIES)
def test_round_trip_is_bit_exact(name):
    original = load_file(fixture(name) / "model.safetensors")
    back = hf.to_hf_state_dict(hf.from_pretrained(fixture(name)))
    assert set(back) == set(original)
    for key, arr in original.items():
        assert back[key].dtype == arr.dtype and back[key].shape == arr.shape, key
        assert np.array_equal(back[key], arr), key


@pytest.mark.parametrize("name", FAMILIES)
def test_save_then_load_gives_the_same_model(name, tmp_path):
    model = hf.from_pretrained(fixture(name))
    hf.save_pretrained(model, tmp_path / "one")
    hf.save_pretrained(model, tmp_path / "many", max_shard_bytes=64 * 1024)  # several shards and an index
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    assert set(load_file(tmp_path / "one" / "model.safetensors")) == set(load_file(fixture(name) / "model.safetensors"))
    for out in ("one", "many"):
        again = hf.from_pretrained(tmp_path / out)
        assert again.config == model.config
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
            assert np.array_equal(np.asarray(a), np.asarray(b))


# What config_to_hf writes differently from transformers' own file, and why that reads the same.
_WRITTEN_DIFFERENTLY = {
    "qwen2": {"max_window_layers"},  # use_sliding_window is false: no layer slides whatever it says
    "qwen3": {"max_window_layers"},
    "mixtral": {"head_dim"},  # written out (16) where the file has null (hidden / heads = 16)
}


@pytest.mark.parametrize("name", FAMILIES)
def test_config_to_hf_writes_what_transformers_reads(name):
    new, legacy = read_json(fixture(name) / "config.json"), read_json(fixture(name) / "config_legacy.json")
    config = hf.config_from_hf(new)
    out = hf.config_to_hf(config)
    assert out["model_type"] == new["model_type"] and out["architectures"] == new["architectures"]
    for key, value in out.items():
        if key in new and key not in _WRITTEN_DIFFERENTLY.get(name, set()) | {"dtype"}:
            assert value == new[key], (key, value, new[key])
    # the legacy style too, for transformers 4, as the hub's files have it
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"):
        if key in legacy:
            assert out[key] == legacy[key], (key, out[key], legacy[key])
    assert "rope_parameters" in out and "rope_theta" in out
    if name in ("qwen2", "qwen3", "gemma3", "gpt_oss"):
        assert out["layer_types"] == new["layer_types"]
    assert hf.config_from_hf(out) == config


# --- options the fixtures do not exercise: against the numpy reference ----------------------------


@pytest.mark.parametrize("style", ["legacy", "nested"])
def test_gemma_linear_rope_scales_global_layers_only(style, tmp_path):
    def edit(cfg):
        if style == "legacy":
            # an original context length means nothing to the linear rule (some hub configs carry one)
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": 8.0, "original_max_position_embeddings": 32}
        else:
            cfg["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}

    ckpt = checkpoint(
        tmp_path, fixture("gemma3"), edit, config_file="config_legacy.json" if style == "legacy" else "config.json"
    )
    model, logits = check_against_numpy(ckpt, tokens_of("gemma3"))
    c = model.config
    assert c.rope == zoo.RopeConfig(type="linear", theta=1e6, factor=8.0)
    assert c.rope_local == zoo.RopeConfig(theta=1e4)
    assert c.layer_rope(c.layer_spec(0)) == c.rope_local and c.layer_rope(c.layer_spec(3)) == c.rope
    assert_changes_logits(logits, "gemma3")


def test_gemma_nested_yarn_always_truncates(tmp_path):
    """transformers reads yarn's `truncate` from the top of rope_parameters; nested under a layer type
    it is never seen, so the ramp is rounded whatever the nested value says."""
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 1e6,
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "truncate": False,
    }
    ckpt = checkpoint(tmp_path, fixture("gemma3"), lambda cfg: cfg["rope_parameters"].update(full_attention=yarn))
    model, logits = check_against_numpy(ckpt, tokens_of("gemma3"))
    assert model.config.rope.type == "yarn" and model.config.rope.truncate is True
    assert_changes_logits(logits, "gemma3")


@pytest.mark.parametrize("truncate", [True, False])
def test_gpt_oss_yarn_truncate(truncate, tmp_path):
    ckpt = checkpoint(tmp_path, fixture("gpt_oss"), lambda cfg: cfg["rope_parameters"].update(truncate=truncate))
    model, logits = check_against_numpy(ckpt, tokens_of("gpt_oss"))
    assert model.config.rope.truncate is truncate
    if truncate:  # the fixture has truncate false
        assert_changes_logits(logits, "gpt_oss")


def test_yarn_in_the_legacy_style_on_qwen2(tmp_path):
    """Qwen2.5's long-context recipe: `rope_scaling: {type: yarn, ...}` with the legacy `type` key."""
    scaling = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    ckpt = checkpoint(
        tmp_path, fixture("qwen2"), lambda cfg: cfg.update(rope_scaling=scaling), config_file="config_legacy.json"
    )
    model, logits = check_against_numpy(ckpt, tokens_of("qwen2"))
    assert model.config.rope.type == "yarn" and model.config.rope.truncate
    assert_changes_logits(logits, "qwen2")


def test_llama3_rope_on_qwen3(tmp_path):
    params = {
        "rope_type": "llama3",
        "rope_theta": 1e6,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    ckpt = checkpoint(tmp_path, fixture("qwen3"), lambda cfg: cfg.update(rope_parameters=params))
    model, logits = check_against_numpy(ckpt, tokens_of("qwen3"))
    assert model.config.rope.type == "llama3"
    assert_changes_logits(logits, "qwen3")


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "gemma3"])
def test_untied_head(name, tmp_path):
    vocab, hidden = (
        np.load(fixture(name) / "logits.npy").shape[-1],
        read_json(fixture(name) / "config.json")["hidden_size"],
    )
    ckpt = checkpoint(
        tmp_path,
        fixture(name),
        lambda cfg: cfg.update(tie_word_embeddings=False),
        lambda state: state.update({"lm_head.weight": rand(1, vocab, hidden)}),
    )
    model, logits = check_against_numpy(ckpt, tokens_of(name))
    assert model.lm_head is not None
    assert "lm_head.weight" in hf.to_hf_state_dict(model)
    assert_changes_logits(logits, name)


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize("style", ["max_window_layers", "layer_types"])
def test_qwen_windows_by_depth(name, style, tmp_path):
    """use_sliding_window with max_window_layers 1: layer 0 full, layer 1 slides. An explicit layer_types
    wins over max_window_layers (here the other way round)."""

    def edit(cfg):
        cfg.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
        if style == "layer_types":
            cfg["layer_types"] = ["sliding_attention", "full_attention"]
        else:
            cfg.pop("layer_types", None)

    ckpt = checkpoint(tmp_path, fixture(name), edit)
    model, logits = check_against_numpy(ckpt, tokens_of(name))
    expected = (
        ["full_attention", "sliding_attention"]
        if style == "max_window_layers"
        else ["sliding_attention", "full_attention"]
    )
    assert [model.config.layer_type(i) for i in range(2)] == expected and model.config.sliding_window == 8
    assert_changes_logits(logits, name)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_window_on_every_layer(name, tmp_path):
    ckpt = checkpoint(tmp_path, fixture(name), lambda cfg: cfg.update(sliding_window=8, use_sliding_window=True))
    model, logits = check_against_numpy(ckpt, tokens_of(name))
    assert model.config.layer_types is None and model.config.sliding_window == 8
    assert all(model.config.layer_spec(i).window == 8 for i in range(model.config.num_layers))
    assert_changes_logits(logits, name)


def test_qwen3_moe_window_needs_the_flag(tmp_path):
    config = hf.config_from_hf(dict(read_json(fixture("qwen3_moe") / "config.json"), sliding_window=8))
    assert config.sliding_window is None  # use_sliding_window false nulls it


def test_gemma_final_logit_softcap(tmp_path):
    ckpt = checkpoint(tmp_path, fixture("gemma3"), lambda cfg: cfg.update(final_logit_softcapping=1.5))
    model, logits = check_against_numpy(ckpt, tokens_of("gemma3"))
    assert model.config.final_logit_softcap == 1.5
    assert np.abs(logits).max() < 1.5
    assert_changes_logits(logits, "gemma3")


def test_gemma_attn_softcap_is_ignored_as_transformers_does(tmp_path):
    ckpt = checkpoint(tmp_path, fixture("gemma3"), lambda cfg: cfg.update(attn_logit_softcapping=0.5))
    with pytest.warns(UserWarning, match="attn_logit_softcapping is ignored"):
        model = hf.from_pretrained(ckpt)
    np.testing.assert_allclose(
        np.asarray(_logits(model, tokens_of("gemma3"))), np.load(fixture("gemma3") / "logits.npy"), atol=1e-4
    )


def test_gemma_window_pattern_from_the_legacy_key(tmp_path):
    ckpt = checkpoint(
        tmp_path, fixture("gemma3"), lambda cfg: cfg.update(sliding_window_pattern=2), config_file="config_legacy.json"
    )
    model, logits = check_against_numpy(ckpt, tokens_of("gemma3"))
    assert model.config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert [s.period for s in model.stacks] == [2]  # one scanned stack repeating [S, F]
    assert_changes_logits(logits, "gemma3")


def test_qwen3_moe_norm_topk_prob_false(tmp_path):
    ckpt = checkpoint(tmp_path, fixture("qwen3_moe"), lambda cfg: cfg.update(norm_topk_prob=False))
    model, logits = check_against_numpy(ckpt, tokens_of("qwen3_moe"))
    assert model.config.moe.norm_topk_prob is False
    assert_changes_logits(logits, "qwen3_moe")


def _copy_layers(state: dict, have: int, want: int) -> None:
    """Layers have..want-1 as perturbed copies of layer i % have."""
    for i in range(have, want):
        prefix = f"model.layers.{i % have}."
        for key in [k for k in state if k.startswith(prefix)]:
            state[f"model.layers.{i}." + key[len(prefix) :]] = state[key] + rand(i, *state[key].shape)


def _make_dense(state: dict, layers, hidden: int, inter: int) -> None:
    """Layers whose sparse MLP becomes a dense one of `inter`: drop router and experts, add the MLP."""
    for i in layers:
        p = f"model.layers.{i}.mlp."
        for key in [k for k in state if k.startswith(p)]:
            del state[key]
        state[p + "gate_proj.weight"], state[p + "up_proj.weight"] = (
            rand(10 + i, inter, hidden),
            rand(20 + i, inter, hidden),
        )
        state[p + "down_proj.weight"] = rand(30 + i, hidden, inter)


@pytest.mark.parametrize("case", ["mlp_only_layers", "decoder_sparse_step"])
def test_qwen3_moe_dense_layers_among_sparse(case, tmp_path):
    if case == "mlp_only_layers":  # 2 layers: layer 1 dense
        edit, layers, dense = (lambda cfg: cfg.update(mlp_only_layers=[1])), 2, [1]
    else:  # 4 layers, every second sparse: dense, sparse, dense, sparse
        edit, layers, dense = (lambda cfg: cfg.update(decoder_sparse_step=2, num_hidden_layers=4)), 4, [0, 2]

    def tensors(state):
        _copy_layers(state, 2, layers)
        _make_dense(state, dense, 64, 128)

    ckpt = checkpoint(tmp_path, fixture("qwen3_moe"), edit, tensors)
    model, logits = check_against_numpy(ckpt, tokens_of("qwen3_moe"))
    assert [model.config.is_moe_layer(i) for i in range(layers)] == [i not in dense for i in range(layers)]
    if case == "decoder_sparse_step":
        assert [(s.period, s.repeats) for s in model.stacks] == [(2, 2)]
    back = hf.to_hf_state_dict(model)
    assert set(back) == set(load_file(ckpt / "model.safetensors"))
    assert "model.layers.0.mlp.gate_proj.weight" in back if 0 in dense else "model.layers.0.mlp.gate.weight" in back


def test_head_dim_key_on_qwen2(tmp_path):
    """Qwen2Config has no head_dim field, but transformers honours an extra key: 14 heads of 16, not 112 / 14 = 8."""

    def tensors(state):
        for i in range(2):
            a = f"model.layers.{i}.self_attn."
            state[a + "q_proj.weight"], state[a + "q_proj.bias"] = rand(i, 14 * 16, 112), rand(i + 2, 14 * 16)
            state[a + "k_proj.weight"], state[a + "k_proj.bias"] = rand(i + 4, 2 * 16, 112), rand(i + 6, 2 * 16)
            state[a + "v_proj.weight"], state[a + "v_proj.bias"] = rand(i + 8, 2 * 16, 112), rand(i + 10, 2 * 16)
            state[a + "o_proj.weight"] = rand(i + 12, 112, 14 * 16)

    ckpt = checkpoint(tmp_path, fixture("qwen2"), lambda cfg: cfg.update(head_dim=16), tensors)
    model, _ = check_against_numpy(ckpt, tokens_of("qwen2"))
    assert model.config.head_dim == 16


def test_head_dim_defaults_per_family():
    def without_head_dim(name, **kw):
        cfg = dict(read_json(fixture(name) / "config.json"), **kw)
        cfg.pop("head_dim", None)
        return hf.config_from_hf(cfg).head_dim

    assert without_head_dim("qwen3") == 128  # Qwen3Config's default, not hidden / heads
    assert without_head_dim("qwen3_moe") == 64 // 4  # no such field: hidden / heads
    assert without_head_dim("qwen2") == 112 // 14
    assert hf.config_from_hf(read_json(fixture("mixtral") / "config.json")).head_dim == 16  # null: hidden / heads
    assert without_head_dim("gpt_oss") == 64 and without_head_dim("gemma3") == 256  # their classes' defaults


def test_gpt_oss_defaults_without_layer_types_or_rope():
    cfg = read_json(fixture("gpt_oss") / "config.json")
    cfg.pop("layer_types")
    cfg.pop("rope_parameters")
    c = hf.config_from_hf(cfg)
    assert c.layer_types == ["sliding_attention", "full_attention"] * 2
    assert c.rope == zoo.RopeConfig(
        type="yarn",
        theta=150000.0,
        factor=32.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
    )


@pytest.mark.parametrize("bias", [True, False])
def test_gpt_oss_attention_bias_flag(bias, tmp_path):
    def tensors(state):
        if not bias:
            for key in [k for k in state if "self_attn." in k and k.endswith("_proj.bias")]:
                del state[key]

    ckpt = checkpoint(tmp_path, fixture("gpt_oss"), lambda cfg: cfg.update(attention_bias=bias), tensors)
    model, logits = check_against_numpy(ckpt, tokens_of("gpt_oss"))
    assert model.config.attention_bias is bias and model.config.attention_out_bias is bias
    if not bias:
        assert_changes_logits(logits, "gpt_oss")


def test_llama_attention_bias(tmp_path):
    def tensors(state):
        for i in range(2):
            a = f"model.layers.{i}.self_attn."
            for j, (p, n) in enumerate((("q", 64), ("k", 32), ("v", 32), ("o", 64))):
                state[a + f"{p}_proj.bias"] = rand(100 + 4 * i + j, n)

    ckpt = checkpoint(tmp_path, DATA / "llama_tiny_a", lambda cfg: cfg.update(attention_bias=True), tensors)
    model, _ = check_against_numpy(ckpt, jnp.asarray(np.load(DATA / "llama_tiny_a" / "inputs.npy")))
    assert model.config.attention_bias and model.config.attention_out_bias


# --- bad input: one CheckpointError naming the file, the key or tensor, and what is supported --------


@pytest.mark.parametrize(
    "name,edit,match",
    [
        (
            "qwen3",
            lambda c: c.update(model_type="falcon"),
            r"model_type 'falcon' is not supported; supported: llama, deepseek_v3, gemma3_text, .*qwen2, qwen3, "
            r"qwen3_moe",
        ),
        (
            "gemma3",
            lambda c: c.update(model_type="gemma3"),
            r"model_type 'gemma3' is not supported \(the multimodal Gemma 3",
        ),
        (
            "qwen2",
            lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}),
            r"rope type 'dynamic' is not supported; supported: default, linear, llama3, yarn",
        ),
        (
            "mixtral",
            lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}),
            r"rope type 'longrope' is not supported",
        ),
        (
            "gemma3",
            lambda c: c["rope_parameters"].update(
                sliding_attention={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
            ),
            r"rope_parameters.sliding_attention: rope type 'dynamic' is not supported",
        ),
        (
            "qwen3",
            lambda c: c["rope_parameters"].update(partial_rotary_factor=0.5),
            r"partial_rotary_factor=0.5 is not supported",
        ),
        (
            "qwen2",
            lambda c: c.update(hidden_act="gelu"),
            r"hidden_act 'gelu' is not supported: the Qwen MLP uses 'silu' or 'swish'",
        ),
        (
            "gemma3",
            lambda c: c.update(hidden_activation="gelu"),
            r"hidden_activation 'gelu' is not supported: Gemma 3's MLP uses 'gelu_pytorch_tanh'",
        ),
        (
            "gemma3",
            lambda c: c.update(use_bidirectional_attention=True),
            r"use_bidirectional_attention=true is not supported: zoo's attention is causal",
        ),
        (
            "gpt_oss",
            lambda c: c.update(quantization_config={"quant_method": "mxfp4"}),
            r"quantization_config \(mxfp4\) is not supported",
        ),
        (
            "qwen2",
            lambda c: c.update(layer_types=["sliding_attention", "full_attention"]),
            r"layer_types makes layers \[0\] sliding_attention but the config leaves no sliding_window",
        ),
        (
            "gemma3",
            lambda c: c.update(layer_types=["sliding_attention"] * 3),
            r"layer_types must list one type per layer \(4\)",
        ),
        (
            "gpt_oss",
            lambda c: c["layer_types"].__setitem__(0, "chunked_attention"),
            r"layer_types 'chunked_attention' is not supported",
        ),
        ("qwen3", lambda c: c.pop("hidden_size"), r"'hidden_size' is missing"),
        ("qwen3", lambda c: c.update(num_hidden_layers="2"), r"num_hidden_layers must be an integer, got '2'"),
        ("qwen3_moe", lambda c: c.update(mlp_only_layers="0"), r"mlp_only_layers must be a list of layer indices"),
        (
            "qwen3_moe",
            lambda c: c.update(num_experts_per_tok=9),
            r"num_experts_per_tok: top_k=9 must be in 1..n_routed_experts=8",
        ),
        (
            "gemma3",
            lambda c: c["rope_parameters"].pop("sliding_attention"),
            r"rope_parameters is keyed by layer type but has no 'sliding_attention' entry",
        ),
    ],
    ids=[
        "falcon",
        "gemma3-multimodal",
        "rope-dynamic",
        "rope-longrope",
        "gemma-local-rope",
        "partial-rotary",
        "qwen-act",
        "gemma-act",
        "bidirectional",
        "mxfp4",
        "window-off-but-sliding",
        "layer-types-length",
        "layer-type-unknown",
        "missing-key",
        "wrong-type",
        "mlp-only-layers-type",
        "top-k",
        "gemma-rope-entry",
    ],
)
def test_unsupported_config(name, edit, match, tmp_path):
    ckpt = checkpoint(tmp_path, fixture(name), edit)
    with pytest.raises(hf.CheckpointError, match=match) as info:
        hf.from_pretrained(ckpt)
    assert str(ckpt / "config.json") in str(info.value)


def _set(key, value):
    return lambda state: state.__setitem__(key, value)


@pytest.mark.parametrize(
    "name,tensors,match",
    [
        (
            "gpt_oss",
            lambda s: s.pop("model.layers.2.self_attn.sinks"),
            r"missing tensor 'model.layers.2.self_attn.sinks' \(expected shape \[4\]\)",
        ),
        (
            "mixtral",
            _set("model.layers.1.block_sparse_moe.experts.3.w2.weight", np.zeros((64, 32), np.float32)),
            r"model.safetensors: tensor 'model.layers.1.block_sparse_moe.experts.3.w2.weight' has shape \[64, 32\], "
            r"the config implies \[64, 64\]",
        ),
        (
            "gpt_oss",
            _set("model.layers.0.mlp.experts.gate_up_proj", np.zeros((4, 64, 64), np.float32)),
            r"'model.layers.0.mlp.experts.gate_up_proj' has shape \[4, 64, 64\], the config implies \[4, 64, 128\]",
        ),
        (
            "qwen3",
            _set("model.layers.0.self_attn.q_norm.weight", np.ones(16, np.int32)),
            r"model.safetensors: tensor 'model.layers.0.self_attn.q_norm.weight' has dtype I32; a floating-point "
            r"tensor \(F32, BF16, F16, F64\)",
        ),
        (
            "qwen3",
            _set("model.layers.1.self_attn.o_proj.bias", np.zeros(64, np.float32)),
            r"tensors the config does not account for: model.layers.1.self_attn.o_proj.bias",
        ),
        (
            "qwen3_moe",
            _set("model.layers.0.mlp.experts.8.up_proj.weight", np.zeros((32, 64), np.float32)),
            r"does not account for: model.layers.0.mlp.experts.8.up_proj.weight",
        ),
        (
            "qwen2",
            _set("lm_head.weight", np.zeros((256, 112), np.float32)),
            r"tie_word_embeddings is true but the file's lm_head.weight differs from model.embed_tokens.weight",
        ),
    ],
    ids=["missing", "shape", "fused-shape", "int-dtype", "unused-bias", "extra-expert", "tied-head-differs"],
)
def test_tensors_that_do_not_match_the_config(name, tensors, match, tmp_path):
    ckpt = checkpoint(tmp_path, fixture(name), tensors=tensors)
    with pytest.raises(hf.CheckpointError, match=match) as info:
        hf.from_pretrained(ckpt)
    assert str(ckpt) in str(info.value)


def test_tied_head_equal_to_the_embedding_is_accepted(tmp_path):
    ckpt = checkpoint(
        tmp_path,
        fixture("qwen3"),
        tensors=lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].copy()}),
    )
    assert hf.from_pretrained(ckpt).lm_head is None


@pytest.mark.parametrize(
    "name,change,match",
    [
        ("qwen2", dict(attention_bias=False), r"a qwen2 config.json cannot express this model: attention_bias=False"),
        ("qwen3", dict(attention_sinks=True), r"attention_sinks=True \(reads back as False\)"),
        (
            "mixtral",
            dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
            r"mixtral config.json cannot express .*layer_types",
        ),
        (
            "gemma3",
            dict(
                rope=zoo.RopeConfig(
                    type="yarn", theta=1e6, factor=8.0, original_max_position_embeddings=16, truncate=False
                )
            ),
            r"gemma3_text config.json cannot express this model: rope=",
        ),
        ("llama", dict(qk_norm=True), r"a llama config.json cannot express this model: qk_norm=True"),
    ],
    ids=["qwen2-no-bias", "qwen3-sinks", "mixtral-mixed-windows", "gemma-yarn-no-truncate", "llama-qk-norm"],
)
def test_config_to_hf_refuses_what_the_family_cannot_express(name, change, match, tmp_path):
    base = hf.config_from_hf(read_json((DATA / "llama_tiny_a" if name == "llama" else fixture(name)) / "config.json"))
    config = base.replace(**change)
    with pytest.raises(hf.CheckpointError, match=match):
        hf.config_to_hf(config)
    model = zoo.abstract(config)
    with pytest.raises(hf.CheckpointError, match=match):
        hf.save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_mixtral_router_jitter_is_accepted_with_a_warning(tmp_path):
    ckpt = checkpoint(tmp_path, fixture("mixtral"), lambda cfg: cfg.update(router_jitter_noise=0.01))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = hf.config_from_hf(read_json(ckpt / "config.json"))
    assert any("router_jitter_noise=0.01 is ignored" in str(w.message) for w in caught)
    assert config == hf.config_from_hf(read_json(fixture("mixtral") / "config.json"))


@pytest.mark.parametrize("name", ["gemma3_27b", "gpt_oss_20b", "llama3.1_8b", "deepseek_v3_671b"])
def test_pad_token_id_reads_and_writes_back(name):
    from zoo.hf.convert import config_from_hf, config_to_hf

    c = SIZES[name]
    written = config_to_hf(c)
    assert written["pad_token_id"] == c.pad_token_id
    assert config_from_hf(written).pad_token_id == c.pad_token_id
    # An id outside the vocabulary (transformers would refuse it as padding_idx) is no padding row.
    assert config_from_hf({**written, "pad_token_id": c.vocab_size}).pad_token_id is None
