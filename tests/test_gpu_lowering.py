"""zoo.tools.gpu_lowering: train.py's step lowered for the `cuda` platform on this CPU-only machine, and the
host placements that survive in it (the CPU lowering of the same step drops the offloaded residuals'
ones, and the placements inside the layer loops). Tiny Llama and DeepSeek-V3 here; the real widths at reduced depth, on
128 simulated devices, are docs/scale.md's commands (tests/test_scale_doc.py, slow tier)."""

import pytest

from zoo.tools.gpu_lowering import HOST, host_placements, preset_row

# One device and Llama for the presets whose placements do not depend on the family (a trace and two
# lowerings in ~3 s each); DeepSeek-V3 on the fsdp mesh for its own preset (MLA and MoE tags, ~7 s).
LLAMA = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16", "model.attention_impl=blockwise"]
DSV3 = ["model=dsv3_tiny_a", "mesh=fsdp", "data.batch_size=8", "data.seq_len=16", "model.attention_impl=blockwise"]
ACTIVATION_PRESETS = ("llama_qkv_offload", "deepseek_mla_moe_offload")


def test_host_placements_reads_annotations_and_memory_kinds():
    # a line ending in a backslash goes on in the next (Python drops the backslash and the newline)
    text = """func.func public @main(%arg0: tensor<4xf32> {mhlo.memory_kind = "pinned_host"}, \
%arg1: tensor<4xf32> {mhlo.memory_kind = "device"}) -> (tensor<4xf32> {mhlo.memory_kind = "pinned_host"}) {
    %0 = stablehlo.custom_call @annotate_device_placement(%arg1) {backend_config = "", has_side_effect = true, \
mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : (tensor<4xf32>) -> tensor<4xf32>
    %1 = stablehlo.custom_call @annotate_device_placement(%0) {backend_config = "", has_side_effect = true, \
mhlo.frontend_attributes = {_xla_buffer_placement = "device"}} : (tensor<4xf32>) -> tensor<4xf32>
    %2 = stablehlo.custom_call @other(%1) {mhlo.frontend_attributes = {_xla_buffer_placement = "pinned_host"}} : \
(tensor<4xf32>) -> tensor<4xf32>
"""
    found = host_placements(text)
    assert found.annotations == {HOST: 1, "device": 1}
    assert found.memory_kinds == {HOST: 2, "device": 1}


@pytest.mark.parametrize(
    "overrides,preset",
    [
        (LLAMA, "none"),
        (LLAMA, "llama_qkv_offload"),
        (DSV3, "deepseek_mla_moe_offload"),
        (LLAMA, "optimizer_host"),
        (LLAMA, "params_host"),
    ],
    ids=lambda v: v if isinstance(v, str) else v[0].split("=")[1],
)
def test_cuda_lowering_keeps_every_host_placement_the_traced_step_makes(overrides, preset):
    row = preset_row(overrides, preset)
    cpu, cuda = row["cpu"], row["cuda"]
    # Every placement of the CPU program (either memory) is in the GPU one: XLA:CPU's lowering only drops.
    for kind in ("annotations", "memory_kinds"):
        assert all(cuda[kind].get(k, 0) >= n for k, n in cpu[kind].items()), (kind, cpu[kind], cuda[kind])
    if preset in ACTIVATION_PRESETS:
        assert row["offloaded_tags"] and row["traced_host_residuals"] > 0
        # One host placement per residual the traced program offloads, in the GPU program only.
        assert cuda["host_annotations"] == row["traced_host_residuals"]
        assert cpu["host_annotations"] == 0
        assert cpu["host_memory_kinds"] == cuda["host_memory_kinds"] == 0
    elif preset == "none":
        assert cpu["host_annotations"] == cuda["host_annotations"] == cuda["host_memory_kinds"] == 0
    else:
        # State between steps in pinned host: the arguments and results say so in both lowerings,
        # and the GPU program moves the streamed slices back to host at least as often as the CPU one.
        assert row["traced_host_residuals"] == 0
        assert cuda["host_memory_kinds"] == cpu["host_memory_kinds"] > 0
        assert cuda["host_annotations"] >= cpu["host_annotations"] > 0


def test_unknown_preset_is_one_line_before_anything_is_traced(capsys):
    from zoo.tools.gpu_lowering import main

    assert main(["model=llama_tiny_a", "mesh=single", "lower.presets=[full,nope]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "error: lower.presets: nope is not a preset of conf/offload; choose from custom,"
    ), err


def test_the_table_renders_each_rows_counts():
    from zoo.tools.gpu_lowering import render

    def row(preset, cuda_host):
        counts = {"host_annotations": cuda_host, "host_memory_kinds": 0}
        return {
            "preset": preset,
            "offloaded_tags": ["query_proj"],
            "traced_host_residuals": cuda_host,
            "params": "device",
            "opt_state": "pinned_host",
            "cpu": {"host_annotations": 0, "host_memory_kinds": 0},
            "cuda": counts,
        }

    lines = render([row("none", 0), row("llama_qkv_offload", 6)]).splitlines()
    assert lines[0].split()[:2] == ["preset", "offloaded"]
    assert lines[2].split() == ["llama_qkv_offload", "1", "6", "opt_state", "0", "6", "0", "0"], lines


def test_presets_that_exchange_the_same_rows_share_a_line():
    """zoo.tools.gpu_lowering's exchange lines: one per distinct set of all_to_alls, naming its presets
    (`every preset` when there is one set); a preset whose recomputed forward exchanges again apart."""
    from zoo.tools.gpu_lowering import render

    def row(preset, first):
        exchanges = {("8x40960x7168", "bf16"): first, ("8x10240x7168", "bf16"): 5}
        return {
            "preset": preset,
            "offloaded_tags": [],
            "traced_host_residuals": 0,
            "params": "device",
            "opt_state": "device",
            "cpu": {"host_annotations": 0, "host_memory_kinds": 0},
            "cuda": {"host_annotations": 0, "host_memory_kinds": 0, "row_exchanges": exchanges},
        }

    notes = render([row("full", 6), row("none", 4), row("custom", 6)]).splitlines()[4:]
    assert notes == [
        "full, custom: cuda: 5 all_to_all of bf16[8,10240,7168]",
        "full, custom: cuda: 6 all_to_all of bf16[8,40960,7168]",
        "none: cuda: 5 all_to_all of bf16[8,10240,7168]",
        "none: cuda: 4 all_to_all of bf16[8,40960,7168]",
    ]
    assert render([row("full", 6), row("custom", 6)]).splitlines()[3:] == [
        "every preset: cuda: 5 all_to_all of bf16[8,10240,7168]",
        "every preset: cuda: 6 all_to_all of bf16[8,40960,7168]",
    ]
