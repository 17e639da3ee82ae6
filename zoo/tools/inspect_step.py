"""`python -m zoo.tools.inspect_step <train.py overrides>`: what went where in train.py's step, per tagged
intermediate, read from the traced program (`zoo.placement`), against what the offload policy asks;
the compiled step's memory, who holds the HBM, and the scale report (`zoo.tools.scale`).

It composes the same Hydra config as train.py, builds the same step (`zoo.tools.kit.prepare_step`) and
prints a table; `inspect.json` holds the same. Exit 1 when a tag is not where the policy says.
"""

import dataclasses
import json
import re
import sys
from typing import Callable, Optional, Sequence

import jax

from zoo import hlo
from zoo import model as zoo_model
from zoo.counts import count_params
from zoo.offload import expected_placement, layer_policies, placement_matches, resolve, scan_policies
from zoo.placement import Placement, placement_from_jaxpr, scan_names, update_buffers
from zoo.tools import scale
from zoo.tools.kit import fmt_bytes, output_path, prepare_step, run_tool, split_tool_args, text_table
from zoo.train.batches import SyntheticData
from zoo.train.metrics import compiled_memory, device_memory
from zoo.train.run import kernels

EXIT_MISMATCH = 1


@dataclasses.dataclass
class InspectOptions:
    """`inspect.*` keys of `python -m zoo.tools.inspect_step` (the other arguments are train.py's overrides)."""

    # null: outputs/inspect/<date>_<time>/inspect.json under the current directory, or <hydra.run.dir>/inspect.json;
    # an existing file the inspector did not write is replaced only with inspect.overwrite=true (zoo.tools.kit)
    out: Optional[str] = None
    # Run one real step to read the device's peak memory, where the backend reports it (not CPU).
    measure: bool = True
    # Exit 1 when a tag is not where the policy says it should be.
    strict: bool = True
    # Print who holds the HBM (the compiled step's largest buffers) even when XLA's estimated peak is
    # within hardware.hbm_bytes (it is printed whenever it is not).
    holders: bool = False


def report(
    c,
    trainer,
    placement: Placement,
    compiled_mem: Optional[dict],
    measured: Optional[dict],
    overrides=(),
    update: Optional[dict] = None,
) -> dict:
    """inspect.json's content (schema in docs/offload.md: "The inspector"); `update`: `update_buffers`
    of the traced step."""
    expected = expected_placement(c.offload, c.model)
    actions = resolve(c.offload, c.model)
    # Per forward scan, the policy its layers run under (a policy per layer range: offload.ranges).
    scans = dict(scan_policies(c.offload, zoo_model.abstract(c.model)))
    top = c.offload.without_ranges()

    def policy_of(stack: str):
        return scans[stack].config if stack in scans else top

    tags = []
    for r in placement.records:
        policy = policy_of(r.stack)
        want = expected_placement(policy, c.model).get(r.tag)
        d = r.as_dict()
        d["configured"] = resolve(policy, c.model).get(r.tag)
        d["expected"] = want
        d["ok"] = placement_matches(want or "", r.placement)
        tags.append(d)
    found = {r.tag for r in placement.records}
    missing = sorted(set(expected) - found)
    totals = {p: placement.bytes_on(p) for p in ("host", "device", "recomputed", "unread")}
    totals["untagged_device"] = placement.other_bytes("device")
    totals["untagged_host"] = placement.other_bytes("host")
    notes = []
    if any(
        r.tag == "decoder_layer_input" and t["configured"] == "remat" and r.placement == "device"
        for r, t in zip(placement.records, tags)
    ):
        notes.append(
            "decoder_layer_input: the checkpointed layer's input is kept by the scan, so remat leaves it on device "
            "(offload moves it to host)"
        )
    checkpointed = [r for r in placement.records if policy_of(r.stack).checkpoint]
    if any(r.placement == "unread" for r in checkpointed):
        unread = sorted({r.tag for r in checkpointed if r.placement == "unread"})
        notes.append(f"{', '.join(unread)}: the backward pass never reads it, so there is nothing to keep or recompute")
    weights = sum(o.total_bytes for o in placement.other if o.source == "device_put" and o.memory == "device")
    if weights:
        notes.append(
            f"{fmt_bytes(weights)} of per-layer values moved to the device inside the scan (parameters) are kept for "
            "the backward pass: "
            "without a checkpoint every layer's weights stay on device; with params on host use a checkpointing "
            "policy, "
            "e.g. offload=[full,params_host]"
        )
    kinds = {
        "params": sorted({s.memory_kind for s in jax.tree.leaves(trainer.param_shardings)}),
        "opt_state": sorted({s.memory_kind for s in jax.tree.leaves(trainer.opt_shardings)}),
    }
    if trainer.lora is not None:  # params are the adapters; the frozen base is state of its own
        kinds["frozen_base"] = sorted({s.memory_kind for s in jax.tree.leaves(trainer.base_shardings)})
    return {
        "schema": "zoo.inspect/1",
        "overrides": list(overrides),
        "model": {"family": c.model.family, "params": count_params(c.model), "num_layers": c.model.num_layers},
        "batch": {
            "batch_size": c.data.batch_size,
            "seq_len": c.data.seq_len,
            "grad_accum": c.trainer.grad_accum,
            "microbatch": trainer.plan.microbatch,
        },
        "policy": {
            "name": c.offload.name,
            "describe": c.offload.describe(),
            "checkpoint": c.offload.checkpoint,
            "actions": actions,
            "params": c.offload.params,
            "opt_state": c.offload.opt_state,
        },
        "state_memory_kinds": kinds,
        "stacks": placement.stacks,
        "ranges": range_sections(c, placement, scans) if c.offload.ranges else None,
        "tags": tags,
        "untagged_residuals": [o.as_dict() for o in placement.other],
        "totals_bytes": totals,
        "compiled_memory": compiled_mem,
        "measured": measured,
        **memory_sections(c, trainer, update),
        "mismatches": [t["tag"] + "@" + t["stack"] for t in tags if not t["ok"]]
        + [f"{t}: not found in the program" for t in missing],
        "notes": notes,
    }


