"""python -m zoo.tools.plan: the planner's command line. Per tag keep on device, offload to host, or
recompute, to minimise the estimated step time within an HBM budget; the `plan.*` keys are
`zoo.plan.options.PlanConfig`'s, the rest are train.py's overrides.

The planner itself is the library zoo.plan (its docstring, which --help prints: the cost model and
the search); this module reads the command line, composes the run's config, prints what the library
finds and writes the plan: the offload YAML (`plan.out`), with plan.split=true the split's side
policies, and `plan.json`.
"""

import dataclasses
import json
import math
import pathlib
import shlex
import sys
from typing import Optional, Sequence

import zoo.plan
from zoo.offload import conf_dir
from zoo.plan.batch import batch_table, best_batch, per_device_to_global, search_batches
from zoo.plan.compiled import compile_checked, compile_count, compile_hint
from zoo.plan.cost import RANGE_CUT_COPIES, estimates_table, free_layers, streamed
from zoo.plan.holders import holders, holders_table
from zoo.plan.options import PlanConfig
from zoo.plan.policies import to_offload_config, to_yaml
from zoo.plan.problem import Estimate, Infeasible, PlanError, Problem, fmt_bytes
from zoo.plan.search import search
from zoo.plan.split import offload_presets, search_split, search_split_tags, split_problem
from zoo.plan.traced import (
    host_attention_impl,
    none_estimate,
    none_note,
    planning_for,
    problem_from_config,
    target_attention_impl,
)
from zoo.tools.kit import compose, output_path, prepare_step, run_tool, split_tool_args
from zoo.train.run import start_jax
from zoo.train.run_config import load


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def split_line(
    p: Problem, c, best: Estimate, args: Sequence[str], out=None, name: str = "planned", show_holders: bool = False
) -> str:
    """`plan.split=true`: the fastest head/tail split with per-tag assignments for each side
    (`search_split_tags`), against the plan and the best split of two conf/offload presets, with
    the train.py command that runs it. A side whose assignment is no preset's is written as a
    policy YAML next to the plan's (`out`: the plan's YAML; `<name>_head.yaml`, `<name>_tail.yaml`),
    which `offload.ranges` takes by path. Returns the lines to print."""
    n = c.model.num_layers
    if n < 2:
        return "split: a model of one layer has no split point"
    presets = offload_presets(p, c)
    preset_split = search_split(p, presets, n)
    split = search_split_tags(p, n, start=preset_split)
    if split is None:
        stacks = max(
            ((s, sc.param_bytes_per_layer * sc.layers) for s, sc in p.stacks.items()),
            key=lambda x: x[1],
            default=("", 0.0),
        )
        cost = (
            f" (a split inside {stacks[0]} costs {fmt_bytes(RANGE_CUT_COPIES * stacks[1])} of HBM: copies of its "
            "parameters)"
            if stacks[1] and not p.params_on_host
            else ""
        )
        return f"split: no split fits the budgets{cost}"
    unit = max(1e-3 * p.step_flops / p.rate, 1e-12)  # search's tolerance: within it, step times count as equal
    if (math.floor(split.estimate.time_s / unit), split.estimate.host_tag_bytes) >= (
        math.floor(best.time_s / unit),
        best.host_tag_bytes,
    ):
        return f"split: no split is faster than the plan's one policy for every layer ({1e3 * best.time_s:.3f} ms)"
    at = split.at
    head = f"0-{at - 1}" if at > 1 else "0"
    tail = f"{at}-{n - 1}" if n - 1 > at else f"{at}"
    by_assignment = {tuple(sorted(a.items())): k for k, a in presets.items()}
    folder = (out.parent if out is not None else pathlib.Path(".")).resolve()
    lines, values = [], []
    for side, layers, assignment in (("head", head, split.head_assignment), ("tail", tail, split.tail_assignment)):
        preset = by_assignment.get(tuple(sorted(assignment.items())))
        setattr(split, side, preset or "")
        if preset is not None:
            values.append((preset, preset))
            continue
        path = folder / f"{name}_{side}.yaml"
        policy = to_offload_config(
            dataclasses.replace(split.estimate, assignment=assignment),
            f"{name}_{side}",
            c.offload.params,
            c.offload.opt_state,
        )
        header = (
            f"The policy of layers {layers} of a split planned by python -m zoo.tools.plan plan.split=true,\n"
            "for offload.ranges (a value ending in .yaml is a file). Tags left out are recomputed."
        )
        path.write_text(to_yaml(policy, header))
        lines.append(f"wrote {path}")
        values.append((path.stem, f'"{path}"'))  # quoted for Hydra: a path may hold characters its grammar reserves
    e = split.estimate
    # The ranges cover every layer; where state lives is the top level's (offload.params / opt_state).
    state = [
        f"offload.{k}={v}"
        for k, v in (("params", c.offload.params), ("opt_state", c.offload.opt_state))
        if v != "device" and not any(a.startswith(f"offload.{k}=") for a in args)
    ]
    command = " ".join(
        [
            "python train.py",
            *(shlex.quote(a) for a in args),
            "offload=none",
            *state,
            shlex.quote(f"+offload.ranges={{{head}:{values[0][1]},{tail}:{values[1][1]}}}"),
        ]
    )
    against = (
        f"the best split of two presets: {1e3 * preset_split.estimate.time_s:.3f} ms"
        if preset_split
        else "no split of two presets fits"
    )
    lines.append(
        f"split: layers {head} {values[0][0]}, {tail} {values[1][0]}: estimated step {1e3 * e.time_s:.3f} ms, "
        f"HBM peak {fmt_bytes(e.peak_bytes)}, host {fmt_bytes(e.host_bytes)} (the plan: {1e3 * best.time_s:.3f} ms, "
        f"{fmt_bytes(best.peak_bytes)}; {against}); train with it: {command}"
    )
    if show_holders:  # the split's own estimate, each range's tags under its name
        q = split_problem(p, at, n, split.head_assignment, split.tail_assignment, values[0][0], values[1][0])
        lines.append("the split's " + holders_table(q, e, "hbm"))
        if e.host_tag_bytes:
            lines.append("the split's " + holders_table(q, e, "host"))
    return "\n".join(lines)


