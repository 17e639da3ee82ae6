"""A tag's host transfer priced exposed unless the hardware measured it hidden (`Problem.overlapped`,
hardware.hidden_transfers, plan.transfers), which figures the plan says are measured, the batch
searched with the policy (zoo.plan.batch), and the hidden tags fitted from a record (bench/step_fit.py)."""

import dataclasses

import pytest

from bench import step_fit
from zoo.plan.batch import batch_candidates, best_batch, search_batches
from zoo.plan.cost import evaluate
from zoo.plan.options import PlanConfig, hidden_transfers
from zoo.plan.problem import GB, PlanError, Problem, StackCost, TagCost
from zoo.plan.search import search

MB = 1e6
LAYERS = 10


def problem(overlapped=None, batch=1, budget_gb=100.0):
    """Two tags of 100 MB per layer (x batch) over a 900 GB/s link, each 10 ms of compute to hide behind."""
    flops = 1e12 * batch
    return Problem(
        tags=[TagCost(t, {"s": 100 * MB * batch}, {"s": 1e12 * batch}) for t in ("a", "b")],
        stacks={"s": StackCost(layers=LAYERS, forward_flops_per_layer=flops)},
        rate=1e14,
        link=900 * GB,
        budget=budget_gb * GB,
        step_flops=3 * flops * LAYERS,
        param_bytes=1 * GB,
        overlapped=overlapped,
    )


def test_a_transfer_is_exposed_whole_unless_measured_hidden():
    xfer = 100 * MB / (900 * GB) + 10e-6
    assert evaluate(problem(None), {"a": "offload", "b": "remat"}).exposed_transfer_s == 0
    assert evaluate(problem(frozenset({"a"})), {"a": "offload", "b": "remat"}).exposed_transfer_s == 0
    exposed = evaluate(problem(frozenset({"a"})), {"a": "remat", "b": "offload"})
    assert exposed.exposed_transfer_s == pytest.approx(LAYERS * 2 * xfer)
    # its recompute is still priced beside (a regression: an exposed tag's recompute once went uncounted)
    assert exposed.recompute_s == pytest.approx(LAYERS * 1e12 / 1e14)


def test_plan_transfers_names_where_the_hidden_tags_come_from(tmp_path):
    (tmp_path / "fast.yaml").write_text("host_link_gbps: 64\nhidden_transfers: [context]\n")
    assert hidden_transfers(PlanConfig(), ["query_proj"]) == {"query_proj"}
    assert hidden_transfers(PlanConfig(transfers="exposed"), ["query_proj"]) == frozenset()
    assert hidden_transfers(PlanConfig(transfers="overlapped"), []) is None
    assert hidden_transfers(PlanConfig(link="fast"), ["query_proj"], tmp_path) == {"context"}
    assert hidden_transfers(PlanConfig(link="pcie_gen5"), ["query_proj"], tmp_path) == frozenset()
    with pytest.raises(PlanError, match="plan.transfers: got 'some'"):
        PlanConfig(transfers="some")


def test_the_plan_says_which_figures_are_measured_and_which_assumed(capsys, tmp_path):
    from zoo.tools import plan as zp

    args = ["model=llama_tiny_a", "mesh=single", "data.batch_size=4", "data.seq_len=64", "hardware=tpu_v5e",
            "plan.compile=0", "plan.hbm_budget_gb=1", f"plan.out={tmp_path / 'p.yaml'}"]  # fmt: skip
    assert zp.main(args) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("figures measured:"))
    assert "the matmul rate (hardware.matmul_flops of tpu_v5e)" in line
    hidden = line.split("transfers hidden behind compute: ")[1].split(" (")[0].split(", ")
    exposed = line.split("transfers exposed whole, both ways: ")[1].split(" (")[0].split(", ")
    assert "query_proj" in hidden and "key_proj" in exposed and not set(hidden) & set(exposed)
    assert "(not measured hidden)" in line and "10 us per transfer (plan.transfer_latency_us)" in line


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


def test_the_fit_names_the_tags_whose_transfers_the_runs_show_hidden():
    """Synthetic runs: `a` offloaded ran as if hidden, `b` as if exposed whole; the fit finds {a}."""
    values = dict(step_fit.UNIT)
    samples = []
    for i, assignment in enumerate(({"a": "offload", "b": "remat"}, {"a": "remat", "b": "offload"},
                                    {"a": "offload", "b": "offload"})):  # fmt: skip
        truth = evaluate(problem(frozenset({"a"})), assignment).time_s
        samples.append(step_fit.Sample("synthetic", str(i), truth, problem(frozenset()), assignment))
    assert step_fit.fit_hidden(samples, values) == ["a"]
    evidence = {e.tag: e for e in step_fit.transfer_evidence(samples, values, ["a"])}
    assert evidence["a"].hidden and not evidence["b"].hidden


def test_a_profile_naming_no_tag_among_its_hidden_transfers_is_one_line():
    from types import SimpleNamespace

    from zoo.plan.traced import overlapped_tags

    c = SimpleNamespace(hardware=SimpleNamespace(hidden_transfers=["context", "contxt"]))
    with pytest.raises(PlanError, match=r"^hardware.hidden_transfers: 'contxt' is no tag \(zoo.tags\)"):
        overlapped_tags(c, PlanConfig())
    assert overlapped_tags(SimpleNamespace(hardware=SimpleNamespace(hidden_transfers=["context"])), PlanConfig()) == {
        "context"
    }


def test_the_fit_rewrites_the_hidden_tags_in_place_with_their_comment(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("".join(f"{k}: 1.0\n" for k in step_fit.FITTED) + "hidden_transfers: []  # the fit's\nname: x\n")
    values = {"step_efficiency": 0.9, "recompute_cost": 0.3, "activation_passes": 6.0, "recompute_passes": 4.0}
    text = step_fit.rewrite_profile(path, values, ["query_proj", "context"])
    assert "hidden_transfers: [query_proj, context]  # the fit's\nname: x\n" in text and "recompute_cost: 0.3\n" in text
    path.write_text("step_efficiency: 1.0\n")
    with pytest.raises(ValueError, match="no top-level `recompute_cost:` line"):
        step_fit.rewrite_profile(path, values)
