"""One training job: composed config -> validate -> XLA flags -> mesh -> sharded init -> compiled step
loop -> metrics.jsonl + summary.json. `train.py` wraps this in @hydra.main; tests call it directly.
"""

import dataclasses
import math
import os
import pathlib
import statistics
import time
from typing import Optional

from omegaconf import DictConfig

from zoo.train.config import ConfigError, TrainConfig, TrainingStopped, XlaConfig, load, to_dict, validate

# The XLA flags this process started JAX with (None: not started by us).
_APPLIED_XLA_FLAGS: Optional[str] = None


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merged_xla_flags(c: XlaConfig, env: Optional[str]) -> str:
    """The environment's XLA_FLAGS plus the group's flags; the group wins where both set one flag."""
    ours = list(c.flags)
    if c.cpu_devices is not None:
        ours.append(f"--xla_force_host_platform_device_count={c.cpu_devices}")
    names = {_flag_name(f) for f in ours}
    kept = [f for f in (env or "").split() if _flag_name(f) not in names]
    return " ".join(kept + ours)


def apply_xla_flags(c: XlaConfig) -> str:
    """Set XLA_FLAGS before JAX starts its backend. Once started, flags cannot change in this process."""
    global _APPLIED_XLA_FLAGS
    from zoo._compat import backends_are_initialized

    if backends_are_initialized():
        current = _APPLIED_XLA_FLAGS if _APPLIED_XLA_FLAGS is not None else os.environ.get("XLA_FLAGS", "")
        wanted = merged_xla_flags(c, current)
        if sorted(wanted.split()) != sorted(current.split()):
            raise ConfigError(
                "xla: JAX already started in this process with other XLA flags; "
                "sweep the xla group with a process-per-job launcher (see README: Sweeps)"
            )
        return current
    flags = merged_xla_flags(c, os.environ.get("XLA_FLAGS"))
    os.environ["XLA_FLAGS"] = flags
    _APPLIED_XLA_FLAGS = flags
    return flags


def prepare(cfg: DictConfig):
    """Everything up to (not including) compilation: typed config, flags, devices, validated plan.
    Bad input raises ConfigError (one line) from here."""
    c = load(cfg)
    flags = apply_xla_flags(c.xla)
    from zoo.train.distributed import initialize

    initialize(c.distributed)  # several processes: join them before JAX starts its backends
    import jax

    from zoo.model import abstract

    devices = jax.devices()
    plan = validate(c, len(devices), abstract(c.model))
    return c, plan, devices, flags


