"""Expert-parallel bad input on the command line (`python -m zoo.tools.inspect_step`, the same composition and
validation as train.py): one `error:` line naming the key and the fix, exit 2, nothing compiled."""

import pytest

from zoo.tools.inspect_step import main

EP_BAD_INPUTS = {
    "expert_axis_does_not_divide_the_experts": (
        ["mesh=fsdp_ep", "model.moe.n_routed_experts=6"],
        "error: model.moe.n_routed_experts: 6 experts cannot be split over mesh.expert=4; use an expert axis that "
        "divides 6",
    ),
    "expert_axis_on_a_dense_model": (
        ["model=llama_tiny_a", "mesh=fsdp_ep"],
        "error: mesh.expert: 4 devices on the expert axis, but the model has no MoE layers; set mesh.expert=1",
    ),
    "batch_not_split_over_the_expert_devices": (
        ["mesh=fsdp_ep", "data.batch_size=4"],
        "error: data.batch_size: 4 is not divisible by the data-parallel size 8 (batch is split over "
        "data=1*fsdp=2*expert=4)",
    ),
    "microbatch_not_split_over_the_expert_devices": (
        ["mesh=fsdp_ep", "data.batch_size=16", "trainer.grad_accum=4"],
        "error: data.batch_size: 16 is not divisible by the data-parallel size 8 times trainer.grad_accum=4",
    ),
    "batch_rule_without_the_expert_axis": (
        ["mesh=fsdp_ep", "mesh.rules.batch=[data,fsdp]"],
        "error: mesh.rules.batch: expert parallelism needs the batch split over the expert axis; add expert to "
        "mesh.rules.batch",
    ),
}


@pytest.mark.parametrize("case", sorted(EP_BAD_INPUTS))
def test_expert_parallel_bad_input_is_one_line_before_compiling(case, capsys, tmp_path):
    args, expected = EP_BAD_INPUTS[case]
    assert main([*args, f"inspect.out={tmp_path / 'inspect.json'}"]) == 2
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(expected), out.err
    assert ";" in lines[0]  # the fix follows the problem
    assert "compiled" not in out.out and not (tmp_path / "inspect.json").exists()  # stopped before compiling
