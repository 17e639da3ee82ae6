"""The planner: per tag keep on device, offload to host, or recompute, to minimise the estimated step
time within an HBM budget.

The cost model (per device, per step; every number it uses is printed in the estimates table):

- compute: the step's training FLOPs (`zoo.counts.flops_per_token`) at the device's rate,
  `hardware.matmul_flops * hardware.step_efficiency` for a measured profile, else
  `hardware.peak_flops * plan.flops_efficiency`; where the profile measured rates per op and shape
  (`hardware.op_rates`: attention, the experts' grouped matmul, matmuls by width), each tag's producer
  runs at its measured rate times `step_efficiency` instead (`OpSlowness`: its FLOPs weighted by
  the matmul rate over its op's), at the widths one device computes (`per_device_widths`).
- memory-bound work (norms, RoPE, an MoE's routing, casts: what no op's FLOPs count), where the
  profile prices it: `hardware.activation_passes` passes over the layers' activations (every tag and
  what `none` keeps besides) at `hardware.hbm_gbps`, part of compute; and for a policy that
  checkpoints `hardware.recompute_passes` more (its layers' forward runs again in the backward),
  part of recompute, whatever the tags' assignment (`Problem.memory_s`, `Problem.rerun_s`).
- `remat` of a tag costs its producer's FLOPs (the matmul, attention or norm that makes it; formulas
  in `producer_flops`, ops in `producer_op`; a data-parallel rank's, shared by the devices its batch
  is not split over: tensor and context parallelism) once more per layer, at the same rate (the forward's
  where `op_rates` measured the forward alone), times `hardware.recompute_cost` (the share of a
  recompute the step pays for; fitted on the chip). Nothing else changes.
- `offload` of a tag costs its bytes over the host link, device->host in the layer's forward and
  host->device in its backward, plus a fixed latency per transfer (`plan.transfer_latency_us`: tiny
  tensors gain nothing). The link is full duplex, `link` GB/s each way. Within a layer, transfers
  overlap the layer's compute (forward: its forward FLOPs; backward: twice those plus what it
  recomputes), so only the excess `max(0, transfer - compute)` is exposed; the layer input's
  (what the layer's backward starts from) is exposed whole, both ways (measured on a TPU v5e).
- `device` costs HBM: the tag's bytes per layer times the layers; `offload` one layer's worth, the
  next layer's copy in flight while this one's backward runs. A tag's bytes are one device's:
  its traced array's logical axes (`zoo.tags.TagInfo.axes`) under the run's sharding rules
  (`per_device_shape`: tensor parallelism splits the heads and the MLP hidden dim, sequence
  parallelism the kept layer input).
- HBM is the larger of two phases: forward/backward (parameters on device, gradients, optimizer
  state if on device, the kept tags, untagged residuals and a working set: one layer's
  intermediates, the gradients of its largest block and one layer's attention transient, or the
  head + loss, whichever is larger;
  `attention_working_bytes` by the implementation the planned hardware runs,
  `loss_working_bytes` by `trainer.loss_chunk_size`) and the optimizer update (all state on device;
  with state on host the update streams layer by layer, zoo.train.update: the device-resident
  state, with parameters on host the gradients outside the stacks, and two layers' worth of
  host-resident slices).
- Parameters in host memory move one layer at a time inside the scan (forward and backward, hidden
  behind compute like offloaded tags), their gradients stay on host; host-resident state moves in
  and out for the update, exposed.
- Host memory (pinned, per device) is the offloaded tags (their bytes per layer times the layers, for
  one microbatch: the microbatches run one after another and each one's backward frees what its
  forward offloaded), the host-resident parameters and the stacks' gradients (plus one microbatch's
  gradients arriving to be summed in, with several microbatches), the host-resident optimizer state,
  and the staging of the input: the step's token batch and the next one's, built a step ahead. The
  budget is `hardware.host_bytes_per_device` (or `plan.host_budget_gb`); the per-node figure is that
  times the devices sharing a node's memory (`hardware.devices_per_node`).

The search is exhaustive over every assignment of device / offload / remat to the tags that can take
them (3^15 for DeepSeek-V3, vectorised in chunks); ties go to less host traffic, so with a budget to
spare everything stays on device. An assignment must fit both budgets, HBM and host. If nothing
fits, the one-line error names the budget that failed and the smallest of each that would do, and
`holders` / `best_changes` say who holds the memory and which single change frees the most.

With `offload.ranges`, each range's layers count under their preset's actions (`FixedRange`,
`with_ranges`) and the search assigns the tags of the other layers: the plan is the top-level policy
that goes with the ranges; the holders listing counts each range under its preset too.

With `plan.split=true` the search also places every layer itself as a head (layers 0..b-1) and a tail,
each with its own per-tag assignment (`search_split_tags`: exact per split point, over the
assignments no other beats in every per-layer cost), and writes the sides that are no preset as
policy files that `offload.ranges` takes by path.
"""

import contextlib
import dataclasses
import itertools
import json
import math
import pathlib
import re
import sys
import time
from typing import Callable, Optional, Sequence, Union

import numpy as np

from zoo import model as zoo_model
from zoo.config import attended_keys, moe_capacity
from zoo.counts import flops_per_token
from zoo.model import block_classes, loss_fn, stack_layout
from zoo.nn.attention_kernels import DEFAULT_BLOCK_K, DEFAULT_BLOCK_Q, resolve_impl
from zoo.nn.expert_rounds import round_block
from zoo.nn.moe_dispatch import exchanges_in_rounds
from zoo.backend import BackendChoices
from zoo.backend import choices as backend_choices
from zoo.backend import libtpu_installed, lowering_for, pallas_interpreted
from zoo.op_rates import FORWARD_KIND
from zoo.op_rates import rate as op_rate
from zoo.offload import (
    CHECKPOINT_INPUTS,
    OffloadConfig,
    backward_never_reads,
    conf_dir,
    load_preset,
    policy_from_label,
    preset_names,
    range_configs,
    remat_policy,
    resolve,
)
from zoo.placement import inspect_placement, stack_names
from zoo.sharding import CONTEXT, logical_to_spec, logical_ways
from zoo.tags import ATTENTION, MLA, MLP, MOE, TAGS, FlopShape, Op, emitted_tags
from zoo.tools.cli import one_line
from zoo.tools.kit import compose, output_path, prepare_step, run_tool, split_tool_args
from zoo.train.run import start_jax
from zoo.train.run_config import load

CHOICES = ("device", "offload", "remat")
GB = 1e9

# Named host links, GB/s per direction (full duplex).
LINKS = {
    "pcie_gen4": 32.0,  # PCIe Gen4 x16
    "pcie_gen5": 64.0,  # PCIe Gen5 x16 (H100 / H200 PCIe)
    "pcie_gen6": 128.0,
    "nvlink_c2c": 450.0,  # Grace <-> Hopper/Blackwell, 900 GB/s both directions together (GH200, GB200)
    "nvlink_c2c_rubin": 900.0,  # Vera <-> Rubin, 1.8 TB/s both directions together
}


class PlanError(ValueError):
    """One line: `<key>: <what is wrong>; <fix>`."""


@dataclasses.dataclass
class PlanConfig:
    """`plan.*` keys of `python -m zoo.tools.plan`."""

    hbm_budget_gb: Optional[float] = None  # null: the hardware profile's hbm_bytes
    host_budget_gb: Optional[float] = (
        None  # pinned host memory per device; null: hardware.host_bytes_per_device (0 there: no budget)
    )
    link: Optional[str] = (
        None  # GB/s per direction, a name of LINKS, or a conf/hardware profile; null: hardware.host_link_gbps
    )
    flops_efficiency: float = 0.5  # fraction of hardware.peak_flops matmuls reach
    transfer_latency_us: float = 10.0  # fixed cost of one host transfer
    # Where the offload YAML goes; null: outputs/plan/<date>_<time>/offload/<name>.yaml (a folder
    # named offload, so train.py finds it with hydra.searchpath=[file://<the folder above>]).
    out: Optional[str] = None
    name: str = "planned"
    # Also search one split point: layers 0..b-1 under one per-tag assignment, the rest under another
    # (offload.ranges; `search_split_tags`), and print the fastest that fits with its command line.
    split: bool = False
    json: Optional[str] = None  # also write the estimates as JSON here
    holders: bool = False  # also print who holds the memory for a plan that fits (always printed when none does)
    # Compile up to this many candidate policies for the target with XLA (nothing runs) and keep the
    # fastest whose compiled peak fits the budget (`checked_search`); 0: the estimate alone; null:
    # 4 for a TPU where its compiler is here (on the chip, or libtpu installed), else 0.
    compile: Optional[int] = None
    # With plan.compile on the target itself: also compile the presets (MEASURED_PRESETS), run every
    # candidate that fits for this many steps per round on the device, in alternation, and keep the
    # fastest measured; 0: pick by the estimate.
    measure: int = 0

    def __post_init__(self):
        if self.hbm_budget_gb is not None and self.hbm_budget_gb <= 0:
            raise PlanError(
                f"plan.hbm_budget_gb: must be positive, got {self.hbm_budget_gb}; e.g. plan.hbm_budget_gb=80"
            )
        if self.host_budget_gb is not None and self.host_budget_gb <= 0:
            raise PlanError(
                f"plan.host_budget_gb: must be positive GB per device, got {self.host_budget_gb}; e.g. "
                "plan.host_budget_gb=240"
            )
        if not 0 < self.flops_efficiency <= 1:
            raise PlanError(f"plan.flops_efficiency: must be in (0, 1], got {self.flops_efficiency}")
        if self.transfer_latency_us < 0:
            raise PlanError(f"plan.transfer_latency_us: must be >= 0, got {self.transfer_latency_us}")
        if self.compile is not None and self.compile < 0:
            raise PlanError(f"plan.compile: the number of candidates to compile, >= 0; got {self.compile}")
        if self.measure < 0:
            raise PlanError(f"plan.measure: timed steps per candidate, >= 0; got {self.measure}")
        if self.measure and self.compile == 0:
            raise PlanError(
                "plan.measure: it times the compiled candidates; drop plan.compile=0 or give plan.compile=4"
            )
        if not self.name or "/" in self.name:
            raise PlanError(f"plan.name: {self.name!r} is not a file stem; e.g. plan.name=planned")


def _link_profile(link, hardware_dir):
    """The conf/hardware profile `plan.link` names (its YAML, loaded), or None."""
    if hardware_dir is None or not isinstance(link, str) or not (hardware_dir / f"{link}.yaml").exists():
        return None
    from omegaconf import OmegaConf

    return OmegaConf.load(hardware_dir / f"{link}.yaml")


def link_duplex(link, profile_duplex: bool, hardware_dir=None) -> bool:
    """Whether the link `plan.link` names carries both directions at once: a number or a LINKS name
    does (PCIe, NVLink), a hardware profile says for itself; null: the run's profile."""
    if link is None:
        return bool(profile_duplex)
    profile = _link_profile(link, hardware_dir)
    return True if profile is None else bool(profile.get("host_link_duplex", True))


def resolve_link(link, default_gbps: Union[int, float, None], hardware_dir=None) -> float:
    """GB/s per direction from `plan.link` (number, LINKS name, or hardware profile name)."""
    if link is None:
        if not default_gbps or default_gbps <= 0:
            raise PlanError(
                "plan.link: the hardware profile has no host_link_gbps; give one, e.g. plan.link=pcie_gen5 or "
                "plan.link=64"
            )
        return float(default_gbps)
    try:
        value = float(link)
    except (TypeError, ValueError):
        value = None
    if value is not None:
        if value <= 0:
            raise PlanError(f"plan.link: must be positive GB/s per direction, got {link}")
        return value
    if link in LINKS:
        return LINKS[link]
    profile = _link_profile(link, hardware_dir)
    if profile is not None:
        gbps = profile.get("host_link_gbps", 0)
        if gbps and gbps > 0:
            return float(gbps)
        raise PlanError(f"plan.link: hardware profile {link!r} has no host_link_gbps; give GB/s, e.g. plan.link=64")
    profiles = sorted(p.stem for p in hardware_dir.glob("*.yaml")) if hardware_dir is not None else []
    raise PlanError(
        f"plan.link: unknown link {link!r}; give GB/s per direction, or one of {', '.join([*LINKS, *profiles])}"
    )


# --- the problem ------------------------------------------------------------------------------


@dataclasses.dataclass
class TagCost:
    """One tag: per stack, its bytes per layer on one device and the FLOPs of recomputing it."""

    tag: str
    bytes_per_layer: dict[str, float]
    recompute_flops_per_layer: dict[str, float]
    choices: tuple[str, ...] = CHOICES


@dataclasses.dataclass
class StackCost:
    layers: int
    forward_flops_per_layer: float  # one device's forward FLOPs of one layer
    param_bytes_per_layer: float = 0.0  # moved per layer when parameters live on host
    opt_bytes_per_layer: float = 0.0  # optimizer state of one layer (moved per layer when it lives on host)
    layer_range: str = ""  # the model's layer indices of this stack, for the holders listing ("3-60")


