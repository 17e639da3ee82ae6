"""The step model's fit: the four figures of a hardware profile that price a step beyond each op's
measured rate, fitted over a bench record's runs, and written back into the profile.

    python bench/tpu.py --fit 'docs/bench_tpu.json,docs/bench_maxtext*.json' --dry-run   # print the fit
    python bench/tpu.py --fit 'docs/bench_tpu.json,docs/bench_maxtext*.json'   # rewrite conf/hardware/tpu_v5e.yaml

The planner's step estimate (zoo.tools.plan, `_totals`) is, per run,

    compute / step_efficiency + recompute * recompute_cost / step_efficiency
      + activation_passes * pass + recompute_passes * pass (where the policy checkpoints)
      + exposed transfers + state transfers

where `compute` and `recompute` are the run's FLOPs at each op's measured rate (`hardware.op_rates`) and
`pass` one pass over the layers' activations at `hardware.hbm_gbps`. Each run is traced once with the
four figures at 1 (its `Problem` then holds those parts), and the estimate at any other values is the
same problem rescaled (`scaled`) and evaluated again, nothing traced. The fit is the weighted least
squares of each run's measured step, less its exposed and state transfers as estimated, on those four
parts, as ratios to the measurement (every run weighs alike whatever its length); the exposed transfers
depend on the compute that hides them, so the fit is repeated from its own values until they settle.
The squared error is flat near its minimum, so the profile keeps its own values where their error is
within --fit-tolerance (0.5%) of the best fit's (`chosen`): a refit that gains less does not move every
estimate the profile prices, and a change to the step model that moves the best fit further is refitted.

The setups run after the fit (bench/tpu.py's `OUT_OF_SAMPLE`) are left out of it, and each fitted
setup is also estimated with the figures fitted on the others (the counts "with each setup left out").
"""

import dataclasses
import glob
import pathlib
import re
import sys
from typing import Optional, Sequence

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent

FITTED = ("step_efficiency", "recompute_cost", "activation_passes", "recompute_passes")
DIGITS = {"step_efficiency": 2, "recompute_cost": 2, "activation_passes": 1, "recompute_passes": 1}
UNIT = {k: 1.0 for k in FITTED}


@dataclasses.dataclass
class Sample:
    """One measured run: its setup, label and median step, and the planner's problem traced with the
    four figures at 1, with the run's own assignment."""

    setup: str
    label: str
    measured_s: float
    problem: object  # zoo.tools.plan.Problem
    assignment: dict
    xla_peak_bytes: Optional[float] = None
    dense: bool = True


def scaled(p, values: dict):
    """The problem `p` (traced at unit values) as the profile `values` prices it."""
    tags = [
        dataclasses.replace(
            t,
            recompute_flops_per_layer={s: f * values["recompute_cost"] for s, f in t.recompute_flops_per_layer.items()},
        )
        for t in p.tags
    ]
    return dataclasses.replace(
        p,
        tags=tags,
        rate=p.rate * values["step_efficiency"],
        memory_s=p.memory_s * values["activation_passes"],
        rerun_s=p.rerun_s * values["recompute_passes"],
    )


def estimate(sample: Sample, values: dict):
    from zoo.plan.cost import evaluate

    return evaluate(scaled(sample.problem, values), sample.assignment)


def _parts(sample: Sample) -> np.ndarray:
    """The four parts of a run's step at unit values: compute, recompute, a pass over the activations,
    and the checkpoint's re-run of it."""
    e = estimate(sample, UNIT)
    p = sample.problem
    return np.array([e.compute_s - p.memory_s, e.recompute_s - p.rerun_s, p.memory_s, p.rerun_s])


def fit(samples: Sequence[Sample], start: Optional[dict] = None, rounds: int = 50) -> dict:
    """The four figures that minimise the squared relative error of the estimated steps (see above)."""
    values = dict(
        start or {"step_efficiency": 0.9, "recompute_cost": 0.5, "activation_passes": 1.0, "recompute_passes": 1.0}
    )
    x = np.array([_parts(s) for s in samples])
    measured = np.array([s.measured_s for s in samples])
    for _ in range(rounds):
        transfers = np.array(
            [(lambda e: e.exposed_transfer_s + e.state_transfer_s)(estimate(s, values)) for s in samples]
        )
        beta, *_ = np.linalg.lstsq(x / measured[:, None], (measured - transfers) / measured, rcond=None)
        new = {
            "step_efficiency": 1.0 / beta[0],
            "recompute_cost": beta[1] / beta[0],
            "activation_passes": beta[2],
            "recompute_passes": beta[3],
        }
        settled = all(abs(new[k] - values[k]) <= 1e-9 * max(1.0, abs(values[k])) for k in FITTED)
        values = new
        if settled:
            break
    return values


def rounded(values: dict) -> dict:
    return {k: round(float(values[k]), DIGITS[k]) for k in FITTED}


def errors(samples: Sequence[Sample], values: dict) -> list[float]:
    """Each run's estimated step as a ratio to the measured one, less 1."""
    return [estimate(s, values).time_s / s.measured_s - 1 for s in samples]


