"""The planner's host memory (budget, per-device and per-node figures) and its account of who holds
the memory when a plan does not fit: constructed problems, then the command line."""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest

from zoo.plan.cost import estimates_table, evaluate
from zoo.plan.holders import best_changes, holders, holders_table
from zoo.plan.problem import CHOICES, GB, FixedRange, Infeasible, Problem, StackCost, TagCost, fmt_bytes
from zoo.plan.search import search
from zoo.plan.working_set import largest_block
from zoo.tools import plan as zp

MB = 1e6
LAYERS = 10


def make_problem(
    tags, *, budget_gb=100.0, host_budget_gb=float("inf"), link_gbps=900.0, layer_flops=1e12, devices_per_node=1
):
    """One stack of LAYERS layers; `tags`: name -> (MB per layer, recompute FLOPs per layer, choices)."""
    return Problem(
        tags=[TagCost(t, {"s": b * MB}, {"s": f}, choices) for t, (b, f, choices) in tags.items()],
        stacks={"s": StackCost(layers=LAYERS, forward_flops_per_layer=layer_flops, layer_range="3-12")},
        rate=1e14,
        link=link_gbps * GB,
        budget=budget_gb * GB,
        step_flops=3 * layer_flops * LAYERS,
        param_bytes=1 * GB,
        grad_bytes=1 * GB,
        host_budget=host_budget_gb * GB,
        devices_per_node=devices_per_node,
    )


KEEP_OR_OFFLOAD = ("device", "offload")  # like the layer input: it cannot be recomputed


def test_host_budget_refuses_the_only_assignment_that_fits_hbm():
    # 1 GB of a tag that cannot be recomputed; 2 GB of fixed state. HBM 2.5 GB: only offloading fits it,
    # and that puts 1 GB per device in host memory, over the 0.5 GB budget.
    p = make_problem({"x": (100, 0.0, KEEP_OR_OFFLOAD)}, budget_gb=2.5, host_budget_gb=0.5, devices_per_node=4)
    offloaded = evaluate(p, {"x": "offload"})
    assert offloaded.peak_bytes <= p.budget and offloaded.host_bytes == pytest.approx(1 * GB)
    with pytest.raises(Infeasible) as e:
        search(p)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1
    assert msg.startswith(
        "plan.host_budget_gb: no policy within the HBM budget of 2.500 GB fits the host budget of 0.500 GB per device "
        "(2.000 GB per node of 4); the smallest host memory such a policy needs is 1.000 GB per device (4.000 GB per "
        "node; offload: x)"
    ), msg
    # ... and the smallest of each budget that would do: host 1 GB with this HBM, or HBM 3 GB with this host budget.
    assert "raise plan.host_budget_gb to at least 1.000, or plan.hbm_budget_gb to at least 3.000" in msg
    assert (
        e.value.budget == "host"
        and e.value.min_host_bytes == pytest.approx(1 * GB)
        and e.value.min_bytes == pytest.approx(3 * GB)
    )
    for fix in (
        dataclasses.replace(p, host_budget=e.value.min_host_bytes),
        dataclasses.replace(p, budget=e.value.min_bytes),
    ):
        best = search(fix)
        assert best.peak_bytes <= fix.budget and best.host_bytes <= fix.host_budget


def test_host_budget_turns_offloads_into_recomputation():
    # A fast link hides the transfers: without a host budget the tags go to host (no recompute);
    # with one that holds only one of them, the other is recomputed.
    # (The HBM budget holds the state and one layer of both in flight, not a tag kept in every layer.)
    tags = {"a": (100, 1e12, CHOICES), "b": (100, 1e12, CHOICES)}
    free = search(make_problem(tags, budget_gb=2.25))
    assert free.assignment == {"a": "offload", "b": "offload"} and free.host_bytes == pytest.approx(2 * GB)
    tight = search(make_problem(tags, budget_gb=2.25, host_budget_gb=1.5))
    assert sorted(tight.assignment.values()) == ["offload", "remat"] and tight.host_bytes == pytest.approx(1 * GB)
    assert tight.recompute_s > 0