def range_sections(c, placement: Placement, scans: dict) -> list[dict]:
    """inspect.json's `ranges` (with `offload.ranges`): per consecutive layer segment, where its
    policy comes from (`offload.ranges.<key>` or the top-level `offload`), its preset, its scans, and
    the tags found on host, kept on device, recomputed or unread there."""
    out = []
    for seg in layer_policies(c.offload, c.model.num_layers):
        names = [n for n, p in scans.items() if (p.first, p.stop) == (seg.first, seg.stop)]
        found: dict[str, set] = {k: set() for k in ("host", "device", "recomputed", "unread")}
        for r in placement.records:
            if r.stack in names:
                found.setdefault(r.placement, set()).add(r.tag)
        out.append(
            {
                "layers": f"{seg.first}-{seg.stop - 1}",
                "source": seg.label,
                "preset": seg.config.name,
                "scans": names,
                **{k: sorted(v) for k, v in found.items()},
            }
        )
    return out


def render_ranges(ranges: Optional[list]) -> list[str]:
    """One line per layer segment of `range_sections`."""
    if not ranges:
        return []
    lines = ["per layer range (offload.ranges; the other layers run under the top-level policy):"]
    for r in ranges:
        where = (
            "; ".join(f"{k} {', '.join(r[k])}" for k in ("host", "device", "recomputed", "unread") if r.get(k))
            or "no tags found"
        )
        lines.append(f"  layers {r['layers']} ({r['source']}: {r['preset']}, {len(r['scans'])} scan(s)): {where}")
    return lines


def memory_sections(c, trainer, update: Optional[dict]) -> dict:
    """inspect.json's `kernels` (what this machine runs: attention implementation, routed-expert
    kernel, loss chunk) and `update` (`update_buffers`, with whether the update is streamed)."""
    out = {"kernels": kernels(c, trainer.plan)}
    if update is not None:
        out["update"] = {"streamed": trainer.layerwise_update, "devices": int(trainer.mesh.size), **update}
    return out


