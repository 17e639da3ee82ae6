"""Whether a training run fits this machine, judged from its config before anything is initialised:
a backend JAX_PLATFORMS names that cannot start here, device ids the machine lacks, XLA flags of
another platform's compiler (a note: they change nothing), and a model whose weights, gradients,
AdamW moments and layer inputs outgrow every byte the machine has (its devices' memory and its host
memory together), which would otherwise spend minutes initialising, or compiling, before it failed.
That last is a lower bound, not the planner's estimate (`python -m zoo.tools.plan` says what a step
holds and where): what is refused here cannot run under any offload policy.
"""

import contextlib
import errno
import os
import pathlib
from typing import Optional, Union

import numpy as np

from zoo.errors import ConfigError
from zoo.train.run_config import TrainingStopped
from zoo.train.xla_flags import flag_name


def host_memory_bytes() -> Optional[int]:
    """The machine's physical memory (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory_bytes(device) -> int:
    """One accelerator's memory as its runtime reports it (0 on a CPU, which shares the host's)."""
    if device.platform == "cpu":
        return 0
    try:
        return int((device.memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # noqa: BLE001 - a runtime without memory stats
        return 0


def _gb(n: Union[int, float]) -> str:
    return f"{n / 1e9:.1f} GB"


def needed_bytes(c, params: int, microbatch: int) -> dict:
    """The least a training step of `c` holds, by what holds it: the weights (in model.param_dtype);
    with every parameter training, their gradients and AdamW's two float32 moments; each layer's input
    (what even full rematerialisation keeps for the backward) for one microbatch."""
    m = c.model
    weights = params * np.dtype(m.param_dtype).itemsize
    training = 0 if c.lora.enabled else weights + 2 * 4 * params
    inputs = m.num_layers * microbatch * c.data.seq_len * m.hidden_size * np.dtype(m.compute_dtype).itemsize
    return {"weights": weights, "gradients and AdamW moments": training, "layer inputs": inputs}


def check_fits(c, params: int, microbatch: int, devices, processes: int = 1) -> None:
    """ConfigError when the run's least memory exceeds the machine's, devices and host together (the
    host memory of each of `processes` hosts taken as this one's)."""
    host = host_memory_bytes()
    if host is None:
        return
    host *= processes
    accelerators = sum(device_memory_bytes(d) for d in devices)
    need = needed_bytes(c, params, microbatch)
    total = sum(need.values())
    if total <= host + accelerators:
        return
    parts = ", ".join(f"{what} {_gb(b)}" for what, b in need.items() if b >= 5e7)
    has = (
        f"{_gb(host)} of host memory, which its {len(devices)} CPU device(s) share"
        if not accelerators
        else f"{_gb(accelerators)} on {len(devices)} {devices[0].platform} device(s) and {_gb(host)} of host memory"
    )
    raise ConfigError(
        f"model: training {params / 1e9:.2f}B parameters needs at least {_gb(total)} ({parts}), and this machine has "
        f"{has}; choose a smaller model (model.num_layers={c.model.num_layers}, model.hidden_size="
        f"{c.model.hidden_size}), LoRA (lora=default), or a machine with more memory"
    )


def started_devices() -> list:
    """`jax.devices()`, or one line when JAX_PLATFORMS names a backend this machine cannot start (JAX
    raises a RuntimeError for a TPU without libtpu, an AssertionError for CUDA without its plugin)."""
    import jax

    try:
        return jax.devices()
    except (RuntimeError, AssertionError) as e:
        wanted = os.environ.get("JAX_PLATFORMS", "").strip()
        if not wanted:
            raise
        why = str(e).split(" (set JAX_PLATFORMS")[0].strip() or "its plugin is not installed"
        raise ConfigError(
            f"JAX_PLATFORMS: {wanted!r} in the environment names a backend this machine cannot start ({why}); unset "
            "JAX_PLATFORMS (JAX then takes the best one here), or install that backend's jax plugin"
        ) from None


def check_local_device_ids(c, devices) -> None:
    """distributed.local_device_ids naming a device this machine lacks, or given to a single process
    (which reads it nowhere): one line."""
    import jax

    wanted = c.distributed.local_device_ids
    if not wanted:
        return
    if jax.process_count() == 1:
        raise ConfigError(
            f"distributed.local_device_ids: {list(wanted)} picks the devices of one process of a multi-process run, "
            "and this run is one process, which would ignore it; drop it (mesh.devices=<n> uses fewer devices)"
        )
    local = sorted(d.local_hardware_id for d in jax.local_devices() if d.local_hardware_id is not None)
    missing = [i for i in wanted if i not in local]
    if missing:
        raise ConfigError(
            f"distributed.local_device_ids: this machine has no device {missing[0]} (its devices: "
            f"{', '.join(map(str, local))}); give ids of these, or null for all"
        )


def other_platform_flags_note(c, platform: str) -> Optional[str]:
    """One line for an xla group whose flags are another platform's compiler's (xla=gpu_overlap, or
    xla=tpu_host_offload, on a CPU): they change nothing here; None where none are."""
    gpu = [flag_name(f) for f in c.flags if flag_name(f).startswith("--xla_gpu_")]
    if platform != "gpu" and gpu:
        more = f" and {len(gpu) - 1} more" if len(gpu) > 1 else ""
        return (
            f"xla={c.name}: its flags ({gpu[0]}{more}) are XLA:GPU's, and this run's devices are {platform}s, so they "
            "change nothing here (the same run as xla=default)"
        )
    if platform != "tpu" and c.tpu_flags:
        return (
            f"xla={c.name}: its xla.tpu_flags go to a TPU's compiler (libtpu), and this run's devices are {platform}s, "
            "so they change nothing here (the same run as xla=default)"
        )
    return None


# The xla group's CPU-only keys and their defaults (conf/xla/*.yaml): XLA:CPU's device count, LLVM level
# and YNNPACK fusions, which no GPU or TPU compiler reads.
CPU_ONLY_KEYS = {"cpu_devices": None, "cpu_fast_compile": "auto", "cpu_ynn_fusions": "dot"}


def cpu_keys_note(c, platform: str) -> Optional[str]:
    """One line for xla's CPU-only keys set away from their defaults on a GPU or TPU run: they change
    nothing there; None on a CPU, or where none is set."""
    given = [f"xla.{k}={getattr(c, k)}" for k, default in CPU_ONLY_KEYS.items() if getattr(c, k) != default]
    if platform == "cpu" or not given:
        return None
    return (
        f"{', '.join(given)}: XLA:CPU's option{'s' if len(given) > 1 else ''}, and this run's devices are "
        f"{platform}s, so {'they change' if len(given) > 1 else 'it changes'} nothing here; drop "
        f"{'them' if len(given) > 1 else 'it'}"
    )


def machine_notes(c, devices) -> list[str]:
    """The notes for a run on these devices (flags of another platform's compiler, XLA:CPU's keys on an
    accelerator); ConfigError for device ids the machine lacks."""
    check_local_device_ids(c, devices)
    notes = [other_platform_flags_note(c.xla, devices[0].platform), cpu_keys_note(c.xla, devices[0].platform)]
    return [n for n in notes if n]


@contextlib.contextmanager
def disk_full_stops(out_dir: pathlib.Path):
    """A disk that fills up while the run writes its record (metrics.jsonl, summary.json): one line
    naming the file, exit code 1, not a traceback. (A checkpoint save that fails says so itself.)"""
    try:
        yield
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise TrainingStopped(
            f"hydra.run.dir: no space left writing {e.filename or out_dir} ({e.strerror}), so the run stopped; free "
            "space (or give another hydra.run.dir) and run the same command again (with checkpoint.dir it resumes)"
        ) from None