def test_both_budgets_failing_names_both():
    # 1 GB of optimizer state on host (the stacks', 0.1 GB a layer): no assignment fits 0.5 GB of host
    # memory; the parameters and gradients need 2 GB of HBM, the streamed update 0.2 GB more.
    p = make_problem({"x": (100, 0.0, KEEP_OR_OFFLOAD)}, budget_gb=1.0, host_budget_gb=0.5)
    p.opt_bytes = p.stack_opt_bytes = 1 * GB
    p.stacks["s"].opt_bytes_per_layer = 0.1 * GB
    p.opt_on_host = True
    with pytest.raises(Infeasible) as e:
        search(p)
    msg = str(e.value)
    assert msg.startswith(
        "plan.hbm_budget_gb: no policy fits 1.000 GB, and none of the smallest fits the host budget of 0.500 GB per "
        "device"
    )
    # the smallest HBM (the tag offloaded) and the host memory that assignment needs (tag + state)
    assert "raise plan.hbm_budget_gb to at least 2.200 and plan.host_budget_gb to at least 2.000" in msg
    assert e.value.budget == "hbm"


def test_host_bytes_per_device_and_per_node():
    """Offloaded tags for one microbatch, host-resident parameters with the stacks' gradients (and one
    microbatch's arriving to be summed in), host-resident optimizer state, the input staging; a node
    holds devices_per_node times that."""
    p = make_problem({"a": (100, 1e12, CHOICES), "b": (50, 1e12, CHOICES)}, devices_per_node=4)
    p.stack_param_bytes = 0.8 * GB
    p.stacks["s"].param_bytes_per_layer = 0.08 * GB
    p.opt_bytes, p.stack_opt_bytes = 2 * GB, 1.6 * GB
    p.staging_bytes = 3 * MB
    p.microbatches = 4
    on_device = evaluate(p, {"a": "offload", "b": "remat"})
    assert on_device.host_bytes == pytest.approx(100 * MB * LAYERS + 3 * MB)  # one microbatch's tags, not four
    p.params_on_host = p.opt_on_host = True
    e = evaluate(p, {"a": "offload", "b": "offload"})
    want = 150 * MB * LAYERS + 1 * GB + 0.8 * GB + 0.8 * GB + 2 * GB + 3 * MB
    assert e.host_bytes == pytest.approx(want)
    assert e.host_node_bytes == pytest.approx(4 * want)
    table = estimates_table(p, e)
    assert f"estimated host memory {fmt_bytes(want)} per device, {fmt_bytes(4 * want)} per node of 4" in table


def test_holders_rank_the_biggest_first_and_the_best_change_saves_what_the_estimates_say():
    p = make_problem(
        {"small": (10, 1e9, CHOICES), "big": (300, 1e9, CHOICES), "mid": (40, 1e9, CHOICES)}, budget_gb=1.0
    )
    p.opt_bytes = 0.5 * GB
    with pytest.raises(Infeasible) as e:
        search(dataclasses.replace(p, tags=[dataclasses.replace(t, choices=("device",)) for t in p.tags]))
    kept = e.value.best  # everything on device: 3.5 GB of tags + 2.5 GB of state
    held = holders(p, kept)
    assert held[0].name == "tag big (s, layers 3-12)" and held[0].bytes == pytest.approx(300 * MB * LAYERS)
    assert [h.bytes for h in held] == sorted((h.bytes for h in held), reverse=True)
    assert sum(h.bytes for h in held) == pytest.approx(kept.peak_bytes)  # every byte of the peak has a holder
    first = best_changes(p, kept)[0]
    assert first.action.startswith("recompute tag big")
    assert first.saving == pytest.approx(kept.peak_bytes - evaluate(p, {**kept.assignment, "big": "remat"}).peak_bytes)
    assert first.saving == pytest.approx(300 * MB * LAYERS)


