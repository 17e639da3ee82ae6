"""Measured rates per op and shape (zoo.op_rates): the lookup, the profile's validation, the
measurement that writes them, and the planner pricing each tag's producer at its op's rate."""

import dataclasses
import math

import pytest
from omegaconf import OmegaConf

import zoo
from zoo import op_rates
from zoo.model import stack_layout
from zoo.plan.cost import tag_totals
from zoo.plan.options import PlanConfig
from zoo.plan.pricing import producer_flops, producer_op, stack_emits
from zoo.plan.traced import none_estimate, policy_estimate, problem_from_config
from zoo.tags import TAGS, emitted_tags
from zoo.train.run_config import ConfigError, HardwareConfig, load_group

GRID = {
    "matmul": {"k": [512, 2048], "n": [512, 8192], "flops": [[20e12, 40e12], [60e12, 160e12]]},
    "attention": {
        "impl": "splash",
        "seq": [2048, 8192],
        "head_dim": [64, 128],
        "flops": [[20e12, 30e12], [40e12, None]],
    },
}


def test_rates_at_the_grid_between_it_and_beyond_it():
    assert op_rates.rate(GRID, "matmul", 512, 8192) == 40e12  # a measured point
    # halfway in log2 of both axes: the time (1 / rate) averaged over the four corners
    mid = op_rates.rate(GRID, "matmul", 1024, 2048)
    assert mid == pytest.approx(1 / (0.25 * (1 / 20e12 + 1 / 40e12 + 1 / 60e12 + 1 / 160e12)))
    assert op_rates.rate(GRID, "matmul", 64, 100_000) == 40e12  # held at the edge: k 512, n 8192
    assert op_rates.rate(GRID, "matmul", 1 << 20, 1) == 60e12
    # a corner not measured: the nearest measured point in log2 (seq 4096 is as far from 2048 as from
    # 8192, head dim 128 exact: (2048, 128) is 1 away, (8192, 64) 2)
    assert op_rates.rate(GRID, "attention", 4096, 128) == 30e12
    assert op_rates.rate(GRID, "grouped_matmul", 512, 512) is None  # not measured
    assert op_rates.rate(None, "matmul", 512, 512) is None


@pytest.mark.parametrize(
    "table, message",
    [
        ({"matmul": {"k": [512], "n": [512], "flops": [[1e12, 2e12]]}}, "matmul.flops: each row one FLOP/s per n (1)"),
        ({"matmul": {"k": [2048, 512], "n": [512], "flops": [[1], [1]]}}, "matmul.k: sizes in increasing order"),
        ({"matmul": {"k": [512], "n": [512], "flops": [[None]]}}, "matmul.flops: every entry is null"),
        ({"matmul": {"k": [512], "n": [512], "flops": [[-3.0]]}}, "matmul.flops: positive FLOP/s or null"),
        ({"conv": {"k": [1], "n": [1], "flops": [[1.0]]}}, "conv: not an op kind; the kinds are matmul, "),
        (
            {"attention": {"seq": [], "head_dim": [64], "flops": []}},
            "attention.seq: a non-empty list of positive sizes",
        ),
    ],
)
def test_a_malformed_table_is_one_line_naming_the_key(table, message):
    assert op_rates.check(GRID) is None
    with pytest.raises(ConfigError) as e:
        load_group("hardware", OmegaConf.create({"name": "x", "op_rates": table}))
    assert f"hardware.op_rates.{message}" in str(e.value) and "\n" not in str(e.value)
    assert "measure_hardware" in str(e.value)


def test_every_tag_a_matmul_or_attention_produces_declares_its_op():
    """A producer without an op would be priced at the step's rate whatever the table says: only
    elementwise producers (norms: a few FLOPs per element) may go without."""
    for name in ("llama_tiny_a", "dsv3_tiny_a", "gemma3_tiny_a", "gpt_oss_tiny_a", "qwen3_moe_tiny_a"):
        c = zoo.get_size(name)
        for stack in {s for s, *_ in stack_layout(c)}:
            emits = stack_emits(c, stack)
            for tag in emitted_tags(c):
                if tag not in emits or TAGS[tag].name == "decoder_layer_input":
                    continue
                op = producer_op(c, tag, stack, 2, 64)
                flops = producer_flops(c, tag, stack, 2, 64)
                if op is None:
                    assert flops <= 5 * 2 * 64 * c.hidden_size, (name, tag)
                else:
                    kind, a, b = op
                    assert kind in op_rates.AXES and a > 0 and b > 0, (name, tag, op)


