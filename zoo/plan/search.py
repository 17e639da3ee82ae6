"""The search: the fastest assignment within both budgets, exhaustive over every assignment (in
chunks), and the one-line refusal naming the budget that failed where nothing fits (`Infeasible`)."""

import itertools
import math
from typing import Optional, Sequence

import numpy as np

from zoo.plan.cost import devices_on_node, evaluate, evaluate_arrays
from zoo.plan.problem import CHOICES, GB, Estimate, Infeasible, Problem


def all_assignments(choices: Sequence[Sequence[int]]) -> np.ndarray:
    if not choices:
        return np.zeros((1, 0), dtype=np.int8)
    return np.asarray(list(itertools.product(*choices)), dtype=np.int8).reshape(-1, len(choices))


class _Lowest:
    """The lowest value of one quantity seen over the chunks of a search, and its assignment."""

    def __init__(self):
        self.value, self.digits = math.inf, None

    def offer(self, value: np.ndarray, tiebreak: np.ndarray, digits: np.ndarray, mask: Optional[np.ndarray] = None):
        idx = np.arange(len(value)) if mask is None else np.nonzero(mask)[0]
        if not idx.size:
            return
        i = idx[int(np.lexsort((tiebreak[idx], value[idx]))[0])]
        if value[i] < self.value:
            self.value, self.digits = float(value[i]), digits[i].copy()


def search(p: Problem, inner_tags: int = 9, rel_tolerance: float = 1e-3) -> Estimate:
    """The fastest assignment within both budgets (HBM and host). Step times within `rel_tolerance`
    of the compute time count as equal; among those, less host traffic wins, then the faster, then
    less HBM (so a cheap norm is recomputed rather than offloaded for a saving of microseconds, and
    with budget to spare everything stays on device).

    Raises Infeasible when nothing fits: its message names the budget that failed and the smallest
    of each that would do.
    """
    tolerance = max(rel_tolerance * p.step_flops / p.rate, 1e-12)
    choice_idx = [[CHOICES.index(c) for c in t.choices] for t in p.tags]
    k = max(0, len(p.tags) - inner_tags)
    outer = all_assignments(choice_idx[:k])
    inner = all_assignments(choice_idx[k:])
    best_key, best_digits = None, None
    # The smallest HBM of all, of those within the host budget; the smallest host memory of those
    # within the HBM budget.
    min_peak, min_peak_host_ok, min_host_hbm_ok = _Lowest(), _Lowest(), _Lowest()
    for o in outer:
        digits = np.concatenate([np.broadcast_to(o, (inner.shape[0], k)), inner], axis=1)
        arrays = evaluate_arrays(p, digits)
        peak, host = arrays["peak_bytes"], arrays["host_bytes"]
        hbm_ok, host_ok = peak <= p.budget, host <= p.host_budget
        min_peak.offer(peak, host, digits)
        min_peak_host_ok.offer(peak, arrays["time_s"], digits, host_ok)  # the fastest of the smallest
        min_host_hbm_ok.offer(host, peak, digits, hbm_ok)
        ok = np.nonzero(hbm_ok & host_ok)[0]
        if not ok.size:
            continue
        exact = arrays["time_s"][ok]
        bucket = np.floor(exact / tolerance)  # estimates this close count as equal ...
        order = np.lexsort((peak[ok], exact, arrays["host_tag_bytes"][ok], bucket))  # ... then less host traffic wins
        i = ok[order[0]]
        key = (bucket[order[0]], arrays["host_tag_bytes"][i], exact[order[0]], peak[i])
        if best_key is None or key < best_key:
            best_key, best_digits = key, digits[i].copy()
    if best_digits is None:
        raise _infeasible(p, min_peak, min_peak_host_ok, min_host_hbm_ok)
    return evaluate(p, assignment_of(p, best_digits))


def assignment_of(p: Problem, digits: np.ndarray) -> dict[str, str]:
    return {t.tag: CHOICES[int(digits[j])] for j, t in enumerate(p.tags)}


def _at_least(b: float) -> str:
    return f"{math.ceil(b / GB * 1000) / 1000:.3f}"


