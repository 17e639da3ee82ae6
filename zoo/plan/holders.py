"""Who holds the memory of an estimate (`holders`, by holder, largest first) and which single change
frees the most (`best_changes`): what the planner prints when a plan does not fit, with
plan.holders=true, and in the trainer's out-of-memory line."""

import dataclasses
import math


from zoo.plan.cost import (
    RANGE_CUT_COPIES,
    devices_on_node,
    evaluate,
    free_layers,
    frozen_on_device,
    host_fixed_parts,
    layer_state_bytes,
    streamed,
)
from zoo.plan.problem import Estimate, Problem, fmt_bytes


@dataclasses.dataclass
class Holder:
    """One holder of memory in an estimate: `name` (a tag with its stack and layers, a state kind, the
    working set...), its bytes per device, and `detail` (e.g. the largest leaves of a state kind)."""

    name: str
    bytes: float
    detail: str = ""


@dataclasses.dataclass
class Change:
    """One change to a plan and the bytes per device it frees (`saving`: the estimate's figure
    before minus after), with the estimate after it."""

    action: str
    saving: float
    after: Estimate
    fits: bool  # whether the estimate after it fits both budgets


def _tag_holders(p: Problem, e: Estimate, where: str) -> list[Holder]:
    """The tags held `where` (device or offload): the searched layers' under `e.assignment`, each
    range of `offload.ranges` under its own preset's (`p.fixed`)."""
    free = free_layers(p)
    groups = [(e.assignment, free, None)] + [(f.assignment, f.layers, f.label) for f in p.fixed]
    out = []
    for assignment, layers_of, label in groups:
        for t in p.tags:
            if assignment.get(t.tag) != where:
                continue
            for s, b in t.bytes_per_layer.items():
                sc, n = p.stacks[s], layers_of.get(s, 0)
                if not b or not n:
                    continue
                if label is not None:
                    layers = label
                elif n == sc.layers and sc.layer_range:
                    layers = f"layers {sc.layer_range}"
                else:
                    layers = f"{n} layers" + (" outside the ranges" if p.fixed else "")
                out.append(Holder(f"tag {t.tag} ({s}, {layers})", b * n, f"{fmt_bytes(b)} per layer"))
    return out


def _leaves_detail(p: Problem, kind: str, n: int = 3) -> str:
    leaves = sorted((x for x in p.largest_leaves if x[0] == kind), key=lambda x: -x[2])[:n]
    return ", ".join(f"{path} {fmt_bytes(b)}" for _, path, b in leaves)


def holders(p: Problem, e: Estimate, memory: str = "hbm") -> list[Holder]:
    """Who holds the memory of estimate `e` per device, largest first: `memory` "hbm" (the phase that
    sets the peak) or "host"."""
    if memory == "host":
        out = _tag_holders(p, e, "offload")
        details = {"parameters": _leaves_detail(p, "params"), "optimizer state": _leaves_detail(p, "opt_state")}
        out += [Holder(k, v, details.get(k, "")) for k, v in host_fixed_parts(p).items() if v]
    elif e.backward_phase_bytes >= e.update_phase_bytes:
        out = _tag_holders(p, e, "device")
        outside = p.param_bytes - p.stack_param_bytes
        layer = max((s.param_bytes_per_layer for s in p.stacks.values()), default=0.0)
        if p.params_on_host:
            out.append(Holder("parameters (outside the stacks, and two layers in flight)", outside + 2 * layer))
            out.append(
                Holder(
                    "gradients (outside the stacks, and two layers in flight)",
                    p.grad_bytes - p.stack_param_bytes + 2 * layer,
                )
            )
        else:
            out.append(Holder("parameters", p.param_bytes, _leaves_detail(p, "params")))
            out.append(Holder("gradients", p.grad_bytes))
        if not p.opt_on_host:
            out.append(Holder("optimizer state", p.opt_bytes, _leaves_detail(p, "opt_state")))
        if p.frozen_bytes:
            where = " (outside the stacks, and two layers in flight)" if p.frozen_on_host else ""
            out.append(Holder(f"frozen LoRA base{where}", frozen_on_device(p)))
        out.append(Holder("untagged residuals", p.other_bytes))
        out.append(Holder(p.working_label, p.working_bytes))
        if e.offload_in_flight_bytes:
            out.append(Holder("offloaded tags in flight (the next layer's, coming back)", e.offload_in_flight_bytes))
        if p.cut_bytes and not p.params_on_host:
            out.append(
                Holder(
                    "the stacks the layer ranges cut (their parameters' slices and joined gradients)",
                    RANGE_CUT_COPIES * p.cut_bytes,
                )
            )
    else:
        # The update phase: zoo.plan.cost.fixed_bytes, by holder.
        if not streamed(p):
            out = [
                Holder("parameters (update)", p.param_bytes, _leaves_detail(p, "params")),
                Holder("gradients (update)", p.grad_bytes),
                Holder("optimizer state (update)", p.opt_bytes, _leaves_detail(p, "opt_state")),
            ]
        else:
            out = []
            if not p.params_on_host:
                out += [Holder("parameters (update)", p.param_bytes), Holder("gradients (update)", p.grad_bytes)]
            else:
                out.append(Holder("gradients outside the stacks (update)", p.param_bytes - p.stack_param_bytes))
            if not p.opt_on_host:
                out.append(Holder("optimizer state (update)", p.opt_bytes))
            out.append(
                Holder(
                    "two layers of host-resident state in flight (update)",
                    2 * layer_state_bytes(p, p.params_on_host, p.opt_on_host),
                )
            )
        if p.frozen_bytes and not p.frozen_on_host:
            out.append(Holder("frozen LoRA base (update)", p.frozen_bytes))
    return sorted((h for h in out if h.bytes > 0), key=lambda h: -h.bytes)