def test_the_planner_prices_each_producer_at_its_measured_rate():
    from zoo.tools.kit import prepare_step

    c, _, _, trainer, _ = prepare_step(
        [
            "model=llama_tiny_a",
            "mesh=single",
            "data.batch_size=2",
            "data.seq_len=128",
            "hardware=h100_pcie",
            "model.attention_impl=blockwise",
        ]
    )
    base, _ = problem_from_config(c, trainer, PlanConfig())
    m, (stack,) = trainer.cfg.model, base.stacks
    layers = base.stacks[stack].layers

    def planned(table):
        hw = dataclasses.replace(c.hardware, op_rates=table)
        return problem_from_config(dataclasses.replace(c, hardware=hw), trainer, PlanConfig())

    # attention 4x slower than the problem's rate, measured with the kernel this run uses
    table = {"attention": {"impl": "blockwise", "seq": [128], "head_dim": [m.qk_head_dim], "flops": [[base.rate / 4]]}}
    p, info = planned(table)
    context = producer_flops(m, "context", stack, 2, 128)
    costs = {t.tag: t.recompute_flops_per_layer[stack] for t in p.tags}
    assert costs["context"] == pytest.approx(4 * context)
    assert all(costs[t.tag] == t.recompute_flops_per_layer[stack] for t in base.tags if t.tag != "context")
    assert p.stacks[stack].forward_flops_per_layer == pytest.approx(
        base.stacks[stack].forward_flops_per_layer + 3 * context
    )
    assert p.step_flops == pytest.approx(base.step_flops + 3 * layers * 3 * context)
    assert "hardware.op_rates: attention (blockwise)" in info["rate_source"]
    # the forward alone measured at twice the rate: the recompute (a forward) at it, the step's
    # forward and backward still at the value-and-gradient rate
    forward = {"attention_forward": {**table["attention"], "flops": [[base.rate / 2]]}}
    p_fwd, _ = planned({**table, **forward})
    costs = {t.tag: t.recompute_flops_per_layer[stack] for t in p_fwd.tags}
    assert costs["context"] == pytest.approx(2 * context) and p_fwd.step_flops == pytest.approx(p.step_flops)
    # measured with another kernel than the run's: not this run's rate
    other = {"attention": {**table["attention"], "impl": "splash"}}
    assert planned(other)[0].step_flops == base.step_flops
    # matmuls at half the rate: the projections, the MLP and the head take twice their time
    p, _ = planned({"matmul": {"k": [1], "n": [1], "flops": [[base.rate / 2]]}})
    head = 2 * 2 * 128 * m.hidden_size * m.vocab_size
    matmuls = base.stacks[stack].forward_flops_per_layer - context
    assert p.step_flops == pytest.approx(base.step_flops + 3 * (layers * matmuls + head))
    assert math.isclose(p.rate, base.rate)
    # a measured profile: a measured op runs at step_efficiency of its rate, as the rest do of matmul_flops
    table = {"matmul": {"k": [1], "n": [1], "flops": [[base.rate]]}}
    hw = dataclasses.replace(c.hardware, matmul_flops=4 * base.rate, step_efficiency=0.5, op_rates=table)
    p, info = problem_from_config(dataclasses.replace(c, hardware=hw), trainer, PlanConfig())
    assert p.rate == pytest.approx(2 * base.rate) and "each op at 0.5 x its measured rate" in info["rate_source"]
    assert p.step_flops == pytest.approx(base.step_flops + 3 * 3 * (layers * matmuls + head))
    # a profile where a recompute costs a quarter of its time: every tag's recompute, nothing else
    hw = dataclasses.replace(c.hardware, recompute_cost=0.25)
    p, info = problem_from_config(dataclasses.replace(c, hardware=hw), trainer, PlanConfig())
    assert {t.tag: t.recompute_flops_per_layer for t in p.tags} == {
        t.tag: {s: pytest.approx(f / 4) for s, f in t.recompute_flops_per_layer.items()} for t in base.tags
    }
    assert p.step_flops == base.step_flops and "recompute_cost 0.25" in info["rate_source"]