@dataclasses.dataclass
class FixedRange:
    """Layers of a range of `offload.ranges`: how many of each stack's layers it holds, and the choice
    of every tag there (its preset's actions)."""

    label: str  # "layers 0-3 llama_qkv_offload"
    layers: dict[str, int]
    assignment: dict[str, str]


@dataclasses.dataclass
class Problem:
    """Everything the search needs, per device and per microbatch unless said otherwise."""

    tags: list[TagCost]
    stacks: dict[str, StackCost]
    rate: float  # FLOP/s
    link: float  # bytes/s per direction
    budget: float  # HBM bytes
    step_flops: float  # the whole step's FLOPs on one device (all microbatches)
    microbatches: int = 1
    latency: float = 10e-6  # seconds per transfer
    # Whether the link carries both directions at once (hardware.host_link_duplex); if not, transfers
    # the model overlaps across directions (a layer's activations out while its weights come in, the
    # optimizer state's way in and way out) take the sum of their times.
    duplex: bool = True
    param_bytes: float = 0.0
    stack_param_bytes: float = 0.0  # the part of param_bytes inside layer stacks
    grad_bytes: float = 0.0
    opt_bytes: float = 0.0
    stack_opt_bytes: float = 0.0  # the part of opt_bytes inside layer stacks
    params_on_host: bool = False
    opt_on_host: bool = False
    other_bytes: float = 0.0  # untagged residuals (per microbatch)
    working_bytes: float = 0.0  # transient peak on top of residuals
    working_label: str = "working set"  # what sets the working set, for the holders listing
    host_budget: float = math.inf  # pinned host bytes per device; inf: no budget
    devices_per_node: int = 1  # devices sharing a node's host memory (per-node figure)
    staging_bytes: float = 0.0  # host bytes per device for input batches (this step's and the next)
    per_device_batch: int = 1  # sequences per device and microbatch (whether more devices shrink the activations)
    # The largest state leaves per device, (kind, path, bytes), kind "params" or "opt_state"; for the
    # holders listing only.
    largest_leaves: list = dataclasses.field(default_factory=list)
    # Layers whose policy is given (offload.ranges), `FixedRange` each: counted with their own
    # assignment; the search assigns the tags of the other layers.
    fixed: list = dataclasses.field(default_factory=list)
    # LoRA (zoo.lora): the frozen base, per device. It has no gradient and no optimizer state (the
    # adapters are param_bytes); on host (lora.base_on_host) it comes to the device one layer at a
    # time in the forward and again in the backward of every microbatch.
    frozen_bytes: float = 0.0
    stack_frozen_bytes: float = 0.0  # the part of frozen_bytes inside layer stacks
    frozen_layer_bytes: float = 0.0  # the largest one layer's frozen base
    frozen_on_host: bool = False
    # Parameter bytes of the layer stacks that layer ranges cut (a range boundary strictly inside a
    # stack): the step slices those stacks into pieces, a copy, and joins their gradients
    # (`RANGE_CUT_COPIES`).
    cut_bytes: float = 0.0
    # The step's memory-bound work (`hardware.activation_passes`: norms, RoPE, routing, casts, what no
    # op's FLOPs count), seconds per step, part of compute_s; and what a checkpointed layer's forward,
    # run again in the backward, adds of it (`hardware.recompute_passes`), part of recompute_s
    # whatever the tags' assignment (0 for a policy that does not checkpoint).
    memory_s: float = 0.0
    rerun_s: float = 0.0

    def __post_init__(self):
        for t in self.tags:
            bad = [c for c in t.choices if c not in CHOICES]
            if bad or not t.choices:
                raise ValueError(f"tag {t.tag}: choices {t.choices} must be a non-empty subset of {CHOICES}")
            for s in (*t.bytes_per_layer, *t.recompute_flops_per_layer):
                if s not in self.stacks:
                    raise ValueError(f"tag {t.tag}: unknown stack {s!r}; stacks: {', '.join(self.stacks)}")


@dataclasses.dataclass
class Estimate:
    assignment: dict[str, str]
    time_s: float
    compute_s: float
    recompute_s: float
    exposed_transfer_s: float
    state_transfer_s: float
    peak_bytes: float
    backward_phase_bytes: float
    update_phase_bytes: float
    device_tag_bytes: float
    offload_in_flight_bytes: float  # offloaded tags' next layer, coming back in the backward
    host_tag_bytes: float
    host_bytes: float  # pinned host memory per device (tags, host-resident state, staging)
    host_node_bytes: float  # host_bytes times the devices sharing a node

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class Infeasible(PlanError):
    """No assignment fits. `budget`: which one failed ("hbm" or "host"); `min_bytes`: the smallest
    HBM that would do (within the host budget where any assignment is); `min_host_bytes`: the
    smallest host memory per device that would do (within the HBM budget where any assignment is);
    `best`: the assignment those figures belong to (the one the holders listing is about)."""

    def __init__(
        self, message: str, min_bytes: float, best: Estimate, budget: str = "hbm", min_host_bytes: float = math.nan
    ):
        super().__init__(message)
        self.min_bytes = min_bytes
        self.best = best
        self.budget = budget
        self.min_host_bytes = min_host_bytes


def _tag_totals(p: Problem, t: TagCost) -> float:
    return _tag_totals_of(t, p.stacks)


def _tag_totals_of(t: TagCost, stacks: dict[str, StackCost]) -> float:
    return sum(b * stacks[s].layers for s, b in t.bytes_per_layer.items())


def _streamed(p: Problem) -> bool:
    """Host-resident state is updated layer by layer (zoo.train.update)."""
    return p.params_on_host or p.opt_on_host


def _biggest_layer(p: Problem, params: bool, opt: bool) -> float:
    """The largest one layer's parameters + gradients (`params`) and optimizer state (`opt`)."""
    return max(
        (2 * s.param_bytes_per_layer * params + s.opt_bytes_per_layer * opt for s in p.stacks.values()), default=0.0
    )


def _frozen_on_device(p: Problem) -> float:
    """The LoRA base's device bytes in the backward phase: all of it, or, on host, what lies outside
    the stacks and two layers in flight (this one and the next)."""
    if not p.frozen_on_host:
        return p.frozen_bytes
    return p.frozen_bytes - p.stack_frozen_bytes + 2 * p.frozen_layer_bytes


def _fixed_bytes(p: Problem) -> tuple[float, float]:
    """(backward-phase bytes that do not depend on the tags, update-phase bytes)."""
    backward, update = _fixed_state_bytes(p)
    # The update touches only the adapters; a device-resident base stays where it is through it.
    return backward + _frozen_on_device(p), update + (0.0 if p.frozen_on_host else p.frozen_bytes)


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
    for s, (lo, hi) in _stack_bounds(p).items():
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
    if not _streamed(p):
        return backward, p.param_bytes + p.grad_bytes + p.opt_bytes
    # Streamed: what lives on device stays (with parameters on host, the gradients of the leaves outside
    # the stacks, made on device by the backward); host-resident slices come at most a layer's worth at
    # a time (a stack's layer, or a run of a large leaf's rows), this one and the next in flight.
    resident = (0.0 if p.params_on_host else p.param_bytes + p.grad_bytes) + (0.0 if p.opt_on_host else p.opt_bytes)
    outside = outside_params if p.params_on_host else 0.0
    return backward, resident + outside + 2 * _biggest_layer(p, p.params_on_host, p.opt_on_host)


def _devices_on_node(p: Problem) -> int:
    return max(1, int(p.devices_per_node))


def _host_fixed_parts(p: Problem) -> dict[str, float]:
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


def _state_transfer_s(p: Problem) -> float:
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
        return (opt + frozen) / p.link if p.duplex else (2 * opt + frozen) / p.link
    grads = p.stack_param_bytes
    into = frozen + opt + p.param_bytes + 2 * grads + (2 * grads * p.microbatches if p.microbatches > 1 else 0.0)
    out = opt + p.param_bytes + (grads * p.microbatches if p.microbatches > 1 else 0.0)
    return (max(into, out) if p.duplex else into + out) / p.link


def free_layers(p: Problem) -> dict[str, int]:
    """Per stack, its layers outside every fixed range (the ones the search assigns)."""
    return {s: sc.layers - sum(f.layers.get(s, 0) for f in p.fixed) for s, sc in p.stacks.items()}


def _evaluate_arrays(p: Problem, digits: np.ndarray) -> dict[str, np.ndarray]:
    """Vectorised estimates: `digits[i, j]` is the CHOICES index of tag j in assignment i (for the
    layers outside `p.fixed`; the fixed ranges' layers count with their own assignment)."""
    n = digits.shape[0]
    recompute_flops, device_bytes, host_bytes, exposed = _layer_parts(p, digits, free_layers(p))
    inflight = _offloaded_per_layer(p, digits, free_layers(p))
    for f in p.fixed:
        parts = _layer_parts(p, _digits_of(p, f.assignment), f.layers)
        recompute_flops, device_bytes, host_bytes, exposed = (
            a + b for a, b in zip((recompute_flops, device_bytes, host_bytes, exposed), parts)
        )
        inflight = np.maximum(inflight, _offloaded_per_layer(p, _digits_of(p, f.assignment), f.layers))
    return _totals(p, n, recompute_flops, device_bytes, host_bytes, exposed, inflight)


def _offloaded_per_layer(p: Problem, digits: np.ndarray, layers_of: dict[str, int]) -> np.ndarray:
    """One layer's offloaded tag bytes (the largest among the stacks with layers in `layers_of`): in
    the backward the next layer's copies come back while this layer's run (read off a v5e's buffer
    assignment: dsv3_100m with its attention output offloaded held this layer's and the next's)."""
    out = np.zeros(digits.shape[0])
    for s in p.stacks:
        if layers_of.get(s, 0):
            offloaded = sum((digits[:, j] == 1) * float(t.bytes_per_layer.get(s, 0.0)) for j, t in enumerate(p.tags))
            out = np.maximum(out, offloaded)
    return out


def _layer_parts(p: Problem, digits: np.ndarray, layers_of: dict[str, int]) -> tuple[np.ndarray, ...]:
    """(recompute FLOPs, device tag bytes, host tag bytes, exposed transfer seconds) of `layers_of[s]`
    layers of each stack s under the assignments `digits`, per microbatch."""
    n = digits.shape[0]
    stacks = list(p.stacks)
    recompute_flops = np.zeros(n)
    device_bytes = np.zeros(n)
    host_bytes = np.zeros(n)
    per_stack_off = {s: np.zeros(n) for s in stacks}
    per_stack_count = {s: np.zeros(n) for s in stacks}
    per_stack_remat = {s: np.zeros(n) for s in stacks}
    exposed = np.zeros(n)
    for j, t in enumerate(p.tags):
        d = digits[:, j]
        for s in stacks:
            b = float(t.bytes_per_layer.get(s, 0.0))
            f = float(t.recompute_flops_per_layer.get(s, 0.0))
            layers = layers_of.get(s, 0)
            if b:
                device_bytes += (d == 0) * b * layers
                host_bytes += (d == 1) * b * layers
                if t.tag in CHECKPOINT_INPUTS:
                    # What a layer's backward starts from: nothing hides its way back (on a v5e the layer
                    # input's offload cost dsv3_100m 363 ms a step at 68 x 4096, more than its 243 ms round
                    # trip over the link), so both directions count whole.
                    exposed += (d == 1) * layers * 2 * (b / p.link + p.latency)
                    continue
                per_stack_off[s] += (d == 1) * b
                per_stack_count[s] += d == 1
            if f:
                per_stack_remat[s] += (d == 2) * f
                recompute_flops += (d == 2) * f * layers
    for s in stacks:
        sc = p.stacks[s]
        fwd_compute = sc.forward_flops_per_layer / p.rate
        bwd_compute = (2 * sc.forward_flops_per_layer + per_stack_remat[s]) / p.rate
        offload_time = per_stack_off[s] / p.link + per_stack_count[s] * p.latency
        params_time = sc.param_bytes_per_layer / p.link + p.latency if p.params_on_host else 0.0
        # forward: activations out (device->host), this layer's weights in (host->device)
        fwd = np.maximum(offload_time, params_time) if p.duplex else offload_time + params_time
        # backward: activations and weights in, the layer's weight gradients out
        bwd = np.maximum(offload_time + params_time, params_time) if p.duplex else offload_time + 2 * params_time
        exposed += layers_of.get(s, 0) * (np.maximum(0.0, fwd - fwd_compute) + np.maximum(0.0, bwd - bwd_compute))
    return recompute_flops, device_bytes, host_bytes, exposed


def _totals(p: Problem, n: int, recompute_flops, device_bytes, host_bytes, exposed, inflight) -> dict[str, np.ndarray]:
    mb = p.microbatches
    fixed_backward, update = _fixed_bytes(p)
    backward_phase = fixed_backward + device_bytes + inflight
    peak = np.maximum(backward_phase, update)
    host = sum(_host_fixed_parts(p).values()) + host_bytes
    compute_s = p.step_flops / p.rate + p.memory_s
    recompute_s = mb * recompute_flops / p.rate + p.rerun_s
    exposed_s = mb * exposed
    state_s = _state_transfer_s(p)
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
        "host_node_bytes": host * _devices_on_node(p),
    }


