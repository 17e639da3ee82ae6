"""`plan.split=true`: the planner searches the split point and each side's per-tag actions
(`zoo.plan.split.search_split_tags`), and the command it prints runs the split (`offload.ranges` values
that are policy files)."""

import itertools
import shlex

import jax
import jax.numpy as jnp
import pytest

import zoo
from zoo.plan.holders import holders
from zoo.plan.problem import Infeasible, Problem, StackCost, TagCost
from zoo.plan.search import search
from zoo.plan.split import search_split, search_split_tags, split_points, split_problem
from zoo.tools import plan as zp

BASE = ["model=llama_tiny_a", "mesh=single", "data.batch_size=2", "data.seq_len=16", "hardware=h100_pcie"]


def _problem(layers: dict[str, int], extra_kept: int) -> Problem:
    """Stacks of `layers` (consecutive), three tags of 100 B per layer: the layer input, query_proj
    (1 GFLOP to recompute) and mlpwi_0 (2 GFLOP). The link is so slow that offloading is ruinous;
    the HBM holds the input and mlpwi_0 in every layer and query_proj in `extra_kept` more layers."""
    stacks, first = {}, 0
    for s, n in layers.items():
        stacks[s] = StackCost(layers=n, forward_flops_per_layer=1e10, layer_range=f"{first}-{first + n - 1}")
        first += n
    tags = [
        TagCost("decoder_layer_input", {s: 100.0 for s in layers}, {}, ("device", "offload")),
        TagCost("query_proj", {s: 100.0 for s in layers}, {s: 1e9 for s in layers}),
        TagCost("mlpwi_0", {s: 100.0 for s in layers}, {s: 2e9 for s in layers}),
    ]
    total = sum(layers.values())
    return Problem(
        tags=tags,
        stacks=stacks,
        rate=1e12,
        link=1e3,
        budget=100.0 * (2 * total + extra_kept),
        step_flops=1e9,
        latency=0.0,
    )


PRESETS = {  # the three whole-layer policies a preset could be here
    "keep": {"decoder_layer_input": "device", "query_proj": "device", "mlpwi_0": "device"},
    "recompute": {"decoder_layer_input": "device", "query_proj": "remat", "mlpwi_0": "remat"},
    "offload": {"decoder_layer_input": "offload", "query_proj": "offload", "mlpwi_0": "offload"},
}


def _brute_force(p: Problem, num_layers: int) -> float:
    """The fastest split by another route: every split point, every head assignment, and `search`
    (exhaustive) over the tail's."""
    best = float("inf")
    for at in range(1, num_layers):
        for digits in itertools.product(*[t.choices for t in p.tags]):
            head = dict(zip([t.tag for t in p.tags], digits))
            q = split_problem(p, at, num_layers, head, head)
            q.fixed.pop()  # the tail's layers are free: search assigns them
            try:
                best = min(best, search(q).time_s)
            except Infeasible:
                continue
    return best


def test_a_per_tag_split_beats_every_preset_split_and_one_policy():
    """HBM for query_proj in one layer more than mlpwi_0's: one policy recomputes query_proj in all
    six layers; a split of presets at best keeps everything in three layers and recomputes both
    tags in the other three; keeping all in one layer and only query_proj recomputed in five wins."""
    p = _problem({"a": 2, "b": 4}, extra_kept=1)  # two stacks: layers 0-1 and 2-5
    whole = search(p)
    assert whole.assignment == {"decoder_layer_input": "device", "query_proj": "remat", "mlpwi_0": "device"}
    presets = search_split(p, PRESETS, 6)
    split = search_split_tags(p, 6)
    e = split.estimate
    assert e.peak_bytes <= p.budget and e.host_bytes <= p.host_budget
    assert e.recompute_s == pytest.approx(5e-3)  # query_proj recomputed in five layers
    assert e.time_s < whole.time_s - 0.5e-3 and e.time_s < presets.estimate.time_s - 0.5e-3
    assert {split.head_assignment["query_proj"], split.tail_assignment["query_proj"]} == {"device", "remat"}
    assert e.time_s == pytest.approx(_brute_force(p, 6), abs=1e-6)
    # The estimate accounts for each range: its holders are the two ranges' tags, adding up.
    q = split_problem(p, split.at, 6, split.head_assignment, split.tail_assignment)
    tag_holders = [h for h in holders(q, e, "hbm") if h.name.startswith("tag ")]
    assert sum(h.bytes for h in tag_holders) == pytest.approx(e.device_tag_bytes) == pytest.approx(p.budget)
    labels = {r.label for r in q.fixed}
    assert all(any(label in h.name for label in labels) for h in tag_holders)
    for r in q.fixed:  # per range: its layers times its kept tags' bytes per layer
        kept = sum(
            100.0
            for a in (split.head_assignment if r is q.fixed[0] else split.tail_assignment).values()
            if a == "device"
        )
        assert sum(h.bytes for h in tag_holders if r.label in h.name) == pytest.approx(kept * sum(r.layers.values()))
    # With HBM for nothing but the inputs and mlpwi_0, no split can keep query_proj anywhere.
    tight = search_split_tags(_problem({"a": 2, "b": 4}, extra_kept=0), 6)
    assert tight.estimate.recompute_s == pytest.approx(6e-3)