def _host_budget_text(p: Problem) -> str:
    n = devices_on_node(p)
    return f"{p.host_budget / GB:.3f} GB per device ({n * p.host_budget / GB:.3f} GB per node of {n})"


def _infeasible(p: Problem, min_peak: "_Lowest", min_peak_host_ok: "_Lowest", min_host_hbm_ok: "_Lowest") -> Infeasible:
    if min_host_hbm_ok.digits is None:
        # HBM failed: no assignment fits it whatever the host holds.
        if min_peak_host_ok.digits is not None:
            best = evaluate(p, assignment_of(p, min_peak_host_ok.digits))
            within = " within the host budget" if min_peak_host_ok.value > min_peak.value else ""
            return Infeasible(
                f"plan.hbm_budget_gb: no policy fits {p.budget / GB:.3f} GB; the smallest HBM any policy{within} "
                "needs is "
                f"{best.peak_bytes / GB:.3f} GB ({describe(best.assignment)}); raise plan.hbm_budget_gb to at least "
                f"{_at_least(best.peak_bytes)}" + state_hint(p),
                best.peak_bytes,
                best,
                "hbm",
                best.host_bytes,
            )
        # Neither budget can be met by any one assignment: the smallest HBM, with its host memory.
        best = evaluate(p, assignment_of(p, min_peak.digits))
        return Infeasible(
            f"plan.hbm_budget_gb: no policy fits {p.budget / GB:.3f} GB, and none of the smallest fits the host "
            "budget of "
            f"{_host_budget_text(p)}; the smallest HBM any policy needs is {best.peak_bytes / GB:.3f} GB "
            f"({describe(best.assignment)}) with {best.host_bytes / GB:.3f} GB of host memory per device; raise "
            f"plan.hbm_budget_gb to at least {_at_least(best.peak_bytes)} and plan.host_budget_gb to at least "
            f"{_at_least(best.host_bytes)}, or shard over more devices",
            best.peak_bytes,
            best,
            "hbm",
            best.host_bytes,
        )
    # HBM can be met, but not together with the host budget.
    best = evaluate(p, assignment_of(p, min_host_hbm_ok.digits))
    n = devices_on_node(p)
    other = ""
    if min_peak_host_ok.digits is not None:
        other = (
            f", or plan.hbm_budget_gb to at least {_at_least(min_peak_host_ok.value)} "
            "(the smallest HBM within the host budget)"
        )
    hints = ["shard over more devices"]
    if p.opt_on_host:
        hints.insert(0, "keep the optimizer state on device (offload.opt_state=device)")
    if p.params_on_host:
        hints.insert(0, "keep the parameters on device (offload.params=device)")
    return Infeasible(
        f"plan.host_budget_gb: no policy within the HBM budget of {p.budget / GB:.3f} GB fits the host budget of "
        f"{_host_budget_text(p)}; the smallest host memory such a policy needs is {best.host_bytes / GB:.3f} GB per "
        "device "
        f"({n * best.host_bytes / GB:.3f} GB per node; {describe(best.assignment)}); raise plan.host_budget_gb to at "
        "least "
        f"{_at_least(best.host_bytes)}{other}, or {', or '.join(hints)}",
        min_peak_host_ok.value,
        best,
        "host",
        best.host_bytes,
    )


def describe(assignment: dict[str, str]) -> str:
    groups = {c: [t for t, a in assignment.items() if a == c] for c in CHOICES}
    return "; ".join(f"{c}: {', '.join(ts)}" for c, ts in groups.items() if ts) or "no tags"


def state_hint(p: Problem) -> str:
    hints = []
    if not p.opt_on_host and p.opt_bytes:
        hints.append("offload.opt_state=pinned_host")
    if not p.params_on_host and p.stack_param_bytes:
        hints.append("offload.params=pinned_host")
    if not hints:
        return ", or shrink the batch / sequence or shard over more devices"
    return (
        f", or shrink the batch / sequence, or try {' '.join(hints)} "
        "(the update then streams that state layer by layer)"
    )