def use_plan_lines(out, overrides: Sequence[str]) -> list[str]:
    """How to train with (and inspect) a plan written to `out`: Hydra finds an option of the
    offload group in `<dir>/offload/<name>.yaml` given `hydra.searchpath=[file://<dir>]`."""
    out = out.resolve()
    if out.parent.name != "offload" or out.suffix != ".yaml":
        return [
            f"to use it, copy it to conf/offload/{out.stem}.yaml (or write it to <dir>/offload/{out.stem}.yaml with "
            f"plan.out) and pass offload={out.stem}"
        ]
    args = " ".join(shlex.quote(a) for a in overrides)
    search = shlex.quote(f"hydra.searchpath=[file://{out.parent.parent}]")
    return [
        f"train with it: python train.py {args} {search} offload={out.stem}",
        f"confirm the placement: python -m zoo.tools.inspect_step {args} {search} offload={out.stem}",
    ]


@dataclasses.dataclass
class Planning:
    """What the command line composed and the library built from it: the run's config and step, the
    problem and its figures (`problem_from_config`'s info), and the attention the target runs."""

    opts: PlanConfig
    overrides: list
    out: pathlib.Path
    c: object
    step_plan: object
    devices: list
    p: Problem
    info: dict
    attention_impl: str
    asked: str  # model.attention_impl as given
    notes: list


def _compose(argv: Sequence[str]) -> Planning:
    """The command line read, the run's config composed and validated, its step traced into the problem."""
    opts, overrides = split_tool_args(argv, "plan", PlanConfig)
    out = output_path(opts.out, "plan.out", "plan", f"offload/{opts.name}.yaml", argv)
    if opts.json:
        output_path(opts.json, "plan.json", "plan", "plan.json", argv)
    return _traced(opts, overrides, out)


def _traced(opts: PlanConfig, overrides: list, out) -> Planning:
    """The run's config composed from `overrides` and validated, its step traced into the problem."""
    cfg = compose(overrides)
    typed = load(cfg)
    start_jax(typed)  # the xla group's flags before target_attention_impl asks JAX for its backend
    # Resolve the attention for the hardware planned for; this machine validates and traces a
    # stand-in it can run (cuDNN's on a CPU: blockwise).
    asked = typed.model.attention_impl
    attention_impl = target_attention_impl(typed)
    cfg.model.attention_impl = host_attention_impl(attention_impl)
    with planning_for(typed.hardware.platform):
        c, step_plan, devices, trainer, notes = prepare_step(overrides, cfg)
        p, info = problem_from_config(c, trainer, opts, conf_dir() / "hardware", attention_impl)
    return Planning(opts, overrides, out, c, step_plan, devices, p, info, attention_impl, asked, notes)


def _ranges_note(p: Problem) -> str:
    free = sum(free_layers(p).values())
    return (
        "note: offload.ranges: "
        + "; ".join(f"{f.label} ({_layers(sum(f.layers.values()))}) counted as given" for f in p.fixed)
        + f"; the plan is the policy of the other {_layers(free)} "
        "(the YAML it writes; the commands below keep the ranges)"
    )


