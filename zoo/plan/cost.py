"""The cost model (numpy arithmetic, no JAX call): an assignment of device / offload / remat to the tags,
priced per device and step (time: compute, recompute, exposed host transfers, state transfers; memory:
the HBM peak of two phases and the host memory), vectorised over many assignments at once
(`evaluate_arrays`; `evaluate` for one). What a host transfer costs is `transfer_s`. The model's terms
are listed in zoo.plan's docstring; `estimates_table` prints every number it used."""

import math

import numpy as np

from zoo.offload import CHECKPOINT_INPUTS
from zoo.plan.problem import CHOICES, Estimate, Problem, StackCost, TagCost, fmt_bytes, stack_bounds


def transfer_s(p: Problem, nbytes, transfers=1):
    """Seconds to move `nbytes` one way over the host link in `transfers` transfers: its bandwidth
    (`Problem.link`, bytes/s per direction) and a fixed latency per transfer (plan.transfer_latency_us;
    the optimizer update's state moves are counted as 0 transfers: one stream each way). Every host
    transfer the model prices comes here: the tags' (`layer_parts`, where they overlap compute), the
    host-resident weights' and the state's (`state_transfer_s`). Works on arrays of assignments."""
    return nbytes / p.link + transfers * p.latency


def tag_totals(p: Problem, t: TagCost) -> float:
    return tag_totals_of(t, p.stacks)


def tag_totals_of(t: TagCost, stacks: dict[str, StackCost]) -> float:
    return sum(b * stacks[s].layers for s, b in t.bytes_per_layer.items())


def streamed(p: Problem) -> bool:
    """Host-resident state is updated layer by layer (zoo.train.update)."""
    return p.params_on_host or p.opt_on_host


def layer_state_bytes(p: Problem, params: bool, opt: bool) -> float:
    """The largest one layer's parameters + gradients (`params`) and optimizer state (`opt`)."""
    return max(
        (2 * s.param_bytes_per_layer * params + s.opt_bytes_per_layer * opt for s in p.stacks.values()), default=0.0
    )


def frozen_on_device(p: Problem) -> float:
    """The LoRA base's device bytes in the backward phase: all of it, or, on host, what lies outside
    the stacks and two layers in flight (this one and the next)."""
    if not p.frozen_on_host:
        return p.frozen_bytes
    return p.frozen_bytes - p.stack_frozen_bytes + 2 * p.frozen_layer_bytes


def fixed_bytes(p: Problem) -> tuple[float, float]:
    """(backward-phase bytes that do not depend on the tags, update-phase bytes)."""
    backward, update = _fixed_state_bytes(p)
    # The update touches only the adapters; a device-resident base stays where it is through it.
    return backward + frozen_on_device(p), update + (0.0 if p.frozen_on_host else p.frozen_bytes)


# What cutting a scanned stack into pieces (offload.ranges, `zoo.model.Stack.cut`) costs in the
# backward phase, in copies of the cut stacks' parameters: the pieces are slices of the stacked
# leaves (a copy each) and their gradients are joined back (another, partly overlapping). On XLA:CPU's
# compiled gradient of llama_100m (125.86 MB of stacked float32 weights) a range of layers 0-3 under
# the top-level policy itself costs 184.61 MB more temp than no range: 1.47 copies (docs/offload.md's
# table, `tests/test_offload_ranges.py -k compiled_memory`); counted as 1.5.
RANGE_CUT_COPIES = 1.5


def cut_bytes(p: Problem, boundaries) -> float:
    """Parameter bytes (per device) of the stacks that a range starting at any of `boundaries` (layer
    indices) cuts: a boundary strictly inside a stack's layers."""
    out = 0.0
    for s, (lo, hi) in stack_bounds(p).items():
        if any(lo < b <= hi for b in boundaries):
            out += p.stacks[s].param_bytes_per_layer * p.stacks[s].layers
    return out