def _digits_of(p: Problem, assignment: dict[str, str]) -> np.ndarray:
    row = []
    for t in p.tags:
        a = assignment.get(t.tag, "remat" if "remat" in t.choices else t.choices[0])
        if a not in t.choices:
            raise ValueError(f"tag {t.tag}: {a} is not one of its choices {t.choices}")
        row.append(CHOICES.index(a))
    return np.asarray([row], dtype=np.int8)


def evaluate(p: Problem, assignment: dict[str, str]) -> Estimate:
    """The estimate of one assignment (tags left out: remat, or their first choice)."""
    digits = _digits_of(p, assignment)
    arrays = _evaluate_arrays(p, digits)
    full = {t.tag: CHOICES[int(digits[0, j])] for j, t in enumerate(p.tags)}
    return Estimate(assignment=full, **{k: float(v[0]) for k, v in arrays.items()})


def _all_assignments(choices: Sequence[Sequence[int]]) -> np.ndarray:
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
    outer = _all_assignments(choice_idx[:k])
    inner = _all_assignments(choice_idx[k:])
    best_key, best_digits = None, None
    # The smallest HBM of all, of those within the host budget; the smallest host memory of those
    # within the HBM budget.
    min_peak, min_peak_host_ok, min_host_hbm_ok = _Lowest(), _Lowest(), _Lowest()
    for o in outer:
        digits = np.concatenate([np.broadcast_to(o, (inner.shape[0], k)), inner], axis=1)
        arrays = _evaluate_arrays(p, digits)
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
    return evaluate(p, _assignment_of(p, best_digits))


def _assignment_of(p: Problem, digits: np.ndarray) -> dict[str, str]:
    return {t.tag: CHOICES[int(digits[j])] for j, t in enumerate(p.tags)}


def _at_least(b: float) -> str:
    return f"{math.ceil(b / GB * 1000) / 1000:.3f}"


def _host_budget_text(p: Problem) -> str:
    n = _devices_on_node(p)
    return f"{p.host_budget / GB:.3f} GB per device ({n * p.host_budget / GB:.3f} GB per node of {n})"


def _infeasible(p: Problem, min_peak: "_Lowest", min_peak_host_ok: "_Lowest", min_host_hbm_ok: "_Lowest") -> Infeasible:
    if min_host_hbm_ok.digits is None:
        # HBM failed: no assignment fits it whatever the host holds.
        if min_peak_host_ok.digits is not None:
            best = evaluate(p, _assignment_of(p, min_peak_host_ok.digits))
            within = " within the host budget" if min_peak_host_ok.value > min_peak.value else ""
            return Infeasible(
                f"plan.hbm_budget_gb: no policy fits {p.budget / GB:.3f} GB; the smallest HBM any policy{within} "
                "needs is "
                f"{best.peak_bytes / GB:.3f} GB ({_describe(best.assignment)}); raise plan.hbm_budget_gb to at least "
                f"{_at_least(best.peak_bytes)}" + _state_hint(p),
                best.peak_bytes,
                best,
                "hbm",
                best.host_bytes,
            )
        # Neither budget can be met by any one assignment: the smallest HBM, with its host memory.
        best = evaluate(p, _assignment_of(p, min_peak.digits))
        return Infeasible(
            f"plan.hbm_budget_gb: no policy fits {p.budget / GB:.3f} GB, and none of the smallest fits the host "
            "budget of "
            f"{_host_budget_text(p)}; the smallest HBM any policy needs is {best.peak_bytes / GB:.3f} GB "
            f"({_describe(best.assignment)}) with {best.host_bytes / GB:.3f} GB of host memory per device; raise "
            f"plan.hbm_budget_gb to at least {_at_least(best.peak_bytes)} and plan.host_budget_gb to at least "
            f"{_at_least(best.host_bytes)}, or shard over more devices",
            best.peak_bytes,
            best,
            "hbm",
            best.host_bytes,
        )
    # HBM can be met, but not together with the host budget.
    best = evaluate(p, _assignment_of(p, min_host_hbm_ok.digits))
    n = _devices_on_node(p)
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
        f"({n * best.host_bytes / GB:.3f} GB per node; {_describe(best.assignment)}); raise plan.host_budget_gb to at "
        "least "
        f"{_at_least(best.host_bytes)}{other}, or {', or '.join(hints)}",
        min_peak_host_ok.value,
        best,
        "host",
        best.host_bytes,
    )


def _describe(assignment: dict[str, str]) -> str:
    groups = {c: [t for t, a in assignment.items() if a == c] for c in CHOICES}
    return "; ".join(f"{c}: {', '.join(ts)}" for c, ts in groups.items() if ts) or "no tags"


def _state_hint(p: Problem) -> str:
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


# --- who holds the memory ----------------------------------------------------------------------


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
                out.append(Holder(f"tag {t.tag} ({s}, {layers})", b * n, f"{_fmt_bytes(b)} per layer"))
    return out


def _leaves_detail(p: Problem, kind: str, n: int = 3) -> str:
    leaves = sorted((x for x in p.largest_leaves if x[0] == kind), key=lambda x: -x[2])[:n]
    return ", ".join(f"{path} {_fmt_bytes(b)}" for _, path, b in leaves)


