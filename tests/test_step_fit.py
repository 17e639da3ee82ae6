"""The step model's fit (bench/step_fit.py, `python bench/tpu.py --fit RECORD`): the four figures of a
hardware profile that price a step beyond each op's measured rate, fitted over a bench record's runs and
written back into the profile with its comments.

The default run fits synthetic runs made from known figures (the planner's own cost model, no trace) and
rewrites a copy of the profile; the slow one refits docs/bench_tpu.json with docs/bench_maxtext.json (as
the docs' command does) and checks that it gives the figures and hidden transfers
conf/hardware/tpu_v5e.yaml holds, to the digits written there, and the counts the docs quote.
"""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench/ is a folder of scripts beside the package
    sys.path.insert(0, str(ROOT))

from bench import step_fit  # noqa: E402
from zoo.plan.cost import evaluate  # noqa: E402
from zoo.plan.problem import GB, Problem, StackCost, TagCost  # noqa: E402

KNOWN = {"step_efficiency": 0.81, "recompute_cost": 0.37, "activation_passes": 4.6, "recompute_passes": 2.3}


def _synthetic_samples(values: dict) -> list:
    """Runs of made-up layers under assignments that keep, offload (some of it exposed: a slow link) and
    recompute, each 'measured' as the planner estimates it at `values`; the problems at unit values."""
    rng = np.random.default_rng(0)
    samples = []
    for i in range(18):
        layers, flops = int(rng.integers(2, 8)), float(rng.uniform(0.5, 4.0)) * 1e12
        tags = [
            TagCost(f"t{j}", {"s": float(rng.uniform(50, 400)) * 1e6}, {"s": flops * 0.1 * (j + 1)}) for j in range(3)
        ]
        checkpoints = i % 3 != 0
        p = Problem(
            tags=tags,
            stacks={"s": StackCost(layers=layers, forward_flops_per_layer=flops)},
            rate=1e14,
            link=float(rng.uniform(2, 20)) * GB,
            budget=1e15,
            step_flops=3 * flops * layers,
            latency=0.0,
            memory_s=float(rng.uniform(0.002, 0.02)),
            rerun_s=float(rng.uniform(0.001, 0.01)) if checkpoints else 0.0,
        )
        choices = ("device", "offload", "remat") if checkpoints else ("device",)
        assignment = {t.tag: str(rng.choice(choices)) for t in tags}
        measured = evaluate(step_fit.scaled(p, values), assignment).time_s
        samples.append(step_fit.Sample(f"setup{i // 3}", f"run{i}", measured, p, assignment))
    return samples


def test_the_fit_recovers_the_figures_a_synthetic_record_was_made_with():
    samples = _synthetic_samples(KNOWN)
    exposed = [evaluate(step_fit.scaled(s.problem, KNOWN), s.assignment).exposed_transfer_s for s in samples]
    assert sum(e > 0 for e in exposed) >= 3  # the fit must see transfers that the compute hides only in part
    got = step_fit.fit(samples)
    assert got == pytest.approx(KNOWN, rel=1e-6)
    assert max(abs(e) for e in step_fit.errors(samples, got)) < 1e-9


def test_the_profile_keeps_its_values_only_where_they_fit_about_as_well_as_the_best():
    samples = _synthetic_samples(KNOWN)
    noise = np.random.default_rng(1).normal(1.0, 0.03, len(samples))  # a measurement's spread
    samples = [dataclasses.replace(s, measured_s=s.measured_s * f) for s, f in zip(samples, noise)]
    best = step_fit.fit(samples)
    kept, why = step_fit.chosen(samples, best, step_fit.rounded(best), tolerance=0.0)
    assert kept == step_fit.rounded(best) and why.endswith("kept")  # the best fit as written
    near = {**step_fit.rounded(best), "recompute_cost": step_fit.rounded(best)["recompute_cost"] + 0.01}
    kept, why = step_fit.chosen(samples, best, near, tolerance=0.05)
    assert kept == step_fit.rounded(near) and why.endswith("kept")
    assert step_fit.chosen(samples, best, near, tolerance=0.0)[0] == step_fit.rounded(best)
    far = {**KNOWN, "step_efficiency": 0.6}
    values, why = step_fit.chosen(samples, best, far, tolerance=0.005)
    assert values == step_fit.rounded(best) and why.endswith("refitted")
    assert step_fit.chosen(samples, best, far, tolerance=1e9)[0] == step_fit.rounded(far)