def _fixed_state_bytes(p: Problem) -> tuple[float, float]:
    outside_params = p.param_bytes - p.stack_param_bytes
    if p.params_on_host:
        # Weights: this layer and the next in flight. Their gradients leave for host memory per layer.
        biggest_layer = max((s.param_bytes_per_layer for s in p.stacks.values()), default=0.0)
        params = outside_params + 2 * biggest_layer
        grads = p.grad_bytes - p.stack_param_bytes + 2 * biggest_layer
    else:
        params, grads = p.param_bytes, p.grad_bytes
    if p.microbatches > 1:
        # zoo.train.step scans the microbatches with the gradients' running sum as its carry: at each
        # microbatch's end the sum and that microbatch's gradients are both on device (the stacks' with
        # parameters on host go to host layer by layer). TPU v5e, llama_1b's layers, 8 microbatches
        # of 8 x 2048: XLA's peak 13.26 GB, this estimate 12.83 (10.81 without the sum).
        grads += p.grad_bytes - (p.stack_param_bytes if p.params_on_host else 0.0)
    opt = 0.0 if p.opt_on_host else p.opt_bytes
    # Host-resident stacks are sliced in host memory: the cut's copies are on device only otherwise.
    cut = 0.0 if p.params_on_host else RANGE_CUT_COPIES * p.cut_bytes
    backward = params + grads + opt + p.other_bytes + p.working_bytes + cut
    if not streamed(p):
        return backward, p.param_bytes + p.grad_bytes + p.opt_bytes
    # Streamed: what lives on device stays (with parameters on host, the gradients of the leaves outside
    # the stacks, made on device by the backward); host-resident slices come at most a layer's worth at
    # a time (a stack's layer, or a run of a large leaf's rows), this one and the next in flight.
    resident = (0.0 if p.params_on_host else p.param_bytes + p.grad_bytes) + (0.0 if p.opt_on_host else p.opt_bytes)
    outside = outside_params if p.params_on_host else 0.0
    return backward, resident + outside + 2 * layer_state_bytes(p, p.params_on_host, p.opt_on_host)


def devices_on_node(p: Problem) -> int:
    return max(1, int(p.devices_per_node))


def host_fixed_parts(p: Problem) -> dict[str, float]:
    """Host bytes per device that do not depend on the tags, by holder."""
    parts = {}
    if p.params_on_host:
        parts["parameters"] = p.param_bytes
        # The stacks' gradients come back from the backward pass into host memory (zoo.train.update);
        # with several microbatches one microbatch's arrive while the sum is held.
        parts["gradients"] = p.stack_param_bytes
        if p.microbatches > 1:
            parts["gradients of the microbatch being summed in"] = p.stack_param_bytes
    if p.opt_on_host:
        parts["optimizer state"] = p.opt_bytes
    if p.frozen_on_host:
        parts["frozen LoRA base"] = p.frozen_bytes
    if p.staging_bytes:
        parts["input staging (this step's and the next step's tokens)"] = p.staging_bytes
    return parts


def state_transfer_s(p: Problem) -> float:
    """Host-resident state moved for the optimizer update, exposed (in and out overlap on a full-duplex
    link, so the busier direction counts; otherwise their sum). With params on host the stacks'
    gradients come in twice (the norm, then the update) and, with several microbatches, are summed in
    place once per microbatch (in twice, out once)."""
    opt = p.opt_bytes if p.opt_on_host else 0.0
    # A host-resident LoRA base comes in per layer in the forward and again in the backward of each
    # microbatch (counted as exposed, like the state here: the planner does not model its overlap).
    frozen = (
        (2 * p.stack_frozen_bytes * p.microbatches + p.frozen_bytes - p.stack_frozen_bytes) if p.frozen_on_host else 0.0
    )
    if not p.params_on_host:
        return transfer_s(p, opt + frozen, 0) if p.duplex else transfer_s(p, 2 * opt + frozen, 0)
    grads = p.stack_param_bytes
    into = frozen + opt + p.param_bytes + 2 * grads + (2 * grads * p.microbatches if p.microbatches > 1 else 0.0)
    out = opt + p.param_bytes + (grads * p.microbatches if p.microbatches > 1 else 0.0)
    return transfer_s(p, max(into, out) if p.duplex else into + out, 0)