def holders(p: Problem, e: Estimate, memory: str = "hbm") -> list[Holder]:
    """Who holds the memory of estimate `e` per device, largest first: `memory` "hbm" (the phase that
    sets the peak) or "host"."""
    if memory == "host":
        out = _tag_holders(p, e, "offload")
        details = {"parameters": _leaves_detail(p, "params"), "optimizer state": _leaves_detail(p, "opt_state")}
        out += [Holder(k, v, details.get(k, "")) for k, v in _host_fixed_parts(p).items() if v]
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
            out.append(Holder(f"frozen LoRA base{where}", _frozen_on_device(p)))
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
        # The update phase: zoo.tools.plan's _fixed_bytes, by holder.
        if not _streamed(p):
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
                    2 * _biggest_layer(p, p.params_on_host, p.opt_on_host),
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
        title = f"who holds the HBM: {_fmt_bytes(e.peak_bytes)} per device; budget {_fmt_bytes(p.budget)}"
    else:
        n = _devices_on_node(p)
        budget = (
            f"; budget {_fmt_bytes(p.host_budget)} per device, {_fmt_bytes(n * p.host_budget)} per node"
            if math.isfinite(p.host_budget)
            else " (no host budget)"
        )
        title = (
            f"who holds the host memory: {_fmt_bytes(e.host_bytes)} per device, "
            f"{_fmt_bytes(e.host_node_bytes)} per node of {n}{budget}"
        )
    hs = holders(p, e, memory)
    rows = [("holder", "bytes", "share", "")] + [
        (h.name, _fmt_bytes(h.bytes), f"{100 * h.bytes / max(sum(x.bytes for x in hs), 1.0):.1f}%", h.detail)
        for h in hs[:top]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = [title] + ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(hs) > top:
        out.append(f"  ... and {len(hs) - top} more holding {_fmt_bytes(sum(h.bytes for h in hs[top:]))}")
    changes = best_changes(p, e, memory)
    if changes:
        key = "peak_bytes" if memory == "hbm" else "host_bytes"
        out.append("what would free the most (estimated saving per device; the figure after it):")
        for c in changes:
            fits = "fits both budgets" if c.fits else "still over a budget"
            out.append(f"  {c.action}: frees {_fmt_bytes(c.saving)} -> {_fmt_bytes(getattr(c.after, key))} ({fits})")
    return "\n".join(out)


# --- from a model config ----------------------------------------------------------------------


def _layers(n: int) -> str:
    return f"{n} layer" if n == 1 else f"{n} layers"


def _stack_bounds(p: Problem) -> dict[str, tuple[int, int]]:
    bounds = {}
    for s, sc in p.stacks.items():
        if not sc.layer_range:
            raise PlanError(
                f"offload.ranges: the planner does not know the layers of stack {s}; plan without offload.ranges"
            )
        lo, hi = (int(x) for x in sc.layer_range.split("-"))
        bounds[s] = (lo, hi)
    return bounds


def _layers_in(bounds: dict[str, tuple[int, int]], first: int, last: int) -> dict[str, int]:
    """Per stack, how many of layers first..last (inclusive) it holds."""
    return {s: min(hi, last) - max(lo, first) + 1 for s, (lo, hi) in bounds.items() if min(hi, last) >= max(lo, first)}


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
    bounds = _stack_bounds(p)
    ranges = range_configs(policy)
    fixed = [
        FixedRange(
            f"layers {r.key} {r.preset}",
            _layers_in(bounds, r.first, r.last),
            preset_assignment(p, config, model_config),
        )
        for r, config in ranges
    ]
    boundaries = [b for r, _ in ranges for b in (r.first, r.last + 1)]
    return dataclasses.replace(p, fixed=fixed, cut_bytes=cut_bytes(p, boundaries))


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


def _split_problem(
    p: Problem, at: int, num_layers: int, head: dict, tail: dict, head_label: str = "head", tail_label: str = "tail"
) -> Problem:
    """`p` with layers 0..at-1 fixed to `head` and the rest to `tail` (no free layers left)."""
    bounds = _stack_bounds(p)
    first, last = f"0-{at - 1}" if at > 1 else "0", f"{at}-{num_layers - 1}" if num_layers - 1 > at else f"{at}"
    return dataclasses.replace(p, cut_bytes=cut_bytes(p, [at]), fixed=[
        FixedRange(f"layers {first} {head_label}", _layers_in(bounds, 0, at - 1), head),
        FixedRange(f"layers {last} {tail_label}", _layers_in(bounds, at, num_layers - 1), tail),
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
                e = evaluate(_split_problem(p, at, num_layers, assign_a, assign_b), {})
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
        flops, device, host, exposed = _layer_parts(p, digits, {s: 1})
        inflight = _offloaded_per_layer(p, digits, {s: 1})
        out[:, k] = np.stack([p.microbatches * (flops / p.rate + exposed), device, host, inflight], axis=1)
    return out


def split_costs(p: Problem, inner_tags: int = 9) -> tuple[np.ndarray, np.ndarray]:
    """(digits, per-layer costs `_per_layer_costs`) of every assignment, enumerated in chunks like
    `search` (3^9 for Llama: 13k rows; the whole table is held, 48 bytes a row per stack)."""
    choice_idx = [[CHOICES.index(c) for c in t.choices] for t in p.tags]
    k = max(0, len(p.tags) - inner_tags)
    outer, inner = _all_assignments(choice_idx[:k]), _all_assignments(choice_idx[k:])
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
    fixed_backward, update = _fixed_bytes(p)
    if update > p.budget:
        return None
    const_s = p.step_flops / p.rate + _state_transfer_s(p)
    host_fixed = sum(_host_fixed_parts(p).values())
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
            q = _split_problem(p, at, num_layers, head, tail)
            new_tail = search(dataclasses.replace(q, fixed=q.fixed[:1])).assignment
            q = _split_problem(p, at, num_layers, head, new_tail)
            new_head = search(dataclasses.replace(q, fixed=q.fixed[1:])).assignment
        except Infeasible:
            return None
        if (new_head, new_tail) == (head, tail):
            break
        head, tail = new_head, new_tail
    return Split(at, "", "", evaluate(_split_problem(p, at, num_layers, head, tail), {}), head, tail)


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
    bounds = _stack_bounds(p)
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
                cut, costs, _layers_in(bounds, 0, b - 1), _layers_in(bounds, b, num_layers - 1), unit, fronts
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
    head, tail = _assignment_of(p, digits[i]), _assignment_of(p, digits[j])
    return Split(b, "", "", evaluate(_split_problem(p, b, num_layers, head, tail), {}), head, tail)


def _offload_presets(p: Problem, c) -> dict[str, dict[str, str]]:
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


def split_line(
    p: Problem, c, best: Estimate, args: Sequence[str], out=None, name: str = "planned", show_holders: bool = False
) -> str:
    """`plan.split=true`: the fastest head/tail split with per-tag assignments for each side
    (`search_split_tags`), against the plan and the best split of two conf/offload presets, with
    the train.py command that runs it. A side whose assignment is no preset's is written as a
    policy YAML next to the plan's (`out`: the plan's YAML; `<name>_head.yaml`, `<name>_tail.yaml`),
    which `offload.ranges` takes by path. Returns the lines to print."""
    import shlex

    n = c.model.num_layers
    if n < 2:
        return "split: a model of one layer has no split point"
    presets = _offload_presets(p, c)
    preset_split = search_split(p, presets, n)
    split = search_split_tags(p, n, start=preset_split)
    if split is None:
        stacks = max(
            ((s, sc.param_bytes_per_layer * sc.layers) for s, sc in p.stacks.items()),
            key=lambda x: x[1],
            default=("", 0.0),
        )
        cost = (
            f" (a split inside {stacks[0]} costs {_fmt_bytes(RANGE_CUT_COPIES * stacks[1])} of HBM: copies of its "
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
        f"HBM peak {_fmt_bytes(e.peak_bytes)}, host {_fmt_bytes(e.host_bytes)} (the plan: {1e3 * best.time_s:.3f} ms, "
        f"{_fmt_bytes(best.peak_bytes)}; {against}); train with it: {command}"
    )
    if show_holders:  # the split's own estimate, each range's tags under its name
        q = _split_problem(p, at, n, split.head_assignment, split.tail_assignment, values[0][0], values[1][0])
        lines.append("the split's " + holders_table(q, e, "hbm"))
        if e.host_tag_bytes:
            lines.append("the split's " + holders_table(q, e, "host"))
    return "\n".join(lines)


def _stack_layers(config, stack: str) -> list[int]:
    """The layer indices of a named stack of the model `config` builds."""
    for name, first, period, repeats in stack_layout(config):
        if name == stack:
            return list(range(first, first + period * repeats))
    return list(range(config.num_layers))


def producer_flops(config, tag: str, stack: str, batch: int, seq: int) -> float:
    """Forward FLOPs, per layer and device, of the op that produces `tag` from its inputs: the formula
    its block declares beside its maths (`EMITS` of the blocks this stack is built of, `_stack_emits`),
    given this stack's shapes (`zoo.tags.FlopShape`). Matmuls: 2 * output elements * contraction;
    attention (`context`) over the keys a query attends, averaged over the stack's layers; the layer
    input cannot be recomputed: 0.
    """
    c = config
    table = _stack_emits(c, stack)
    if tag not in table:
        # A tag this stack emits that no block declares a formula for would cost 0 FLOPs to recompute.
        raise ValueError(
            f"zoo.tools.plan.producer_flops: no FLOP count for tag {tag!r} on stack {stack!r}; declare it in its "
            "block's EMITS"
        )
    return float(table[tag].flops(_flop_shape(c, stack, batch, seq)))


def producer_op(config, tag: str, stack: str, batch: int, seq: int) -> Optional[Op]:
    """The kind and shape of the op producing `tag` on `stack` (`zoo.tags.Emit.op`): what its
    measured rate is looked up by (`zoo.op_rates.rate`); None: no measured rate applies."""
    emit = _stack_emits(config, stack).get(tag)
    return None if emit is None or emit.op is None else emit.op(_flop_shape(config, stack, batch, seq))


def _flop_shape(c, stack: str, batch: int, seq: int) -> FlopShape:
    n = batch * seq
    layers = _stack_layers(c, stack)
    keys = sum(attended_keys(seq, c.layer_spec(i).window) for i in layers) / len(layers)
    if all(c.is_moe_layer(i) for i in layers):
        mo = c.moe
        ffn = mo.moe_intermediate_size * mo.n_shared_experts
        if mo.impl == "capacity":  # the config as the run builds it: `auto` resolved (zoo.train.run_config.as_built)
            rows = mo.n_routed_experts * moe_capacity(n, mo)
        else:
            rows = n * mo.num_experts_per_tok
    else:
        ffn, rows = c.intermediate_size, 0
    return FlopShape(c, batch, seq, n, keys, ffn, rows)


def _stack_emits(config, stack: str) -> dict:
    """Tag -> its `zoo.tags.Emit` (FLOP formula and op), of the blocks this stack's layers are built
    of (`EMITS` of zoo.model.block_classes: its attention, its feed-forward, a MoE's shared experts)."""
    layers = _stack_layers(config, stack)
    blocks = dict.fromkeys(b for i in layers for b in block_classes(config, config.layer_spec(i)))
    return {e.tag.name: e for b in blocks for e in getattr(b, "EMITS", ())}


def layer_forward_flops(
    config, stack: str, batch: int, seq: int, slowness: Optional["OpSlowness"] = None, op_config=None
) -> float:
    """Forward FLOPs of one layer of a data-parallel rank (the devices sharing its batch split them):
    the sum of its producers (mlpwo included), over the tags the model emits that this stack's blocks
    declare (a dense stack of an MoE model has no routed experts; an MoE stack without shared experts
    no dense MLP); with `slowness`, each weighted by its op's, its shape read from `op_config`
    (default `config`; `per_device_widths`)."""
    declared = _stack_emits(config, stack)
    return sum(
        producer_flops(config, t, stack, batch, seq)
        * (slowness(producer_op(op_config or config, t, stack, batch, seq)) if slowness else 1.0)
        for t in emitted_tags(config)
        if t in declared
    )


def per_device_widths(config, rules=None, sizes=None):
    """`config` with the widths one device computes under the sharding `rules` on a mesh of axis
    `sizes` (tensor parallelism splits the heads, the kv heads and the MLP's hidden dim, dense and
    experts'; rounded up, as the partitioner pads): what an op's measured rate is looked up by."""
    if not (rules and sizes):
        return config

    def ways(logical):
        return logical_ways(rules, sizes, logical)

    heads, kv_heads, mlp = ways("heads"), ways("kv_heads"), ways("mlp")
    if heads == kv_heads == mlp == 1:
        return config
    num_heads = -(-config.num_heads // heads)
    num_kv_heads = -(-config.num_kv_heads // kv_heads)
    # The config must stay valid (query heads a multiple of kv heads); where rounding up broke that,
    # the nearest kv width that divides (only a rate lookup reads it).
    changes = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads if num_heads % num_kv_heads == 0 else math.gcd(num_heads, num_kv_heads),
        "intermediate_size": -(-config.intermediate_size // mlp),
    }
    if config.moe is not None:
        changes["moe"] = dataclasses.replace(
            config.moe, moe_intermediate_size=-(-config.moe.moe_intermediate_size // mlp)
        )
    return config.replace(**changes)


class OpSlowness:
    """How many times longer an op takes than its FLOPs at the `reference` rate: `reference` over its
    measured rate (`zoo.op_rates.rate` over the `table` of hardware.op_rates), 1 where none applies
    (no table, an op the table lacks, or a table measured with another kernel than `impls` names,
    e.g. splash's rates for a run on blockwise attention). `used` lists the ops it weighed."""

    def __init__(self, table: Optional[dict], reference: float, impls: dict):
        self.table, self.reference, self.impls = table or {}, reference, impls
        self.used: list[str] = []

    def __call__(self, op: Optional[Op], forward_only: bool = False) -> float:
        """`forward_only`: the op's forward alone (a recompute), at its forward grid where the table
        has one (`zoo.op_rates.FORWARD_KIND`), else at its value-and-gradient rate."""
        if op is None:
            return 1.0
        kind, a, b = op
        impl = self.impls.get(kind)
        if forward_only and FORWARD_KIND.get(kind) in self.table:
            kind = FORWARD_KIND[kind]
        grid = self.table.get(kind)
        if not grid or grid.get("impl", impl) != impl:
            return 1.0
        measured = op_rate(self.table, kind, a, b)
        if not measured:
            return 1.0
        label = kind + (f" ({grid['impl']})" if grid.get("impl") else "")
        if label not in self.used:
            self.used.append(label)
        return self.reference / measured


def per_device_shape(tag: str, shape: Sequence[int], rules=None, sizes=None) -> tuple[int, ...]:
    """The shape one device holds of a tag's traced array `shape` (traced per data-parallel rank:
    batch and routed rows already split), under the logical-axis `rules` on a mesh of axis `sizes`:
    each dim of the tag's logical axes (`zoo.tags.TagInfo.axes`) divided by the mesh axes its rule
    gives it (rounded up, as the partitioner pads), a mesh axis used by an earlier dim skipped as in
    `zoo.sharding.logical_to_spec`. No rules: the traced shape."""
    layouts = [a for a in TAGS[tag].axes if len(a) == len(shape)] if tag in TAGS else []
    if not layouts:
        raise PlanError(
            f"model: tag {tag!r} traced as shape {tuple(shape)}, which none of its logical axes in zoo.tags "
            f"({TAGS[tag].axes if tag in TAGS else 'none'}) describes; give the tag its layout in its block's EMITS"
        )
    if rules is None:
        return tuple(shape)
    rules = {k: list(v) for k, v in rules.items()}
    logical = tuple("batch" if a == "rows" else a for a in layouts[0])
    # Context parallelism (rules[CONTEXT]) keeps the sequence split inside the blocks too: a block's
    # whole-sequence dim (None after batch) is its chunk there, and routed rows (the flattened
    # tokens, traced per data-parallel rank) are the chunk's tokens (zoo.nn.moe.MoE).
    context = rules.get(CONTEXT, [])
    rows_ways = 1
    if context and logical[:2] == ("batch", None):
        rules["_context"] = context
        logical = ("batch", "_context", *logical[2:])
    elif context and TAGS[tag].axes[0][0] == "rows":
        rows_ways = math.prod(int(sizes.get(a, 1)) for a in context)
    spec = logical_to_spec(logical, rules)
    out = []
    for i, (dim, name, entry) in enumerate(zip(shape, logical, spec)):
        axes = () if name == "batch" or entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        ways = math.prod(int(sizes.get(a, 1)) for a in axes) * (rows_ways if i == len(shape) - 2 else 1)
        out.append(-(-int(dim) // ways))
    return tuple(out)


def round_rows_factor(config, ep: int, assignments: int) -> float:
    """Rows one round of the dropless expert-parallel exchange runs the local experts on, against the
    device's `assignments` (tokens * k): `ep` blocks of `exchange_factor` x the mean (zoo.nn.expert_rounds)."""
    m = config.moe
    k = m.num_experts_per_tok
    tokens = max(1, assignments // k)
    return ep * round_block(tokens, k, ep, m.n_routed_experts // ep, m.exchange_factor) / (tokens * k)


def tiled_elements(shape: Sequence[int], tile: int) -> int:
    """Elements an array of `shape` occupies when its two minor dimensions are stored in whole tiles
    of `tile` elements (`zoo.backend.BackendChoices.layout_tile_elements`; 1: as it is)."""
    minor = math.prod(shape[-2:])
    return math.prod(shape[:-2]) * -(-minor // tile) * tile


def tag_costs(config, records, batch: int, seq: int, rules=None, sizes=None, tile: int = 1) -> list[TagCost]:
    """TagCosts from the inspector's records (traced shapes and dtypes, per data-parallel rank), each
    tag's bytes per device as `per_device_shape` splits it under `rules` on a mesh of axis `sizes`
    (tensor parallelism: the heads and the MLP hidden dim; sequence parallelism: the kept layer input),
    stored in the compiler's tiles of `tile` elements. Tags the backward never reads are left out; the
    layer input can be kept or offloaded, not recomputed."""
    by_tag: dict[str, TagCost] = {}
    # The dropless expert-parallel exchange's tagged intermediates are its first round's blocks,
    # `exchange_factor` x the mean rows per (device, shard): more than the traced program's assignments.
    rounds = config.moe is not None and bool(rules and sizes) and exchanges_in_rounds(config.moe.impl, rules, sizes)
    for r in records:
        if r.tag in backward_never_reads(config):
            continue
        choices = ("device", "offload") if r.tag in CHECKPOINT_INPUTS else CHOICES
        t = by_tag.setdefault(r.tag, TagCost(r.tag, {}, {}, choices))
        device_shape = per_device_shape(r.tag, r.shape, rules, sizes)
        share = tiled_elements(device_shape, tile) / max(1, math.prod(r.shape))
        if (
            rounds and TAGS[r.tag].block == MOE and len(r.shape) == 2
        ):  # a routed-expert tag traced as [assignments, ...]
            share *= round_rows_factor(config, logical_ways(rules, sizes, "experts"), device_shape[0])
        t.bytes_per_layer[r.stack] = t.bytes_per_layer.get(r.stack, 0.0) + r.bytes_per_layer * share
        t.recompute_flops_per_layer[r.stack] = (
            0.0 if r.tag in CHECKPOINT_INPUTS else producer_flops(config, r.tag, r.stack, batch, seq)
        )
    return list(by_tag.values())


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


def estimates_table(p: Problem, chosen: Estimate) -> str:
    """Per tag: bytes, what each choice would cost on its own, and the pick; then the totals."""
    rows = [("tag", "HBM if kept", "recompute", "offload xfer", "choice")]
    for t in p.tags:
        total = _tag_totals(p, t)
        flops = sum(f * p.stacks[s].layers for s, f in t.recompute_flops_per_layer.items()) * p.microbatches
        xfer = (
            sum((b / p.link + p.latency) * p.stacks[s].layers for s, b in t.bytes_per_layer.items())
            * 2
            * p.microbatches
        )
        rows.append(
            (
                t.tag,
                _fmt_bytes(total),
                f"{1e3 * flops / p.rate:.3f} ms" if "remat" in t.choices else "-",
                f"{1e3 * xfer:.3f} ms",
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
        f"estimated HBM peak {_fmt_bytes(e.peak_bytes)} of {_fmt_bytes(p.budget)} (forward/backward "
        f"{_fmt_bytes(e.backward_phase_bytes)}, "
        f"update {_fmt_bytes(e.update_phase_bytes)}); tags on device {_fmt_bytes(e.device_tag_bytes)}"
        + (f" (and {_fmt_bytes(e.offload_in_flight_bytes)} in flight)" if e.offload_in_flight_bytes else "")
        + f", on host {_fmt_bytes(e.host_tag_bytes)}"
    )
    n = _devices_on_node(p)
    parts = {"tags": e.host_tag_bytes, **_host_fixed_parts(p)}
    budget = (
        f"; budget {_fmt_bytes(p.host_budget)} per device, {_fmt_bytes(n * p.host_budget)} per node"
        if math.isfinite(p.host_budget)
        else " (no host budget)"
    )
    out.append(
        f"estimated host memory {_fmt_bytes(e.host_bytes)} per device, {_fmt_bytes(e.host_node_bytes)} per node of "
        f"{n}{budget} (" + ", ".join(f"{k} {_fmt_bytes(v)}" for k, v in parts.items() if v or k == "tags") + ")"
    )
    return "\n".join(out)


def _fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3f} {unit}"
    return f"{b:.0f} B"


# --- the command line -------------------------------------------------------------------------


def per_device_bytes(abstract_tree, shardings, stack_names: Sequence[str] = ()) -> tuple[float, dict]:
    """Bytes per device of a tree of ShapeDtypeStructs under its shardings; and per layer stack
    (leaves under `stacks[i]`, keyed by `stack_names[i]`)."""
    import jax

    total, per_stack = 0.0, {}
    leaves = jax.tree_util.tree_leaves_with_path(abstract_tree)
    shards = jax.tree_util.tree_leaves(shardings)
    for (path, leaf), sh in zip(leaves, shards):
        shape = sh.shard_shape(leaf.shape) if hasattr(sh, "shard_shape") else leaf.shape
        b = float(math.prod(shape) * np.dtype(leaf.dtype).itemsize)
        total += b
        keys = [getattr(k, "name", getattr(k, "idx", None)) for k in path]
        if "stacks" in keys and keys.index("stacks") + 1 < len(keys):
            idx = keys[keys.index("stacks") + 1]
            if isinstance(idx, int) and idx < len(stack_names):
                per_stack[stack_names[idx]] = per_stack.get(stack_names[idx], 0.0) + b
    return total, per_stack


def target_attention_impl(c) -> str:
    """What `model.attention_impl` stands for on the hardware planned for (`hardware.platform` and
    `hardware.compute_capability`; this machine's backend where the profile names none): a GPU
    profile gets cuDNN where it can run the model's heads, even when planning on a CPU. An impl
    the target cannot run is a PlanError naming the key and the choices."""
    import jax

    m, hw = c.model, c.hardware
    try:
        return resolve_impl(
            m.attention_impl,
            backend=hw.platform or jax.default_backend(),
            dtype=m.compute_dtype,
            qk_dim=m.qk_head_dim,
            v_dim=m.v_head_dim,
            seq_len=c.data.seq_len,
            has_sinks=m.attention_sinks,
            compute_capability=hw.capability() or (0, 0),
        )
    except ValueError as e:
        raise PlanError(f"{str(e).splitlines()[0]} (planning for hardware={hw.name})") from None


@contextlib.contextmanager
def planning_for(platform: Optional[str]):
    """Trace for the platform planned for: a TPU profile on a machine without one gets the TPU's
    kernels (splash, megablox) validated and traced in Pallas' interpret mode (traced only; the tags
    and residuals are what the planner reads)."""
    import jax

    if platform != "tpu" or jax.default_backend() == "tpu":
        yield
        return
    with lowering_for("tpu"), pallas_interpreted():
        yield


def host_attention_impl(target: str) -> str:
    """The implementation this machine traces in place of the target's: the tags and residuals do
    not depend on it, and cuDNN's stand-in (blockwise) keeps no T x T scores either."""
    import jax

    return "blockwise" if target == "cudnn" and jax.default_backend() != "gpu" else target


def _largest_block(tags, stack: str) -> float:
    """Per layer of `stack`, the tags' bytes of its largest block: the attention (MLA's latents with
    it) or the feed-forward block (an MoE's routed and shared experts together)."""
    of = {ATTENTION: ATTENTION, MLA: ATTENTION, MLP: MLP, MOE: MLP}
    found: dict[str, float] = {}
    for t in tags:
        kind = of.get(TAGS[t.tag].block) if t.tag in TAGS else None
        if kind:
            found[kind] = found.get(kind, 0.0) + t.bytes_per_layer.get(stack, 0.0)
    return max(found.values(), default=0.0)


def attention_working_bytes(
    impl: str, *, batch: int, seq: int, heads: int, kv_heads: int, qk_dim: int, v_dim: int
) -> float:
    """The transient bytes of one layer's attention backward (its forward holds less), per device.

    - xla: the float32 scores and probabilities [batch, heads, T, T] (their gradients reuse them);
    - blockwise: four float32 tiles [batch, heads, block_q, block_k] (scores, probabilities and
      their gradients), the float32 dq / dk / dv accumulators and the per-row statistics;
    - cudnn, splash: the float32 dq accumulator and the softmax statistics (the tiles live in on-chip
      memory).
    """
    rows = 3.0 * batch * heads * seq * 4  # logsumexp, delta, running max
    if impl == "xla":
        return 2.0 * batch * heads * seq * seq * 4
    if impl == "blockwise":
        tiles = 4.0 * batch * heads * min(DEFAULT_BLOCK_Q, seq) * min(DEFAULT_BLOCK_K, seq) * 4
        accumulators = 4.0 * batch * seq * (heads * qk_dim + kv_heads * (qk_dim + v_dim))
        return tiles + accumulators + rows
    if impl in ("cudnn", "splash"):
        return 4.0 * batch * seq * heads * qk_dim + rows
    raise ValueError(f"attention_working_bytes: unknown implementation {impl!r}")


def loss_working_bytes(
    *,
    batch: int,
    seq: int,
    vocab: int,
    embed: int,
    chunk: int,
    compute_bytes: int,
    head_cast_bytes: float = 0.0,
    row_group: int = 1,
    backend: Optional[BackendChoices] = None,
) -> float:
    """The transient bytes of the head + loss, per device (`vocab` is the device's share; `row_group`
    devices share a vocab axis that also splits the batch, so each chunk's logits cover their rows).

    Whole logits (`chunk` 0): the float32 logits, their softmax and their gradient [batch, T, vocab].
    Chunked (zoo.loss, fused): float32 [batch, chunk, vocab] buffers of one chunk at a time, as many
    as the backend's compiler keeps (`BackendChoices.loss_chunk_buffers`), plus what the fused
    backward keeps through the chunks: the hidden states' gradient [batch, T, embed] in the compute
    dtype, and unless the backend accumulates the head's gradient in its own buffer
    (`BackendChoices.head_gradient_in_place`), the float32 accumulator [embed, vocab] and the head
    cast to the compute dtype (`head_cast_bytes`, 0 when the dtypes agree). `backend`: the planned
    platform's record (None: one chunk buffer, the accumulator and the cast counted)."""
    if not chunk:
        return 3.0 * batch * seq * vocab * 4
    buffers = backend.loss_chunk_buffers if backend else 1.0
    in_place = backend.head_gradient_in_place if backend else False
    rows = min(chunk, seq)
    gathered = float(batch * row_group * rows * embed * compute_bytes) if row_group > 1 else 0.0
    return (
        buffers * float(batch * row_group * rows * vocab * 4)
        + (0.0 if in_place else 4.0 * embed * vocab + head_cast_bytes)
        + float(batch * seq * embed * compute_bytes)
        + gathered
    )


def _ways(c, trainer, logical: str) -> int:
    return logical_ways(c.mesh.rules, trainer.plan.mesh.sizes, logical)


def largest_leaves(abstract_tree, shardings, kind: str, n: int = 3) -> list[tuple[str, str, float]]:
    """The `n` largest leaves per device of a tree under its shardings: (kind, path, bytes)."""
    import jax

    out = []
    for (path, leaf), sh in zip(
        jax.tree_util.tree_leaves_with_path(abstract_tree), jax.tree_util.tree_leaves(shardings)
    ):
        shape = sh.shard_shape(leaf.shape) if hasattr(sh, "shard_shape") else leaf.shape
        name = jax.tree_util.keystr(path).lstrip(".")
        # optax's wrappers (inner_states['train'].inner_state[1][0]...) say nothing about the leaf.
        name = re.sub(r"^.*?\.(mu|nu)\.", r"\1.", name)
        out.append((kind, name, float(math.prod(shape) * np.dtype(leaf.dtype).itemsize)))
    return sorted(out, key=lambda x: -x[2])[:n]


def host_budget_bytes(opts: PlanConfig, hardware) -> float:
    """Pinned host bytes per device: `plan.host_budget_gb`, else the profile's; inf where neither gives one."""
    if opts.host_budget_gb is not None:
        return opts.host_budget_gb * GB
    return float(hardware.host_bytes_per_device) if hardware.host_bytes_per_device else math.inf


def policy_estimate(c, trainer, opts: PlanConfig):
    """(problem, estimate, info) of the run's own policy (`c.offload`): each tag as the policy places it;
    a tag the planner cannot recompute (the checkpointed layer's input) counts as kept."""
    p, info = problem_from_config(c, trainer, opts, own_policy=True)
    actions = resolve(c.offload, c.model)
    assignment = {}
    for t in p.tags:
        a = actions.get(t.tag, "remat")
        assignment[t.tag] = (
            a if a in t.choices else ("device" if a == "remat" and "device" in t.choices else t.choices[0])
        )
    return p, evaluate(p, assignment), info


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
    held = ", ".join(f"{h.name} {_fmt_bytes(h.bytes)}" for h in top)
    fix = f"; the change that frees the most: {change.action} (-{_fmt_bytes(change.saving)})" if change else ""
    return (
        f"out of device memory{xla}: the planner puts this step at {_fmt_bytes(e.peak_bytes)} per device, the largest "
        f"holders {held}{fix}; the whole table: {table}"
    )


# Residual producers whose output XLA derives from another kept value instead of keeping it.
FOLDED_BY_XLA = ("reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type")


def problem_from_config(
    c, trainer, opts: PlanConfig, hardware_dir=None, attention_impl: Optional[str] = None, own_policy: bool = False
) -> tuple[Problem, dict]:
    """The planning problem for a composed, validated train config (sizes per device);
    `attention_impl`: the implementation the target runs (default: `target_attention_impl(c)`).
    `own_policy`: the problem of the run's own policy (`policy_estimate`): a policy without checkpoints
    (`none`) keeps every intermediate its backward reads, tagged or not, and those count as residuals."""
    import jax
    import jax.numpy as jnp

    m = trainer.cfg.model  # as the run builds it: model.moe.impl resolved (zoo.train.run_config.as_built)
    attention_impl = attention_impl or target_attention_impl(c)
    m = m.replace(attention_impl=host_attention_impl(attention_impl))
    sizes = trainer.plan.mesh.sizes
    dp = math.prod(sizes[a] for a in dict.fromkeys(c.mesh.rules.get("batch", [])) if a in sizes) or 1
    batch = max(1, trainer.plan.microbatch // dp)
    seq = c.data.seq_len
    num_devices = trainer.plan.num_devices

    # Shapes and dtypes of every tag, read from the traced gradient with every tag kept.
    keep_all = OffloadConfig(
        name="keep_all",
        checkpoint=True,
        tags={t: "device" for t in emitted_tags(m) if t not in backward_never_reads(m)},
    )
    policy = remat_policy(keep_all, m)
    abstract = zoo_model.abstract(m)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    # Splash traced off a TPU: its Pallas kernel interpreted (traced only: its residuals are what counts).
    interpreted = pallas_interpreted() if attention_impl == "splash" else contextlib.nullcontext()
    with interpreted:
        placement = inspect_placement(
            jax.grad(lambda mod, tok: loss_fn(mod, tok, remat_policy=policy)),
            abstract,
            tokens,
            stacks=stack_names(abstract),
        )
        uncheckpointed = None
        memory_bound = c.hardware.activation_passes or c.hardware.recompute_passes
        no_checkpoint = c.offload if not c.offload.checkpoint else OffloadConfig()  # `none`
        if (own_policy and not c.offload.checkpoint) or memory_bound:
            # What `none` keeps: the policy's untagged residuals, and the activations whose
            # memory-bound work the step pays for (hardware.activation_passes).
            uncheckpointed = inspect_placement(
                jax.grad(lambda mod, tok: loss_fn(mod, tok, remat_policy=remat_policy(no_checkpoint, m))),
                abstract,
                tokens,
                stacks=stack_names(abstract),
            )
    # The traced records are whole sequences, heads and MLP hidden dims: each tag sized as the mesh
    # splits it (tensor parallelism; sequence parallelism for the kept layer input, zoo.model.DecoderBlock).
    sequence_ways = _ways(c, trainer, "seq")
    # Each sized as the planned hardware's compiler stores it (a profile for any platform: as traced).
    tile = backend_choices(c.hardware.platform).layout_tile_elements if c.hardware.platform else 1
    tags = tag_costs(m, placement.records, batch, seq, rules=c.mesh.rules, sizes=sizes, tile=tile)

    stacks = {}
    param_bytes, stack_params = per_device_bytes(
        trainer.abstract_params, trainer.param_shardings, stack_names(abstract)
    )
    abstract_opt = jax.eval_shape(trainer.tx.init, trainer.abstract_params)
    opt_bytes, stack_opt = per_device_bytes(abstract_opt, trainer.opt_shardings, stack_names(abstract))
    frozen_bytes, stack_frozen, frozen_layer = 0.0, {}, 0.0
    if trainer.lora is not None:
        frozen_bytes, stack_frozen = per_device_bytes(
            trainer.abstract_base, trainer.base_shardings, stack_names(abstract)
        )
        layers_of = {s["name"]: s["layers"] for s in placement.stacks}
        frozen_layer = max((b / layers_of[n] for n, b in stack_frozen.items() if layers_of.get(n)), default=0.0)
    hw = c.hardware
    reference = float(hw.matmul_flops) if hw.matmul_flops else hw.peak_flops * opts.flops_efficiency
    if hw.matmul_flops:
        rate, rate_source = reference * hw.step_efficiency, f"hardware.matmul_flops (measured) {hw.matmul_flops:.3g}"
        if hw.step_efficiency != 1.0:
            rate_source += f" x hardware.step_efficiency {hw.step_efficiency:g}"
    else:
        rate = reference
        rate_source = f"hardware.peak_flops {hw.peak_flops:.3g} x plan.flops_efficiency {opts.flops_efficiency}"
    # An op with a measured rate at its shape (hardware.op_rates) runs at that rate times
    # step_efficiency (what an op measured on its own loses inside a step: the fusions, layout
    # changes and elementwise work around it), the rest at `rate`: each producer's FLOPs are weighted
    # by `reference` over its op's rate, so that the problem's FLOPs all run at `rate`.
    slowness = OpSlowness(
        hw.op_rates,
        reference,
        {
            "attention": attention_impl,
            "grouped_matmul": backend_choices(hw.platform or jax.default_backend()).grouped_matmul,
        },
    )
    # The formulas count a data-parallel rank's work (whole heads, MLP and sequence); the devices that
    # share the rank's batch (tensor, context: every axis the batch is not split over) each do their part.
    # Each op's rate at the widths one device computes (tensor parallelism splits its heads and MLP).
    shared_by = num_devices / dp
    m_ops = per_device_widths(m, c.mesh.rules, sizes)
    for t in tags:
        for s, f in t.recompute_flops_per_layer.items():
            t.recompute_flops_per_layer[s] = (
                f
                * slowness(producer_op(m_ops, t.tag, s, batch, seq), forward_only=True)
                * hw.recompute_cost
                / shared_by
            )
    extra_flops = 0.0  # per microbatch and device: what the slower ops add, forward and backward
    for s in placement.stacks:
        indices = _stack_layers(m, s["name"])
        forward = layer_forward_flops(m, s["name"], batch, seq, slowness, m_ops) / shared_by
        extra_flops += 3 * s["layers"] * (forward - layer_forward_flops(m, s["name"], batch, seq) / shared_by)
        stacks[s["name"]] = StackCost(
            layers=s["layers"],
            forward_flops_per_layer=forward,
            param_bytes_per_layer=stack_params.get(s["name"], 0.0) / s["layers"],
            opt_bytes_per_layer=stack_opt.get(s["name"], 0.0) / s["layers"],
            layer_range=f"{indices[0]}-{indices[-1]}" if len(indices) == s["layers"] else "",
        )
    vocab_per_device = -(-m.vocab_size // _ways(c, trainer, "vocab"))
    head_flops = 2.0 * batch * seq * m.hidden_size * vocab_per_device
    extra_flops += 3 * head_flops * (slowness(("matmul", m.hidden_size, vocab_per_device)) - 1)
    if slowness.used:
        share = f"{hw.step_efficiency:g} x " if hw.matmul_flops and hw.step_efficiency != 1.0 else ""
        rate_source += f"; each op at {share}its measured rate (hardware.op_rates: " + ", ".join(slowness.used) + ")"
    if hw.recompute_cost != 1.0:
        rate_source += f"; a recompute at hardware.recompute_cost {hw.recompute_cost:g} of its time"
    if hw.activation_passes or hw.recompute_passes:
        rate_source += (
            f"; memory-bound work: hardware.activation_passes {hw.activation_passes:g} over the layers' activations"
            f" at hardware.hbm_gbps {hw.hbm_gbps:g}, hardware.recompute_passes {hw.recompute_passes:g} more where"
            " the policy checkpoints"
        )
    link_gbps = resolve_link(opts.link, hw.host_link_gbps, hardware_dir)
    if opts.hbm_budget_gb is not None:
        budget = opts.hbm_budget_gb * GB
    elif hw.hbm_bytes:
        budget = float(hw.hbm_bytes)
    else:
        raise PlanError(
            f"plan.hbm_budget_gb: hardware profile {hw.name!r} has no hbm_bytes; give a budget, e.g. "
            "plan.hbm_budget_gb=80"
        )

    # Working set: the layer in backward, its intermediates and the gradients of its largest block
    # (about that block's intermediates again), with one layer's attention transient, or the head +
    # loss, whichever is larger (they do not overlap). What XLA holds at a v5e's compiled peak:
    # dsv3_100m under `full` one MoE layer's backward, 26-27 KB a token at 20 to 90 x 4096, its
    # intermediates 16.5 KB, its MoE block's 8 (docs/benchmarks.md, "The planner against the chip").
    # (the intermediates as traced: the tiling counted above is measured on the kept tags; inside a
    # layer the compiler fuses and lays out the rest its own way)
    as_traced = tag_costs(m, placement.records, batch, seq, rules=c.mesh.rules, sizes=sizes) if tile > 1 else tags
    per_layer = max((sum(t.bytes_per_layer.get(s, 0.0) for t in as_traced) for s in stacks), default=0.0)
    mlpwo_bytes = max(
        (
            r.bytes_per_layer
            * math.prod(per_device_shape(r.tag, r.shape, c.mesh.rules, sizes))
            / max(1, math.prod(r.shape))
            for r in placement.records
            if r.tag in backward_never_reads(m)
        ),
        default=0,
    )
    heads_ways = _ways(c, trainer, "heads")
    attention = attention_working_bytes(
        attention_impl,
        batch=batch,
        seq=seq,
        heads=max(1, m.num_heads // heads_ways),
        kv_heads=max(1, (m.num_kv_heads if not m.uses_mla else m.num_heads) // heads_ways),
        qk_dim=m.qk_head_dim,
        v_dim=m.v_head_dim,
    )
    vocab = -(-m.vocab_size // _ways(c, trainer, "vocab"))
    compute_bytes = np.dtype(m.compute_dtype).itemsize
    head_cast = 0.0 if m.compute_dtype == m.param_dtype else float(m.hidden_size * vocab * compute_bytes)
    sizes = trainer.plan.mesh.sizes
    batch_axes = set(c.mesh.rules.get("batch", []))
    row_group = (
        math.prod(sizes[a] for a in dict.fromkeys(c.mesh.rules.get("vocab", [])) if a in sizes and a in batch_axes) or 1
    )
    loss = loss_working_bytes(
        batch=batch,
        seq=seq,
        vocab=vocab,
        embed=m.hidden_size,
        chunk=c.trainer.loss_chunk_size,
        compute_bytes=compute_bytes,
        head_cast_bytes=head_cast,
        row_group=row_group,
        # A profile for any platform (no hardware.platform) says nothing of its compiler: counted whole.
        backend=backend_choices(hw.platform) if hw.platform else None,
    )
    block = max((_largest_block(as_traced, s) for s in stacks), default=0.0)
    layers_working = per_layer + mlpwo_bytes + block + attention
    working = max(layers_working, loss)
    working_label = (
        f"working set: a layer's intermediates + its largest block's gradients + its {attention_impl} attention"
        if layers_working >= loss
        else "working set: the head + loss"
        + (f" (chunks of {c.trainer.loss_chunk_size})" if c.trainer.loss_chunk_size else " (whole logits)")
    )
    host_budget = host_budget_bytes(opts, hw)
    # The step's token batch and the next one's (built a step ahead, zoo.train.run.Batches), int32.
    staging = 2.0 * c.data.batch_size * seq * 4 / num_devices
    other = float(sum(o.total_bytes for o in placement.other))
    # Views and casts of kept values are left out: XLA folds a view into the buffer it views and
    # fuses a cast into its consumer, recomputing it there (a TPU v5e's compiled peak of `none`
    # on llama_1b's layers and on dsv3_100m: docs/benchmarks.md, "TPU v5e").
    untagged = (
        float(sum(o.total_bytes for o in uncheckpointed.other if o.source not in FOLDED_BY_XLA))
        if uncheckpointed is not None
        else 0.0
    )
    if own_policy and not c.offload.checkpoint:
        other = untagged
    # The layers' activations (every tag and what `none` keeps besides, one microbatch's) at the
    # device's memory bandwidth: the memory-bound work's seconds per pass over them.
    activation_bytes = untagged + sum(_tag_totals_of(t, stacks) for t in tags)
    memory_pass_s = activation_bytes / (hw.hbm_gbps * 1e9) * c.trainer.grad_accum if memory_bound else 0.0
    checkpoints = c.offload.checkpoint or bool(c.offload.ranges) or not own_policy

    p = Problem(
        tags=tags,
        stacks=stacks,
        rate=float(rate),
        link=link_gbps * GB,
        budget=float(budget),
        step_flops=flops_per_token(m, seq) * c.data.batch_size * seq / num_devices + extra_flops * c.trainer.grad_accum,
        microbatches=c.trainer.grad_accum,
        latency=opts.transfer_latency_us * 1e-6,
        duplex=link_duplex(opts.link, hw.host_link_duplex, hardware_dir),
        param_bytes=param_bytes,
        stack_param_bytes=float(sum(stack_params.values())),
        grad_bytes=param_bytes,
        opt_bytes=opt_bytes,
        stack_opt_bytes=float(sum(stack_opt.values())),
        # With LoRA, offload.params places the frozen base (zoo.train.step.Trainer), not the adapters.
        params_on_host=c.offload.params == "pinned_host" and trainer.lora is None,
        opt_on_host=c.offload.opt_state == "pinned_host",
        other_bytes=other,
        working_bytes=float(working),
        working_label=working_label,
        host_budget=host_budget,
        devices_per_node=min(int(hw.devices_per_node), num_devices),
        staging_bytes=staging,
        per_device_batch=batch,
        frozen_bytes=float(frozen_bytes),
        stack_frozen_bytes=float(sum(stack_frozen.values())),
        frozen_layer_bytes=float(frozen_layer),
        frozen_on_host=trainer.lora is not None and trainer.params_on_host,
        memory_s=hw.activation_passes * memory_pass_s,
        rerun_s=hw.recompute_passes * memory_pass_s if checkpoints else 0.0,
        largest_leaves=largest_leaves(trainer.abstract_params, trainer.param_shardings, "params")
        + largest_leaves(abstract_opt, trainer.opt_shardings, "opt_state"),
    )
    if c.offload.ranges:
        p = with_ranges(p, c.offload, m)
    info = {
        "per_device_batch": batch,
        "seq_len": seq,
        "sequence_parallel": sequence_ways,
        "devices": num_devices,
        "data_parallel": dp,
        "rate_flops": rate,
        "rate_source": rate_source,
        "link_gbps_per_direction": link_gbps,
        "link_duplex": p.duplex,
        "budget_bytes": budget,
        "host_budget_bytes": host_budget if math.isfinite(host_budget) else None,
        "devices_per_node": p.devices_per_node,
        "host_staging_bytes": staging,
        "param_bytes": param_bytes,
        "opt_bytes": opt_bytes,
        "working_bytes": working,
        "attention_impl": attention_impl,
        "attention_working_bytes": attention,
        "loss_chunk_size": c.trainer.loss_chunk_size,
        "loss_working_bytes": loss,
        "untagged_residual_bytes": other,
        # what `none` keeps besides the tags, where it was traced (the memory-bound term needs it)
        "none_residual_bytes": untagged if uncheckpointed is not None else None,
    }
    return p, info


def none_estimate(p: Problem, none_residual_bytes: float) -> Estimate:
    """`none`'s estimate from the search's problem `p` (no fixed ranges): every tag kept, the untagged
    residuals `none` keeps (`problem_from_config`'s info), and no checkpoint to re-run; what
    `policy_estimate` gives for `offload=none`, without tracing the model again."""
    kept = {t.tag: "device" if "device" in t.choices else t.choices[0] for t in p.tags}
    return evaluate(dataclasses.replace(p, other_bytes=none_residual_bytes, rerun_s=0.0), kept)


def none_note(p: Problem, best: Estimate, none: Estimate, compiled: bool) -> Optional[str]:
    """A note where `none` (nothing checkpointed; its estimate `none`) fits both budgets by the estimate
    and is faster than the plan `best` by more than 1%: the planner's search assigns tags under a
    checkpoint, and a checkpointed layer runs its forward again in the backward (`Problem.rerun_s`:
    on a TPU v5e's MoE that alone made every recompute policy 1.27x `none`'s step)."""
    if none.peak_bytes > p.budget or none.host_bytes > p.host_budget or none.time_s >= 0.99 * best.time_s:
        return None
    return (
        f"note: offload=none (nothing checkpointed) fits too by the estimate ({_fmt_bytes(none.peak_bytes)}) and is "
        f"estimated {100 * (1 - none.time_s / best.time_s):.0f}% faster ({1e3 * none.time_s:.1f} ms): a checkpointed "
        "layer runs its forward again in the backward; train with offload=none"
        + (" (its peak is the estimate's: plan.compile checks the plan's candidates, not it)" if compiled else "")
    )


def use_plan_lines(out, overrides: Sequence[str]) -> list[str]:
    """How to train with (and inspect) a plan written to `out`: Hydra finds an option of the
    offload group in `<dir>/offload/<name>.yaml` given `hydra.searchpath=[file://<dir>]`."""
    import shlex

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


# --- candidates compiled by XLA: plan.compile, plan.measure ---------------------------------------

# The planner's candidates compiled by XLA for the target (`python -m zoo.tools.plan plan.compile=N`).
#
# The planner's HBM model is a sum of holders; the compiler's peak is a schedule with reuse and padding.
# On a TPU v5e the two differ by -34..+35% over 48 runs (docs/benchmarks.md, "TPU v5e"), so an estimate
# alone can refuse a batch that runs or pick a policy that does not fit. With `plan.compile=N` the
# planner compiles (never runs) up to N candidates for the target and keeps the fastest whose compiled
# peak fits:
#
# 1. search with the HBM budget; compile the pick and read XLA's peak (`estimated_peak_bytes`: on a
#    TPU the compiler's simulated heap, which is what decides an out-of-memory there);
# 2. the ratio compiled / estimated is the model's error near that policy: search again with the budget
#    divided by it (a model that overstates gets room, one that understates loses it), and compile
#    that pick, until a pick repeats or N are compiled.
#
# Where a compile is possible: on the target itself (a TPU on a TPU, the CPU for `hardware=cpu`), and for
# a TPU on any machine with libtpu installed (ahead of time, for the chip's topology; the same compiler,
# so the same figures). A GPU target needs its GPU.

# The chip grid jax.experimental.topologies is asked for, by the number of devices planned for.
_TOPOLOGY_SHAPES = {1: "1x1", 4: "2x2", 8: "2x4"}


@dataclasses.dataclass
class Checked:
    """One candidate: the planner's estimate and XLA's compiled peak (inf: XLA reported out of memory
    without a figure)."""

    estimate: Estimate
    compiled_peak: float
    compile_s: float
    label: str = ""  # a preset's name, for one compiled because `plan.measure` asked for the presets
    measured_s: Optional[float] = None  # the median step on the device (`plan.measure`)
    # Bytes of the values XLA rematerialized to stay within its memory limit (zoo.hlo.rematerialized):
    # its peak is then that of a program holding less than the one the estimate counts.
    rematerialized_bytes: Optional[float] = None

    def fits(self, budget: float) -> bool:
        """Within the budget as compiled, and as written within REMAT_SLACK of it: XLA's rematerializing
        a little near its limit is cheap, a lot is not."""
        written = self.compiled_peak + (self.rematerialized_bytes or 0.0)
        return self.compiled_peak <= budget and written <= REMAT_SLACK * budget


# How far over the budget a compiled program may be as written (XLA's peak plus what it rematerialized
# to fit) and still count as fitting. On a TPU v5e, dsv3_100m: within 1.1 and timed, `minimal` at
# 28 x 4096 (1.47 GB rematerialized, +1.5%), `full:context=device` at 84 x 4096 (2.14 GB, +7.6%; the
# fastest there), `full:context=offload` at 90 x 4096 (0.64 GB, +0.2%; the fastest there); beyond it,
# five tags offloaded at 90 x 4096 (4.18 GB, +19%), 1.44x the fastest (docs/benchmarks.md).
REMAT_SLACK = 1.1


def _candidate_key(e: Estimate) -> tuple:
    return tuple(sorted(e.assignment.items()))


def checked_search(p: Problem, compile_peak: Callable[[Estimate], tuple[float, float]], n: int) -> list[Checked]:
    """Up to `n` candidates compiled (`compile_peak(estimate) -> (peak bytes, seconds)`), in the order tried.

    When the search has nothing new to offer (its pick at the scaled budget was compiled already)
    and that pick offloads, it searches on among the policies that recompute in place of offloading:
    offloads can hold more device memory than the estimate's one layer in flight (on a TPU v5e,
    dsv3_100m at 84 x 4096 compiled to 16.65 GB as written with its attention output sent to host and
    to 12.84 GB with it recomputed; the estimate's smallest there once, offloading seven tags,
    compiled to 18.78 GB: docs/benchmarks.md), so where the estimate's smallest offloads, a policy
    without offloads may fit where it did not.

    Last, from the fastest candidate that fits, it offloads one of the tags that candidate recomputes,
    the estimate's fastest first, until one fits: an offload in place of a recompute adds no kept
    bytes, only in-flight ones (on the same chip and batch, `full` with the attention output
    offloaded compiled within the budget and ran 3.0% faster than `full`)."""
    tried: list[Checked] = []
    budget = p.budget
    space = p
    while len(tried) < n:
        try:
            e = search(dataclasses.replace(space, budget=budget))
        except Infeasible as why:  # the smallest the model knows: compile it, XLA may disagree
            e = why.best
        if any(_candidate_key(c.estimate) == _candidate_key(e) for c in tried):
            if space is not p or not any(a == "offload" for a in e.assignment.values()):
                break
            space = _without_offload(p)
            continue
        peak, secs = compile_peak(e)
        tried.append(Checked(e, peak, secs, rematerialized_bytes=_rematerialized(compile_peak, e)))
        if not math.isfinite(peak):
            budget = min(budget, e.peak_bytes) * 0.9  # out of memory without a figure: ask for less
        else:
            budget = p.budget * e.peak_bytes / peak
    base = chosen(tried, p.budget)
    if base is None:
        return tried
    done = {_candidate_key(c.estimate) for c in tried}
    offloading_one = [
        evaluate(p, {**base.estimate.assignment, t.tag: "offload"})
        for t in p.tags
        if base.estimate.assignment.get(t.tag) == "remat" and "offload" in t.choices
    ]
    for e in sorted(offloading_one, key=lambda e: e.time_s):
        if len(tried) >= n or e.time_s >= base.estimate.time_s:
            break
        if _candidate_key(e) in done:
            continue
        tried.append(Checked(e, *compile_peak(e)))
        tried[-1].rematerialized_bytes = _rematerialized(compile_peak, e)
        if tried[-1].fits(p.budget):  # the fastest of the rest by the estimate: none after it would be picked
            break
    return tried


def _rematerialized(compile_peak, e: Estimate) -> Optional[float]:
    """What XLA rematerialized in `e`'s compiled program, where the compiler records it (`Compiler`)."""
    return getattr(compile_peak, "rematerialized", {}).get(_candidate_key(e))


def _without_offload(p: Problem) -> Problem:
    """`p` with no tag offloaded (those that cannot be recomputed stay on device)."""
    return dataclasses.replace(
        p, tags=[dataclasses.replace(t, choices=tuple(c for c in t.choices if c != "offload")) for t in p.tags]
    )


def chosen(tried: list[Checked], budget: float) -> Optional[Checked]:
    """The fastest candidate whose compiled peak fits (measured where they were, else by the
    estimate); None if none fits."""
    fits = [c for c in tried if c.fits(budget)]
    if any(c.measured_s is not None for c in fits):
        return min((c for c in fits if c.measured_s is not None), key=lambda c: c.measured_s)
    return min(fits, key=lambda c: (c.estimate.time_s, c.compiled_peak)) if fits else None


def checked_table(tried: list[Checked], budget: float, where: str) -> str:
    measured = any(c.measured_s is not None for c in tried)
    remat = any(c.rematerialized_bytes for c in tried)
    rows = [
        (
            "",
            "estimated step",
            *(["measured step"] if measured else []),
            "estimated HBM",
            "XLA's HBM",
            *(["XLA rematerialized"] if remat else []),
            "fits",
            "policy",
        )
    ]
    pick = chosen(tried, budget)
    for c in tried:
        step = [f"{1e3 * c.measured_s:.1f} ms" if c.measured_s is not None else "-"] if measured else []
        rematerialized = [_fmt_bytes(c.rematerialized_bytes) if c.rematerialized_bytes else "-"] if remat else []
        rows.append(
            (
                "*" if c is pick else "",
                f"{1e3 * c.estimate.time_s:.1f} ms",
                *step,
                _fmt_bytes(c.estimate.peak_bytes),
                _fmt_bytes(c.compiled_peak) if math.isfinite(c.compiled_peak) else "out of memory",
                *rematerialized,
                "yes" if c.fits(budget) else "no",
                (f"{c.label} = " if c.label else "") + _describe(c.estimate.assignment),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    note = (
        "\nXLA rematerialized values to fit its memory limit where a size is given: its HBM is that of a "
        "program holding less than the one estimated (and recomputing more); one that needed more than "
        f"{REMAT_SLACK:g}x the budget as written does not count as fitting"
        if remat
        else ""
    )
    return f"compiled by XLA ({where}; HBM budget {_fmt_bytes(budget)}):\n" + "\n".join(lines) + note


_OOM = re.compile(r"Used ([\d.]+)([KMGT]?) of [\d.]+[KMGT]? hbm|\(([\d.]+)([KMGT]?)i?B?\) exceeds available HBM")
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _oom_bytes(error: BaseException) -> Optional[float]:
    """XLA's figure from its out-of-memory error at compile time (inf when it gives none); None when the
    error is something else."""
    s = str(error)
    if "RESOURCE_EXHAUSTED" not in s and "out of memory" not in s.lower():
        return None
    m = _OOM.search(s)
    if not m:
        return math.inf
    value, unit = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return float(value) * _SCALE[unit]


@contextlib.contextmanager
def compile_target(c, platform: str, devices):
    """(devices, description) to compile for `platform` on this machine; PlanError (one line) where it
    cannot. A TPU off a TPU: the chip's topology from libtpu."""
    import jax

    from zoo.backend import lowering_for

    here = jax.default_backend()
    if platform == here:
        yield devices, f"compiled on this {here}"
        return
    if platform != "tpu":
        raise PlanError(
            f"plan.compile: compiling for {platform} needs a {platform} here (this machine has {here}); "
            "run the plan there, or drop plan.compile"
        )
    if not libtpu_installed():
        raise PlanError(
            "plan.compile: compiling for a TPU off the chip needs libtpu (pip install libtpu); or plan on the TPU, "
            "or drop plan.compile"
        )
    n = len(devices)
    if n not in _TOPOLOGY_SHAPES:
        raise PlanError(
            f"plan.compile: ahead-of-time for {n} TPU chips is not set up here (1, 4 or 8 chips); plan on the TPU"
        )
    from jax.experimental import topologies

    # The xla group's TPU flags reach this compile only if they were set before JAX started (libtpu reads
    # them once, then): zoo.train.run.apply_xla_flags, which main's start_jax calls, does so.
    chip = c.hardware.name.removeprefix("tpu_")
    shape = _TOPOLOGY_SHAPES[n]
    bounds = (1, 1, 1) if n == 1 else (2, 2, 1)
    try:
        topo = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{chip}:{shape}", chips_per_host_bounds=bounds
        )
    except Exception as e:  # noqa: BLE001 - a libtpu that does not start: one line, not its traceback
        raise PlanError(
            f"plan.compile: libtpu could not describe a {chip} {shape} ({type(e).__name__}: {one_line(e)[:160]}); "
            "reinstall libtpu (pip install libtpu), plan on the TPU, or drop plan.compile"
        ) from e
    with lowering_for("tpu"):
        yield list(topo.devices)[:n], f"ahead of time for a {chip} {shape} on this {here}, libtpu"


class Compiler:
    """Candidates' steps as train.py builds them (the run's config with the candidate's policy),
    lowered on abstract inputs and compiled; the executables are kept for `measure`."""

    def __init__(self, c, plan, devices, name: str, platform: str):
        self.c, self.plan, self.devices, self.name, self.platform = c, plan, devices, name, platform
        self.compiled: dict[tuple, tuple] = {}  # candidate key -> (trainer, executable)
        self.rematerialized: dict[tuple, float] = {}  # candidate key -> bytes XLA rematerialized

    def __call__(self, e: Estimate) -> tuple[float, float]:
        """(XLA's peak bytes per device, seconds to compile)."""
        from zoo.hlo import rematerialized
        from zoo.train.metrics import compiled_memory
        from zoo.train.step import Trainer

        c = self.c
        policy = to_offload_config(e, self.name, c.offload.params, c.offload.opt_state)
        policy = dataclasses.replace(policy, ranges=c.offload.ranges)
        trainer = Trainer(dataclasses.replace(c, offload=policy), self.plan, self.devices)
        t = time.perf_counter()
        try:
            exe = trainer.lower().compile(trainer.compiler_options)
        except Exception as why:  # noqa: BLE001 - XLA's out-of-memory is an answer; anything else is not
            got = _oom_bytes(why)
            if got is None:
                raise
            return got, time.perf_counter() - t
        mem = compiled_memory(exe, self.platform) or {}
        got = mem.get("estimated_peak_bytes")
        if got is None:
            raise PlanError(f"plan.compile: XLA for {self.platform} reports no memory analysis here; drop plan.compile")
        self.compiled[_candidate_key(e)] = (trainer, exe)
        self.rematerialized[_candidate_key(e)] = float(sum(v.bytes for v in rematerialized(exe.as_text())))
        return float(got), time.perf_counter() - t

    def measure(self, tried: list[Checked], budget: float, steps: int, rounds: int = 2, echo=print) -> None:
        """Run every candidate that fits for `steps` timed steps (after one warm-up) per round, the
        candidates in alternation (a drift of the machine falls on all alike), on one state and one
        batch of random tokens; sets each one's median `measured_s`."""
        import statistics

        import jax
        import numpy as np

        runs = [
            (t, *self.compiled[_candidate_key(t.estimate)])
            for t in tried
            if t.fits(budget) and _candidate_key(t.estimate) in self.compiled
        ]
        if not runs:
            return
        first = runs[0][1]
        state = first.init()
        cfg = first.cfg
        rng = np.random.default_rng(0)
        tokens = first.shard_tokens(
            rng.integers(0, cfg.model.vocab_size, size=(cfg.data.batch_size, cfg.data.seq_len), dtype=np.int32)
        )
        times: dict[int, list[float]] = {id(t): [] for t, _, _ in runs}
        for r in range(rounds):
            for t, _, exe in runs:
                for i in range(1 + steps):
                    start = time.perf_counter()
                    state, metrics = exe(state, tokens)
                    jax.block_until_ready(metrics)
                    if i:
                        times[id(t)].append(time.perf_counter() - start)
            echo(f"measured round {r + 1}/{rounds} of {len(runs)} candidates")
        for t, _, _ in runs:
            t.measured_s = statistics.median(times[id(t)])


def _compile_hint(c) -> str:
    """The refusal's pointer to `plan.compile` where the target's compiler can run here: the estimate
    counts the program as written, and near its memory limit XLA rematerializes values to fit (on a
    v5e dsv3_100m's `full:context=device` at 84 x 4096: 19.15 GB estimated, 16.05 GB compiled, 2.14 GB
    rematerialized)."""
    import jax

    platform = c.hardware.platform or jax.default_backend()
    if platform != jax.default_backend() and platform != "tpu":
        return ""  # a GPU's program compiles on its GPU only
    needs = " (with libtpu installed: pip install libtpu)" if platform == "tpu" and not libtpu_installed() else ""
    return (
        "; that is the program as written, and XLA may rematerialize values to fit it: plan.compile=4 asks the "
        f"compiler{needs}"
    )


def compile_count(opts: PlanConfig, c) -> int:
    """`plan.compile`, its default (null) resolved: 4 for a TPU target whose compiler is on this
    machine (the estimate alone is -17..+11% off XLA's peak on a v5e, and misses what offloading
    several tags costs: docs/benchmarks.md), else 0."""
    import jax

    if opts.compile is not None:
        return opts.compile
    if c.hardware.platform != "tpu":
        return 0
    return 4 if jax.default_backend() == "tpu" or libtpu_installed() else 0


# The recompute-only presets, and the attention output's offload on top of two of them, that
# `plan.measure` times beside the planner's own candidates (labels of `policy_from_label`). On a
# v5e the context's offload won where keeping it did not fit (llama_1b's layers at long rows:
# minimal_context_offloaded) and beat recomputing it (dsv3_100m at 68 and 84 x 4096:
# full:context=offload, 0.96-0.97x full; docs/benchmarks.md, "TPU v5e").
MEASURED_PRESETS = ("full", "save_qkv_proj", "minimal", "minimal_context_offloaded", "full:context=offload")


def compile_checked(p: Problem, c, step_plan, devices, opts: PlanConfig):
    """(estimate, `Checked`) of the fastest of up to `plan.compile` candidates whose
    compiled peak fits; PlanError (one line) when none does."""
    import jax

    platform = c.hardware.platform or jax.default_backend()
    if opts.measure and platform != jax.default_backend():
        raise PlanError(
            f"plan.measure: it runs the candidates, so it needs the target ({platform}) here, not "
            f"{jax.default_backend()}; drop plan.measure to compile only"
        )
    with compile_target(c, platform, devices) as (target, where):
        print(f"compiling up to {opts.compile} candidate policies ({where}) ...", flush=True)
        compiler = Compiler(c, step_plan, target, opts.name, platform)
        tried = checked_search(p, compiler, opts.compile)
        if opts.measure:
            seen = {_candidate_key(t.estimate) for t in tried}
            for name in MEASURED_PRESETS:
                e = evaluate(p, preset_assignment(p, policy_from_label(name), c.model))
                if _candidate_key(e) not in seen:
                    seen.add(_candidate_key(e))
                    peak, secs = compiler(e)
                    tried.append(Checked(e, peak, secs, label=name, rematerialized_bytes=_rematerialized(compiler, e)))
            print(f"measuring {opts.measure} steps per round of each that fits ...", flush=True)
            compiler.measure(tried, p.budget, opts.measure)
    print(checked_table(tried, p.budget, where))
    pick = chosen(tried, p.budget)
    if pick is None:
        least = min(tried, key=lambda t: t.compiled_peak)
        raise PlanError(
            f"plan.compile: none of the {len(tried)} policies compiled fits {_fmt_bytes(p.budget)} per device; the "
            f"smallest, {_describe(least.estimate.assignment)}, compiled to {_fmt_bytes(least.compiled_peak)}; "
            f"{_state_hint(p).removeprefix(', or ')}"
        )
    note = unmeasured_offload_note(pick, on_target=platform == jax.default_backend(), measured=bool(opts.measure))
    if note:
        print(note)
    return pick.estimate, pick, tried


def unmeasured_offload_note(pick: Checked, *, on_target: bool, measured: bool) -> Optional[str]:
    """A line for a compiled pick that sends several tags to host and was not timed: on a TPU v5e
    (dsv3_100m at 90 x 4096) such a pick, compiled ahead of time to 15.90 GB with nothing
    rematerialized, compiled on the chip with 4.18 GB rematerialized and ran 1.44x the fastest policy
    there (docs/benchmarks.md, "The planner's candidates compiled and timed on the chip")."""
    offloaded = [t for t, a in pick.estimate.assignment.items() if a == "offload"]
    if measured or len(offloaded) < 2:
        return None
    where = "compiled ahead of time, not on the target, and " if not on_target else ""
    return (
        f"note: the pick sends {len(offloaded)} tags to host ({', '.join(offloaded)}), {where}not timed: the estimate "
        "and the compile can miss what several offloads cost; on the target, plan.measure=2 times it beside the presets"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    after_error: list[str] = []  # printed after the one error line: who holds the memory

    def body() -> int:
        opts, overrides = split_tool_args(argv, "plan", PlanConfig)
        out = output_path(opts.out, "plan.out", "plan", f"offload/{opts.name}.yaml", argv)
        if opts.json:
            output_path(opts.json, "plan.json", "plan", "plan.json", argv)
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
        for n in notes:
            print(f"note: {n}")
        if opts.split and p.fixed:
            raise PlanError("plan.split: it searches the ranges itself; drop offload.ranges or plan.split=true")
        if p.fixed:
            free = sum(free_layers(p).values())
            print(
                "note: offload.ranges: "
                + "; ".join(f"{f.label} ({_layers(sum(f.layers.values()))}) counted as given" for f in p.fixed)
                + f"; the plan is the policy of the other {_layers(free)} "
                "(the YAML it writes; the commands below keep the ranges)"
            )
        print(
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
            f"{_fmt_bytes(info['budget_bytes'])}, "
            + (
                f"host budget {_fmt_bytes(p.host_budget)} per device "
                f"({_fmt_bytes(p.devices_per_node * p.host_budget)} per node of {p.devices_per_node}); "
                if math.isfinite(p.host_budget)
                else "no host budget (hardware.host_bytes_per_device 0); "
            )
            + (
                f"params {c.offload.params}, optimizer state {c.offload.opt_state}"
                if p.frozen_bytes == 0
                else f"LoRA adapters {_fmt_bytes(p.param_bytes)} trainable "
                f"(optimizer state {_fmt_bytes(p.opt_bytes)}, {c.offload.opt_state}), "
                f"frozen base {_fmt_bytes(p.frozen_bytes)} per device on "
                f"{'host, streamed per layer' if p.frozen_on_host else 'device'}"
            )
        )
        chunk = c.trainer.loss_chunk_size
        print(
            f"counted: attention {attention_impl} on {c.hardware.name} (model.attention_impl={asked}) "
            f"{_fmt_bytes(info['attention_working_bytes'])} per layer, "
            + (f"loss over chunks of {chunk} positions" if chunk else "loss over the whole logits")
            + f" {_fmt_bytes(info['loss_working_bytes'])}, update "
            + ("streamed layer by layer" if _streamed(p) else "whole tree on device")
        )
        compiled, candidates = None, []
        n_compile = compile_count(opts, c)
        if opts.measure and not n_compile:
            raise PlanError(
                f"plan.measure: it times the compiled candidates, and nothing compiles for {c.hardware.name} "
                "here by default; give plan.compile=4"
            )
        opts = dataclasses.replace(opts, compile=n_compile)
        if opts.compile:
            best, compiled, candidates = compile_checked(p, c, step_plan, devices, opts)
        else:
            try:
                best = search(p)
            except Infeasible as e:
                print(estimates_table(p, e.best))
                after_error.append(holders_table(p, e.best, e.budget))
                hint = _compile_hint(c) if e.budget == "hbm" else ""
                if hint:
                    raise Infeasible(str(e) + hint, e.min_bytes, e.best, e.budget, e.min_host_bytes) from None
                raise
        policy = to_offload_config(best, opts.name, c.offload.params, c.offload.opt_state)
        print(estimates_table(p, best))
        if p.rerun_s and not p.fixed and info["none_residual_bytes"] is not None:
            # `none` differs from keeping every tag only where the profile prices the checkpoint's re-run.
            note = none_note(p, best, none_estimate(p, info["none_residual_bytes"]), compiled is not None)
            if note:
                print(note)
        if compiled:
            print(
                f"XLA compiled this policy to {_fmt_bytes(compiled.compiled_peak)} of {_fmt_bytes(p.budget)} "
                "per device "
                "(plan.compile): that, not the estimate above, is what decides whether it fits"
            )
        if opts.holders:
            print(holders_table(p, best, "hbm"))
            if best.host_bytes:
                print(holders_table(p, best, "host"))
        header = (
            f"Planned by: python -m zoo.tools.plan {' '.join(argv)}\n"
            f"Estimated step {1e3 * best.time_s:.3f} ms, HBM peak {_fmt_bytes(best.peak_bytes)} of "
            f"{_fmt_bytes(p.budget)} per device,\n"
            f"host memory {_fmt_bytes(best.host_bytes)} per device ({_fmt_bytes(best.host_node_bytes)} per node of "
            f"{p.devices_per_node}).\n"
            + (f"XLA's compiled peak {_fmt_bytes(compiled.compiled_peak)} (plan.compile).\n" if compiled else "")
            + (
                f"Measured step {1e3 * compiled.measured_s:.1f} ms, the fastest of {len(candidates)} candidates "
                "(plan.measure).\n"
                if compiled and compiled.measured_s is not None
                else ""
            )
            + "Tags left out are recomputed."
        )
        out.write_text(to_yaml(policy, header))
        print(f"wrote {out}")
        # The plan's own output directory is no place for the training run's.
        kept = [a for a in overrides if not a.startswith(("offload=", "hydra.run.", "hydra.sweep."))]
        for line in use_plan_lines(out, kept):
            print(line)
        if opts.split:
            print(split_line(p, c, best, kept, out, opts.name, opts.holders))
        if opts.json:
            held = {m: [dataclasses.asdict(h) for h in holders(p, best, m)] for m in ("hbm", "host")}
            pathlib.Path(opts.json).write_text(
                json.dumps(
                    {
                        "info": info,
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
        return 0

    rc = run_tool(body, "python -m zoo.tools.plan", argv)
    for text in after_error:
        print(text)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