def test_the_planner_prices_memory_bound_work_by_passes_over_the_activations():
    """`hardware.activation_passes` adds, to every policy's compute, that many passes over the layers'
    activations (every tag and what `none` keeps besides) at `hbm_gbps`; `recompute_passes` adds, to
    a policy that checkpoints, that many again (the forward run twice), whatever its tags' places,
    and nothing to `none`."""
    from zoo.offload import load_preset
    from zoo.tools.kit import prepare_step

    args = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=128", "hardware=h100_pcie"]
    estimates = {}
    for policy in ("none", "full", "minimal"):
        c, _, _, trainer, _ = prepare_step([*args, f"offload={policy}"])
        for passes in ((0.0, 0.0), (3.0, 2.0)):
            hw = dataclasses.replace(c.hardware, hbm_gbps=1.0, activation_passes=passes[0], recompute_passes=passes[1])
            planned = dataclasses.replace(c, hardware=hw)
            estimates[policy, passes] = policy_estimate(planned, trainer, PlanConfig())
    p_none, _, _ = estimates["none", (0.0, 0.0)]
    activations = p_none.other_bytes + sum(tag_totals(p_none, t) for t in p_none.tags)
    for policy in ("none", "full", "minimal"):
        (_, base, _), (p, e, _) = estimates[policy, (0.0, 0.0)], estimates[policy, (3.0, 2.0)]
        assert p.memory_s == pytest.approx(3 * activations / 1e9) and p.memory_s > 0
        assert e.compute_s == pytest.approx(base.compute_s + p.memory_s)
        rerun = 0.0 if policy == "none" else 2 * activations / 1e9
        assert e.recompute_s == pytest.approx(base.recompute_s + rerun)
    assert not load_preset("none").checkpoint and load_preset("full").checkpoint
    # `none`'s estimate derived from a checkpointing policy's problem (what zoo.tools.plan's note
    # uses, no second trace) is the one `offload=none` gets traced on its own
    c, _, _, trainer, _ = prepare_step([*args, "offload=full"])
    hw = dataclasses.replace(c.hardware, hbm_gbps=1.0, activation_passes=3.0, recompute_passes=2.0)
    p_full, info = problem_from_config(dataclasses.replace(c, hardware=hw), trainer, PlanConfig())
    derived, traced = none_estimate(p_full, info["none_residual_bytes"]), estimates["none", (3.0, 2.0)][1]
    assert derived.time_s == pytest.approx(traced.time_s) and derived.peak_bytes == pytest.approx(traced.peak_bytes)