def free_layers(p: Problem) -> dict[str, int]:
    """Per stack, its layers outside every fixed range (the ones the search assigns)."""
    return {s: sc.layers - sum(f.layers.get(s, 0) for f in p.fixed) for s, sc in p.stacks.items()}


def evaluate_arrays(p: Problem, digits: np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised estimates: `digits[i, j]` is the CHOICES index of tag j in assignment i (for the
    layers outside `p.fixed`; the fixed ranges' layers count with their own assignment)."""
    n = digits.shape[0]
    recompute_flops, device_bytes, host_bytes, exposed = layer_parts(p, digits, free_layers(p))
    inflight = offloaded_per_layer(p, digits, free_layers(p))
    last = digits
    for f in p.fixed:
        parts = layer_parts(p, digits_of(p, f.assignment), f.layers)
        recompute_flops, device_bytes, host_bytes, exposed = (
            a + b for a, b in zip((recompute_flops, device_bytes, host_bytes, exposed), parts)
        )
        inflight = np.maximum(inflight, offloaded_per_layer(p, digits_of(p, f.assignment), f.layers))
        if f.holds_last:
            last = np.broadcast_to(digits_of(p, f.assignment), digits.shape)
    exposed = exposed + turn_s(p, last)
    return _totals(p, n, recompute_flops, device_bytes, host_bytes, exposed, inflight)


def offloaded_per_layer(p: Problem, digits: np.ndarray, layers_of: dict[str, int]) -> np.ndarray:
    """One layer's offloaded tag bytes (the largest among the stacks with layers in `layers_of`): in
    the backward the next layer's copies come back while this layer's run (read off a v5e's buffer
    assignment: dsv3_100m with its attention output offloaded held this layer's and the next's)."""
    out = np.zeros(digits.shape[0])
    for s in p.stacks:
        if layers_of.get(s, 0):
            offloaded = sum((digits[:, j] == 1) * float(t.bytes_per_layer.get(s, 0.0)) for j, t in enumerate(p.tags))
            out = np.maximum(out, offloaded)
    return out


def overlaps(p: Problem, tag: str) -> bool:
    """Whether `tag`'s host transfer is priced as overlapping its layer's compute at all (the share
    `Problem.transfer_overlap`, from hardware.transfer_overlap; plan.transfers) rather than exposed
    whole, both ways. The layer input never is: it is what the layer's backward starts from, so
    nothing hides its way back (on a v5e its offload cost dsv3_100m 363 ms a step at 68 x 4096, more
    than its 243 ms round trip over the link)."""
    return tag not in CHECKPOINT_INPUTS and p.transfer_overlap > 0


def link_exposed(p: Problem, acts, params, fwd_compute, bwd_compute, overlap=None):
    """Seconds one layer's host traffic adds to the step beyond the compute that hides it, per
    microbatch: its offloaded activations (`acts` seconds each way: out in the forward, back in the
    backward) run behind `overlap` (`Problem.transfer_overlap`) of the layer's compute, its streamed
    weights (`params` seconds: in both ways, the gradients out in the backward) behind what compute is
    left. Works on arrays of assignments."""
    share = p.transfer_overlap if overlap is None else overlap

    def one_way(acts, params_in, compute):
        hidden = np.minimum(acts, share * compute)
        return acts - hidden + np.maximum(0.0, params_in - (compute - hidden))

    if p.duplex:  # weights in while the activations go out; the gradients out while both come in
        fwd = np.maximum(np.maximum(0.0, acts - share * fwd_compute), np.maximum(0.0, params - fwd_compute))
        bwd = np.maximum(one_way(acts, params, bwd_compute), np.maximum(0.0, params - bwd_compute))
    else:  # one direction at a time: everything on the link adds up
        fwd, bwd = one_way(acts, params, fwd_compute), one_way(acts, 2 * params, bwd_compute)
    return fwd + bwd


def _stack_link(p: Problem, digits: np.ndarray, s: str) -> tuple:
    """One layer of stack `s` under the assignments `digits`: (its offloaded tags' transfer seconds one
    way, the layer input's aside, its weights' if streamed, its forward and its backward compute)."""
    n = digits.shape[0]
    offloaded, count, remat = np.zeros(n), np.zeros(n), np.zeros(n)
    for j, t in enumerate(p.tags):
        d = digits[:, j]
        b = float(t.bytes_per_layer.get(s, 0.0))
        if b and t.tag not in CHECKPOINT_INPUTS:
            offloaded += (d == 1) * b
            count += d == 1
        remat += (d == 2) * float(t.recompute_flops_per_layer.get(s, 0.0))
    sc = p.stacks[s]
    params = transfer_s(p, sc.param_bytes_per_layer) if p.params_on_host else 0.0
    fwd_compute = sc.forward_flops_per_layer / p.rate
    bwd_compute = (2 * sc.forward_flops_per_layer + remat) / p.rate
    return transfer_s(p, offloaded, count), params, fwd_compute, bwd_compute


def layer_parts(p: Problem, digits: np.ndarray, layers_of: dict[str, int]) -> tuple[np.ndarray, ...]:
    """(recompute FLOPs, device tag bytes, host tag bytes, exposed transfer seconds) of `layers_of[s]`
    layers of each stack s under the assignments `digits`, per microbatch (the turn's own exposure
    aside: `turn_s`)."""
    n = digits.shape[0]
    recompute_flops = np.zeros(n)
    device_bytes = np.zeros(n)
    host_bytes = np.zeros(n)
    exposed = np.zeros(n)
    for j, t in enumerate(p.tags):
        d = digits[:, j]
        for s, layers in layers_of.items():
            b = float(t.bytes_per_layer.get(s, 0.0))
            device_bytes += (d == 0) * b * layers
            host_bytes += (d == 1) * b * layers
            if t.tag in CHECKPOINT_INPUTS:
                exposed += (d == 1) * layers * 2 * transfer_s(p, b) if b else 0.0
            recompute_flops += (d == 2) * float(t.recompute_flops_per_layer.get(s, 0.0)) * layers
    for s, layers in layers_of.items():
        if layers:
            exposed += layers * link_exposed(p, *_stack_link(p, digits, s))
    return recompute_flops, device_bytes, host_bytes, exposed


def last_stack(p: Problem):
    """The stack holding the model's last layer (the stacks run in their order), None if none has layers."""
    return next((s for s in reversed(list(p.stacks)) if p.stacks[s].layers), None)


def turn_s(p: Problem, digits: np.ndarray) -> np.ndarray:
    """What the last layer's transfers add beyond `layer_parts`' pricing where `Problem.turn_exposed`:
    its activations go out at the end of the forward and come back at the start of the backward with
    no compute of that layer left to hide them, so they are exposed whole, both ways. Per microbatch;
    `digits`: the assignments of the last layer."""
    s = last_stack(p)
    if not p.turn_exposed or s is None:
        return np.zeros(digits.shape[0])
    parts = _stack_link(p, digits, s)
    return link_exposed(p, *parts, overlap=0.0) - link_exposed(p, *parts)


def _totals(p: Problem, n: int, recompute_flops, device_bytes, host_bytes, exposed, inflight) -> dict[str, np.ndarray]:
    mb = p.microbatches
    fixed_backward, update = fixed_bytes(p)
    backward_phase = fixed_backward + device_bytes + inflight
    peak = np.maximum(backward_phase, update)
    host = sum(host_fixed_parts(p).values()) + host_bytes
    compute_s = p.step_flops / p.rate + p.memory_s
    recompute_s = mb * recompute_flops / p.rate + p.rerun_s
    exposed_s = mb * exposed
    state_s = state_transfer_s(p)
    return {
        "time_s": compute_s + recompute_s + exposed_s + state_s,
        "compute_s": np.full(n, compute_s),
        "recompute_s": recompute_s,
        "exposed_transfer_s": exposed_s,
        "state_transfer_s": np.full(n, state_s),
        "peak_bytes": peak,
        "backward_phase_bytes": backward_phase,
        "update_phase_bytes": np.full(n, update),
        "device_tag_bytes": device_bytes,
        "offload_in_flight_bytes": inflight,
        "host_tag_bytes": host_bytes,
        "host_bytes": host,
        "host_node_bytes": host * devices_on_node(p),
    }


def digits_of(p: Problem, assignment: dict[str, str]) -> np.ndarray:
    row = []
    for t in p.tags:
        a = assignment.get(t.tag, "remat" if "remat" in t.choices else t.choices[0])
        if a not in t.choices:
            raise ValueError(f"tag {t.tag}: {a} is not one of its choices {t.choices}")
        row.append(CHOICES.index(a))
    return np.asarray([row], dtype=np.int8)


def evaluate(p: Problem, assignment: dict[str, str]) -> Estimate:
    """The estimate of one assignment (tags left out: remat, or their first choice)."""
    digits = digits_of(p, assignment)
    arrays = evaluate_arrays(p, digits)
    full = {t.tag: CHOICES[int(digits[0, j])] for j, t in enumerate(p.tags)}
    return Estimate(assignment=full, **{k: float(v[0]) for k, v in arrays.items()})


def estimates_table(p: Problem, chosen: Estimate) -> str:
    """Per tag: bytes, what each choice would cost on its own, and the pick; then the totals."""
    rows = [("tag", "HBM if kept", "recompute", "offload xfer", "choice")]
    for t in p.tags:
        total = tag_totals(p, t)
        flops = sum(f * p.stacks[s].layers for s, f in t.recompute_flops_per_layer.items()) * p.microbatches
        xfer = sum(transfer_s(p, b) * p.stacks[s].layers for s, b in t.bytes_per_layer.items()) * 2 * p.microbatches
        rows.append(
            (
                t.tag,
                fmt_bytes(total),
                f"{1e3 * flops / p.rate:.3f} ms" if "remat" in t.choices else "-",
                f"{1e3 * xfer:.3f} ms " + ("overlapped" if overlaps(p, t.tag) else "exposed"),
                chosen.assignment[t.tag],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    e = chosen
    out.append("")
    memory = f" (memory-bound work {1e3 * p.memory_s:.3f})" if p.memory_s else ""
    rerun = f" (the checkpointed forward's memory-bound work again {1e3 * p.rerun_s:.3f})" if p.rerun_s else ""
    out.append(
        f"estimated step {1e3 * e.time_s:.3f} ms = compute {1e3 * e.compute_s:.3f}{memory} + recompute "
        f"{1e3 * e.recompute_s:.3f}{rerun} "
        f"+ exposed transfers {1e3 * e.exposed_transfer_s:.3f} + state transfers {1e3 * e.state_transfer_s:.3f}"
    )
    out.append(
        f"estimated HBM peak {fmt_bytes(e.peak_bytes)} of {fmt_bytes(p.budget)} (forward/backward "
        f"{fmt_bytes(e.backward_phase_bytes)}, "
        f"update {fmt_bytes(e.update_phase_bytes)}); tags on device {fmt_bytes(e.device_tag_bytes)}"
        + (f" (and {fmt_bytes(e.offload_in_flight_bytes)} in flight)" if e.offload_in_flight_bytes else "")
        + f", on host {fmt_bytes(e.host_tag_bytes)}"
    )
    n = devices_on_node(p)
    parts = {"tags": e.host_tag_bytes, **host_fixed_parts(p)}
    budget = (
        f"; budget {fmt_bytes(p.host_budget)} per device, {fmt_bytes(n * p.host_budget)} per node"
        if math.isfinite(p.host_budget)
        else " (no host budget)"
    )
    out.append(
        f"estimated host memory {fmt_bytes(e.host_bytes)} per device, {fmt_bytes(e.host_node_bytes)} per node of "
        f"{n}{budget} (" + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in parts.items() if v or k == "tags") + ")"
    )
    return "\n".join(out)