def test_an_offloaded_tag_holds_its_next_layer_in_flight():
    """Offloading costs no kept bytes but one layer of the tag on the device (the next layer's copy
    coming back while this layer's backward runs), counted once, beside the kept tags, and listed as
    a holder; recomputing it costs neither."""
    p = make_problem({"a": (300, 1e9, CHOICES), "b": (40, 1e9, CHOICES)})
    remat = evaluate(p, {"a": "remat", "b": "remat"})
    off = evaluate(p, {"a": "offload", "b": "offload"})
    assert remat.offload_in_flight_bytes == 0 and off.device_tag_bytes == remat.device_tag_bytes == 0
    assert off.offload_in_flight_bytes == pytest.approx(340 * MB)  # one layer of each, not LAYERS
    assert off.backward_phase_bytes - remat.backward_phase_bytes == pytest.approx(340 * MB)
    held = {h.name: h.bytes for h in holders(p, off)}
    assert held["offloaded tags in flight (the next layer's, coming back)"] == pytest.approx(340 * MB)
    assert sum(held.values()) == pytest.approx(off.peak_bytes)


def test_the_working_set_counts_a_layers_largest_block_once_more():
    """The layers' working set: one layer's intermediates, the gradients of its largest block (MLA's
    latents count with the attention, an MoE's routed and shared experts together) and the attention
    transient."""
    from types import SimpleNamespace

    from zoo.tags import MLA_KV, MOE_MLPWI_0, QUERY_PROJ

    def tag(name, mb):
        return SimpleNamespace(tag=name, bytes_per_layer={"s": mb * MB})

    attention_heavy = [tag(QUERY_PROJ, 30), tag(MLA_KV, 20), tag("mlpwi_0", 40), tag(MOE_MLPWI_0, 5)]
    assert largest_block(attention_heavy, "s") == pytest.approx(50 * MB)
    ffn_heavy = [tag(QUERY_PROJ, 30), tag("mlpwi_0", 20), tag(MOE_MLPWI_0, 15), tag("decoder_layer_input", 99)]
    assert largest_block(ffn_heavy, "s") == pytest.approx(35 * MB)  # the layer input is no block's
    assert largest_block(ffn_heavy, "other") == 0


def test_a_state_preset_is_named_when_it_frees_the_most():
    p = make_problem({"a": (10, 1e9, CHOICES)}, budget_gb=1.0)
    p.opt_bytes = p.stack_opt_bytes = 10 * GB
    p.stacks["s"].opt_bytes_per_layer = 1 * GB
    e = evaluate(p, {"a": "remat"})
    assert holders(p, e)[0].name == "optimizer state"
    first = best_changes(p, e)[0]
    assert first.action == "offload.opt_state=pinned_host"
    assert first.saving == pytest.approx(
        e.peak_bytes - evaluate(dataclasses.replace(p, opt_on_host=True), e.assignment).peak_bytes
    )
    assert "what would free the most" in holders_table(p, e)


def test_host_holders_and_what_frees_host_memory():
    p = make_problem({"x": (100, 0.0, KEEP_OR_OFFLOAD), "y": (30, 1e9, CHOICES)}, host_budget_gb=0.1)
    p.opt_bytes = 0.5 * GB
    p.opt_on_host = True
    e = evaluate(p, {"x": "offload", "y": "offload"})
    held = holders(p, e, "host")
    assert [h.name for h in held] == ["tag x (s, layers 3-12)", "optimizer state", "tag y (s, layers 3-12)"]
    changes = {c.action: c.saving for c in best_changes(p, e, "host")}
    assert changes["offload.opt_state=device"] == pytest.approx(0.5 * GB)
    assert changes["recompute tag y (tags.y: remat)"] == pytest.approx(0.3 * GB)
    assert changes["keep on device tag x (tags.x: device)"] == pytest.approx(1 * GB)


# --- the command line ----------------------------------------------------------------------------

BASE = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16", "hardware=h100_pcie"]


