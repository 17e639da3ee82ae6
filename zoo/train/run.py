"""One training job: composed config -> validate -> XLA flags -> mesh -> sharded init -> compiled step
loop -> metrics.jsonl + summary.json. `train.py` wraps this in @hydra.main; tests call it directly.
"""

import dataclasses
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Optional

from omegaconf import DictConfig

from zoo import backend, families
from zoo._compat import backends_are_initialized
from zoo.counts import count_params
from zoo.hf.pretrained import describe as describe_pretrained
from zoo.lora import resolved as resolved_lora
from zoo.model import abstract
from zoo.offload import OffloadConfig, parse_ranges, range_configs
from zoo.sharding import ShardingError, memory_kinds
from zoo.train import huge_pages
from zoo.train.batches import make_data
from zoo.train.config_checks import exchange_rounds_block
from zoo.train.checkpoint import Checkpoints, all_processes_agree
from zoo.train.machine_fit import check_fits, disk_full_stops, machine_notes, started_devices
from zoo.train.run_lock import probe_writable
from zoo.train.distributed import initialize
from zoo.train.evaluate import attach_data
from zoo.train import run_dir
from zoo.train.metrics import (
    compiled_flops,
    compiled_memory,
    write_json,
)
from zoo.train.run_config import (
    ConfigError,
    HardwareConfig,
    TrainConfig,
    RunInterrupted,
    TrainingStopped,
    XlaConfig,
    auto_hardware,
    check_hardware_platform,
    load,
    to_dict,
    validate,
)
from zoo.train.step import Trainer
from zoo.train.step_loop import Batches, Diverged, Dispatched, StepLog, StepLoop, moe_layer_indices  # noqa: F401
from zoo.train.stop import EXIT_REQUEUE, StopSignals, ctrl_c_served, raise_if_interrupted, set_phase
from zoo.train.xla_flags import GPU_HOST_OFFLOAD_FLAG, GPU_HOST_OFFLOAD_FLAGS, known_flag

# The XLA flags this process started JAX with (None: not started by us).
_APPLIED_XLA_FLAGS: Optional[str] = None


# XLA:CPU's choice of ops for its YNNPACK library (xla.cpu_ynn_fusions); a CPU debug option, ignored elsewhere.
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
# The jaxlib releases it was measured with. XLA refuses to start on a flag it does not know, and an
# experimental flag can go in any release: elsewhere the default is left out (xla.flags still sets it).
YNN_FLAG_JAXLIBS = ("0.10.",)


def _ynn_flag_known() -> bool:
    import importlib.metadata

    try:
        return importlib.metadata.version("jaxlib").startswith(YNN_FLAG_JAXLIBS)
    except importlib.metadata.PackageNotFoundError:
        return False


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged_xla_flags(
    c: XlaConfig, env: Optional[str], host_offload: bool = False, scheduler: bool = True, platform: Optional[str] = None
) -> str:
    """The environment's XLA_FLAGS plus the group's flags; the group wins where both set one flag.
    `host_offload` (some state or tag lives in pinned host memory) adds XLA:GPU's host-offloading
    switch and its latency hiding scheduler (`GPU_HOST_OFFLOAD_FLAGS`), each unless the environment
    or xla.flags set it; other backends ignore them. `scheduler=False` adds the switch alone: bench/gpu.py's
    groups, whose default group is the baseline without the scheduler. `platform` (what JAX will
    start on, `zoo.backend.expected_platform`): on a TPU neither the CPU's defaults (xla.cpu_*) nor the
    GPU's switches are added; None adds them all (no backend reads another's)."""
    ours = list(c.flags)
    cpu, gpu = platform in (None, "cpu"), platform in (None, "cpu", "gpu")
    if c.cpu_devices is not None and cpu:
        ours.append(f"--xla_force_host_platform_device_count={c.cpu_devices}")
    names = {_flag_name(f) for f in ours}
    kept = [f for f in (env or "").split() if _flag_name(f) not in names]
    named = names | {_flag_name(f) for f in kept}
    if c.cpu_ynn_fusions is not None and YNN_FLAG not in named and _ynn_flag_known() and cpu:
        ours.append(f"{YNN_FLAG}={c.cpu_ynn_fusions}")  # a default: the environment or xla.flags win
    for flag in (GPU_HOST_OFFLOAD_FLAGS if scheduler else (GPU_HOST_OFFLOAD_FLAG,)) if host_offload and gpu else ():
        if flag not in named and known_flag(flag) is not False:
            ours.append(f"{flag}=true")
    return " ".join(kept + ours)


