"""The inspector: placement read from the traced program, held against the policy, JAX's own
residual list, hand-written JAX policies, compiled memory, and the command line."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

import zoo
from zoo.tools.inspect_step import main
from zoo.placement import inspect_placement, stack_names
from zoo.offload import expected_placement, load_preset, placement_matches, remat_policy

from test_offload import FAMILIES, PRESETS
from tiers import by_family


def _placement(config, rp, batch=2, seq=16):
    model = zoo.abstract(config)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return inspect_placement(
        jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)), model, tokens, stacks=stack_names(model)
    )


# Presets that repeat another's policy on every family (`full` until set; `none` for the activations): they
# come after what they repeat, so that this is what the default tier checks.
_LATER = ("custom", "optimizer_host")


def _repeats(config) -> set:
    """The presets whose jax.checkpoint policy on `config` an earlier preset already gives (the same resolved
    actions, checkpoint and parameter memory: the same traced program), e.g. `custom` (`full` until set),
    `optimizer_host` (`none` for the activations), `qkv_proj_offloaded` (`deepseek_mla_moe_offload` on Llama)."""
    from zoo.offload import resolve

    seen, out = set(), set()
    for preset in sorted(PRESETS, key=lambda p: p in _LATER):
        policy = load_preset(preset)
        key = (policy.checkpoint, policy.params, tuple(sorted(resolve(policy, config).items())))
        if key in seen:
            out.add(preset)
        seen.add(key)
    return out


def _placement_cases():
    """(size, preset) for every family and preset; in the slow tier the families that reuse another's blocks
    (tests/tiers.py) and a preset that repeats an earlier one's policy on that family (`_repeats`)."""
    out = []
    for param in by_family(FAMILIES):
        size = getattr(param, "values", (param,))[0]
        repeats = _repeats(zoo.get_size(size))
        for preset in sorted(PRESETS, key=lambda p: p in _LATER):
            slow = preset in repeats or param is not size
            out.append(pytest.param(size, preset, id=f"{preset}-{size}", marks=[pytest.mark.slow] if slow else []))
    return out


@pytest.mark.parametrize("size, preset", _placement_cases())
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
        names_which_can_be_saved=["context", "mla_kv"],
        names_which_can_be_offloaded=["moe_mlpwi_1", "decoder_layer_input"],
        offload_src="device",
        offload_dst="pinned_host",
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
    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "offload=[qkv_proj_offloaded,optimizer_host]",
        "data.batch_size=2",
        "data.seq_len=16",
        f"inspect.out={out}",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "query_proj" in printed and "compiled: argument" in printed
    rep = json.loads(out.read_text())
    assert rep["schema"] == "zoo.inspect/1"
    from zoo.tools.kit import check_output

    assert check_output(out, "inspect.out", "inspect", "inspect.overwrite=true") == out  # its own, replaced again
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


def test_the_update_line_says_its_shapes_are_traced_where_a_mesh_splits_them():
    # update_buffers reads the traced program: on a mesh its shapes are global, not one device's part
    # (at Llama 3.1 405B, the whole float32 embedding table: 8.41 GB, where a device holds 1/128 of it).
    from zoo.tools.inspect_step import render_memory_sections

    table = {"shape": [128256, 16384], "dtype": "float32", "bytes": 128256 * 16384 * 4}
    for devices, qualified in ((1, False), (128, True)):
        update = {
            "streamed": False,
            "devices": devices,
            "layer_loops": 0,
            "device_in_loops": None,
            "device_outside_loops": table,
            "moved_to_device": None,
        }
        (line,) = render_memory_sections({"update": update})
        assert line.startswith("update: whole tree on device; largest device value 8.41 GB (128256x16384 float32)")
        assert ("traced shapes: each split over the 128 devices" in line) == qualified, line


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["model=llama_tiny_a", "offload=custom", "offload.tags.mla_q=offload"],
            "error: offload.tags.mla_q: the llama model never emits this tag",
        ),
        (
            ["model=llama_tiny_a", "offload=custom", "offload.tags.query_proj=keep"],
            "error: offload.tags.query_proj: 'keep' is not an action",
        ),
        (
            ["model=llama_tiny_a", "offload=custom", "offload.tags.query_projection=offload"],
            "error: offload.tags.query_projection: unknown tag (did you mean query_proj?)",
        ),
        (
            ["model=llama_tiny_a", "inspect.output=x.json"],
            "error: inspect.output: unknown key; the keys are out, measure, strict",
        ),
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


