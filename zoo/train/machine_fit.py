"""Whether a training run can fit this machine at all, judged from its config before anything is
initialised: a model whose weights, gradients, AdamW moments and layer inputs outgrow every byte the
machine has (its devices' memory and its host memory together) would otherwise spend minutes
initialising, or compiling, before it failed. A lower bound, not the planner's estimate
(`python -m zoo.tools.plan` says what a step holds and where): what is refused here cannot run
under any offload policy.
"""

import os
from typing import Optional, Union

import numpy as np

from zoo.errors import ConfigError


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