def merged_tpu_flags(c: XlaConfig, env: Optional[str]) -> str:
    """The environment's LIBTPU_INIT_ARGS plus xla.tpu_flags; the group wins where both set one flag."""
    names = {_flag_name(f) for f in c.tpu_flags}
    return " ".join([f for f in (env or "").split() if _flag_name(f) not in names] + list(c.tpu_flags))


def dropless_note(family: str, impl: str) -> Optional[str]:
    """One line for a run of the capacity kernel (`impl`: the kernel the run resolved, `Plan.moe_impl`)
    on a family trained dropless (not an error: a capacity run is a legitimate, cheaper approximation),
    else None."""
    # The family's own flag (zoo.families: DeepSeek-V3, whose report says "no token-dropping",
    # Qwen3-MoE, Mixtral, GPT-OSS).
    if impl != "capacity" or family not in families.names() or not families.get(family).dropless:
        return None
    return (
        f"model.moe.impl=capacity: {family} is trained dropless; this run drops the assignments past each expert's "
        f"capacity (counted as `dropped`); model.moe.impl=ragged routes every token"
    )


def uses_host_memory(o: OffloadConfig) -> bool:
    """Whether the policy keeps anything in pinned host memory: parameters, optimizer state or an offloaded tag."""
    actions = [o.actions(), *(r.actions() for _, r in range_configs(o))]
    return "pinned_host" in (o.params, o.opt_state) or any("offload" in a.values() for a in actions)


def host_memory_note(o: OffloadConfig, platform: str) -> Optional[str]:
    """The line for a policy that keeps anything in pinned host memory on a CPU run, where that changes
    nothing: XLA:CPU ignores memory kinds inside a program, and a CPU's device and host memories are the
    same RAM (docs/offload.md); None elsewhere."""
    if platform != "cpu" or not uses_host_memory(o):
        return None
    return (
        f"offload {o.describe()}: a CPU's pinned host memory is the same RAM as its device memory (XLA:CPU "
        "ignores memory kinds inside a program), so what goes to host saves no memory here; the remat choices "
        "still apply (python -m zoo.tools.inspect_step shows the placement a GPU or TPU gets)"
    )


def apply_xla_flags(c: XlaConfig, host_offload: bool = False) -> str:
    """Set XLA_FLAGS before JAX starts its backend. Once started, flags cannot change in this process."""
    global _APPLIED_XLA_FLAGS
    if backends_are_initialized():
        current = _APPLIED_XLA_FLAGS if _APPLIED_XLA_FLAGS is not None else os.environ.get("XLA_FLAGS", "")
        # xla.cpu_ynn_fusions is a CPU speed default, not a request that must hold: a process that
        # started JAX without it (a test, a notebook) runs the job with XLA's own choice.
        # Nor are the GPU host-offloading switches, which no CPU program depends on.
        wanted = merged_xla_flags(dataclasses.replace(c, cpu_ynn_fusions=None), current)
        automatic = set(GPU_HOST_OFFLOAD_FLAGS)
        if sorted(f for f in wanted.split() if _flag_name(f) not in automatic) != sorted(
            f for f in current.split() if _flag_name(f) not in automatic
        ):
            raise ConfigError(
                "xla: JAX already started in this process with other XLA flags; "
                "sweep the xla group with a process-per-job launcher (docs/training.md, 'Sweeps')"
            )
        return current
    platform = backend.expected_platform()
    flags = merged_xla_flags(c, os.environ.get("XLA_FLAGS"), host_offload, platform=platform)
    os.environ["XLA_FLAGS"] = flags
    _APPLIED_XLA_FLAGS = flags
    # libtpu reads its flags once, when JAX's backends start, also on a machine without a chip, where it
    # then compiles for one ahead of time (zoo.tools.plan's plan.compile): set them for it there too.
    if c.tpu_flags and (platform == "tpu" or backend.libtpu_installed()):
        os.environ["LIBTPU_INIT_ARGS"] = merged_tpu_flags(c, os.environ.get("LIBTPU_INIT_ARGS"))
        if platform == "tpu":
            return f"{flags} LIBTPU_INIT_ARGS={os.environ['LIBTPU_INIT_ARGS']}".strip()
    return flags