@pytest.mark.parametrize(
    "preset",
    [pytest.param(p, marks=pytest.mark.slow) if p in _repeats(zoo.get_size("dsv3_tiny_a")) else p for p in PRESETS],
)
def test_inspector_sees_into_the_expert_parallel_kernel(preset):
    """Under expert parallelism the routed-expert tags are named inside a shard_map body and their
    residuals leave it as its outputs: the inspector finds the same placement and bytes as for one
    program over the whole batch (dropless, so both buffer the same number of rows)."""
    import dataclasses

    from zoo import sharding as zs

    config = zoo.get_size("dsv3_tiny_a")
    config = config.replace(
        moe=dataclasses.replace(config.moe, impl="capacity", capacity_factor=float(config.moe.n_routed_experts))
    )
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


# A buffer-assignment dump and the compiled module's text, as XLA:CPU writes them (cut down from the
# llama_tiny_a step's): two argument allocations, an output, a temp allocation with three values.
BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 65536, parameter 1, shape |f32[256,64]| at ShapeIndex {}, maybe-live-out:
 value: <10 state__params__embed.1 @0> (size=65536,offset=0): f32[256,64]{1,0}
allocation 1: size 512, parameter 0, shape |f32[2,64]| at ShapeIndex {}, maybe-live-out:
 value: <11 state__opt_state__mu.1 @0> (size=512,offset=0): f32[2,64]{1,0}
allocation 2: size 16, output shape is |(s32[], f32[])|, maybe-live-out:
 value: <13 tuple.9 @{}> (size=16,offset=0): (s32[], f32[])
allocation 3: size 98304, preallocated-temp:
 value: <2405 copy.212 @0> (size=8192,offset=0): f32[2,16,64]{2,1,0}
 value: <2411 dot_fusion.1 @0> (size=65536,offset=8192): f32[256,64]{1,0}
 value: <2412 wrapped_reduce @0> (size=128,offset=8192): f32[2,16]{1,0}
"""
# A line ending in a backslash goes on in the next (Python drops the backslash and the newline).
MODULE = """HloModule jit_train_step

%fused_computation (param_0: f32[256,64]) -> f32[256,64] {
  %param_0 = f32[256,64]{1,0} parameter(0)
  ROOT %dot.1 = f32[256,64]{1,0} multiply(%param_0, %param_0), metadata={op_name="jit(train_step)/inner/mul"}
}

ENTRY %main.94 (state__opt_state__mu.1: f32[2,64], state__params__embed.1: f32[256,64]) -> (s32[], f32[]) {
  %state__opt_state__mu.1 = f32[2,64]{1,0} parameter(0), sharding={replicated}, \
metadata={op_name="state[\\'opt_state\\'].inner_states[\\'train\\'].inner_state[1][0].mu.w"}
  %state__params__embed.1 = f32[256,64]{1,0} parameter(1), metadata={op_name="state[\\'params\\'].embed"}
  %dot_fusion.1 = f32[256,64]{1,0} fusion(%state__params__embed.1), kind=kLoop, calls=%fused_computation, \
metadata={op_name="jit(train_step)/transpose(jvp())/dot_general"}
  %copy.212 = f32[2,16,64]{2,1,0} copy(%x)
}
"""


def test_buffer_assignment_names_arguments_by_path_and_values_by_op():
    from zoo.hlo import buffer_assignment
    from zoo.tools.inspect_step import compiled_holders

    found = buffer_assignment(BUFFER_ASSIGNMENT, MODULE)
    by_name = {b.name: b for b in found}
    assert by_name["parameter 1"].op_name == "state['params'].embed" and by_name["parameter 1"].kind == "argument"
    assert by_name["parameter 0"].op_name == "state['opt_state'].inner_states['train'].inner_state[1][0].mu.w"
    assert (
        by_name["dot_fusion.1"].kind == "temp"
        and by_name["dot_fusion.1"].bytes == 65536
        and by_name["dot_fusion.1"].shape == "f32[256,64]"
    )
    assert by_name["dot_fusion.1"].op_name == "jit(train_step)/transpose(jvp())/dot_general"
    assert by_name["copy.212"].op_name == ""  # no metadata
    mem = {"estimated_peak_bytes": 200_000, "temp_size_in_bytes": 98304}
    h = compiled_holders(found, mem, hbm_bytes=100_000)
    assert h["over_budget"] and h["arguments_by_kind"] == {"params": 65536, "opt_state": 512}
    assert [b["name"] for b in h["largest_temp"]] == ["dot_fusion.1", "copy.212", "wrapped_reduce"]
    assert not compiled_holders(found, mem, hbm_bytes=0)["over_budget"]  # no budget given: nothing is over it


LIVE_RANGE = """HloLiveRange (max 12):
  InstructionSequence:
    0:state__opt_state__mu.1
  BufferLiveRange:
    dot_fusion.1{}:3-9
  Live ranges at 7 (peak):
    state__params__embed.1{}: 65536 bytes (cumulative: 65536 bytes)
    copy.212{}: 8192 bytes (cumulative: 73728 bytes)
    dot_fusion.1{}: 65536 bytes (cumulative: 139264 bytes)
    while.3{1}: 512 bytes (cumulative: 139776 bytes)
  Stack trace breakdown for peak usage: 139 776 bytes
    main.94 (100.0%, total: 139 776 bytes, current: 0 bytes, remaining: 139 776 bytes)
