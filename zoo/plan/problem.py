"""The planning problem and its answer: per tag (`TagCost`) and per layer stack (`StackCost`), what
the search assigns, the budgets (`Problem`), one assignment's estimate (`Estimate`), and the errors
(`PlanError`, `Infeasible`). Plain data: the cost model reads it (zoo.plan.cost), nothing here prices
anything."""

import dataclasses
import math


CHOICES = ("device", "offload", "remat")
GB = 1e9


class PlanError(ValueError):
    """One line: `<key>: <what is wrong>; <fix>`."""


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
    holds_last: bool = False  # the model's last layer is in this range (`Problem.turn_exposed`)


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
    # How the tags' host transfers are priced (`zoo.plan.cost.link_exposed`): each layer's run behind
    # this share of the layer's compute, the rest exposed; with `turn_exposed`, the last layer's (where
    # the forward turns into the backward, nothing left to hide them behind) exposed whole, both ways.
    # 1 and False: every transfer hidden up to its layer's compute (plan.transfers=overlapped); 0 and
    # True: every transfer exposed whole. The layer input's is exposed whole whatever these say.
    transfer_overlap: float = 1.0
    turn_exposed: bool = False

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


def stack_bounds(p: Problem) -> dict[str, tuple[int, int]]:
    bounds = {}
    for s, sc in p.stacks.items():
        if not sc.layer_range:
            raise PlanError(
                f"offload.ranges: the planner does not know the layers of stack {s}; plan without offload.ranges"
            )
        lo, hi = (int(x) for x in sc.layer_range.split("-"))
        bounds[s] = (lo, hi)
    return bounds


def layers_in(bounds: dict[str, tuple[int, int]], first: int, last: int) -> dict[str, int]:
    """Per stack, how many of layers first..last (inclusive) it holds."""
    return {s: min(hi, last) - max(lo, first) + 1 for s, (lo, hi) in bounds.items() if min(hi, last) >= max(lo, first)}


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3f} {unit}"
    return f"{b:.0f} B"