# XLA:GPU's pinned-host pool (one per process; host-resident state and offloaded activations live in it)
# is capped at this many GiB, 64 unless the variable is set, and read once when the GPU client starts.
GPU_HOST_POOL_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"


def gpu_host_pool_gib(offload: OffloadConfig, hardware: HardwareConfig) -> Optional[int]:
    """The pinned-host pool cap for a run that keeps something on host: the host memory the hardware
    profile gives a node (hardware.host_bytes_per_device x devices_per_node, the budget zoo.tools.plan holds
    a plan to), so a plan that fits its host budget is not stopped by XLA's 64 GiB default. None: nothing
    on host, or a profile without a host budget (hardware=cpu), where XLA's default stays."""
    if not uses_host_memory(offload) or hardware.host_bytes_per_device <= 0:
        return None
    return max(1, int(hardware.host_bytes_per_device * hardware.devices_per_node // 2**30))


def apply_gpu_host_pool(c: TrainConfig) -> Optional[str]:
    """Set the pool's cap before JAX starts unless the environment sets it; the value in effect
    (None: XLA's default)."""
    return set_gpu_host_pool(gpu_host_pool_gib(c.offload, c.hardware), os.environ, started=backends_are_initialized())


def set_gpu_host_pool(gib: Optional[int], environ, *, started: bool) -> Optional[str]:
    """Put `gib` in `environ` unless it holds a cap already (the user's wins) or JAX has started (too
    late: XLA read it); the value in effect."""
    if gib is not None and GPU_HOST_POOL_ENV not in environ and not started:
        environ[GPU_HOST_POOL_ENV] = str(gib)
    return environ.get(GPU_HOST_POOL_ENV)


def start_jax(c: TrainConfig) -> str:
    """What has to happen before anything starts JAX's backends (`jax.devices()`,
    `jax.default_backend()`): the XLA flags, then joining the other processes. Calling it again with
    the same config does nothing more. Returns the XLA flags."""
    flags = apply_xla_flags(c.xla, host_offload=uses_host_memory(c.offload))
    apply_gpu_host_pool(c)
    initialize(c.distributed)
    return flags


def prepare(cfg: DictConfig):
    """Everything up to (not including) compilation: typed config, flags, devices, validated plan.
    Bad input raises ConfigError (one line) from here."""
    c = load(cfg)
    flags = start_jax(c)
    devices = started_devices()
    for note in machine_notes(c, devices):  # refuses device ids the machine lacks
        print(f"note: {note}", flush=True)
    c.hardware, note = auto_hardware(c.hardware, devices[0])
    if note:
        print(f"note: {note}", flush=True)
    model = abstract(c.model)
    c.lora = resolved_lora(model, c.lora)  # lora.targets=[all]: the model's projections, by name
    plan = validate(c, len(devices), model)
    return c, plan, devices, flags


def train(c: TrainConfig, plan, devices, out_dir: pathlib.Path, xla_flags: str = "", overrides=(), echo=print) -> dict:
    import jax

    check_hardware_platform(c.hardware, devices[0].platform)  # MFU is read against the profile
    check_fits(c, count_params(c.model), plan.microbatch, devices, jax.process_count())  # before any init
    # From here on SIGTERM / SIGUSR1 stop the run after a step, with a checkpoint (zoo.train.stop).
    with StopSignals(jax.process_count()) as stop, disk_full_stops(out_dir):
        return _train(c, plan, devices, out_dir, xla_flags, overrides, echo, stop)


def _train(c: TrainConfig, plan, devices, out_dir: pathlib.Path, xla_flags: str, overrides, echo, stop) -> dict:
    import jax

    t_start = time.perf_counter()
    main = jax.process_index() == 0  # process 0 prints and writes metrics and the summary
    if not main:
        echo = _quiet
    else:
        probe_writable(out_dir, "hydra.run.dir")  # metrics and the summary go there
    trainer = Trainer(c, plan, devices)
    try:
        shard, shards = trainer.data_shard()  # which rows of each batch this process feeds
    except ShardingError as e:
        raise ConfigError(str(e)) from None
    data = make_data(c, shard, shards)  # bad data input: ConfigError, before any compile
    evaluator = attach_data(c, trainer, data)  # the held-out loss (None without an eval split)
    mesh_devices = list(trainer.mesh.devices.flat)
    steps = c.trainer.steps
    _announce(c, plan, trainer, data, evaluator, mesh_devices, overrides, echo)
    ckpt = Checkpoints(c, plan, trainer, echo) if c.checkpoint.dir is not None else None
    try:
        if ckpt:
            ckpt.open()  # writable, and ours alone: else one line, before any compile
        start = (ckpt.check() if ckpt else None) or 0  # a checkpoint that does not fit: ConfigError, before any compile
        taken = (
            run_dir.taken_line(out_dir, start, overrides) if main else None
        )  # it would replace an earlier run's record
        if not all_processes_agree(taken is None):
            raise run_dir.RunDirTaken(
                taken or "hydra.run.dir: process 0 refused the run directory (see its error line)"
            )
        if start == steps:
            echo(
                f"checkpoints: {ckpt.dir}, step {start} is trainer.steps={steps}: nothing left to train; raise "
                "trainer.steps to go on"
            )
            return _nothing_left(c, ckpt, start, out_dir, overrides, main)
        if ckpt and not start:
            echo(f"checkpoints: {ckpt.dir}, none yet: starting from step 0")

        t0 = time.perf_counter()
        set_phase(
            f"{'restoring step ' + str(start) if start else 'initialising the parameters'}, before any step ran",
            "nothing was trained or saved; run the same command again",
        )
        state, start = initial_state(trainer, ckpt, start)
        jax.block_until_ready(state)
        init_s = time.perf_counter() - t0
        if ckpt and start:
            set_aside = (
                f" (unreadable steps {', '.join(str(s) for s, _ in ckpt.skipped)} renamed <step>.unreadable)"
                if ckpt.skipped
                else ""
            )
            echo(f"checkpoints: {ckpt.dir}, resuming from step {start}{set_aside}")
        batches = Batches(data, trainer)
        t0 = time.perf_counter()
        set_phase(
            f"compiling the training step, before step {start + 1}",
            "nothing was trained or saved; run the same command again",
        )
        compiled = trainer.compile(state, batches.prefetch(start))
        compile_s = time.perf_counter() - t0
        mem_compiled = compiled_memory(compiled)
        echo(f"{'restore' if start else 'init'} {init_s:.1f}s, compile {compile_s:.1f}s")

        local_devices = [d for d in mesh_devices if d.process_index == jax.process_index()]
        log = StepLog(c, out_dir if main else None, start, len(mesh_devices), local_devices, main)
        loop = StepLoop(compiled, batches, log, ckpt, stop, steps, c.checkpoint.every_n_steps, evaluator=evaluator)
        raise_if_interrupted()  # a Ctrl-C Python swallowed while compiling ends the run as one during the compile
        try:
            state = loop.run(state, start)
        except KeyboardInterrupt:
            raise RunInterrupted(
                f"interrupted during step {log.completed + 1}; {_kept(ckpt)}"
                + ("; run the same command to resume" if ckpt else "")
            ) from None
        except Diverged as e:
            raise TrainingStopped(_diverged(c, e.step, e.metrics, ckpt)) from None  # this state is not saved
        finally:
            log.close()
            if ckpt:
                ckpt.close()  # the save in flight completes, whatever stopped the loop
        if loop.stopped:
            _stop_for_requeue(c, stop, log, ckpt, start, out_dir if main else None, overrides)
    finally:
        if ckpt:
            ckpt.release()

    summary = _summary(c, plan, trainer, state, data, log, ckpt, start, mesh_devices, init_s, compile_s, mem_compiled,
                       compiled, t_start, xla_flags, overrides, evaluator)  # fmt: skip
    if main:
        write_summary(out_dir, summary)
    echo(_last_line(c, data, log, evaluator, summary, out_dir))
    return summary


def _announce(c: TrainConfig, plan, trainer, data, evaluator, mesh_devices, overrides, echo) -> None:
    """The run's opening lines: the model, mesh, policy and batch, the kernels, and each choice made for it."""
    import jax

    steps = c.trainer.steps
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    echo(
        f"model {c.model.family} ({count_params(c.model) / 1e6:.2f}M params, "
        f"{count_params(c.model, active=True) / 1e6:.2f}M active) "
        f"mesh {plan.mesh.sizes} on {len(mesh_devices)} {mesh_devices[0].platform} device(s){processes}, offload "
        f"{offload_label(c, overrides)}, "
        f"batch {c.data.batch_size}x{c.data.seq_len}, {steps} steps"
    )
    echo(kernels_line(c, plan))
    note = host_memory_note(c.offload, mesh_devices[0].platform)
    if note:
        echo(f"note: {note}")
    if plan.moe_impl is not None:
        note = dropless_note(c.model.family, plan.moe_impl)
        if note:
            echo(f"note: {note}")
    if trainer.lora is not None:
        echo(lora_line(c, trainer))
    echo(backend.choices(trainer.mesh.devices.flat[0].platform).describe())
    optimize, why = trainer.cpu_optimization()
    if optimize is not None:
        echo(
            "XLA:CPU compile: LLVM optimisations "
            f"{'on (slower compile, faster steps)' if optimize else 'off (faster compile, slower steps)'}; {why}"
        )
        echo(huge_pages.describe())
    if c.pretrained is not None:
        for line in describe_pretrained(c.pretrained, c.model):
            echo(line)
    if hasattr(data, "describe"):
        echo(data.describe())
    if evaluator:
        echo(evaluator.describe())


def _nothing_left(c: TrainConfig, ckpt, start: int, out_dir: pathlib.Path, overrides, main: bool) -> dict:
    """The summary of a run whose checkpoint is already at trainer.steps: nothing to train."""
    summary = {
        "status": "ok",
        "overrides": list(overrides),
        "steps": c.trainer.steps,
        "start_step": start,
        "steps_run": 0,
        "checkpoint": {"dir": str(ckpt.dir), "steps": ckpt.complete_steps()},
        "config": to_dict(c),
    }
    if main and not run_dir.finished(out_dir):  # the summary of the run that trained those steps stays
        write_summary(out_dir, summary)
    return summary


def _last_line(c: TrainConfig, data, log, evaluator, summary: dict, out_dir: pathlib.Path) -> str:
    """The run's closing line: the loss against the data's floor, the held-out loss, the step's speed."""
    floor = data.floor()
    floor_note = f"floor {floor:.3f}" if floor is not None else f"unigram entropy {data.unigram_entropy():.3f}"
    perf = log.throughput(summary["step_time_s"])
    ev = evaluator.last if evaluator else None
    eval_note = f", eval loss {ev['eval_loss']:.4f} (perplexity {ev['eval_perplexity']:.2f})" if ev else ""
    return (
        f"loss {log.losses[0]:.4f} -> {log.losses[-1]:.4f} ({floor_note}){eval_note}; step "
        f"{1e3 * summary['step_time_s']:.1f} ms, "
        f"{perf['tokens_per_s']:.0f} tok/s, {perf['tflops_per_device']:.4f} TFLOP/s/device, MFU "
        f"{100 * perf['mfu']:.2f}% "
        f"of {c.hardware.name}{' (nominal)' if c.hardware.nominal else ''}; summary: {out_dir / 'summary.json'}"
    )


def lora_line(c: TrainConfig, trainer) -> str:
    """Trainable parameters and optimizer-state bytes with the adapters against full fine-tuning."""
    import jax

    def nbytes(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    full_opt = nbytes(jax.eval_shape(trainer.tx.init, trainer.abstract_base))
    lora_opt = nbytes(jax.eval_shape(trainer.tx.init, trainer.abstract_params))
    trainable = sum(x.size for x in jax.tree.leaves(trainer.abstract_params))
    total = sum(x.size for x in jax.tree.leaves(trainer.abstract_base))
    where = "pinned host memory, streamed per layer" if trainer.params_on_host else "device memory"
    dropout = f", dropout {c.lora.dropout:g} (adapters unmerged while training)" if c.lora.dropout else ""
    return (
        f"lora: rank {c.lora.rank}, alpha {c.lora.alpha:g}{dropout} "
        f"on {','.join(c.lora.targets)}; trainable {trainable:,} of {total:,} "
        f"parameters ({100 * trainable / total:.2f}%), optimizer state {lora_opt / 2**20:.2f} MiB vs "
        f"{full_opt / 2**20:.2f} MiB "
        f"full fine-tuning; frozen base in {where}"
    )


def offload_label(c: TrainConfig, overrides=()) -> str:
    """The offload presets the run composed (`offload=[a,b]`: `a+b`; the merged config keeps only the
    first one's name, and Hydra records no choice for a list), else the config's name; then the layer
    ranges' presets (`, layers 0-3 llama_qkv_offload`)."""
    given = [o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == "offload" and "=" in o]
    names = [n.strip() for n in given[-1].strip("[]").split(",") if n.strip()] if given else []
    label = "+".join(names) if len(names) > 1 else c.offload.name
    return ", ".join([label, *(f"layers {r.key} {r.preset}" for r in parse_ranges(c.offload.ranges))])


def initial_state(trainer, ckpt, start: int):
    """`(state, start)`: the checkpoint's state (the newest intact one from `start` down), or a fresh
    initialisation when there is none."""
    if start:
        return ckpt.restore_newest(start)[::-1]
    return trainer.init(), 0


def write_summary(out_dir: pathlib.Path, summary: dict) -> None:
    write_json(out_dir / "summary.json", summary)


def _stop_for_requeue(
    c: TrainConfig, stop, log: StepLog, ckpt, start: int, out_dir: Optional[pathlib.Path], overrides
) -> None:
    """After a stop signal (the last completed step saved, the save complete): one line naming the
    step and the checkpoint, the summary, the handler that was there before ours (submitit's
    requeues), and the exit code a requeue script reads (zoo.train.stop.EXIT_REQUEUE)."""
    done = log.completed
    # XLA cannot be interrupted mid-compile: a signal sent while it compiles is acted on when it ends.
    when = (
        f"after step {done}"
        if done > start
        else f"before step {done + 1} (a signal during compilation is acted on once it ends)"
    )
    if ckpt is None:
        raise TrainingStopped(
            f"stopped by {stop.received} {when}; checkpointing is off (checkpoint.dir=null), so nothing was "
            "saved: set checkpoint.dir for a run that can be stopped and resumed"
        )
    last = ckpt.latest()
    kept = f"checkpoint step {last} in {ckpt.dir}" if last is not None else f"no checkpoint in {ckpt.dir} yet"
    line = f"stopped by {stop.received} {when}: {kept}; run the same command to resume (exit code {EXIT_REQUEUE})"
    if out_dir is not None:
        summary = {
            "status": "stopped",
            "signal": stop.received,
            "overrides": list(overrides),
            "steps": c.trainer.steps,
            "start_step": start,
            "steps_run": done - start,
            "last_step": done,
            "exit_code": EXIT_REQUEUE,
            "checkpoint": {"dir": str(ckpt.dir), "steps": ckpt.complete_steps()},
            "config": to_dict(c),
        }
        write_summary(out_dir, summary)
        print(line, file=sys.stderr, flush=True)
    stop.chain()
    raise SystemExit(EXIT_REQUEUE)


def _summary(
    c: TrainConfig,
    plan,
    trainer,
    state,
    data,
    log: StepLog,
    ckpt,
    start,
    mesh_devices,
    init_s,
    compile_s,
    mem_compiled,
    compiled,
    t_start,
    xla_flags,
    overrides,
    evaluator=None,
) -> dict:
    kinds = {"params": sorted(memory_kinds(state["params"])), "opt_state": sorted(memory_kinds(state["opt_state"]))}
    if "base" in state:  # LoRA's frozen base
        kinds["base"] = sorted(memory_kinds(state["base"]))
    timed = log.times[1:] if len(log.times) > 1 else log.times  # the first call also pays one-off dispatch costs
    step_time = statistics.median(timed)
    perf = log.throughput(step_time)
    estimated = mem_compiled["estimated_peak_bytes"] if mem_compiled else None
    return {
        "status": "ok",
        "overrides": list(overrides),
        "model": {
            "family": c.model.family,
            "params": count_params(c.model),
            "active_params": count_params(c.model, active=True),
        },
        "mesh": plan.mesh.sizes,
        "num_devices": len(mesh_devices),
        "platform": mesh_devices[0].platform,
        "offload": c.offload.name,
        "offload_ranges": dict(c.offload.ranges),  # layer range -> preset (offload.ranges); {}: one policy
        "memory_kinds": kinds,
        "steps": c.trainer.steps,
        "start_step": start,
        "steps_run": len(log.losses),
        "checkpoint": {"dir": str(ckpt.dir), "steps": ckpt.complete_steps(), "resumed_from": start or None}
        if ckpt
        else None,
        "first_loss": log.losses[0],
        "last_loss": log.losses[-1],
        "eval": evaluator.last if evaluator else None,
        "loss_floor": data.floor(),
        "init_s": init_s,
        "compile_s": compile_s,
        "wall_s": time.perf_counter() - t_start,
        "step_time_s": step_time,
        # The spread of the timed steps (all but the first), so a report can tell noise from a difference.
        "step_time_quantiles_s": step_quantiles(timed),
        "timed_steps": len(timed),
        "tokens_per_s": perf["tokens_per_s"],
        "tflops_per_device": perf["tflops_per_device"],
        "mfu": perf["mfu"],
        "model_flops_per_token": log.throughput.flops_per_token,
        "xla_flops_per_step_per_device": compiled_flops(compiled),
        "hardware": dataclasses.asdict(c.hardware),
        "device_peak_bytes": log.peak_device,
        "compiled_memory": mem_compiled,
        # What the report plots: the larger of the runtime's high-water mark and XLA's estimate of the
        # step's peak. A TPU's runtime counts the buffers it hands out (parameters, state, batches),
        # not a program's temporaries: llama_1b's 4-layer runs all reported 6.1 GB there, XLA 12-18 GB.
        **peak_memory(log.peak_device, estimated),
        "kernels": kernels(c, plan),
        # The model layer of each row of metrics.jsonl's per-MoE-layer lists (zoo.tools.report labels by it).
        "moe_layers": moe_layer_indices(c),
        "xla_flags": xla_flags,
        "gpu_host_pool_gib": os.environ.get(
            GPU_HOST_POOL_ENV
        ),  # XLA:GPU's pinned-host cap (null: XLA's 64 GiB default)
        "config": to_dict(c),
    }


def peak_memory(runtime: Optional[int], compiled: Optional[int]) -> dict:
    """summary.json's `peak_memory_bytes` and where it comes from: the larger of the runtime's
    high-water mark (device.memory_stats) and XLA's estimate (compiled.memory_analysis)."""
    known = {
        k: v for k, v in (("device.memory_stats", runtime), ("compiled.memory_analysis", compiled)) if v is not None
    }
    if not known:
        return {"peak_memory_bytes": None, "peak_memory_source": None}
    source = max(known, key=known.get)
    return {"peak_memory_bytes": known[source], "peak_memory_source": source}


def step_quantiles(times: list[float]) -> dict:
    """min, p25, median, p75, max of the step times (seconds)."""
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [times[0]] * 3
    return {"min": min(times), "p25": q[0], "median": q[1], "p75": q[2], "max": max(times)}


def kernels(c: TrainConfig, plan) -> dict:
    """The kernels this run uses (what `auto` resolved to on this backend) and the loss chunking."""
    return {
        "attention": plan.attention_impl,
        "moe": plan.moe_impl,
        "loss_chunk_size": c.trainer.loss_chunk_size or None,
    }


def kernels_line(c: TrainConfig, plan) -> str:
    k = kernels(c, plan)
    parts = [f"attention {k['attention']} (model.attention_impl={c.model.attention_impl})"]
    if k["moe"] is not None:
        exchange = ""
        block = exchange_rounds_block(c, plan.mesh.sizes, plan.microbatch)
        if block is not None:
            exchange = (
                f", exchanged over the expert axis in rounds of {block} rows per device and shard "
                f"(model.moe.exchange_factor={c.model.moe.exchange_factor:g})"
            )
        parts.append(f"routed experts {k['moe']} (model.moe.impl={c.model.moe.impl}){exchange}")
    parts.append(
        f"loss over chunks of {k['loss_chunk_size']} positions"
        if k["loss_chunk_size"]
        else "loss over the whole logits"
    )
    return "kernels: " + ", ".join(parts)


def _quiet(*args, **kwargs) -> None:
    """Processes other than 0 print nothing (their errors still reach stderr)."""


def _kept(ckpt) -> str:
    """Which checkpoint a stopped run leaves (after the save in flight completes)."""
    if ckpt is None:
        return "checkpointing is off (checkpoint.dir=null)"
    last = ckpt.latest()
    # The run is stopping, which serves a Ctrl-C noted so far; only another one cuts this wait short.
    ctrl_c_served()
    set_phase(
        "waiting for the checkpoint save in flight, after a first Ctrl-C",
        f"the steps saved before it are intact (last: {last} in {ckpt.dir}); a save cut short is left as a temporary "
        "directory no resume reads; run the same command to resume"
        if last is not None
        else f"no checkpoint in {ckpt.dir} yet",
    )
    ckpt.wait()
    last = ckpt.latest()
    return (
        f"last good checkpoint: step {last} in {ckpt.dir}" if last is not None else f"no checkpoint in {ckpt.dir} yet"
    )


def _diverged(c: TrainConfig, step: int, m: dict, ckpt) -> str:
    """The one line a non-finite loss stops the run with."""
    kept = _kept(ckpt)
    clip = (
        f"optimizer.grad_clip (now {c.optimizer.grad_clip})"
        if c.optimizer.grad_clip > 0
        else "set optimizer.grad_clip (now off)"
    )
    what = (
        f"loss is {m['loss']}"
        if not math.isfinite(m["loss"])
        else f"gradient norm is {m['grad_norm']} (loss {m['loss']:.4f})"
    )
    return (
        f"step {step + 1}: {what}: training diverged, and this state was not saved; "
        f"lower optimizer.lr (now {c.optimizer.lr:g}) or {clip}; {kept}"
    )