def _more_devices(p: Problem) -> tuple[Problem, str]:
    """The problem on twice the devices along FSDP: the state sharded twice as thin and, where the
    per-device batch can halve, the activations and working set with it. An estimate: the real
    figure needs the plan redone with the new mesh."""
    halve = p.per_device_batch >= 2
    a = 0.5 if halve else 1.0
    q = dataclasses.replace(
        p,
        tags=[dataclasses.replace(t, bytes_per_layer={s: b * a for s, b in t.bytes_per_layer.items()}) for t in p.tags],
        stacks={
            s: dataclasses.replace(
                sc, param_bytes_per_layer=sc.param_bytes_per_layer / 2, opt_bytes_per_layer=sc.opt_bytes_per_layer / 2
            )
            for s, sc in p.stacks.items()
        },
        param_bytes=p.param_bytes / 2,
        stack_param_bytes=p.stack_param_bytes / 2,
        grad_bytes=p.grad_bytes / 2,
        opt_bytes=p.opt_bytes / 2,
        stack_opt_bytes=p.stack_opt_bytes / 2,
        other_bytes=p.other_bytes * a,
        working_bytes=p.working_bytes * a,
        staging_bytes=p.staging_bytes / 2,
        per_device_batch=max(1, p.per_device_batch // 2),
    )
    what = "state and per-device batch halved" if halve else "state halved; the per-device batch of 1 cannot halve"
    return q, f"twice the devices, along fsdp ({what})"


def best_changes(p: Problem, e: Estimate, memory: str = "hbm", top: int = 4) -> list[Change]:
    """Single changes to estimate `e` that free `memory` ("hbm": the peak; "host": host bytes per
    device), the most first: a tag recomputed (or, where it cannot be, moved), a state preset, or
    twice the devices. Each saving is the estimate before minus after."""
    key = "peak_bytes" if memory == "hbm" else "host_bytes"
    candidates: list[tuple[str, Problem, dict]] = []
    for t in p.tags:
        now = e.assignment[t.tag]
        frees = now == ("device" if memory == "hbm" else "offload")
        if not frees:
            continue
        to = "remat" if "remat" in t.choices else ("offload" if memory == "hbm" else "device")
        if to in t.choices and to != now:
            verb = {"remat": "recompute", "offload": "offload", "device": "keep on device"}[to]
            candidates.append((f"{verb} tag {t.tag} (tags.{t.tag}: {to})", p, {**e.assignment, t.tag: to}))
    if memory == "hbm":
        if not p.opt_on_host and p.opt_bytes:
            candidates.append(("offload.opt_state=pinned_host", dataclasses.replace(p, opt_on_host=True), e.assignment))
        if not p.params_on_host and p.stack_param_bytes:
            candidates.append(("offload.params=pinned_host", dataclasses.replace(p, params_on_host=True), e.assignment))
    else:
        if p.opt_on_host:
            candidates.append(("offload.opt_state=device", dataclasses.replace(p, opt_on_host=False), e.assignment))
        if p.params_on_host:
            candidates.append(("offload.params=device", dataclasses.replace(p, params_on_host=False), e.assignment))
    q, what = _more_devices(p)
    candidates.append((what, q, e.assignment))
    out = []
    for action, problem, assignment in candidates:
        after = evaluate(problem, assignment)
        saving = getattr(e, key) - getattr(after, key)
        if saving > 0:
            fits = after.peak_bytes <= problem.budget and after.host_bytes <= problem.host_budget
            out.append(Change(action, saving, after, fits))
    return sorted(out, key=lambda c: -c.saving)[:top]


def holders_table(p: Problem, e: Estimate, memory: str = "hbm", top: int = 8) -> str:
    """Who holds `memory` in estimate `e` (the largest `top`), and what would free the most."""
    if memory == "hbm":
        title = f"who holds the HBM: {fmt_bytes(e.peak_bytes)} per device; budget {fmt_bytes(p.budget)}"
    else:
        n = devices_on_node(p)
        budget = (
            f"; budget {fmt_bytes(p.host_budget)} per device, {fmt_bytes(n * p.host_budget)} per node"
            if math.isfinite(p.host_budget)
            else " (no host budget)"
        )
        title = (
            f"who holds the host memory: {fmt_bytes(e.host_bytes)} per device, "
            f"{fmt_bytes(e.host_node_bytes)} per node of {n}{budget}"
        )
    hs = holders(p, e, memory)
    rows = [("holder", "bytes", "share", "")] + [
        (h.name, fmt_bytes(h.bytes), f"{100 * h.bytes / max(sum(x.bytes for x in hs), 1.0):.1f}%", h.detail)
        for h in hs[:top]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [title] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(hs) > top:
        out.append(f"  ... and {len(hs) - top} more holding {fmt_bytes(sum(h.bytes for h in hs[top:]))}")
    changes = best_changes(p, e, memory)
    if changes:
        key = "peak_bytes" if memory == "hbm" else "host_bytes"
        out.append("what would free the most (estimated saving per device; the figure after it):")
        for c in changes:
            fits = "fits both budgets" if c.fits else "still over a budget"
            out.append(f"  {c.action}: frees {fmt_bytes(c.saving)} -> {fmt_bytes(getattr(c.after, key))} ({fits})")
    return "\n".join(out)