def test_the_profile_is_rewritten_in_place_with_its_comments(tmp_path):
    text = (ROOT / "conf" / "hardware" / "tpu_v5e.yaml").read_text()
    path = tmp_path / "tpu_v5e.yaml"
    path.write_text(text)
    new = step_fit.rewrite_profile(path, {**KNOWN, "activation_passes": 4.64})
    assert "step_efficiency: 0.81\n" in new and "recompute_cost: 0.37\n" in new
    assert "activation_passes: 4.6\n" in new and "recompute_passes: 2.3\n" in new  # the digits the profile writes
    # Everything else as it was: the same lines once the four values are put back.
    old = {k: re.search(rf"^{k}: (.*)$", text, re.MULTILINE).group(1) for k in step_fit.FITTED}
    assert step_fit.rewrite_profile(path, {k: float(v) for k, v in old.items()}) == text
    path.write_text(text.replace("recompute_passes:", "# recompute_passes:"))
    with pytest.raises(ValueError, match="recompute_passes"):
        step_fit.rewrite_profile(path, KNOWN)


# The records the docs' command fits (docs/benchmarks.md, "The planner against the chip"; the profile's comment).
FIT_RECORDS = "docs/bench_tpu.json,docs/bench_maxtext*.json"


def _fit_dry_run() -> str:
    proc = subprocess.run(
        [sys.executable, "bench/tpu.py", "--fit", FIT_RECORDS, "--dry-run"],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_refitting_the_v5e_record_gives_the_profiles_figures():
    """A change to the step model (or the records) that is not refitted fails here: the profile's four
    figures and its transfer overlap are what `--fit 'docs/bench_tpu.json,docs/bench_maxtext*.json'`
    gives, to the digits written, and the counts and the overlap's evidence the profile's comment and
    docs/benchmarks.md quote are the fit's."""
    out = _fit_dry_run()
    profile = (ROOT / "conf" / "hardware" / "tpu_v5e.yaml").read_text()
    for k in (*step_fit.FITTED, "transfer_overlap"):
        printed = re.search(rf"^{k}: (.+?)\s*$", out, re.MULTILINE).group(1).split("  (")[0]
        written = re.search(rf"^{k}: (.+?)\s*(#.*)?$", profile, re.MULTILINE).group(1)
        assert float(printed) == float(written), (k, printed, written)
    counts = re.search(
        r"fitted over (\d+) runs .* within 15% for (\d+) of (\d+) runs, (\d+) within 10%; "
        r"with each setup left out of the fit in turn, (\d+) and (\d+) of the (\d+)",
        out.replace("\n", " "),
    )
    fitted, all15, every, all10, loo15, loo10, total = counts.groups()
    flat = " ".join(line.lstrip("# ").strip() for line in profile.splitlines())
    assert f"over the {fitted} runs of docs/bench_tpu.json" in flat
    assert f"--fit '{FIT_RECORDS}' rewrites them" in flat
    assert f"out of the fit, {all15} of {every}, {all10} within 10%" in flat
    assert f"left out of the fit in turn, {loo15} and {loo10} of the {total}" in flat
    docs = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert f"four figures fitted over the {fitted} runs" in docs
    assert f"{loo15} of the {total} are within 15% and {loo10} within 10%" in docs
    assert f"`python bench/tpu.py --fit '{FIT_RECORDS}'`" in docs
    assert f"within 15% for {all15} of the {every} runs of the records, {all10} within 10%" in docs
    # The overlap's evidence as the docs quote it: the share, and the squared error there, with every
    # transfer exposed and with every one hidden, over the offloading runs.
    share, at, runs, exposed, hidden = re.search(
        r"^transfers overlap (\S+) of their layer's compute, the last layer's exposed: squared error (\S+) over "
        r"(\d+) offloading runs \((\S+) with every transfer exposed, (\S+) with every one hidden",
        out,
        re.MULTILINE,
    ).groups()
    quoted = (
        f"`transfer_overlap: {share}`: squared error {at} over the {runs} runs that offload, against {exposed} with "
        f"every transfer exposed and {hidden} with every one hidden up to its layer's compute"
    )
    assert quoted in docs, quoted