def test_cli_host_overrun_is_one_line_then_the_holders(tmp_path, capsys):
    ample = tmp_path / "ample.json"
    assert zp.main([*BASE, "plan.hbm_budget_gb=80", f"plan.out={tmp_path / 'a.yaml'}", f"plan.json={ample}"]) == 0
    got = json.loads(ample.read_text())
    assert (
        got["info"]["host_budget_bytes"] == 250e9 and got["info"]["devices_per_node"] == 1
    )  # one device of an 8-GPU node
    est = got["estimate"]
    # HBM for the state and one layer's input in flight (just above): the layer input, which cannot be
    # recomputed, has to go to host, where a budget of 1 kB does not hold it.
    fixed = est["peak_bytes"] - est["device_tag_bytes"]
    (inputs,) = [h["bytes"] for h in got["holders"]["hbm"] if h["name"].startswith("tag decoder_layer_input")]
    capsys.readouterr()
    args = [
        *BASE,
        f"plan.hbm_budget_gb={(fixed + inputs / 2 + 1) / GB}",  # llama_tiny_a: two layers
        "plan.host_budget_gb=0.000001",
        f"plan.out={tmp_path / 'x.yaml'}",
    ]
    assert zp.main(args) == 2
    out, err = capsys.readouterr()
    err = err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: plan.host_budget_gb: no policy within the HBM budget of"), err
    assert "decoder_layer_input" in err[0] and "raise plan.host_budget_gb to at least" in err[0]
    assert "who holds the host memory" in out and "  tag decoder_layer_input (dense_layers, layers 0-1)" in out
    assert "keep on device tag decoder_layer_input" in out
    assert not (tmp_path / "x.yaml").exists()


