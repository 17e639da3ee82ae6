"""The split search (plan.split=true): layers 0..b-1 under one assignment and the rest under
another, over two presets (`search_split`) or per tag on each side (`search_split_tags`, exact per
split point over each side's Pareto front)."""

import dataclasses
import math
from typing import Optional

import numpy as np

from zoo.offload import load_preset, preset_names, range_configs
from zoo.plan.cost import (
    cut_bytes,
    evaluate,
    fixed_bytes,
    host_fixed_parts,
    layer_parts,
    offloaded_per_layer,
    state_transfer_s,
)
from zoo.plan.policies import preset_assignment
from zoo.plan.problem import CHOICES, Estimate, FixedRange, Infeasible, Problem, layers_in, stack_bounds
from zoo.plan.search import all_assignments, assignment_of, search


@dataclasses.dataclass
class Split:
    """Layers 0..at-1 (the head) under one assignment, at..n-1 (the tail) under another, and the
    estimate. `head` / `tail`: the conf/offload preset each assignment is, "" where it is none."""

    at: int
    head: str
    tail: str
    estimate: Estimate
    head_assignment: dict = dataclasses.field(default_factory=dict)
    tail_assignment: dict = dataclasses.field(default_factory=dict)


def split_problem(
    p: Problem, at: int, num_layers: int, head: dict, tail: dict, head_label: str = "head", tail_label: str = "tail"
) -> Problem:
    """`p` with layers 0..at-1 fixed to `head` and the rest to `tail` (no free layers left)."""
    bounds = stack_bounds(p)
    first, last = f"0-{at - 1}" if at > 1 else "0", f"{at}-{num_layers - 1}" if num_layers - 1 > at else f"{at}"
    return dataclasses.replace(p, cut_bytes=cut_bytes(p, [at]), fixed=[
        FixedRange(f"layers {first} {head_label}", layers_in(bounds, 0, at - 1), head),
        FixedRange(f"layers {last} {tail_label}", layers_in(bounds, at, num_layers - 1), tail, holds_last=True),
    ])  # fmt: skip


def search_split(
    p: Problem, presets: dict[str, dict[str, str]], num_layers: int, rel_tolerance: float = 1e-3
) -> Optional[Split]:
    """The fastest split of the layers into a head and a tail under two different presets (`presets`:
    name -> `preset_assignment`) within both budgets, over every split point; None if none fits.
    Ties (step times within `rel_tolerance` of the compute time) go to less host traffic, then less HBM."""
    unit = max(rel_tolerance * p.step_flops / p.rate, 1e-12)
    best, best_key = None, None
    for at in range(1, num_layers):
        for a, assign_a in presets.items():
            for b, assign_b in presets.items():
                if a == b:
                    continue
                e = evaluate(split_problem(p, at, num_layers, assign_a, assign_b), {})
                if e.peak_bytes > p.budget or e.host_bytes > p.host_budget:
                    continue
                key = (round(e.time_s / unit), e.host_tag_bytes, e.peak_bytes)
                if best_key is None or key < best_key:
                    best, best_key = Split(at, a, b, e, assign_a, assign_b), key
    return best


def _pareto(x: np.ndarray) -> np.ndarray:
    """Indices of the rows of `x` that no other row dominates (<= in every column); of equal rows, one."""
    # In order of the columns' sum (each scaled to its range), ties lexicographically: a row that
    # dominates another comes first. The early rows dominate the most, so the rest shrinks fast.
    if not len(x):
        return np.zeros(0, dtype=np.int64)
    span = np.ptp(x, axis=0)
    remaining = np.lexsort((*x.T[::-1], (x / np.where(span > 0, span, 1.0)).sum(axis=1)))
    keep = []
    while remaining.size:
        i = remaining[0]
        keep.append(i)
        remaining = remaining[~np.all(x[remaining] >= x[i], axis=1)]
    return np.asarray(keep, dtype=np.int64)


def _per_layer_costs(p: Problem, digits: np.ndarray) -> np.ndarray:
    """[assignments, stacks, 4]: one layer of each stack under each assignment: its step seconds
    (recompute and exposed transfers, all microbatches), device tag bytes, host tag bytes, and its
    offloaded bytes (in flight). A range's first three are these times its layers per stack, so they
    add up over the ranges; the in-flight bytes are the largest of its stacks' with layers."""
    out = np.zeros((digits.shape[0], len(p.stacks), 4))
    for k, s in enumerate(p.stacks):
        flops, device, host, exposed = layer_parts(p, digits, {s: 1})
        inflight = offloaded_per_layer(p, digits, {s: 1})
        out[:, k] = np.stack([p.microbatches * (flops / p.rate + exposed), device, host, inflight], axis=1)
    return out