def _planning_line(c, p: Problem, info: dict) -> str:
    """What is planned: the model, the batch per device, the rate, the link, the budgets, the state."""
    return (
        f"planning {c.model.family} ({c.model.num_layers} layers), per device batch {info['per_device_batch']} x "
        f"{info['seq_len']} "
        + (
            f"(layer inputs split {info['sequence_parallel']} ways along the sequence) "
            if info["sequence_parallel"] > 1
            else ""
        )
        + f"on {info['devices']} device(s); compute rate {info['rate_flops'] / 1e12:.1f} TFLOP/s "
        f"({info['rate_source']}), "
        f"host link {info['link_gbps_per_direction']:g} GB/s per direction"
        + ("" if info["link_duplex"] else " (one direction at a time)")
        + ", HBM budget "
        f"{fmt_bytes(info['budget_bytes'])}, "
        + (
            f"host budget {fmt_bytes(p.host_budget)} per device "
            f"({fmt_bytes(p.devices_per_node * p.host_budget)} per node of {p.devices_per_node}); "
            if math.isfinite(p.host_budget)
            else "no host budget (hardware.host_bytes_per_device 0); "
        )
        + (
            f"params {c.offload.params}, optimizer state {c.offload.opt_state}"
            if p.frozen_bytes == 0
            else f"LoRA adapters {fmt_bytes(p.param_bytes)} trainable "
            f"(optimizer state {fmt_bytes(p.opt_bytes)}, {c.offload.opt_state}), "
            f"frozen base {fmt_bytes(p.frozen_bytes)} per device on "
            f"{'host, streamed per layer' if p.frozen_on_host else 'device'}"
        )
    )


def _counted_line(run: Planning) -> str:
    """The working set's parts as counted: the attention the target runs, the loss, the update."""
    c, info, chunk = run.c, run.info, run.c.trainer.loss_chunk_size
    return (
        f"counted: attention {run.attention_impl} on {c.hardware.name} (model.attention_impl={run.asked}) "
        f"{fmt_bytes(info['attention_working_bytes'])} per layer, "
        + (f"loss over chunks of {chunk} positions" if chunk else "loss over the whole logits")
        + f" {fmt_bytes(info['loss_working_bytes'])}, update "
        + ("streamed layer by layer" if streamed(run.p) else "whole tree on device")
    )


def _figures_line(info: dict) -> str:
    """Which figures of the estimate were measured on the hardware and which are assumed."""
    f = info["figures"]
    return "figures measured: " + ("; ".join(f["measured"]) or "none") + "; assumed: " + "; ".join(f["assumed"])


def _choose(run: Planning, after_error: list[str]):
    """(the plan's estimate, its compiled candidate or None, the candidates compiled): by the estimate
    alone, or with plan.compile by XLA's compiled peaks. Nothing fits: the refusal, its table printed
    before and who holds the memory (`after_error`) after its one line."""
    c, p = run.c, run.p
    n_compile = compile_count(run.opts, c)
    if run.opts.measure and not n_compile:
        raise PlanError(
            f"plan.measure: it times the compiled candidates, and nothing compiles for {c.hardware.name} "
            "here by default; give plan.compile=4"
        )
    run.opts = dataclasses.replace(run.opts, compile=n_compile)
    if run.opts.compile:
        return compile_checked(p, c, run.step_plan, run.devices, run.opts, none=_none(run))
    try:
        return search(p), None, []
    except Infeasible as e:
        print(estimates_table(p, e.best))
        after_error.append(holders_table(p, e.best, e.budget))
        hint = compile_hint(c) if e.budget == "hbm" else ""
        if hint:
            raise Infeasible(str(e) + hint, e.min_bytes, e.best, e.budget, e.min_host_bytes) from None
        raise


def _none(run: Planning) -> Optional[Estimate]:
    """`none`'s estimate where it differs from keeping every tag (the profile prices the checkpoint's
    re-run) and the search plans every layer (no offload.ranges); else None."""
    p, info = run.p, run.info
    if p.rerun_s and not p.fixed and info["none_residual_bytes"] is not None:
        return none_estimate(p, info["none_residual_bytes"])
    return None


def _print_estimate(run: Planning, best: Estimate, compiled) -> None:
    """The estimates table, the note on `none`, XLA's figure and (plan.holders) who holds the memory."""
    p = run.p
    print(estimates_table(p, best))
    none = _none(run)
    if none is not None and not (compiled and compiled.label == "none"):
        note = none_note(p, best, none, compiled is not None)
        if note:
            print(note)
    if compiled:
        print(
            f"XLA compiled this policy to {fmt_bytes(compiled.compiled_peak)} of {fmt_bytes(p.budget)} "
            "per device "
            "(plan.compile): that, not the estimate above, is what decides whether it fits"
        )
    if run.opts.holders:
        print(holders_table(p, best, "hbm"))
        if best.host_bytes:
            print(holders_table(p, best, "host"))


