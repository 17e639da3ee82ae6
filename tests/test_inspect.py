"""The inspector: placement read from the traced program, held against the policy, JAX's own
residual list, hand-written JAX policies, compiled memory, and the command line."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

import zoo
from zoo import offload
from zoo.inspect import inspect_placement, main, stack_names
from zoo.offload import expected_placement, load_preset, placement_matches, remat_policy

from test_offload import FAMILIES, PRESETS


def _placement(config, rp, batch=2, seq=16):
    model = zoo.abstract(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return inspect_placement(jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)), model, tokens, stacks=stack_names(model))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("size", FAMILIES)
def test_inspector_finds_exactly_the_configured_placement(size, preset):
    config = zoo.get_size(size)
    policy = load_preset(preset)
    placement = _placement(config, remat_policy(policy, config))
    expected = expected_placement(policy, config)
    found = placement.by_tag()
    assert set(found) == set(expected)  # every emitted tag is in the program, nothing else
    for tag, want in expected.items():
        assert placement_matches(want, found[tag]), (tag, want, found[tag])
    if policy.checkpoint:
        assert placement.tags_with("host") == {t for t, p in expected.items() if p == "host"}
        assert placement.tags_with("device") == {t for t, p in expected.items() if p == "device"}
        assert placement.tags_with("recomputed") == {t for t, p in expected.items() if p == "recomputed"}
        assert not placement.other_bytes("host")
    else:
        assert not placement.tags_with("host") and not placement.tags_with("recomputed")


def test_layer_input_and_mlpwo_exceptions_are_what_the_program_does():
    config = zoo.get_size("llama_tiny_a")
    full = _placement(config, remat_policy(load_preset("full"), config)).by_tag()
    assert full["decoder_layer_input"] == "device" and full["mlpwo"] == "unread"
    assert {p for t, p in full.items() if t not in ("decoder_layer_input", "mlpwo")} == {"recomputed"}
    # Asking JAX directly (bypassing Zoo's refusal) to keep mlpwo: still nothing kept.
    rp = jax.checkpoint_policies.save_only_these_names("mlpwo")
    assert _placement(config, rp).by_tag()["mlpwo"] == "unread"
    # With sandwich norms (Gemma 3) the post-MLP norm reads it: recomputed under `full`.
    gemma = zoo.get_size("gemma3_tiny_a")
    assert _placement(gemma, remat_policy(load_preset("full"), gemma)).by_tag()["mlpwo"] == "recomputed"


def test_placement_follows_the_program_not_the_config():
    config = zoo.get_size("dsv3_tiny_a")
    rp = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=["context", "mla_kv"], names_which_can_be_offloaded=["moe_mlpwi_1", "decoder_layer_input"],
        offload_src="device", offload_dst="pinned_host",
    )
    found = _placement(config, rp).by_tag()
    assert {t for t, p in found.items() if p == "device"} == {"context", "mla_kv"}
    assert {t for t, p in found.items() if p == "host"} == {"moe_mlpwi_1", "decoder_layer_input"}
    assert found["moe_mlpwi_0"] == "recomputed"


def test_host_bytes_agree_with_jaxs_saved_residuals():
    from zoo._compat import saved_residuals

    saved_residuals = saved_residuals()

    config = zoo.get_size("dsv3_tiny_a")
    model = zoo.abstract(config)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    rp = remat_policy(load_preset("deepseek_mla_moe_offload"), config)
    loss = lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)  # noqa: E731
    residuals = saved_residuals(loss, model, tokens)
    jax_host = sum(math.prod(a.shape) * a.dtype.itemsize for a, _ in residuals if "host" in str(a).lower())
    placement = inspect_placement(jax.grad(loss), model, tokens, stacks=stack_names(model))
    assert jax_host > 0
    assert placement.bytes_on("host") == jax_host


def test_shapes_and_bytes_per_layer():
    config = zoo.get_size("dsv3_tiny_a")  # 1 dense layer, 2 MoE layers; 4 heads, qk 16+8, top-2 of 8 experts
    config = config.replace(moe=dataclasses.replace(config.moe, impl="ragged"))  # [assignments, .] routed tags
    placement = _placement(config, remat_policy(load_preset("minimal"), config), batch=2, seq=16)
    rec = {(r.tag, r.stack): r for r in placement.records}
    q = rec[("query_proj", "moe_layers")]
    assert q.shape == (2, 16, 4, 24) and q.dtype == "float32" and q.layers == 2
    assert q.bytes_per_layer == 2 * 16 * 4 * 24 * 4 and q.total_bytes == 2 * q.bytes_per_layer
    assert rec[("query_proj", "dense_layers")].layers == 1
    routed = rec[("moe_mlpwi_0", "moe_layers")]
    assert routed.shape == (2 * 16 * 2, 32)  # assignments x moe_intermediate_size
    assert ("moe_mlpwi_0", "dense_layers") not in rec


def test_compiled_temp_memory_orders_full_minimal_none():
    config = zoo.get_size("llama_100m").replace(vocab_size=1024)  # 8 layers of 512 wide, small head
    model = zoo.abstract(config)
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    temp = {}
    for name in ("full", "minimal", "none"):
        rp = remat_policy(load_preset(name), config)
        grad = jax.jit(jax.grad(lambda m, t, rp=rp: zoo.loss_fn(m, t, remat_policy=rp)))
        compiled = grad.lower(model, tokens).compile({"xla_backend_optimization_level": 0})
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["full"] < temp["minimal"] < temp["none"], temp


# --- the command line ----------------------------------------------------------------------------


def test_cli_writes_inspect_json(tmp_path, capsys):
    out = tmp_path / "inspect.json"
    args = ["model=llama_tiny_a", "mesh=single", "offload=[qkv_proj_offloaded,optimizer_host]", "data.batch_size=2",
            "data.seq_len=16", f"inspect.out={out}"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "query_proj" in printed and "compiled: argument" in printed
    rep = json.loads(out.read_text())
    assert rep["schema"] == "zoo.inspect/1"
    assert rep["state_memory_kinds"] == {"params": ["device"], "opt_state": ["pinned_host"]}
    placement = {t["tag"]: t["placement"] for t in rep["tags"]}
    assert {t for t, p in placement.items() if p == "host"} == {"query_proj", "key_proj", "value_proj"}
    assert all(t["ok"] for t in rep["tags"]) and rep["mismatches"] == []
    q = next(t for t in rep["tags"] if t["tag"] == "query_proj")
    assert q["shape"] == [2, 16, 4, 16] and q["bytes_per_layer"] == 2 * 16 * 4 * 16 * 4 and q["layers"] == 2
    assert q["total_bytes"] == 2 * q["bytes_per_layer"]
    mem = rep["compiled_memory"]
    for key in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "host_temp_size_in_bytes"):
        assert isinstance(mem[key], int)
    assert rep["measured"] is None  # the CPU backend reports no memory statistics


@pytest.mark.parametrize(
    "args, message",
    [
        (["model=llama_tiny_a", "offload=custom", "offload.tags.mla_q=offload"], "error: offload.tags.mla_q: the llama model never emits this tag"),
        (["model=llama_tiny_a", "offload=custom", "offload.tags.query_proj=keep"], "error: offload.tags.query_proj: 'keep' is not an action"),
        (["model=llama_tiny_a", "offload=custom", "offload.tags.query_projection=offload"], "error: offload.tags.query_projection: unknown tag (did you mean query_proj?)"),
        (["model=llama_tiny_a", "inspect.output=x.json"], "error: inspect.output: unknown key; the keys are out, measure, strict"),
        (["model=llama_tiny_a", "offload=nonesuch"], "error: offload: unknown option 'nonesuch'"),
    ],
)
def test_cli_bad_input_is_one_line_before_compiling(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message), err
    assert len(err.splitlines()) == 1


def test_params_on_host_keep_one_layer_of_weights_on_device():
    """With params_host and no activation checkpoint, the weights brought to the device inside the scan
    are fetched again in the backward pass instead of being kept for every layer at once."""
    from zoo.sharding import to_device

    config = zoo.get_size("llama_tiny_a")
    model = zoo.abstract(config)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)

    def kept_transfers(rp):
        loss = lambda m, t: zoo.loss_fn(m, t, remat_policy=rp, layer_transform=to_device)  # noqa: E731
        placement = inspect_placement(jax.grad(loss), model, tokens, stacks=stack_names(model))
        return [o for o in placement.other if o.source == "device_put"]

    assert len(kept_transfers(None)) == 7  # no checkpoint: all 7 weight matrices of every layer kept
    assert kept_transfers(remat_policy(load_preset("params_host"), config)) == []
    assert kept_transfers(remat_policy(load_preset("full", "params_host"), config)) == []


@pytest.mark.parametrize("preset", PRESETS)
def test_inspector_sees_into_the_expert_parallel_kernel(preset):
    """Under expert parallelism the routed-expert tags are named inside a shard_map body and their
    residuals leave it as its outputs: the inspector finds the same placement and bytes as for one
    program over the whole batch (dropless, so both buffer the same number of rows)."""
    import dataclasses

    from zoo import sharding as zs

    config = zoo.get_size("dsv3_tiny_a")
    config = config.replace(moe=dataclasses.replace(config.moe, impl="capacity", capacity_factor=float(config.moe.n_routed_experts)))
    policy = load_preset(preset)
    rp = remat_policy(policy, config)
    single = _placement(config, rp, batch=8)
    mesh = zs.make_mesh(zs.MeshShape(data=1, fsdp=2, tensor=1, expert=4))
    with zs.activate(mesh, zs.DEFAULT_RULES):
        sharded = _placement(config, rp, batch=8)
    moe_tags = {"moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo"}
    assert sharded.by_tag() == single.by_tag()
    expected = expected_placement(policy, config)
    for tag in moe_tags:
        assert placement_matches(expected[tag], sharded.by_tag()[tag]), (tag, expected[tag], sharded.by_tag()[tag])
    for a, b in ((sharded, "expert-parallel"), (single, "single")):
        assert {r.tag for r in a.records} >= moe_tags, b
    bytes_of = lambda p: {r.tag: r.bytes_per_layer for r in p.records if r.tag in moe_tags}  # noqa: E731
    assert bytes_of(sharded) == bytes_of(single)
    assert sharded.other_bytes("host") == single.other_bytes("host") == 0