"""


def test_live_at_peak_lists_the_values_xla_holds_together_at_its_peak():
    """zoo.hlo.live_at_peak reads XLA's live-range dump: the values live at the simulated peak, largest
    first, named by their instruction's op_name, the arguments marked, tuple indices kept."""
    from zoo.hlo import buffer_assignment, live_at_peak

    found = live_at_peak(LIVE_RANGE, MODULE)
    assert [(v.name, v.bytes, v.argument) for v in found] == [
        ("state__params__embed.1", 65536, True),
        ("dot_fusion.1", 65536, False),
        ("copy.212", 8192, False),
        ("while.3{1}", 512, False),
    ]
    assert found[0].op_name == "state['params'].embed"
    assert found[1].op_name == "jit(train_step)/transpose(jvp())/dot_general"
    assert live_at_peak("no peak here", MODULE) == []
    # The inspector lists them as the peak's only where they make most of XLA's estimated peak (on a
    # TPU with host offload the dump's own peak was seen at half the compiled one).
    from zoo.tools.inspect_step import compiled_holders, render_holders

    buffers = buffer_assignment(BUFFER_ASSIGNMENT, MODULE)
    shown = compiled_holders(buffers, {"estimated_peak_bytes": 150_000}, 0, live=found)
    assert [b["name"] for b in shown["live_at_peak"]] == ["dot_fusion.1", "copy.212", "while.3{1}"]
    assert shown["live_at_peak_argument_bytes"] == 65536 and "live together at XLA's peak" in render_holders(shown)
    short = compiled_holders(buffers, {"estimated_peak_bytes": 200_000}, 0, live=found)
    assert short["live_at_peak"] == [] and short["live_at_peak_bytes"] == 139776
    assert "live together" not in render_holders(short) and "the largest values" in render_holders(short)


def test_cli_over_the_hbm_budget_says_who_holds_it(tmp_path, capsys):
    """hardware.hbm_bytes below XLA's estimated peak: the inspector lists the compiled step's largest
    arguments (by their paths) and temporaries, largest first, and points to the planner."""
    out = tmp_path / "inspect.json"
    args = [
        "model=llama_tiny_a",
        "mesh=single",
        "data.batch_size=2",
        "data.seq_len=16",
        "hardware.hbm_bytes=100000",
        f"inspect.out={out}",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    rep = json.loads(out.read_text())
    h, mem = rep["holders"], rep["compiled_memory"]
    assert h["over_budget"] and h["estimated_peak_bytes"] == mem["estimated_peak_bytes"] > 100000
    # Every argument byte has a holder; parameters and AdamW moments are what the state is made of.
    assert sum(h["arguments_by_kind"].values()) == mem["argument_size_in_bytes"]
    # (AdamW's two moments, and its step counts: a few scalars)
    assert h["arguments_by_kind"]["opt_state"] == pytest.approx(2 * h["arguments_by_kind"]["params"], abs=64)
    temp = [b["bytes"] for b in h["largest_temp"]]
    assert temp == sorted(temp, reverse=True) and 0 < temp[0] <= mem["temp_size_in_bytes"]
    assert h["largest_arguments"][0]["op_name"].startswith("state[")
    # What coexists at XLA's peak (its live-range dump): the state, and the step's own values beside it.
    assert h["live_at_peak_argument_bytes"] <= mem["argument_size_in_bytes"] < h["live_at_peak_bytes"]
    assert h["live_at_peak_bytes"] <= mem["argument_size_in_bytes"] + mem["temp_size_in_bytes"]
    live = [b["bytes"] for b in h["live_at_peak"]]
    assert live == sorted(live, reverse=True) and not any(b["name"].startswith("state__") for b in h["live_at_peak"])
    assert "live together at XLA's peak" in printed
    assert (
        "who holds the HBM: the compiled step's buffers, XLA's estimated peak" in printed
        and "over hardware.hbm_bytes 100.00 kB" in printed
    )
    assert "python -m zoo.tools.plan model=llama_tiny_a" in printed and "plan.holders=true" in printed