def _plan_header(argv: Sequence[str], p: Problem, best: Estimate, compiled, candidates: list) -> str:
    """The plan file's comment: the command that planned it and its figures."""
    return (
        f"Planned by: python -m zoo.tools.plan {' '.join(argv)}\n"
        f"Estimated step {1e3 * best.time_s:.3f} ms, HBM peak {fmt_bytes(best.peak_bytes)} of "
        f"{fmt_bytes(p.budget)} per device,\n"
        f"host memory {fmt_bytes(best.host_bytes)} per device ({fmt_bytes(best.host_node_bytes)} per node of "
        f"{p.devices_per_node}).\n"
        + (f"XLA's compiled peak {fmt_bytes(compiled.compiled_peak)} (plan.compile).\n" if compiled else "")
        + (
            f"Measured step {1e3 * compiled.measured_s:.1f} ms, the fastest of {len(candidates)} candidates "
            "(plan.measure).\n"
            if compiled and compiled.measured_s is not None
            else ""
        )
        + "Tags left out are recomputed."
    )


def _write_json(path: str, run: Planning, best: Estimate, compiled, candidates: list, policy) -> None:
    """plan.json: the figures, the estimate, the candidates compiled, who holds the memory, the policy."""
    p = run.p
    held = {m: [dataclasses.asdict(h) for h in holders(p, best, m)] for m in ("hbm", "host")}
    pathlib.Path(path).write_text(
        json.dumps(
            {
                "info": run.info,
                "estimate": best.as_dict(),
                "compiled_peak_bytes": compiled.compiled_peak if compiled else None,
                "candidates": [
                    {
                        "assignment": t.estimate.assignment,
                        "preset": t.label or None,
                        "estimated_step_s": t.estimate.time_s,
                        "estimated_peak_bytes": t.estimate.peak_bytes,
                        "compiled_peak_bytes": t.compiled_peak,
                        "measured_step_s": t.measured_s,
                    }
                    for t in candidates
                ],
                "holders": held,
                "policy": dataclasses.asdict(policy),
            },
            indent=2,
        )
        + "\n"
    )


def _batch_searched(run: Planning) -> Planning:
    """plan.batch_search=true: the plan at the per-device batch with the most tokens per second that
    fits (`zoo.plan.batch`), its table printed."""
    per_device, given = run.info["per_device_batch"], run.c.data.batch_size
    kept = [a for a in run.overrides if not a.startswith("data.batch_size=")]
    traced: dict[int, Planning] = {per_device: run}

    def problem_at(b: int):
        if b not in traced:
            traced[b] = _traced(
                run.opts, [*kept, f"data.batch_size={per_device_to_global(b, given, per_device)}"], run.out
            )
        return traced[b].p, _none(traced[b])

    rows = search_batches(
        problem_at, run.info["seq_len"], limit=run.opts.batch_limit, echo=lambda t: print(t, flush=True)
    )
    print(batch_table(rows, run.p.budget))
    best = best_batch(rows)
    if best is None:  # not even the smallest fits: its refusal, who holds the memory there
        return traced[rows[0].batch]
    chosen = traced[best.batch]
    print(f"planning per device batch {best.batch} (data.batch_size={chosen.c.data.batch_size})")
    return chosen


def _plan(argv: Sequence[str], after_error: list[str]) -> int:
    run = _compose(argv)
    if run.opts.batch_search:
        run = _batch_searched(run)
    c, p, opts = run.c, run.p, run.opts
    for n in run.notes:
        print(f"note: {n}")
    if opts.split and p.fixed:
        raise PlanError("plan.split: it searches the ranges itself; drop offload.ranges or plan.split=true")
    if p.fixed:
        print(_ranges_note(p))
    print(_planning_line(c, p, run.info))
    print(_counted_line(run))
    print(_figures_line(run.info))
    best, compiled, candidates = _choose(run, after_error)
    opts = run.opts
    policy = to_offload_config(best, opts.name, c.offload.params, c.offload.opt_state)
    if compiled is not None and compiled.label == "none":  # nothing checkpointed: no assignment says that
        policy = dataclasses.replace(policy, checkpoint=False, tags={})
    _print_estimate(run, best, compiled)
    run.out.write_text(to_yaml(policy, _plan_header(argv, p, best, compiled, candidates)))
    print(f"wrote {run.out}")
    # The plan's own output directory is no place for the training run's.
    kept = [a for a in run.overrides if not a.startswith(("offload=", "hydra.run.", "hydra.sweep."))]
    for line in use_plan_lines(run.out, kept):
        print(line)
    if opts.split:
        print(split_line(p, c, best, kept, run.out, opts.name, opts.holders))
    if opts.json:
        _write_json(opts.json, run, best, compiled, candidates, policy)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    after_error: list[str] = []  # printed after the one error line: who holds the memory
    rc = run_tool(lambda: _plan(argv, after_error), "python -m zoo.tools.plan", argv, doc=zoo.plan.__doc__)
    for text in after_error:
        print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
