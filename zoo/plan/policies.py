"""Between offload policies and assignments: a policy's action for every tag of a problem
(`preset_assignment`), the problem with `offload.ranges`' layers fixed to their presets
(`with_ranges`), and an assignment written back as a policy (`to_offload_config`, `to_yaml`)."""

import dataclasses


from zoo.offload import OffloadConfig, range_configs, resolve
from zoo.plan.cost import cut_bytes
from zoo.plan.problem import Estimate, FixedRange, Problem, layers_in, stack_bounds


def preset_assignment(p: Problem, config, model_config) -> dict[str, str]:
    """An OffloadConfig's action for every tag of `p`; a tag left at `remat` that cannot be
    recomputed (the layer input) is kept on device, as the scan keeps it."""
    actions = resolve(config, model_config)
    out = {}
    for t in p.tags:
        a = actions.get(t.tag, "remat")
        out[t.tag] = a if a in t.choices else "device"
    return out


def with_ranges(p: Problem, policy, model_config) -> Problem:
    """`p` with the layers of `policy.ranges` fixed to their presets' actions (`FixedRange`): the
    estimate counts them so, and the search assigns the other layers' tags."""
    bounds = stack_bounds(p)
    ranges = range_configs(policy)
    fixed = [
        FixedRange(
            f"layers {r.key} {r.preset}",
            layers_in(bounds, r.first, r.last),
            preset_assignment(p, config, model_config),
            holds_last=r.last == sum(sc.layers for sc in p.stacks.values()) - 1,
        )
        for r, config in ranges
    ]
    boundaries = [b for r, _ in ranges for b in (r.first, r.last + 1)]
    return dataclasses.replace(p, fixed=fixed, cut_bytes=cut_bytes(p, boundaries))


def to_offload_config(
    estimate: Estimate, name: str, params: str = "device", opt_state: str = "device"
) -> OffloadConfig:
    tags = {t: a for t, a in estimate.assignment.items() if a != "remat"}
    return OffloadConfig(name=name, checkpoint=True, tags=tags, params=params, opt_state=opt_state)


def to_yaml(policy: OffloadConfig, header: str = "") -> str:
    lines = [f"# {ln}" if ln else "#" for ln in header.splitlines()]
    lines += [f"name: {policy.name}", f"checkpoint: {str(policy.checkpoint).lower()}"]
    if policy.tags:
        lines.append("tags:")
        lines += [f"  {t}: {a}" for t, a in policy.tags.items()]
    else:
        lines.append("tags: {}")
    lines += [f"params: {policy.params}", f"opt_state: {policy.opt_state}"]
    return "\n".join(lines) + "\n"