def test_deep_models_try_coarse_split_points_then_refine():
    assert split_points(6) == [1, 2, 3, 4, 5]
    coarse = split_points(126)
    assert len(coarse) <= 16 and all(b % coarse[0] == 0 for b in coarse) and coarse[0] > 1
    # 40 layers, HBM for query_proj in 8 more: the best split (at 8 or 32) is no coarse point
    # (every third layer); the refinement finds it, as brute force over every point does.
    p = _problem({"layers": 40}, extra_kept=8)
    assert 8 not in split_points(40) and 32 not in split_points(40)
    split = search_split_tags(p, 40)
    assert split.at in (8, 32) and split.estimate.recompute_s == pytest.approx(32e-3)
    assert split.estimate.time_s == pytest.approx(_brute_force(p, 40), abs=1e-6)


def test_the_split_search_is_exact_on_a_random_problem():
    """Random bytes and FLOPs, a real link and host budget: the search agrees with brute force."""
    import numpy as np

    rng = np.random.default_rng(0)
    layers = {"a": 2, "b": 3}
    tags = [
        TagCost("decoder_layer_input", {s: float(rng.uniform(50, 150)) for s in layers}, {}, ("device", "offload"))
    ] + [
        TagCost(t, {s: float(rng.uniform(50, 150)) for s in layers}, {s: float(rng.uniform(1e8, 3e9)) for s in layers})
        for t in ("query_proj", "context", "mlpwi_0")
    ]
    stacks = {"a": StackCost(2, 3e9, layer_range="0-1"), "b": StackCost(3, 3e9, layer_range="2-4")}
    p = Problem(
        tags=tags, stacks=stacks, rate=1e12, link=1e5, budget=1200.0, step_flops=1e10, latency=1e-4, host_budget=600.0
    )
    split = search_split_tags(p, 5)
    assert split.estimate.peak_bytes <= p.budget and split.estimate.host_bytes <= p.host_budget
    assert split.estimate.time_s == pytest.approx(_brute_force(p, 5), abs=1e-5)  # within search's tolerance


def _printed_command(printed: str) -> list[str]:
    line = next(ln for ln in printed.splitlines() if ln.startswith("split: "))
    return shlex.split(line.split("; train with it: ", 1)[1])


# Gemma 3's tiny model scans layers 0-2 (sliding window) and 3 (global) as two stacks: a split between
# them cuts no stack, so it costs no copy of the parameters (RANGE_CUT_COPIES), and on a slow link
# with 20 MB of HBM it beats the one policy for every layer.
GEMMA3_SPLIT = [
    "model=gemma3_tiny_a",
    "mesh=single",
    "data.batch_size=8",
    "data.seq_len=128",
    "hardware=cpu",
    "plan.link=0.05",
]