@pytest.mark.parametrize("dispatch_s", [0.5, 10.0])
def test_each_op_rate_is_its_own_ops_flops_over_its_own_time(monkeypatch, dispatch_s):
    """Every entry is the FLOPs of its own op and shape over the time of one copy of it inside a
    program, the call's own dispatch taken out (a timer that runs the program and reports the
    dispatch plus 1 s a copy leaves the FLOPs; without the subtraction they would be 2/3 or 1/11 of
    them; a dispatch ten times an op's is timed with more copies): the experts' two kernels differ in
    rows here (the capacity buffers hold rows // groups each), so one kind's table filed under
    another shows."""
    import jax

    from zoo.config import attended_keys
    from zoo.tools import measure_hardware as mh

    copies = []

    def a_second_a_copy(call, repeats):
        """A call's dispatch takes `dispatch_s`, each copy of the op in it 1 s."""
        copies.append(len(jax.block_until_ready(call())))
        return dispatch_s + copies[-1]

    monkeypatch.setattr(mh, "median_time", a_second_a_copy)
    # At most 5 copies, not 32: the cap is what a large dispatch reaches either way, and a program of 32
    # copies of every shape's gradient took 3.7x the CPU time of this whole test at 5 (29 -> 8 s).
    monkeypatch.setattr(mh, "MAX_COPIES", 5)
    grid = {
        "matmul_rows": 16,
        "widths": (8, 16),
        "grouped_rows": 30,
        "groups": 4,
        "grouped_widths": (8,),
        "attention_tokens": 512,
        "attention_heads": 2,
        "seqs": (256,),
        "head_dims": (32,),
    }
    table = mh.measure_op_rates(repeats=1, grid=grid)
    assert op_rates.check(table) is None and set(op_rates.AXES) <= set(table)
    assert table["attention"]["impl"] == "blockwise"  # what model.attention_impl=auto runs here
    hw = HardwareConfig(name="m", op_rates=table)  # a table the profile accepts and the planner reads
    assert op_rates.rate(hw.op_rates, "matmul", 12, 12) > 0
    assert table["matmul"]["flops"] == [[6.0 * 16 * k * n for n in (8, 16)] for k in (8, 16)]
    assert table["grouped_matmul"]["flops"] == [[6.0 * 30 * 8 * 8]]
    assert table["grouped_matmul_forward"]["flops"] == [[2.0 * 30 * 8 * 8]]
    assert table["capacity_einsum"]["flops"] == [[6.0 * 28 * 8 * 8]] and table["capacity_einsum"]["rows"] == 28
    assert table["attention"]["flops"] == [[3 * 2.0 * 2 * 256 * attended_keys(256, None) * 2 * 64]]
    assert table["attention_forward"]["flops"] == [[2.0 * 2 * 256 * attended_keys(256, None) * 2 * 64]]
    assert max(copies) == (3 if dispatch_s < 1 else mh.MAX_COPIES)


def test_measure_hardware_writes_what_it_measured_as_it_goes_and_only_the_grids_asked_for(tmp_path, monkeypatch):
    """`op_kinds` picks the grids; the profile is written before the grids and after each one (a run
    stopped midway leaves a profile train.py loads, with the grids measured so far), a grid where no
    shape ran is left out, and a kind that is not one is one line, exit 2, before anything runs."""
    import jax
    import yaml

    from zoo.tools import measure_hardware as mh

    def timer(call, repeats):  # after the first grid every shape fails: a kernel this device lacks
        if broken:
            raise RuntimeError("RESOURCE_EXHAUSTED: no such kernel here")
        out = jax.block_until_ready(call())
        return 0.5 + len(out) if isinstance(out, list) else 1.0  # an op-rate program: 1 s a copy

    broken, written = [], []
    monkeypatch.setattr(mh, "median_time", timer)
    monkeypatch.setitem(mh.OP_GRID, "cpu", {**mh.OP_GRID["cpu"], "matmul_rows": 16, "widths": (8, 16)})

    def write(profile):
        written.append(profile)
        if "op_rates" in profile:
            broken.append(True)

    opts = mh.MeasureOptions(name="t", n=64, transfer_mb=1.0, repeats=1, op_kinds=["matmul", "attention"])
    final = mh.measure(opts, write=write)
    assert [sorted(p.get("op_rates", {})) for p in written] == [[], ["dtype", "matmul"], ["dtype", "matmul"]]
    assert all("still being measured" in p["note"] for p in written) and "still" not in final["note"]
    assert sorted(final["op_rates"]) == ["dtype", "matmul"]  # attention: no shape ran, left out
    assert final["op_rates"]["matmul"]["flops"] == [[6.0 * 16 * k * n for n in (8, 16)] for k in (8, 16)]
    for p in (*written, final):  # each one a profile train.py accepts
        load_group("hardware", OmegaConf.create(yaml.safe_load(mh.to_yaml(p))))
    out = tmp_path / "x.yaml"
    assert mh.main([f"out={out}", "op_kinds=[matmul,attn]"]) == 2 and not out.exists()