def left_out_errors(samples: Sequence[Sample], start: dict) -> list[float]:
    """Each setup's runs estimated with the figures fitted on the other setups (rounded as printed)."""
    out = []
    for setup in dict.fromkeys(s.setup for s in samples):
        rest = [s for s in samples if s.setup != setup]
        values = rounded(fit(rest, start))
        out += errors([s for s in samples if s.setup == setup], values)
    return out


def _within(errs, bound: float) -> int:
    return sum(abs(e) <= bound + 1e-12 for e in errs)


def squared_error(samples: Sequence[Sample], values: dict) -> float:
    """What the fit minimises: the sum of the squared relative errors of the estimated steps."""
    return float(sum(e * e for e in errors(samples, values)))


def chosen(fitted: Sequence[Sample], best: dict, current: dict, tolerance: float) -> tuple[dict, str]:
    """The values the profile gets: its own where their squared error is within `tolerance` (a fraction)
    of the best fit's, else the best fit's as written (rounded): a refit that gains less than
    `tolerance` does not move every estimate the profile prices. Returns (values, why)."""
    low, have = squared_error(fitted, best), squared_error(fitted, current)
    change = (have - low) / low if low > 0 else (0.0 if have <= 0 else float("inf"))
    text = (
        f"the profile's values: squared relative error {have:.4f} against the best fit's {low:.4f} "
        f"({100 * change:+.2f}%"
    )
    if rounded(best) == rounded(current):
        return rounded(current), text + ", the best fit as written): kept"
    if change <= tolerance:
        return rounded(current), text + f", within {100 * tolerance:g}%): kept"
    return rounded(best), text + f", over {100 * tolerance:g}%): refitted"


def summary(values: dict, best: dict, fitted: Sequence[Sample], every: Sequence[Sample], left_out) -> str:
    """The values the profile gets (beside the best fit's), and how close they put the estimates."""
    lines = [f"{k}: {values[k]:g}  (best fit {best[k]:.4f})" for k in FITTED]
    step = errors(every, values)
    lines.append(
        f"fitted over {len(fitted)} runs of {len(dict.fromkeys(s.setup for s in fitted))} setups; with these "
        f"values the step within 15% for {_within(step, 0.15)} of {len(step)} runs, {_within(step, 0.10)} within "
        f"10%; with each setup left out of the fit in turn, {_within(left_out, 0.15)} and {_within(left_out, 0.10)} "
        f"of the {len(left_out)}"
    )
    return "\n".join(lines)


def with_overlap(samples: Sequence[Sample], overlap: Optional[float]) -> list:
    """The samples with their problems pricing the tags' transfers as overlapping `overlap` of their
    layer's compute, the last layer's exposed (`zoo.plan.problem.Problem.transfer_overlap`); None: every
    transfer exposed whole."""
    share = 0.0 if overlap is None else overlap
    return [
        dataclasses.replace(s, problem=dataclasses.replace(s.problem, transfer_overlap=share, turn_exposed=True))
        for s in samples
    ]


OVERLAPS = tuple(round(0.05 * i, 2) for i in range(21))  # the shares fit_overlap tries


def offloading(samples: Sequence[Sample]) -> list:
    """The runs that sent a tag other than the layer input to host (whose transfer is exposed
    whatever the profile says)."""
    from zoo.offload import CHECKPOINT_INPUTS

    return [s for s in samples if any(a == "offload" and t not in CHECKPOINT_INPUTS for t, a in s.assignment.items())]


def fit_overlap(samples: Sequence[Sample], values: dict) -> tuple[Optional[float], dict]:
    """The share of a layer's compute its transfers overlap, fitted to the offloading runs: of
    `OVERLAPS`, the one with the least squared step error (None where no run offloads), and each
    share's error."""
    runs = offloading(samples)
    if not runs:
        return None, {}
    errs = {o: squared_error(with_overlap(runs, o), values) for o in OVERLAPS}
    return min(errs, key=errs.get), errs


def overlap_lines(samples: Sequence[Sample], values: dict, overlap: Optional[float], errs: dict) -> str:
    """The evidence: the squared error at the fitted share, with every transfer exposed, and with
    every one hidden up to its layer's compute (the last layer's too), over the offloading runs."""
    runs = offloading(samples)
    if overlap is None:
        return "transfer_overlap: no run offloads a tag, so nothing to fit (the transfers stay priced exposed)"
    hidden = [
        dataclasses.replace(s, problem=dataclasses.replace(s.problem, transfer_overlap=1.0, turn_exposed=False))
        for s in runs
    ]
    return (
        f"transfers overlap {overlap:g} of their layer's compute, the last layer's exposed: squared error "
        f"{errs[overlap]:.4f} over {len(runs)} offloading runs ({errs[0.0]:.4f} with every transfer exposed, "
        f"{squared_error(hidden, values):.4f} with every one hidden up to its layer's compute); the runs: "
        + ", ".join(f"{s.setup}/{s.label}" for s in runs)
    )