def test_cli_split_writes_the_sides_and_its_command_runs(tmp_path, capsys):
    """The split between Gemma 3's two stacks: neither side is a preset, so both are written next to
    the plan and named by path; the holders name each range with its policy."""
    out = tmp_path / "offload" / "p.yaml"
    assert (
        zp.main([*GEMMA3_SPLIT, "plan.hbm_budget_gb=0.021", "plan.split=true", "plan.holders=true", f"plan.out={out}"])
        == 0
    )
    printed = capsys.readouterr().out
    assert f"wrote {tmp_path / 'offload' / 'planned_tail.yaml'}" in printed
    split_holders = printed.split("the split's who holds the HBM: ")[1]
    assert "(dense_layers_0_2, layers 0-2 planned_head)" in split_holders
    assert "the stacks the layer ranges cut" not in split_holders
    line = next(ln for ln in printed.splitlines() if ln.startswith("split: "))
    plan_ms, split_ms, presets_ms = (
        float(x)
        for x in (
            line.split("(the plan: ")[1].split(" ms")[0],
            line.split("estimated step ")[1].split(" ms")[0],
            line.split("the best split of two presets: ")[1].split(" ms")[0],
        )
    )
    assert split_ms < plan_ms and split_ms < presets_ms
    command = _printed_command(printed)
    assert command[:2] == ["python", "train.py"] and "offload=none" in command
    # The ranges parse, the files load, and the step traces under them.
    from zoo.offload import parse_ranges, range_configs, remat_policy
    from zoo.tools.kit import compose
    from zoo.train.run_config import load

    c = load(compose(command[2:]))
    ranges = parse_ranges(c.offload.ranges)
    assert [(r.first, r.last) for r in ranges] == [(0, 2), (3, 3)]
    assert ranges[1].preset == str(tmp_path / "offload" / "planned_tail.yaml")
    (_, head), (_, tail) = range_configs(c.offload)
    assert tail.name == "planned_tail" and head.name == "planned_head" and head.tags != tail.tags
    rp = remat_policy(c.offload, c.model)
    grads = jax.eval_shape(
        jax.grad(lambda m, t: zoo.loss_fn(m, t, remat_policy=rp)),
        zoo.abstract(c.model),
        jax.ShapeDtypeStruct((2, 16), jnp.int32),
    )
    assert jax.tree_util.tree_leaves(grads)


def test_cli_split_says_when_no_split_is_faster(capsys, tmp_path):
    assert zp.main([*BASE, "plan.split=true", f"plan.out={tmp_path / 'offload' / 'p.yaml'}"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("split: no split is faster than the plan's one policy for every layer ("), line


def test_cli_split_names_the_copy_a_cut_would_cost(capsys, tmp_path):
    """llama_tiny_a's two layers are one stack: with HBM for one layer's input only, any split cuts
    the stack and its 1.5 copies of the stack's parameters do not fit; the line says what a cut costs."""
    assert (
        zp.main([*BASE, "plan.hbm_budget_gb=0.0019", "plan.split=true", f"plan.out={tmp_path / 'offload' / 'p.yaml'}"])
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line == (
        "split: no split fits the budgets (a split inside dense_layers costs 443.904 kB of HBM: copies of "
        "its parameters)"
    ), line


@pytest.mark.slow
def test_train_py_runs_the_printed_split(tmp_path, capsys):
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path / "offload" / "p.yaml"
    assert zp.main([*GEMMA3_SPLIT, "plan.hbm_budget_gb=0.021", "plan.split=true", f"plan.out={out}"]) == 0
    command = _printed_command(capsys.readouterr().out)
    args = [
        *command[2:],
        "trainer.steps=2",
        "trainer.progress=false",
        "xla.cpu_fast_compile=true",
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    p = subprocess.run(
        [sys.executable, str(root / "train.py"), *args],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(root)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "layers 3 " + str(tmp_path / "offload" / "planned_tail.yaml") in p.stdout.splitlines()[0]


def test_many_tags_alternate_at_one_point_and_never_lose_to_the_starts():
    """Above `exact_rows` assignments the sides are searched in turn from the best preset split and
    from the unsplit plan: within budget, no slower than either start, no faster than exact."""
    p = _problem({"a": 2, "b": 4}, extra_kept=1)
    exact = search_split_tags(p, 6)
    start = search_split(p, PRESETS, 6)
    found = search_split_tags(p, 6, start=start, exact_rows=0)
    e = found.estimate
    assert found.at == start.at and e.peak_bytes <= p.budget and e.host_bytes <= p.host_budget
    assert exact.estimate.time_s - 1e-9 <= e.time_s <= min(start.estimate.time_s, search(p).time_s) + 1e-9
    # Here the alternation stops at the unsplit plan's 6 recomputes (each side alone cannot use the
    # HBM the other frees); the exact search's 5 needs both sides changed at once.
    assert e.recompute_s == pytest.approx(6e-3) and exact.estimate.recompute_s == pytest.approx(5e-3)