def split_costs(p: Problem, inner_tags: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """(digits, per-layer costs `_per_layer_costs`) of every assignment, enumerated in chunks like
    `search` (3^9 for Llama: 13k rows; the whole table is held, 48 bytes a row per stack)."""
    choice_idx = [[CHOICES.index(c) for c in t.choices] for t in p.tags]
    k = max(0, len(p.tags) - inner_tags)
    outer, inner = all_assignments(choice_idx[:k]), all_assignments(choice_idx[k:])
    digits = [np.concatenate([np.broadcast_to(o, (inner.shape[0], k)), inner], axis=1) for o in outer]
    return np.concatenate(digits), np.concatenate([_per_layer_costs(p, d) for d in digits])


def _best_pair(
    p: Problem,
    costs: np.ndarray,
    head: dict[str, int],
    tail: dict[str, int],
    unit: float,
    fronts: dict,
    chunk: int = 512,
):
    """The best (key, head index, tail index) over every pair of assignments for a head of `head`
    layers per stack and a tail of `tail`, within both budgets; None if no pair fits. Only each
    side's Pareto front in (seconds, device bytes, host bytes, bytes in flight) is paired: an
    assignment another beats in all four, swapped for it, leaves the step no slower and both budgets
    no fuller (the pair's in-flight bytes are the larger side's).
    `fronts` caches them by the side's layers per stack (a front is the same for any multiple)."""
    order = list(p.stacks)
    lh = np.asarray([head.get(s, 0) for s in order], dtype=float)
    lt = np.asarray([tail.get(s, 0) for s in order], dtype=float)

    def front(layers: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(np.round(layers / max(layers.max(), 1.0), 12))
        side = np.einsum("nsc,s->nc", costs[..., :3], layers)  # [assignments, (seconds, device, host)]
        inflight = np.max(np.where(layers > 0, costs[..., 3], 0.0), axis=1, initial=0.0)
        side = np.concatenate([side, inflight[:, None]], axis=1)
        if key not in fronts:
            fronts[key] = _pareto(side)
        return fronts[key], side[fronts[key]]

    hi, h = front(lh)
    ti, t = front(lt)
    fixed_backward, update = fixed_bytes(p)
    if update > p.budget:
        return None
    const_s = p.step_flops / p.rate + state_transfer_s(p)
    host_fixed = sum(host_fixed_parts(p).values())
    best = None
    for lo in range(0, len(h), chunk):
        hc = h[lo : lo + chunk, None, :]
        seconds = const_s + hc[..., 0] + t[None, :, 0]
        device = hc[..., 1] + t[None, :, 1]
        host = hc[..., 2] + t[None, :, 2]
        peak = np.maximum(fixed_backward + device + np.maximum(hc[..., 3], t[None, :, 3]), update)
        ok = np.nonzero((peak <= p.budget) & (host_fixed + host <= p.host_budget))
        if not ok[0].size:
            continue
        sec, hb, pk = seconds[ok], host[ok], peak[ok]
        i = int(np.lexsort((pk, sec, hb, np.floor(sec / unit)))[0])
        key = (float(np.floor(sec[i] / unit)), float(hb[i]), float(sec[i]), float(pk[i]))
        if best is None or key < best[0]:
            best = (key, int(hi[lo + int(ok[0][i])]), int(ti[int(ok[1][i])]))
    return best


def split_points(num_layers: int, coarse: int = 16) -> list[int]:
    """The split points tried first: every one for up to `coarse` of them, else about `coarse`
    evenly spaced (a multiple of a step); `search_split_tags` then refines around the best."""
    if num_layers - 1 <= coarse:
        return list(range(1, num_layers))
    step = -(-(num_layers - 1) // coarse)
    return list(range(step, num_layers, step))


def _alternate(
    p: Problem, num_layers: int, at: int, head: dict[str, str], tail: dict[str, str], rounds: int = 4
) -> Optional[Split]:
    """From a split at `at` that fits, `search` the tail's assignment with the head's fixed, then the
    head's with the tail's, until neither changes (at most `rounds` times). Each step keeps what
    fits and is never slower, but it can stop short of the best split."""
    for _ in range(rounds):
        try:
            q = split_problem(p, at, num_layers, head, tail)
            new_tail = search(dataclasses.replace(q, fixed=q.fixed[:1])).assignment
            q = split_problem(p, at, num_layers, head, new_tail)
            new_head = search(dataclasses.replace(q, fixed=q.fixed[1:])).assignment
        except Infeasible:
            return None
        if (new_head, new_tail) == (head, tail):
            break
        head, tail = new_head, new_tail
    return Split(at, "", "", evaluate(split_problem(p, at, num_layers, head, tail), {}), head, tail)


def search_split_tags(
    p: Problem,
    num_layers: int,
    rel_tolerance: float = 1e-3,
    coarse: int = 16,
    start: Optional[Split] = None,
    exact_rows: int = 200_000,
) -> Optional[Split]:
    """The fastest split of the layers into a head (0..b-1) and a tail (b..n-1), each with its own
    per-tag assignment, within both budgets; None if none fits.

    Exact for each split point tried: the estimate is a sum over layers, so a range's seconds, device
    and host bytes are its layers per stack times one layer's (`_per_layer_costs`, tabled once for
    every assignment: `split_costs`; its bytes in flight, one layer's, the largest of its stacks');
    only the assignments no other beats in all four for that range
    can be part of a best split, and every pair of those of the head and the tail is tried
    (`_best_pair`; one stack: one front serves every split point). The enumeration is `search`'s
    (3^k assignments of k tags, held whole). Above `exact_rows` assignments (DeepSeek-V3's 16 tags:
    9.6M; Llama's 9: 13k) that would take minutes and gigabytes, so the split is searched by
    alternating (`_alternate`) at one point only, `start`'s (the best split of two presets) and
    from the unsplit plan's assignment on both sides, the better kept: never worse than either, but
    not exact. The same assignment on both sides is the unsplit plan, so the result
    is never slower than `search`'s. The split points: every one for models of up to `coarse` + 1
    layers; deeper ones first at about `coarse` evenly spaced points (a multiple of a step), then at
    every point within a step of the best of those (126 layers: 15 points, a step of 8, then at
    most 14 more; not 125): a best point far from the best coarse one can be missed there. Ties, as
    in `search`: step times within `rel_tolerance` of the compute time count as equal, then less
    host traffic wins, then the faster, then less HBM."""
    if p.fixed:
        raise ValueError("search_split_tags: the problem has fixed ranges; it places every layer itself")
    unit = max(rel_tolerance * p.step_flops / p.rate, 1e-12)
    bounds = stack_bounds(p)
    if math.prod(len(t.choices) for t in p.tags) > exact_rows:
        try:
            whole = search(p, rel_tolerance=rel_tolerance).assignment
        except Infeasible:
            return None
        at = start.at if start is not None else num_layers // 2
        tries = [_alternate(p, num_layers, at, whole, whole)]
        if start is not None:
            tries.append(_alternate(p, num_layers, at, start.head_assignment, start.tail_assignment))
        tries = [t for t in tries if t is not None]
        return min(
            tries,
            key=lambda t: (
                math.floor(t.estimate.time_s / unit),
                t.estimate.host_tag_bytes,
                t.estimate.time_s,
                t.estimate.peak_bytes,
            ),
            default=None,
        )
    digits, costs = split_costs(p)
    tried: dict[int, tuple] = {}
    fronts: dict = {}

    def at(b: int):
        if b not in tried:
            cut = dataclasses.replace(p, cut_bytes=cut_bytes(p, [b]))  # the split's own copies of the stacks it cuts
            tried[b] = _best_pair(
                cut, costs, layers_in(bounds, 0, b - 1), layers_in(bounds, b, num_layers - 1), unit, fronts
            )
        return tried[b]

    points = split_points(num_layers, coarse)
    for b in points:
        at(b)
    found = {b: r for b, r in tried.items() if r is not None}
    if found and len(points) < num_layers - 1:
        step = points[1] - points[0] if len(points) > 1 else 1
        b0 = min(found, key=lambda b: found[b][0])
        for b in range(max(1, b0 - step + 1), min(num_layers, b0 + step)):
            at(b)
    found = {b: r for b, r in tried.items() if r is not None}
    if not found:
        return None
    b = min(found, key=lambda b: (found[b][0], b))
    _, i, j = found[b]
    head, tail = assignment_of(p, digits[i]), assignment_of(p, digits[j])
    return Split(b, "", "", evaluate(split_problem(p, b, num_layers, head, tail), {}), head, tail)


def offload_presets(p: Problem, c) -> dict[str, dict[str, str]]:
    """The activation presets of conf/offload this model takes, one name per distinct assignment."""
    presets = {}
    for name in sorted(preset_names(), key=lambda n: n == "custom"):  # custom (= full until edited) last
        try:  # loaded as a range's preset is: modifiers (params_host, optimizer_host) are refused
            ((_, config),) = range_configs(
                load_preset("none", params=c.offload.params, opt_state=c.offload.opt_state, ranges={"0": name})
            )
            presets[name] = preset_assignment(p, config, c.model)
        except ValueError:
            continue  # not an activation policy, or not one this model takes
    # One name per distinct assignment (custom is full; deepseek_mla_moe_offload is qkv_proj_offloaded on Llama).
    distinct = {}
    for name, a in presets.items():
        distinct.setdefault(tuple(sorted(a.items())), name)
    return {name: presets[name] for name in distinct.values()}