def render_memory_sections(rep: dict) -> list[str]:
    k = rep.get("kernels")
    lines = []
    if k:
        lines.append(
            f"kernels: attention {k['attention']}"
            + (f", routed experts {k['moe']}" if k.get("moe") else "")
            + (
                f", loss over chunks of {k['loss_chunk_size']} positions"
                if k.get("loss_chunk_size")
                else ", loss over the whole logits"
            )
        )
    u = rep.get("update")
    if u:

        def buf(b):
            return "none" if b is None else f"{fmt_bytes(b['bytes'])} ({'x'.join(map(str, b['shape']))} {b['dtype']})"

        if u["streamed"]:
            lines.append(
                f"update: streamed over {u['layer_loops']} layer loops; largest device value inside them "
                f"{buf(u['device_in_loops'])}, "
                f"outside them {buf(u['device_outside_loops'])}; largest host->device move {buf(u['moved_to_device'])}"
            )
        else:
            lines.append(f"update: whole tree on device; largest device value {buf(u['device_outside_loops'])}")
        if u.get("devices", 1) > 1:
            # update_buffers reads the traced program, whose shapes are global: a sharded leaf's
            # part on one device is that divided by the ways it is split.
            lines[-1] += f" (traced shapes: each split over the {u['devices']} devices as its leaf is)"
    return lines


def render(rep: dict) -> str:
    rows = [("tag", "stack", "shape/layer", "dtype", "bytes/layer", "layers", "total", "configured", "found", "")]
    for t in rep["tags"]:
        rows.append(
            (
                t["tag"],
                t["stack"],
                "x".join(map(str, t["shape"])),
                t["dtype"],
                fmt_bytes(t["bytes_per_layer"]),
                t["layers"],
                fmt_bytes(t["total_bytes"]),
                t["configured"],
                t["placement"],
                "" if t["ok"] else f"MISMATCH (expected {t['expected']})",
            )
        )
    out = [
        f"policy {rep['policy']['describe']}; params in {', '.join(rep['state_memory_kinds']['params'])}, "
        f"optimizer state in {', '.join(rep['state_memory_kinds']['opt_state'])}"
        + (
            f"; LoRA: params are the adapters, the frozen base in {', '.join(rep['state_memory_kinds']['frozen_base'])}"
            if "frozen_base" in rep["state_memory_kinds"]
            else ""
        ),
        text_table(rows),
    ]
    out += render_ranges(rep.get("ranges"))
    tot = rep["totals_bytes"]
    out.append(
        f"tags on host {fmt_bytes(tot['host'])}, kept on device {fmt_bytes(tot['device'])}, recomputed "
        f"{fmt_bytes(tot['recomputed'])}; "
        f"untagged residuals on device {fmt_bytes(tot['untagged_device'])}, on host {fmt_bytes(tot['untagged_host'])} "
        f"({len(rep['untagged_residuals'])} per-layer outputs)"
    )
    m = rep["compiled_memory"]
    if m:
        out.append(
            "compiled: argument {} output {} temp {} host temp {} (alias {}; estimated peak {})".format(
                fmt_bytes(m.get("argument_size_in_bytes")),
                fmt_bytes(m.get("output_size_in_bytes")),
                fmt_bytes(m.get("temp_size_in_bytes")),
                fmt_bytes(m.get("host_temp_size_in_bytes")),
                fmt_bytes(m.get("alias_size_in_bytes")),
                fmt_bytes(m.get("estimated_peak_bytes")),
            )
        )
    out += render_memory_sections(rep)
    meas = rep["measured"]
    out.append(
        f"measured peak device memory {fmt_bytes(meas['peak_bytes_in_use'])} ({meas['source']})"
        if meas
        else "measured peak device memory: n/a (the backend reports no memory statistics)"
    )
    out += [f"note: {n}" for n in rep["notes"]]
    if rep["mismatches"]:
        out.append(f"placement differs from the policy: {', '.join(rep['mismatches'])}")
    return "\n".join(out)


def _state_kind(op_name: str) -> str:
    """`state['params'].embed` -> params; `state['opt_state']...` -> opt_state; `tokens` -> tokens."""
    m = re.match(r"^(\w+)(?:\['(\w+)'\])?", op_name)
    return (m.group(2) or m.group(1)) if m else "other"


# The share of XLA's estimated peak that the values of its live-range dump's peak must add up to
# (their shapes' sizes, before layout padding) to be listed as what the peak holds.
LIVE_AT_PEAK_MIN_SHARE = 0.8


