"""The planning problem built from a composed, validated train config and its traced step
(`problem_from_config`): the tags' shapes from the gradient traced with every tag kept, the state's
bytes per device under its shardings, the rate and link of the hardware profile, the working set."""

import contextlib
import dataclasses
import math
import re
from typing import Any, Optional, Sequence

import numpy as np

from zoo import model as zoo_model
from zoo.backend import choices as backend_choices
from zoo.backend import lowering_for, pallas_interpreted
from zoo.counts import flops_per_token
from zoo.model import loss_fn
from zoo.nn.attention_kernels import resolve_impl
from zoo.offload import CHECKPOINT_INPUTS, OffloadConfig, backward_never_reads, remat_policy, resolve
from zoo.placement import inspect_placement, stack_names
from zoo.plan.cost import evaluate, tag_totals_of
from zoo.plan.options import (
    PlanConfig,
    host_budget_bytes,
    link_duplex,
    link_profile,
    resolve_link,
    transfer_pricing,
)
from zoo.plan.policies import with_ranges
from zoo.plan.pricing import (
    OpSlowness,
    layer_forward_flops,
    per_device_widths,
    producer_op,
    stack_layers,
    tag_costs,
)
from zoo.plan.problem import GB, Estimate, PlanError, Problem, StackCost, fmt_bytes
from zoo.plan.working_set import WorkingSet, step_working_set
from zoo.sharding import logical_ways
from zoo.tags import emitted_tags


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


