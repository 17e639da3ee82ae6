"""The line the trainer prints when a run runs out of device memory: XLA's figures, the planner's
largest holders of the run's own policy, and the single change that frees the most."""

import re


from zoo.plan.holders import best_changes, holders
from zoo.plan.options import PlanConfig
from zoo.plan.problem import fmt_bytes
from zoo.plan.traced import policy_estimate


def out_of_memory_line(c, trainer, error: BaseException, overrides=()) -> str:
    """One line for a run that ran out of device memory: XLA's figures, the planner's largest holders
    of the run's own policy, and the single change that frees the most."""
    m = re.search(r"\(([\d.]+[KMGT]?i?B?)\) exceeds available HBM \(([\d.]+[KMGT]?i?B?)\)", str(error)) or re.search(
        r"Used ([\d.]+[KMGT]?i?B?) of ([\d.]+[KMGT]?i?B?) hbm", str(error)
    )
    xla = f" (XLA: {m.group(1)} needed, {m.group(2)} available)" if m else ""
    args = " ".join(a for a in overrides if not a.startswith(("hydra.run.", "hydra.sweep.")))
    table = f"python -m zoo.tools.plan {args} plan.holders=true".replace("  ", " ")
    try:
        budget = c.hardware.hbm_bytes / 1e9 if c.hardware.hbm_bytes else None
        # (a profile without a host link still sizes the memory: the link only prices time)
        p, e, _ = policy_estimate(
            c, trainer, PlanConfig(hbm_budget_gb=budget, link=None if c.hardware.host_link_gbps else "1")
        )
        top = holders(p, e)[:3]
        change = next(iter(best_changes(p, e)), None)
    except Exception as why:  # noqa: BLE001 - the line must come out whatever the planner makes of the run
        return (
            f"out of device memory{xla}; the planner could not size this run ({type(why).__name__}); "
            f"for who holds it: {table}"
        )
    held = ", ".join(f"{h.name} {fmt_bytes(h.bytes)}" for h in top)
    fix = f"; the change that frees the most: {change.action} (-{fmt_bytes(change.saving)})" if change else ""
    return (
        f"out of device memory{xla}: the planner puts this step at {fmt_bytes(e.peak_bytes)} per device, the largest "
        f"holders {held}{fix}; the whole table: {table}"
    )