def compiled_holders(
    buffers, compiled_mem: Optional[dict], hbm_bytes: int, top: int = 8, live: Optional[list] = None
) -> dict:
    """Who holds the compiled step's device memory: its arguments by kind (params, opt_state, tokens)
    and their largest leaves, the largest values of the temp allocation, and (`live`: `zoo.hlo.live_at_peak`)
    the values live together at XLA's peak, largest first; with XLA's estimated peak against
    `hardware.hbm_bytes` (0: none given)."""
    device = [b for b in buffers if b.memory_space == 0]
    args = sorted((b for b in device if b.kind == "argument"), key=lambda b: -b.bytes)
    by_kind: dict[str, int] = {}
    for b in args:
        k = _state_kind(b.op_name)
        by_kind[k] = by_kind.get(k, 0) + b.bytes
    temp = sorted((b for b in device if b.kind == "temp"), key=lambda b: -b.bytes)
    peak = (compiled_mem or {}).get("estimated_peak_bytes")

    def row(b):
        return {"name": b.name, "bytes": b.bytes, "shape": b.shape, "op_name": b.op_name}

    shapes = {b.name: b.shape for b in buffers}
    live_bytes = None if live is None else sum(v.bytes for v in live)
    # XLA's live-range dump names the moment its own count peaks, which for a TPU was seen to miss the
    # compiled peak (v5e: 2.81 of 5.78 GB for dsv3_100m with its attention output offloaded, 9.78 of
    # 13.74 GB for llama_1b's layers under `minimal`; 4.18 of 4.45 GB for dsv3_100m under `full`):
    # a listing short of most of the peak is not shown as the peak's.
    at_peak = live is not None and bool(peak) and live_bytes >= LIVE_AT_PEAK_MIN_SHARE * peak

    return {
        "estimated_peak_bytes": peak,
        "hbm_bytes": hbm_bytes,
        "over_budget": bool(hbm_bytes and peak is not None and peak > hbm_bytes),
        "arguments_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "largest_arguments": [row(b) for b in args[:top]],
        "temp_bytes": (compiled_mem or {}).get("temp_size_in_bytes"),
        "largest_temp": [row(b) for b in temp[:top]],
        "live_at_peak_bytes": live_bytes,
        "live_at_peak_argument_bytes": None if live is None else sum(v.bytes for v in live if v.argument),
        # The state is listed above: these are the step's own values that coexist at the peak.
        "live_at_peak": [
            {"name": v.name, "bytes": v.bytes, "shape": shapes.get(v.name.split("{")[0], ""), "op_name": v.op_name}
            for v in [v for v in (live or []) if not v.argument][:top]
        ]
        if at_peak
        else [],
    }


def render_holders(h: dict, overrides: Sequence[str] = ()) -> str:
    peak, hbm = h["estimated_peak_bytes"], h["hbm_bytes"]
    against = (
        f"over hardware.hbm_bytes {fmt_bytes(hbm)}"
        if h["over_budget"]
        else (f"within hardware.hbm_bytes {fmt_bytes(hbm)}" if hbm else "no hardware.hbm_bytes")
    )
    out = [
        f"who holds the HBM: the compiled step's buffers, XLA's estimated peak {fmt_bytes(peak)} per device, {against}"
    ]
    kinds = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in h["arguments_by_kind"].items())
    out.append(f"  arguments {fmt_bytes(sum(h['arguments_by_kind'].values()))}: {kinds}")
    # optax's wrappers (inner_states['train'].inner_state[1][0]...) say nothing about the leaf.
    rows = [
        (re.sub(r"\]\..*?\.(mu|nu)\.", r"].\1.", b["op_name"]) or b["name"], fmt_bytes(b["bytes"]), b["shape"])
        for b in h["largest_arguments"]
    ]
    if rows:
        out.append("  largest arguments:")
        out += ["    " + ln for ln in text_table(rows).splitlines()]
    if h.get("live_at_peak"):
        out.append(
            f"  live together at XLA's peak: {fmt_bytes(h['live_at_peak_bytes'])} as their shapes count them (before "
            f"layout padding), {fmt_bytes(h['live_at_peak_argument_bytes'])} of it arguments; the largest of the rest:"
        )
        rows = [(b["name"], fmt_bytes(b["bytes"]), b["shape"], b["op_name"]) for b in h["live_at_peak"]]
        out += ["    " + ln for ln in text_table(rows).splitlines()]
    elif h["largest_temp"]:
        out.append(
            f"  temporaries {fmt_bytes(h['temp_bytes'])} in all; the largest values (they share that allocation over "
            "the step):"
        )
        rows = [(b["name"], fmt_bytes(b["bytes"]), b["shape"], b["op_name"]) for b in h["largest_temp"]]
        out += ["    " + ln for ln in text_table(rows).splitlines()]
    if h["over_budget"]:
        args = " ".join(a for a in overrides if not a.startswith(("hydra.run.", "hydra.sweep.")))
        out.append(
            f"  to find what frees the most: python -m zoo.tools.plan {args} plan.holders=true (per-tag offload / "
            "remat and state presets, "
            "with the saving of each)"
        )
    return "\n".join(out)