# Residual producers whose output XLA derives from another kept value instead of keeping it.
FOLDED_BY_XLA = ("reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "convert_element_type")


@dataclasses.dataclass
class StepShape:
    """The run's step as the planner traces it: the model as built (with the attention this machine
    traces), the mesh's axis sizes, the data-parallel ways, and one rank's microbatch."""

    model: Any  # zoo.config.ModelConfig
    sizes: dict
    data_parallel: int
    batch: int  # sequences per data-parallel rank and microbatch
    seq: int
    devices: int


def step_shape(c, trainer, attention_impl: str) -> StepShape:
    m = trainer.cfg.model  # as the run builds it: model.moe.impl resolved (zoo.train.run_config.as_built)
    m = m.replace(attention_impl=host_attention_impl(attention_impl))
    sizes = trainer.plan.mesh.sizes
    dp = math.prod(sizes[a] for a in dict.fromkeys(c.mesh.rules.get("batch", [])) if a in sizes) or 1
    return StepShape(m, sizes, dp, max(1, trainer.plan.microbatch // dp), c.data.seq_len, trainer.plan.num_devices)


def trace_step(c, shape: StepShape, attention_impl: str, own_policy: bool):
    """(placement with every tag kept, placement of `none` or None, the stacks' names): the gradient
    traced on abstract inputs. `none`'s (what it keeps untagged) only where it is needed: the run's own
    policy without checkpoints, or a profile that prices the memory-bound work."""
    import jax
    import jax.numpy as jnp

    m = shape.model
    # Shapes and dtypes of every tag, read from the traced gradient with every tag kept.
    keep_all = OffloadConfig(
        name="keep_all",
        checkpoint=True,
        tags={t: "device" for t in emitted_tags(m) if t not in backward_never_reads(m)},
    )
    policy = remat_policy(keep_all, m)
    abstract = zoo_model.abstract(m)
    tokens = jax.ShapeDtypeStruct((shape.batch, shape.seq), jnp.int32)
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
    return placement, uncheckpointed, stack_names(abstract)


@dataclasses.dataclass
class StateBytes:
    """The state's bytes per device, in all and per layer stack: parameters, optimizer state, and with
    LoRA the frozen base (`frozen_layer`: its largest one layer's)."""

    params: float
    stack_params: dict
    opt: float
    stack_opt: dict
    abstract_opt: Any
    frozen: float = 0.0
    stack_frozen: dict = dataclasses.field(default_factory=dict)
    frozen_layer: float = 0.0


def state_bytes(trainer, names: Sequence[str], placement) -> StateBytes:
    import jax

    param_bytes, stack_params = per_device_bytes(trainer.abstract_params, trainer.param_shardings, names)
    abstract_opt = jax.eval_shape(trainer.tx.init, trainer.abstract_params)
    opt_bytes, stack_opt = per_device_bytes(abstract_opt, trainer.opt_shardings, names)
    state = StateBytes(param_bytes, stack_params, opt_bytes, stack_opt, abstract_opt)
    if trainer.lora is not None:
        state.frozen, state.stack_frozen = per_device_bytes(trainer.abstract_base, trainer.base_shardings, names)
        layers_of = {s["name"]: s["layers"] for s in placement.stacks}
        state.frozen_layer = max(
            (b / layers_of[n] for n, b in state.stack_frozen.items() if layers_of.get(n)), default=0.0
        )
    return state


def compute_rate(hw, opts: PlanConfig) -> tuple[float, float, str]:
    """(reference, rate, where the rate comes from): the measured matmul rate times step_efficiency, or
    the peak times plan.flops_efficiency; `reference` is the rate an op's slowness is measured against."""
    reference = float(hw.matmul_flops) if hw.matmul_flops else hw.peak_flops * opts.flops_efficiency
    if hw.matmul_flops:
        rate, rate_source = reference * hw.step_efficiency, f"hardware.matmul_flops (measured) {hw.matmul_flops:.3g}"
        if hw.step_efficiency != 1.0:
            rate_source += f" x hardware.step_efficiency {hw.step_efficiency:g}"
    else:
        rate = reference
        rate_source = f"hardware.peak_flops {hw.peak_flops:.3g} x plan.flops_efficiency {opts.flops_efficiency}"
    return reference, rate, rate_source


def op_slowness(hw, reference: float, attention_impl: str) -> OpSlowness:
    """An op with a measured rate at its shape (hardware.op_rates) runs at that rate times
    step_efficiency (what an op measured on its own loses inside a step: the fusions, layout changes
    and elementwise work around it), the rest at the problem's rate: each producer's FLOPs are
    weighted by `reference` over its op's rate, so that the problem's FLOPs all run at that rate."""
    import jax

    return OpSlowness(
        hw.op_rates,
        reference,
        {
            "attention": attention_impl,
            "grouped_matmul": backend_choices(hw.platform or jax.default_backend()).grouped_matmul,
        },
    )


def price_layers(c, shape: StepShape, tags, placement, state: StateBytes, slowness: OpSlowness):
    """(the stacks' `StackCost`, the FLOPs the slower ops add per microbatch and device); each tag's
    recompute FLOPs weighted by its op's slowness and hardware.recompute_cost, in place."""
    m, batch, seq, hw = shape.model, shape.batch, shape.seq, c.hardware
    # The formulas count a data-parallel rank's work (whole heads, MLP and sequence); the devices that
    # share the rank's batch (tensor, context: every axis the batch is not split over) each do their part.
    # Each op's rate at the widths one device computes (tensor parallelism splits its heads and MLP).
    shared_by = shape.devices / shape.data_parallel
    m_ops = per_device_widths(m, c.mesh.rules, shape.sizes)
    for t in tags:
        for s, f in t.recompute_flops_per_layer.items():
            t.recompute_flops_per_layer[s] = (
                f
                * slowness(producer_op(m_ops, t.tag, s, batch, seq), forward_only=True)
                * hw.recompute_cost
                / shared_by
            )
    stacks = {}
    extra_flops = 0.0  # per microbatch and device: what the slower ops add, forward and backward
    for s in placement.stacks:
        indices = stack_layers(m, s["name"])
        forward = layer_forward_flops(m, s["name"], batch, seq, slowness, m_ops) / shared_by
        extra_flops += 3 * s["layers"] * (forward - layer_forward_flops(m, s["name"], batch, seq) / shared_by)
        stacks[s["name"]] = StackCost(
            layers=s["layers"],
            forward_flops_per_layer=forward,
            param_bytes_per_layer=state.stack_params.get(s["name"], 0.0) / s["layers"],
            opt_bytes_per_layer=state.stack_opt.get(s["name"], 0.0) / s["layers"],
            layer_range=f"{indices[0]}-{indices[-1]}" if len(indices) == s["layers"] else "",
        )
    vocab_per_device = -(-m.vocab_size // logical_ways(c.mesh.rules, shape.sizes, "vocab"))
    head_flops = 2.0 * batch * seq * m.hidden_size * vocab_per_device
    extra_flops += 3 * head_flops * (slowness(("matmul", m.hidden_size, vocab_per_device)) - 1)
    return stacks, extra_flops


def rate_notes(hw, slowness: OpSlowness) -> str:
    """What the rate's source line adds: the ops at their measured rates, the recompute's share, the
    memory-bound work."""
    notes = ""
    if slowness.used:
        share = f"{hw.step_efficiency:g} x " if hw.matmul_flops and hw.step_efficiency != 1.0 else ""
        notes += f"; each op at {share}its measured rate (hardware.op_rates: " + ", ".join(slowness.used) + ")"
    if hw.recompute_cost != 1.0:
        notes += f"; a recompute at hardware.recompute_cost {hw.recompute_cost:g} of its time"
    if hw.activation_passes or hw.recompute_passes:
        notes += (
            f"; memory-bound work: hardware.activation_passes {hw.activation_passes:g} over the layers' activations"
            f" at hardware.hbm_gbps {hw.hbm_gbps:g}, hardware.recompute_passes {hw.recompute_passes:g} more where"
            " the policy checkpoints"
        )
    return notes


def hbm_budget(opts: PlanConfig, hw) -> float:
    """HBM bytes per device: `plan.hbm_budget_gb`, else the profile's; PlanError where neither gives one."""
    if opts.hbm_budget_gb is not None:
        return opts.hbm_budget_gb * GB
    if hw.hbm_bytes:
        return float(hw.hbm_bytes)
    raise PlanError(
        f"plan.hbm_budget_gb: hardware profile {hw.name!r} has no hbm_bytes; give a budget, e.g. plan.hbm_budget_gb=80"
    )


def residual_bytes(c, placement, uncheckpointed, own_policy: bool) -> tuple[float, float]:
    """(the untagged residuals the policy keeps, those `none` keeps: 0 where it was not traced)."""
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
    return other, untagged


def problem_from_config(
    c, trainer, opts: PlanConfig, hardware_dir=None, attention_impl: Optional[str] = None, own_policy: bool = False
) -> tuple[Problem, dict]:
    """The planning problem for a composed, validated train config (sizes per device);
    `attention_impl`: the implementation the target runs (default: `target_attention_impl(c)`).
    `own_policy`: the problem of the run's own policy (`policy_estimate`): a policy without checkpoints
    (`none`) keeps every intermediate its backward reads, tagged or not, and those count as residuals."""
    attention_impl = attention_impl or target_attention_impl(c)
    shape = step_shape(c, trainer, attention_impl)
    m, seq, hw = shape.model, shape.seq, c.hardware
    placement, uncheckpointed, names = trace_step(c, shape, attention_impl, own_policy)
    # The traced records are whole sequences, heads and MLP hidden dims: each tag sized as the mesh
    # splits it (tensor parallelism; sequence parallelism for the kept layer input, zoo.model.DecoderBlock).
    # Each sized as the planned hardware's compiler stores it (a profile for any platform: as traced).
    tile = backend_choices(hw.platform).layout_tile_elements if hw.platform else 1
    tags = tag_costs(m, placement.records, shape.batch, seq, rules=c.mesh.rules, sizes=shape.sizes, tile=tile)
    state = state_bytes(trainer, names, placement)
    reference, rate, rate_source = compute_rate(hw, opts)
    slowness = op_slowness(hw, reference, attention_impl)
    stacks, extra_flops = price_layers(c, shape, tags, placement, state, slowness)
    rate_source += rate_notes(hw, slowness)
    link_gbps = resolve_link(opts.link, hw.host_link_gbps, hardware_dir)
    budget = hbm_budget(opts, hw)
    working = step_working_set(c, shape, placement, tags, stacks, attention_impl, tile)
    other, untagged = residual_bytes(c, placement, uncheckpointed, own_policy)
    # The layers' activations (every tag and what `none` keeps besides, one microbatch's) at the
    # device's memory bandwidth: the memory-bound work's seconds per pass over them.
    activation_bytes = untagged + sum(tag_totals_of(t, stacks) for t in tags)
    memory_bound = hw.activation_passes or hw.recompute_passes
    memory_pass_s = activation_bytes / (hw.hbm_gbps * 1e9) * c.trainer.grad_accum if memory_bound else 0.0
    checkpoints = c.offload.checkpoint or bool(c.offload.ranges) or not own_policy
    overlap, turn_exposed = transfer_pricing(opts, c.hardware.transfer_overlap, hardware_dir)
    p = Problem(
        tags=tags,
        stacks=stacks,
        rate=float(rate),
        link=link_gbps * GB,
        budget=float(budget),
        step_flops=flops_per_token(m, seq) * c.data.batch_size * seq / shape.devices
        + extra_flops * c.trainer.grad_accum,
        microbatches=c.trainer.grad_accum,
        latency=opts.transfer_latency_us * 1e-6,
        duplex=link_duplex(opts.link, hw.host_link_duplex, hardware_dir),
        param_bytes=state.params,
        stack_param_bytes=float(sum(state.stack_params.values())),
        grad_bytes=state.params,
        opt_bytes=state.opt,
        stack_opt_bytes=float(sum(state.stack_opt.values())),
        # With LoRA, offload.params places the frozen base (zoo.train.step.Trainer), not the adapters.
        params_on_host=c.offload.params == "pinned_host" and trainer.lora is None,
        opt_on_host=c.offload.opt_state == "pinned_host",
        other_bytes=other,
        working_bytes=float(working.bytes),
        working_label=working.label,
        host_budget=host_budget_bytes(opts, hw),
        devices_per_node=min(int(hw.devices_per_node), shape.devices),
        # The step's token batch and the next one's (built a step ahead, zoo.train.run.Batches), int32.
        staging_bytes=2.0 * c.data.batch_size * seq * 4 / shape.devices,
        per_device_batch=shape.batch,
        frozen_bytes=float(state.frozen),
        stack_frozen_bytes=float(sum(state.stack_frozen.values())),
        frozen_layer_bytes=float(state.frozen_layer),
        frozen_on_host=trainer.lora is not None and trainer.params_on_host,
        memory_s=hw.activation_passes * memory_pass_s,
        rerun_s=hw.recompute_passes * memory_pass_s if checkpoints else 0.0,
        transfer_overlap=overlap,
        turn_exposed=turn_exposed,
        largest_leaves=largest_leaves(trainer.abstract_params, trainer.param_shardings, "params")
        + largest_leaves(state.abstract_opt, trainer.opt_shardings, "opt_state"),
    )
    if c.offload.ranges:
        p = with_ranges(p, c.offload, m)
    info = problem_info(c, p, shape, (rate, rate_source, link_gbps), state, working)
    info["figures"] = figures(c, opts, p, slowness, hardware_dir)
    # what `none` keeps besides the tags, where it was traced (the memory-bound term needs it)
    info["none_residual_bytes"] = untagged if uncheckpointed is not None else None
    return p, info


def figures(c, opts: PlanConfig, p: Problem, slowness: OpSlowness, hardware_dir=None) -> dict[str, list[str]]:
    """Which of the figures the estimate uses were measured on the hardware (or fitted to its runs) and
    which are assumed: {"measured": [...], "assumed": [...]}, printed by the plan and kept in plan.json."""
    hw = c.hardware
    measured, assumed = [], []
    if hw.matmul_flops:
        measured.append(f"the matmul rate (hardware.matmul_flops of {hw.name})")
    else:
        assumed.append(f"the compute rate (hardware.peak_flops x plan.flops_efficiency {opts.flops_efficiency:g})")
    (measured if slowness.used else assumed).append(
        f"op rates ({', '.join(slowness.used)})" if slowness.used else "every op at that rate (no hardware.op_rates)"
    )
    # The step model's figures away from the schema's defaults (1: not fitted; passes 0: not priced).
    defaults = {f.name: f.default for f in dataclasses.fields(hw)}
    fitted = [
        k
        for k in ("step_efficiency", "recompute_cost", "activation_passes", "recompute_passes")
        if getattr(hw, k) != defaults[k]
    ]
    if fitted:
        measured.append("the step model's " + ", ".join(fitted) + " (fitted to the hardware's runs)")
    if opts.link is None:
        measured.append(f"the host link (hardware.host_link_gbps of {hw.name})")
    elif link_profile(opts.link, hardware_dir) is not None:
        measured.append(f"the host link (hardware.host_link_gbps of {opts.link})")
    else:
        assumed.append(f"the host link (plan.link={opts.link}, a nominal rate)")
    tags = [t.tag for t in p.tags if "offload" in t.choices and t.tag not in CHECKPOINT_INPUTS]
    if not p.turn_exposed:
        assumed.append("every tag's transfer hidden behind its layer's compute (plan.transfers=overlapped)")
    elif p.transfer_overlap > 0:
        source = opts.link if opts.link is not None else hw.name
        measured.append(
            f"transfers behind {p.transfer_overlap:.0%} of their layer's compute, the last layer's exposed "
            f"(hardware.transfer_overlap of {source})"
        )
    elif tags:
        why = "plan.transfers=exposed" if opts.transfers == "exposed" else "no hardware.transfer_overlap measured"
        assumed.append(f"transfers exposed whole, both ways ({why})")
    assumed.append(f"{opts.transfer_latency_us:g} us per transfer (plan.transfer_latency_us)")
    return {"measured": measured, "assumed": assumed}


def problem_info(c, p: Problem, shape: StepShape, rates: tuple, state: StateBytes, working: WorkingSet) -> dict:
    """The figures the planner prints and writes to plan.json besides the estimate (`none_residual_bytes`
    last, set by `problem_from_config`); `rates`: (FLOP/s, where it comes from, the link's GB/s)."""
    rate, rate_source, link_gbps = rates
    return {
        "per_device_batch": shape.batch,
        "seq_len": shape.seq,
        "sequence_parallel": logical_ways(c.mesh.rules, shape.sizes, "seq"),
        "devices": shape.devices,
        "data_parallel": shape.data_parallel,
        "rate_flops": rate,
        "rate_source": rate_source,
        "link_gbps_per_direction": link_gbps,
        "link_duplex": p.duplex,
        "budget_bytes": p.budget,
        "host_budget_bytes": p.host_budget if math.isfinite(p.host_budget) else None,
        "devices_per_node": p.devices_per_node,
        "host_staging_bytes": p.staging_bytes,
        "param_bytes": state.params,
        "opt_bytes": state.opt,
        "working_bytes": working.bytes,
        "attention_impl": working.attention_impl,
        "attention_working_bytes": working.attention,
        "loss_chunk_size": c.trainer.loss_chunk_size,
        "loss_working_bytes": working.loss,
        "untagged_residual_bytes": p.other_bytes,
    }


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
        f"note: offload=none (nothing checkpointed) fits too by the estimate ({fmt_bytes(none.peak_bytes)}) and is "
        f"estimated {100 * (1 - none.time_s / best.time_s):.0f}% faster ({1e3 * none.time_s:.1f} ms): a checkpointed "
        "layer runs its forward again in the backward; train with offload=none"
        + (" (its peak is the estimate's: plan.compile checks the plan's candidates, not it)" if compiled else "")
    )
