"""One training job: composed config -> validate -> XLA flags -> mesh -> sharded init -> compiled step
loop -> metrics.jsonl + summary.json. `train.py` wraps this in @hydra.main; tests call it directly.
"""

import dataclasses
import os
import pathlib
import statistics
import time
from typing import Optional

from omegaconf import DictConfig

from zoo.train.config import ConfigError, TrainConfig, XlaConfig, load, to_dict, validate

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
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
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

    t_start = time.perf_counter()
    data = make_data(c, jax.process_index(), jax.process_count())  # bad data input: ConfigError, before any compile
    trainer = Trainer(c, plan, devices)
    mesh_devices = list(trainer.mesh.devices.flat)
    steps = c.trainer.steps
    echo(
        f"model {c.model.family} ({count_params(c.model) / 1e6:.2f}M params, {count_params(c.model, active=True) / 1e6:.2f}M active) "
        f"mesh {plan.mesh.sizes} on {len(mesh_devices)} {mesh_devices[0].platform} device(s), offload {c.offload.name}, "
        f"batch {c.data.batch_size}x{c.data.seq_len}, {steps} steps"
    )
    if hasattr(data, "describe"):
        echo(data.describe())

    t0 = time.perf_counter()
    state = trainer.init()
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    tokens = trainer.shard_tokens(data.batch(0))
    t0 = time.perf_counter()
    compiled = trainer.compile(state, tokens)
    compile_s = time.perf_counter() - t0
    mem_compiled = compiled_memory(compiled)
    echo(f"init {init_s:.1f}s, compile {compile_s:.1f}s")

    throughput = Throughput(c.model, c.data.seq_len, c.data.batch_size * c.data.seq_len, len(mesh_devices), c.hardware.peak_flops)
    writer = MetricsWriter(out_dir, c.trainer.tensorboard)
    progress = Progress(steps, c.trainer.log_every, c.trainer.progress)
    losses, times, peak_device = [], [], None
    try:
        for step in range(steps):
            if step:
                tokens = trainer.shard_tokens(data.batch(step))
            t0 = time.perf_counter()
            state, m = compiled(state, tokens)
            m = jax.device_get(m)  # waits for the step
            dt = time.perf_counter() - t0
            m = {k: (v.tolist() if getattr(v, "ndim", 0) else float(v)) for k, v in m.items()}
            m.update(throughput(dt))
            mem = device_memory(mesh_devices)
            m["device_bytes_in_use"] = mem["bytes_in_use"] if mem else None
            m["device_peak_bytes"] = mem["peak_bytes_in_use"] if mem else None
            if mem:
                peak_device = max(peak_device or 0, mem["peak_bytes_in_use"])
            losses.append(m["loss"])
            times.append(dt)
            writer.write(step, m)
            progress.update(step, m)
    finally:
        writer.close()

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
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "loss_floor": data.floor(),
        "init_s": init_s,
        "compile_s": compile_s,
        "wall_s": time.perf_counter() - t_start,
        "step_time_s": step_time,
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
        "xla_flags": xla_flags,
        "config": to_dict(c),
    }
    write_json(out_dir / "summary.json", summary)
    floor = data.floor()
    floor_note = f"floor {floor:.3f}" if floor is not None else f"unigram entropy {data.unigram_entropy():.3f}"
    echo(
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f} ({floor_note}); step {1e3 * step_time:.1f} ms, "
        f"{perf['tokens_per_s']:.0f} tok/s, {perf['tflops_per_device']:.4f} TFLOP/s/device, MFU {100 * perf['mfu']:.2f}% "
        f"of {c.hardware.name}{' (nominal)' if c.hardware.nominal else ''}; summary: {out_dir / 'summary.json'}"
    )
    return summary