def inspect_step(
    trainer, measure: bool = True, on_compiled: Optional[Callable] = None, on_buffers: Optional[Callable] = None
):
    """Trace, compile and (optionally) run the train step: placement, compiled memory, measured peak.
    `on_compiled(compiled, partitioned_hlo_text)` sees the executable (the text is None on one device);
    `on_buffers(buffers, live)` its buffer assignment (`zoo.hlo.buffer_assignment`) and the values live at
    XLA's peak (`zoo.hlo.live_at_peak`), each None where XLA wrote no such dump."""
    state, tokens = trainer.abstract_state(), trainer.abstract_tokens()
    traced = trainer.jitted_step().trace(state, tokens)
    placement = placement_from_jaxpr(
        traced.jaxpr, scan_names(zoo_model.abstract(trainer.cfg.model), trainer.cfg.offload)
    )
    compiled, partitioned, assignment, live_range = hlo.compile_with_dumps(
        traced.lower(), partitioned=trainer.mesh.devices.size > 1
    )
    if on_compiled is not None:
        on_compiled(compiled, partitioned)
    if on_buffers is not None:
        text = compiled.as_text()
        on_buffers(
            None if assignment is None else hlo.buffer_assignment(assignment, text),
            None if live_range is None else hlo.live_at_peak(live_range, text),
        )
    compiled_mem = compiled_memory(compiled)
    devices = list(trainer.mesh.devices.flat)
    measured = None
    if measure and device_memory(devices) is not None:
        data = SyntheticData(trainer.cfg.data, trainer.cfg.model.vocab_size)
        real_state = trainer.init()
        for step in range(2):
            real_state, m = compiled(real_state, trainer.shard_tokens(data.batch(step)))
            jax.block_until_ready(m)
        mem = device_memory(devices)
        measured = {
            "peak_bytes_in_use": mem["peak_bytes_in_use"],
            "bytes_limit": mem["bytes_limit"],
            "source": "device.memory_stats after 2 steps",
        }
    return placement, compiled_mem, measured


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts, overrides = split_tool_args(argv, "inspect", InspectOptions)
        out = output_path(opts.out, "inspect.out", "inspect", "inspect.json", argv)
        c, plan, devices, trainer, notes = prepare_step(overrides)
        for n in notes:
            print(f"note: {n}")

        seen = {}
        placement, compiled_mem, measured = inspect_step(
            trainer,
            opts.measure,
            on_compiled=lambda compiled, text: seen.update(scale=scale.scale_report(trainer, compiled, text)),
            on_buffers=lambda buffers, live: seen.update(buffers=buffers, live=live),
        )
        update = update_buffers(trainer.jitted_step().trace(trainer.abstract_state(), trainer.abstract_tokens()).jaxpr)
        rep = report(c, trainer, placement, compiled_mem, measured, overrides, update)
        rep["scale"] = seen["scale"]
        rep["holders"] = (
            None
            if seen.get("buffers") is None
            else compiled_holders(seen["buffers"], compiled_mem, c.hardware.hbm_bytes, live=seen.get("live"))
        )
        print(render(rep))
        print(scale.render(rep["scale"]))
        if rep["holders"] and (rep["holders"]["over_budget"] or opts.holders):
            print(render_holders(rep["holders"], overrides))
        out.write_text(json.dumps(rep, indent=2) + "\n")
        print(f"wrote {out}")
        if rep["mismatches"] and opts.strict:
            print(f"error: placement differs from the policy: {', '.join(rep['mismatches'])}", file=sys.stderr)
            return EXIT_MISMATCH
        return 0

    return run_tool(body, "python -m zoo.tools.inspect_step", argv)


if __name__ == "__main__":
    raise SystemExit(main())