def test_cli_prints_the_holders_when_asked(tmp_path, capsys):
    assert zp.main([*BASE, "plan.hbm_budget_gb=80", "plan.holders=true", f"plan.out={tmp_path / 'a.yaml'}"]) == 0
    out = capsys.readouterr().out
    assert "who holds the HBM" in out and "estimated host memory" in out and "per node of 1" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan.host_budget_gb=-1"], "error: plan.host_budget_gb: must be positive (GB per device; "),
        (["plan.host_budget_gb=lots"], "error: plan.host_budget_gb: Value 'lots'"),
        (["hardware.host_bytes_per_device=-5"], "error: hardware.host_bytes_per_device: must be >= 0"),
        (["hardware.devices_per_node=0"], "error: hardware.devices_per_node: must be >= 1"),
        (["+hardware.recompute_cost=1.5"], "error: hardware.recompute_cost: a fraction of a recompute's time"),
        (["+hardware.activation_passes=6"], "error: hardware.activation_passes: prices memory-bound"),
        (["+hardware.recompute_passes=-1"], "error: hardware.recompute_passes: must be >= 0"),
        (["+hardware.activation_passes=nan"], "error: hardware.activation_passes: must be >= 0"),
        (["hardware.peak_flops=nan"], "error: hardware.peak_flops: must be positive and finite, got nan"),
        (["hardware.peak_flops=inf"], "error: hardware.peak_flops: must be positive and finite, got inf"),
        (["hardware.matmul_flops=-1"], "error: hardware.matmul_flops: must be positive and finite, or null"),
        (["hardware.hbm_bytes=-1"], "error: hardware.hbm_bytes: must be >= 0"),
        (["hardware.host_link_gbps=-5"], "error: hardware.host_link_gbps: GB/s per direction, >= 0"),
        (["+hardware.hbm_gbps=nan"], "error: hardware.hbm_gbps: must be positive or null"),
        # every plan.* number by its range (zoo.ranges): NaN and inf were taken, NaN budgets as "no policy fits"
        (["plan.hbm_budget_gb=nan"], "error: plan.hbm_budget_gb: must be positive (null takes the hardware profile"),
        (["plan.host_budget_gb=inf"], "error: plan.host_budget_gb: must be positive (GB per device; "),
        (["plan.transfer_latency_us=nan"], "error: plan.transfer_latency_us: must be >= 0, got nan"),
        (["plan.batch_limit=99999999999999999999"], "error: plan.batch_limit: must be >= 1 (the largest per-device "),
        (["plan.name=.."], "error: plan.name: '..' is not a file stem"),
        (["plan.link=nan"], "error: plan.link: must be positive and finite GB/s per direction, got nan"),
    ],
)
def test_cli_bad_host_and_hardware_settings_are_one_line(args, message, capsys):
    assert zp.main([*BASE, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_llama_405b_on_gb200_stays_within_the_host_memory_of_a_compute_tray(tmp_path):
    """The issue's command (abstract shapes: nothing is allocated or compiled), with GB200's host budget
    and a tighter one. It used to 'fit' by putting 1.4 TB of tags per device on host (the tags counted
    whole, not split over tensor): a GB200 tray has 2 x 480 GB of Grace memory for 4 GPUs, 240 GB each.
    The tight budget is below what the GB200 plan puts on host, so it has to bind. One process for both
    plans, its own, since xla.cpu_devices=128 has to reach XLA before JAX starts."""
    args = [
        "model=llama3.1_405b",
        "xla.cpu_devices=128",
        "mesh=llama3.1_405b_128",
        "data.batch_size=1024",
        "data.seq_len=4096",
        "trainer.grad_accum=8",
        "hardware=gb200",
        # Every transfer priced hidden behind compute (nothing is measured on a GB200 yet, and exposed
        # transfers would keep the tags on device): the plan then leans on host memory, so the budget binds.
        "plan.transfers=overlapped",
        f"plan.out={tmp_path / 'p.yaml'}",
    ]
    runs = {
        "tight": [*args, "plan.host_budget_gb=100", f"plan.json={tmp_path / 'tight.json'}"],
        "gb200": [*args, f"plan.json={tmp_path / 'gb200.json'}"],
    }
    script = f"import sys; from zoo.tools.plan import main; sys.exit(max(main(a) for a in {list(runs.values())!r}))"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    p = subprocess.run(
        [sys.executable, "-c", script],
        cwd=pathlib.Path(zp.__file__).parent.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads((tmp_path / "gb200.json").read_text())
    assert got["info"]["host_budget_bytes"] == 240e9 and got["info"]["devices_per_node"] == 4
    est = got["estimate"]
    assert 100e9 < est["host_bytes"] <= 240e9 and est["host_node_bytes"] == pytest.approx(4 * est["host_bytes"])
    assert est["peak_bytes"] <= got["info"]["budget_bytes"]
    tight = json.loads((tmp_path / "tight.json").read_text())["estimate"]
    assert 0 < tight["host_bytes"] <= 100e9 and tight["peak_bytes"] <= got["info"]["budget_bytes"]
    assert "per node of 4; budget 240.000 GB per device, 960.000 GB per node" in p.stdout


def test_holders_count_each_layer_range_under_its_own_preset():
    # offload.ranges: layers 3-6 (4 of the stack's 10) offload both tags, the other 6 keep them. The
    # holders' tag bytes add up to the estimate's, on device and on host, and name the range.
    p = make_problem({"a": (100, 1e9, KEEP_OR_OFFLOAD), "b": (300, 1e9, CHOICES)})
    p = dataclasses.replace(p, fixed=[FixedRange("layers 3-6 qkv", {"s": 4}, {"a": "offload", "b": "offload"})])
    e = evaluate(p, {"a": "device", "b": "device"})
    for memory, total, where in (("hbm", e.device_tag_bytes, "device"), ("host", e.host_tag_bytes, "offload")):
        tags = [h for h in holders(p, e, memory) if h.name.startswith("tag ")]
        assert sum(h.bytes for h in tags) == pytest.approx(total) and total > 0, (memory, tags)
    held = {h.name: h.bytes for h in holders(p, e, "host") if h.name.startswith("tag ")}
    assert held == {
        "tag a (s, layers 3-6 qkv)": pytest.approx(400 * MB),
        "tag b (s, layers 3-6 qkv)": pytest.approx(1200 * MB),
    }
    held = {h.name: h.bytes for h in holders(p, e, "hbm") if h.name.startswith("tag ")}
    assert held == {
        "tag a (s, 6 layers outside the ranges)": pytest.approx(600 * MB),
        "tag b (s, 6 layers outside the ranges)": pytest.approx(1800 * MB),
    }
    assert "layers 3-6 qkv" in holders_table(p, e, "host")