def rewrite_key(text: str, path: pathlib.Path, key: str, value: str, example: str) -> str:
    """The profile's text with its top-level `key:` line's value replaced by `value`, its comment kept."""
    pattern = re.compile(rf"^({re.escape(key)}:[ \t]*)([^#\n]*?)([ \t]*(#.*)?)$", re.MULTILINE)
    if not pattern.search(text):
        raise ValueError(f"{path}: no top-level `{key}:` line to rewrite; add `{key}: {example}` and fit again")
    return pattern.sub(lambda m: f"{m.group(1)}{value}{m.group(3)}", text, count=1)


def rewrite_profile(path: pathlib.Path, values: dict, overlap: Optional[float] = None) -> str:
    """The profile's text with each fitted key's value (as written: `rounded`) and, given, its
    `transfer_overlap` replaced in place, its comments kept."""
    text = path.read_text()
    for k in FITTED:
        text = rewrite_key(text, path, k, f"{rounded(values)[k]:g}", "1.0")
    if overlap is not None:
        text = rewrite_key(text, path, "transfer_overlap", f"{overlap:g}", "0.5")
    return text


def samples_from_record(res: dict, profile: str, records, out_of_sample: Sequence[str] = ()) -> tuple[list, list]:
    """(fitted samples, every sample) of a bench/tpu.py record: each run that ran, traced for `profile`
    with the four figures at 1; the setups in `out_of_sample` are in the second list only. `records`:
    what reads a record (bench/tpu.py, which passes itself: `load_profile`, `traced_runs`, `merge`)."""
    from zoo.plan.options import PlanConfig
    from zoo.plan.traced import policy_estimate

    hw = dataclasses.replace(records.load_profile(profile), **UNIT)
    every = []
    for name, label, r, c, tr in records.traced_runs(res, hw):
        if r.get("status") != "ok" or not r.get("median_step_s"):
            continue
        p, e, _ = policy_estimate(c, tr, PlanConfig(hbm_budget_gb=hw.hbm_bytes / 1e9))
        peak = (r.get("compiled_memory") or {}).get("estimated_peak_bytes")
        every.append(
            Sample(name, label, r["median_step_s"], p, e.assignment, peak, not (r.get("kernels") or {}).get("moe"))
        )
    return [s for s in every if s.setup not in out_of_sample], every


def files(record: str) -> list[str]:
    """The record files of --fit's comma list, each a path or a glob (`docs/bench_maxtext*.json`, in
    name order); a glob matching nothing: OSError naming it."""
    out = []
    for item in record.split(","):
        if glob.has_magic(item):
            matched = sorted(glob.glob(item))
            if not matched:
                raise OSError(f"{item} matches no file")
            out += matched
        else:
            out.append(item)
    return out


def main(
    record: str,
    profile: str,
    records,
    dry_run: bool = False,
    out_of_sample: Sequence[str] = (),
    tolerance: float = 0.005,
) -> int:
    """`python bench/tpu.py --fit RECORD`: `records` is bench/tpu.py (its record readers), passed in so
    that this module imports no benchmark script."""
    import json

    path = ROOT / "conf" / "hardware" / f"{profile}.yaml"
    if not path.is_file():
        print(f"error: --profile {profile}: no {path}; name a file of conf/hardware", file=sys.stderr)
        return 2
    if not 0 <= tolerance < 1:
        print(f"error: --fit-tolerance {tolerance}: a fraction in [0, 1), e.g. 0.005; 0 always refits", file=sys.stderr)
        return 2
    try:
        res = records.merge(
            [records.as_record(json.loads(pathlib.Path(f).read_text()), pathlib.Path(f).stem) for f in files(record)]
        )
    except (OSError, ValueError) as e:
        print(f"error: --fit {record}: {e}; give bench/tpu.py --out JSONs (comma list)", file=sys.stderr)
        return 2
    loaded = records.load_profile(profile)
    current = {k: float(getattr(loaded, k)) for k in FITTED}
    peers = [n for n, setup in (res.get("setups") or {}).items() if setup.get("peer")]
    fitted, every = samples_from_record(res, profile, records, (*out_of_sample, *peers))
    if len(fitted) < len(FITTED):
        print(f"error: --fit {record}: {len(fitted)} runs that ran; the fit needs at least 4", file=sys.stderr)
        return 2
    # The share of compute the chip hid the transfers behind, read at the profile's values; then the
    # four figures with the transfers priced that way.
    overlap, overlap_errs = fit_overlap(every, current)
    fitted, every = with_overlap(fitted, overlap), with_overlap(every, overlap)
    best = fit(fitted, current)
    values, why = chosen(fitted, best, current, tolerance)
    print(overlap_lines(every, current, overlap, overlap_errs))
    print(summary(values, best, fitted, every, left_out_errors(fitted, current)))
    print(why)
    print(f"transfer_overlap: {overlap if overlap is not None else loaded.transfer_overlap}")
    if dry_run or (values == rounded(current) and overlap in (None, loaded.transfer_overlap)):
        return 0
    path.write_text(rewrite_profile(path, values, overlap))
    print(f"wrote {path.relative_to(ROOT)}")
    return 0