def train(c: TrainConfig, plan, devices, out_dir: pathlib.Path, xla_flags: str = "", overrides=(), echo=print) -> dict:
    import jax

    from zoo.config import count_params
    from zoo.sharding import memory_kinds
    from zoo.train.data import make_data
    from zoo.train.metrics import MetricsWriter, Progress, Throughput, compiled_flops, compiled_memory, device_memory, write_json
    from zoo.train.step import Trainer

    from zoo.sharding import ShardingError
    from zoo.train.checkpoint import Checkpoints

    t_start = time.perf_counter()
    main = jax.process_index() == 0  # process 0 prints and writes metrics and the summary
    if not main:
        echo = _quiet
    trainer = Trainer(c, plan, devices)
    try:
        shard, shards = trainer.data_shard()  # which rows of each batch this process feeds
    except ShardingError as e:
        raise ConfigError(str(e)) from None
    data = make_data(c, shard, shards)  # bad data input: ConfigError, before any compile
    mesh_devices = list(trainer.mesh.devices.flat)
    local_devices = [d for d in mesh_devices if d.process_index == jax.process_index()]
    steps = c.trainer.steps
    processes = f" in {jax.process_count()} processes" if jax.process_count() > 1 else ""
    echo(
        f"model {c.model.family} ({count_params(c.model) / 1e6:.2f}M params, {count_params(c.model, active=True) / 1e6:.2f}M active) "
        f"mesh {plan.mesh.sizes} on {len(mesh_devices)} {mesh_devices[0].platform} device(s){processes}, offload {c.offload.name}, "
        f"batch {c.data.batch_size}x{c.data.seq_len}, {steps} steps"
    )
    echo(kernels_line(c, plan))
    if hasattr(data, "describe"):
        echo(data.describe())
    ckpt = Checkpoints(c, plan, trainer, echo) if c.checkpoint.dir is not None else None
    start = (ckpt.check() if ckpt else None) or 0  # a checkpoint that does not fit: ConfigError, before any compile
    if ckpt:
        echo(f"checkpoints: {ckpt.dir}" + (f", resuming from step {start}" if start else ", none yet: starting from step 0"))
    if start == steps:
        echo(f"checkpoint step {start} is trainer.steps={steps}: nothing left to train; raise trainer.steps to go on")
        summary = {"status": "ok", "overrides": list(overrides), "steps": steps, "start_step": start, "steps_run": 0,
                   "checkpoint": {"dir": str(ckpt.dir), "steps": ckpt.complete_steps()}, "config": to_dict(c)}
        if main:
            write_json(out_dir / "summary.json", summary)
        return summary

    t0 = time.perf_counter()
    state = ckpt.restore(start) if start else trainer.init()
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    tokens = trainer.shard_tokens(data.batch(start))
    t0 = time.perf_counter()
    compiled = trainer.compile(state, tokens)
    compile_s = time.perf_counter() - t0
    mem_compiled = compiled_memory(compiled)
    echo(f"{'restore' if start else 'init'} {init_s:.1f}s, compile {compile_s:.1f}s")

    throughput = Throughput(c.model, c.data.seq_len, c.data.batch_size * c.data.seq_len, len(mesh_devices), c.hardware.peak_flops)
    writer = MetricsWriter(out_dir, c.trainer.tensorboard) if main else None
    progress = Progress(steps, c.trainer.log_every, c.trainer.progress and main)
    losses, times, peak_device = [], [], None
    every = c.checkpoint.every_n_steps
    try:
        for step in range(start, steps):
            if step > start:
                tokens = trainer.shard_tokens(data.batch(step))
            t0 = time.perf_counter()
            state, m = compiled(state, tokens)
            m = jax.device_get(m)  # waits for the step
            dt = time.perf_counter() - t0
            m = {k: (v.tolist() if getattr(v, "ndim", 0) else float(v)) for k, v in m.items()}
            m.update(throughput(dt))
            mem = device_memory(local_devices)
            m["device_bytes_in_use"] = mem["bytes_in_use"] if mem else None
            m["device_peak_bytes"] = mem["peak_bytes_in_use"] if mem else None
            if mem:
                peak_device = max(peak_device or 0, mem["peak_bytes_in_use"])
            losses.append(m["loss"])
            times.append(dt)
            if writer:
                writer.write(step, m)
            progress.update(step, m)
            if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                raise TrainingStopped(_diverged(c, step, m, ckpt))  # this state is not saved
            done = step + 1
            if ckpt and (done % every == 0 or done == steps):
                ckpt.save(done, state)  # returns once the arrays are copied: the next step may donate them
    except KeyboardInterrupt:
        raise TrainingStopped(f"interrupted during step {step + 1}; {_kept(ckpt)}" + ("; run the same command to resume" if ckpt else "")) from None
    finally:
        if writer:
            writer.close()
        if ckpt:
            ckpt.close()  # the save in flight completes, whatever stopped the loop

    kinds = {"params": sorted(memory_kinds(state["params"])), "opt_state": sorted(memory_kinds(state["opt_state"]))}
    timed = times[1:] if len(times) > 1 else times  # the first call also pays one-off dispatch costs
    step_time = statistics.median(timed)
    perf = throughput(step_time)
    estimated = mem_compiled["estimated_peak_bytes"] if mem_compiled else None
    summary = {
        "status": "ok",
        "overrides": list(overrides),
        "model": {"family": c.model.family, "params": count_params(c.model), "active_params": count_params(c.model, active=True)},
        "mesh": plan.mesh.sizes,
        "num_devices": len(mesh_devices),
        "platform": mesh_devices[0].platform,
        "offload": c.offload.name,
        "memory_kinds": kinds,
        "steps": steps,
        "start_step": start,
        "steps_run": len(losses),
        "checkpoint": {"dir": str(ckpt.dir), "steps": ckpt.complete_steps(), "resumed_from": start or None} if ckpt else None,
        "first_loss": losses[0],
        "last_loss": losses[-1],
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
        "model_flops_per_token": throughput.flops_per_token,
        "xla_flops_per_step_per_device": compiled_flops(compiled),
        "hardware": dataclasses.asdict(c.hardware),
        "device_peak_bytes": peak_device,
        "compiled_memory": mem_compiled,
        # What the report plots: the backend's measured peak where it has one, else XLA's estimate.
        "peak_memory_bytes": peak_device if peak_device is not None else estimated,
        "peak_memory_source": "device.memory_stats" if peak_device is not None else "compiled.memory_analysis",
        "kernels": kernels(c, plan),
        "xla_flags": xla_flags,
        "config": to_dict(c),
    }
    if main:
        write_json(out_dir / "summary.json", summary)
    floor = data.floor()
    floor_note = f"floor {floor:.3f}" if floor is not None else f"unigram entropy {data.unigram_entropy():.3f}"
    echo(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({floor_note}); step {1e3 * step_time:.1f} ms, "
        f"{perf['tokens_per_s']:.0f} tok/s, {perf['tflops_per_device']:.4f} TFLOP/s/device, MFU {100 * perf['mfu']:.2f}% "
        f"of {c.hardware.name}{' (nominal)' if c.hardware.nominal else ''}; summary: {out_dir / 'summary.json'}"
    )
    return summary


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
        parts.append(f"routed experts {k['moe']} (model.moe.impl={c.model.moe.impl})")
    parts.append(f"loss over chunks of {k['loss_chunk_size']} positions" if k["loss_chunk_size"] else "loss over the whole logits")
    return "kernels: " + ", ".join(parts)


def _quiet(*args, **kwargs) -> None:
    """Processes other than 0 print nothing (their errors still reach stderr)."""


def _kept(ckpt) -> str:
    """Which checkpoint a stopped run leaves (after the save in flight completes)."""
    if ckpt is None:
        return "checkpointing is off (checkpoint.dir=null)"
    ckpt.wait()
    last = ckpt.latest()
    return f"last good checkpoint: step {last} in {ckpt.dir}" if last is not None else f"no checkpoint in {ckpt.dir} yet"


def _diverged(c: TrainConfig, step: int, m: dict, ckpt) -> str:
    """The one line a non-finite loss stops the run with."""
    kept = _kept(ckpt)
    clip = f"optimizer.grad_clip (now {c.optimizer.grad_clip})" if c.optimizer.grad_clip > 0 else "set optimizer.grad_clip (now off)"
    what = f"loss is {m['loss']}" if not math.isfinite(m["loss"]) else f"gradient norm is {m['grad_norm']} (loss {m['loss']:.4f})"
    return (
        f"step {step + 1}: {what}: training diverged, and this state was not saved; "
        f"lower optimizer.lr (now {c.optimizer.lr:g}) or {clip}; {kept}"
    )
