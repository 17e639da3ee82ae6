"""A tag's host transfer priced behind the share of its layer's compute the hardware measured, the last
layer's exposed whole, and exposed whole where nothing was measured (`Problem.transfer_overlap`,
hardware.transfer_overlap, plan.transfers), which figures the plan says are measured, the batch searched
with the policy (zoo.plan.batch), and the share fitted from a record (bench/step_fit.py)."""

import dataclasses

import pytest

from bench import step_fit
from zoo.errors import ConfigError
from zoo.hardware import HardwareConfig
from zoo.plan.batch import batch_candidates, best_batch, search_batches
from zoo.plan.cost import evaluate
from zoo.plan.options import PlanConfig, transfer_pricing
from zoo.plan.problem import GB, FixedRange, PlanError, Problem, StackCost, TagCost
from zoo.plan.search import search

MB = 1e6
LAYERS = 10


def problem(overlap=1.0, turn=False, batch=1, budget_gb=100.0, link_gbps=900.0):
    """Two tags of 100 MB per layer (x batch), each 10 ms of compute to hide behind (a layer's forward;
    its backward twice that, and what it recomputes)."""
    flops = 1e12 * batch
    return Problem(
        tags=[TagCost(t, {"s": 100 * MB * batch}, {"s": 1e12 * batch}) for t in ("a", "b")],
        stacks={"s": StackCost(layers=LAYERS, forward_flops_per_layer=flops)},
        rate=1e14,
        link=link_gbps * GB,
        budget=budget_gb * GB,
        step_flops=3 * flops * LAYERS,
        param_bytes=1 * GB,
        transfer_overlap=overlap,
        turn_exposed=turn,
    )


def test_a_transfer_hides_behind_the_measured_share_of_compute_and_the_last_layers_is_exposed():
    slow = 9.0  # GB/s: a tag's 100 MB take 11.1 ms each way, more than the forward's 10 ms of compute
    xfer = 100 * MB / (slow * GB) + 10e-6
    a_out = {"a": "offload", "b": "remat"}
    # hidden up to the layer's compute: forward 11.1 ms behind 10, backward behind 30 (20 + b's recompute)
    assert evaluate(problem(1.0, False, link_gbps=slow), a_out).exposed_transfer_s == pytest.approx(
        LAYERS * (xfer - 0.010)
    )
    # half the compute: 5 ms forward, 15 backward; the last layer's whole, both ways
    half = evaluate(problem(0.5, True, link_gbps=slow), a_out)
    assert half.exposed_transfer_s == pytest.approx((LAYERS - 1) * (xfer - 0.005) + 2 * xfer)
    # its recompute is still priced beside (a regression: an exposed tag's recompute once went uncounted)
    assert half.recompute_s == pytest.approx(LAYERS * 1e12 / 1e14)
    # nothing measured: every layer's whole, both ways
    assert evaluate(problem(0.0, True, link_gbps=slow), a_out).exposed_transfer_s == pytest.approx(LAYERS * 2 * xfer)
    # the last layer's transfers are its range's: a range holding it that offloads nothing exposes none
    ranged = dataclasses.replace(
        problem(0.5, True, link_gbps=slow), fixed=[FixedRange("layers 9 full", {"s": 1}, {}, holds_last=True)]
    )
    e = evaluate(ranged, a_out)  # the 9 free layers offload `a`, behind half their compute
    assert e.exposed_transfer_s == pytest.approx((LAYERS - 1) * (xfer - 0.005))


def test_plan_transfers_names_where_the_share_comes_from(tmp_path):
    (tmp_path / "fast.yaml").write_text("host_link_gbps: 64\ntransfer_overlap: 0.7\n")
    assert transfer_pricing(PlanConfig(), 0.4) == (0.4, True)
    assert transfer_pricing(PlanConfig(), None) == (0.0, True)
    assert transfer_pricing(PlanConfig(transfers="exposed"), 0.4) == (0.0, True)
    assert transfer_pricing(PlanConfig(transfers="overlapped"), None) == (1.0, False)
    assert transfer_pricing(PlanConfig(link="fast"), 0.4, tmp_path) == (0.7, True)
    assert transfer_pricing(PlanConfig(link="pcie_gen5"), 0.4, tmp_path) == (0.0, True)
    with pytest.raises(PlanError, match="plan.transfers: got 'some'"):
        PlanConfig(transfers="some")
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ConfigError, match=r"^hardware.transfer_overlap: a fraction .* in \[0, 1\]"):
            HardwareConfig(transfer_overlap=bad)


def test_the_plan_says_which_figures_are_measured_and_which_assumed(capsys, tmp_path):
    import yaml

    from zoo.offload import conf_dir
    from zoo.tools import plan as zp

    share = yaml.safe_load((conf_dir() / "hardware" / "tpu_v5e.yaml").read_text())["transfer_overlap"]
    args = ["model=llama_tiny_a", "mesh=single", "data.batch_size=4", "data.seq_len=64", "hardware=tpu_v5e",
            "plan.compile=0", "plan.hbm_budget_gb=1", f"plan.out={tmp_path / 'p.yaml'}"]  # fmt: skip
    assert zp.main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("figures measured:"))
    measured, assumed = line.split("; assumed: ")
    assert "the matmul rate (hardware.matmul_flops of tpu_v5e)" in measured
    assert (
        f"transfers behind {share:.0%} of their layer's compute, the last layer's exposed "
        "(hardware.transfer_overlap of tpu_v5e)" in measured
    )
    assert "10 us per transfer (plan.transfer_latency_us)" in assumed and "transfers" not in assumed.split("10 us")[0]


def test_the_batch_search_plans_the_batch_with_the_most_tokens_per_second():
    assert batch_candidates(16) == [1, 2, 3, 4, 6, 8, 12, 16]

    def at(b):  # from 12 sequences a device, not even the fixed 1 GB fits the budget
        return problem(batch=b, budget_gb=2.0 if b <= 8 else 0.5), None

    rows = search_batches(at, seq=1, echo=lambda t: None)
    assert [r.batch for r in rows] == [1, 2, 3, 4, 6, 8, 12] and rows[-1].estimate is None
    # up to 4 both tags go to host (one layer's in flight fits); from 6 they are recomputed, fewer
    # tokens/s: of the batches at the top rate, the largest
    both = [set(r.estimate.assignment.values()) == {"offload"} for r in rows[:-1]]
    assert both == [True] * 4 + [False] * 2
    assert rows[4].tokens_per_s < rows[3].tokens_per_s == pytest.approx(rows[0].tokens_per_s)
    assert best_batch(rows).batch == 4
    # `none` where it fits and is faster than the search's pick
    none = dataclasses.replace(search(problem()), time_s=1e-6, peak_bytes=0.0, host_bytes=0.0)
    rows = search_batches(
        lambda b: (problem(batch=b, budget_gb=2.0 if b == 1 else 0.5), none if b == 1 else None), 1, echo=lambda t: None
    )
    assert rows[0].none and rows[0].estimate is none and rows[1].estimate is None and best_batch(rows).batch == 1


def test_the_fit_finds_the_share_of_compute_the_runs_hid_their_transfers_behind():
    """Synthetic runs priced at a share of 0.35 over a slow link; the fit finds 0.35 of its grid."""
    values = dict(step_fit.UNIT)
    samples = []
    for i, assignment in enumerate(({"a": "offload", "b": "remat"}, {"a": "remat", "b": "offload"},
                                    {"a": "offload", "b": "offload"}, {"a": "remat", "b": "remat"})):  # fmt: skip
        truth = evaluate(problem(0.35, True, link_gbps=9.0), assignment).time_s
        samples.append(step_fit.Sample("synthetic", str(i), truth, problem(0.0, True, link_gbps=9.0), assignment))
    share, errs = step_fit.fit_overlap(samples, values)
    assert share == 0.35 and errs[0.35] == pytest.approx(0.0, abs=1e-20) and errs[0.0] > 0 and errs[1.0] > 0
    assert step_fit.fit_overlap(samples[3:], values) == (None, {})  # no run offloads: nothing to fit
    line = step_fit.overlap_lines(samples, values, share, errs)
    assert (
        line.startswith("transfers overlap 0.35 of their layer's compute, the last layer's exposed")
        and "over 3 " in line
    )


def test_the_fit_rewrites_the_share_in_place_with_its_comment(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("".join(f"{k}: 1.0\n" for k in step_fit.FITTED) + "transfer_overlap: 0.5  # the fit's\nname: x\n")
    values = {"step_efficiency": 0.9, "recompute_cost": 0.3, "activation_passes": 6.0, "recompute_passes": 4.0}
    text = step_fit.rewrite_profile(path, values, 0.45)
    assert "transfer_overlap: 0.45  # the fit's\nname: x\n" in text and "recompute_cost: 0.3\n" in text
    path.write_text("step_efficiency: 1.0\n")
    with pytest.raises(ValueError, match="no top-level `recompute_cost:` line"):
        step_fit.rewrite_profile(path, values)
