"""The hardware profile's schema: `HardwareConfig`, what one device can do (its rates, memory and host
link) as the planner (zoo.plan) prices a step and the trainer measures MFU against. Each profile is a
YAML file, conf/hardware/<name>.yaml, merged into this dataclass (`hardware=<name>`); its
`__post_init__` turns a bad value into one line naming the key. `HARDWARE_OF_KIND`: the profile
`hardware=auto` takes for a device kind."""

import dataclasses
import math
from typing import Any, Optional

from zoo import op_rates
from zoo.errors import ConfigError


PLATFORMS = ("cpu", "gpu", "tpu")


@dataclasses.dataclass
class HardwareConfig:
    """What MFU is measured against, per device. Add fields freely: every profile is a YAML file.
    `hardware=auto` (the default) is replaced, once JAX has started, by the profile of the machine's
    device kind (`auto_hardware`)."""

    name: str = "cpu"
    peak_flops: float = 1e12  # dense bf16 FLOP/s per device
    hbm_bytes: int = 0  # device memory
    # Device memory bandwidth, GB/s (read + write; python -m zoo.tools.measure_hardware measures it):
    # what the planner prices a step's memory-bound work at (`activation_passes`). null: unknown.
    hbm_gbps: Optional[float] = None
    host_link_gbps: float = 0.0  # host <-> device bandwidth, GB/s per direction
    # Where the two directions differ (plain device_put on a TPU v5e: 13.9 GB/s to the device, 0.6
    # from it): each direction's GB/s, as a step moves it; null: host_link_gbps.
    host_to_device_gbps: Optional[float] = None
    device_to_host_gbps: Optional[float] = None
    # Whether the link carries both directions at once (PCIe and NVLink are full duplex); false where a
    # program moving one array in and another out takes the sum of the two (a TPU v5e's, measured by
    # zoo.tools.measure_hardware): the planner then adds, where it would overlap, the optimizer state's
    # way in and way out.
    host_link_duplex: bool = True
    # The share of a layer's compute that its offloaded activations' host transfers run behind, as this
    # hardware was measured to overlap them (bench/tpu.py --fit fits it to the chip's offloading runs);
    # the layer at the turn from the forward to the backward pays its transfers whole either way, as
    # nothing is left to hide them behind. The planner prices the rest of each transfer exposed
    # (plan.transfers=measured, its default). null: never measured, so every transfer is priced exposed
    # whole, both ways: a transfer nobody saw hidden is not assumed hidden.
    transfer_overlap: Optional[float] = None
    # Measured dense matmul FLOP/s (python -m zoo.tools.measure_hardware); the planner prefers it to
    # peak_flops * plan.flops_efficiency. null: not measured.
    matmul_flops: Optional[float] = None
    # The fraction of its measured rate each op reaches inside a step (op_rates' rate for its shape;
    # matmul_flops where op_rates has none): an op timed on its own does not pay for the fusions,
    # layout changes, norms and elementwise work around it in a step. Fitted with bench/tpu.py
    # (docs/benchmarks.md, "TPU v5e").
    step_efficiency: float = 1.0
    # The fraction of a recomputed op's own time (its FLOPs at the rate above) that lengthens the step
    # (likely: the recompute fills time the backward's memory-bound work leaves the matrix units idle).
    # 1: recompute costs its full time. Fitted with bench/tpu.py (docs/benchmarks.md, "The planner
    # against the chip": on a TPU v5e `full` ran 0.93-1.06x `minimal`'s step on six setups).
    recompute_cost: float = 1.0
    # The step's memory-bound work, which no op's FLOPs count (norms, RoPE, an MoE's routing and
    # permutations, casts, layout changes): this many passes over the layers' activations (every
    # tag and what `none` keeps besides) at hbm_gbps; and what a checkpointed layer's forward, run
    # again in the backward, adds (recompute_passes), whatever its tags' assignment. 0: not priced.
    # Fitted with bench/tpu.py (docs/benchmarks.md, "The planner against the chip").
    activation_passes: float = 0.0
    recompute_passes: float = 0.0
    # Measured FLOP/s per op and shape (zoo.op_rates; python -m zoo.tools.measure_hardware writes it on
    # an accelerator): the planner gives each tag's producer its op's measured time. null: every op at
    # the planner's rate.
    op_rates: Optional[dict[str, Any]] = None
    nominal: bool = False  # true: peak_flops is a round number, not a datasheet figure
    note: str = ""
    # The platform the profile describes ("cpu", "gpu", "tpu"; null: any): train.py runs only on it
    # (MFU against another machine's peak is meaningless), and the planner (zoo.plan) resolves
    # model.attention_impl and the kernels for it when it plans from another machine; with a GPU's
    # CUDA compute capability ("9.0").
    platform: Optional[str] = None
    compute_capability: Optional[str] = None
    # Pinned host memory one device may use (offloaded activations, host-resident state, staging),
    # the planner's host budget; 0: no budget (the planner refuses nothing for host memory). Profiles
    # derive it from datasheets (the CPU memory of a node shared by its GPUs), not measurements.
    host_bytes_per_device: int = 0
    devices_per_node: int = 1  # devices sharing one node's host memory (the planner's per-node figure)

    def __post_init__(self):
        self._check_figures()
        if not 0 < self.step_efficiency <= 1:
            raise ConfigError(
                f"hardware.step_efficiency: a fraction of matmul_flops in (0, 1], got {self.step_efficiency}; e.g. "
                "hardware.step_efficiency=0.88"
            )
        if not 0 <= self.recompute_cost <= 1:
            raise ConfigError(
                f"hardware.recompute_cost: a fraction of a recompute's time in [0, 1], got {self.recompute_cost}; "
                "e.g. hardware.recompute_cost=1 (recompute costs its full time)"
            )
        for key in ("activation_passes", "recompute_passes"):
            if not 0 <= getattr(self, key) < math.inf:
                raise ConfigError(f"hardware.{key}: must be >= 0 (0: not priced), got {getattr(self, key)}")
            if getattr(self, key) and not self.hbm_gbps:
                raise ConfigError(
                    f"hardware.{key}: prices memory-bound work at hardware.hbm_gbps, which is not set; give it "
                    f"(e.g. hardware.hbm_gbps=819) or set hardware.{key}=0"
                )
        if self.transfer_overlap is not None and not 0 <= self.transfer_overlap <= 1:
            raise ConfigError(
                f"hardware.transfer_overlap: a fraction of a layer's compute in [0, 1], or null (not measured), got "
                f"{self.transfer_overlap}; e.g. hardware.transfer_overlap=0.5"
            )
        if self.hbm_gbps is not None and not 0 < self.hbm_gbps < math.inf:
            raise ConfigError(f"hardware.hbm_gbps: must be positive or null (unknown), got {self.hbm_gbps}")
        bad_rates = op_rates.check(self.op_rates)
        if bad_rates:
            raise ConfigError(f"{bad_rates}; measure them with python -m zoo.tools.measure_hardware, or set it to null")
        if self.host_bytes_per_device < 0:
            raise ConfigError(
                f"hardware.host_bytes_per_device: must be >= 0 (0: no host budget), got {self.host_bytes_per_device}; "
                "e.g. hardware.host_bytes_per_device=240000000000"
            )
        if self.devices_per_node < 1:
            raise ConfigError(
                f"hardware.devices_per_node: must be >= 1, got {self.devices_per_node}; e.g. "
                "hardware.devices_per_node=8"
            )
        if self.platform not in (None, *PLATFORMS):
            raise ConfigError(f"hardware.platform: got {self.platform!r}; choose {', '.join(PLATFORMS)} or null (any)")
        for key in ("host_to_device_gbps", "device_to_host_gbps"):
            value = getattr(self, key)
            if value is not None and not 0 < value < math.inf:
                raise ConfigError(f"hardware.{key}: must be positive or null (host_link_gbps), got {value}")
        if self.compute_capability is not None:
            major, _, minor = str(self.compute_capability).partition(".")
            if self.platform != "gpu" or not (major.isdigit() and minor.isdigit()):
                raise ConfigError(
                    f"hardware.compute_capability: got {self.compute_capability!r}; give a GPU's major.minor "
                    "(e.g. 9.0) with hardware.platform=gpu, or null"
                )

    def _check_figures(self) -> None:
        """The rates, sizes and link a finite number in range (a NaN passes any comparison, and an
        infinite rate or link would price everything at 0 seconds)."""
        if not 0 < self.peak_flops < math.inf:
            raise ConfigError(
                f"hardware.peak_flops: must be positive and finite, got {self.peak_flops}; e.g. "
                "hardware.peak_flops=1.0e12"
            )
        if self.matmul_flops is not None and not 0 < self.matmul_flops < math.inf:
            raise ConfigError(
                f"hardware.matmul_flops: must be positive and finite, or null (not measured), got {self.matmul_flops}"
            )
        if self.hbm_bytes < 0:
            raise ConfigError(f"hardware.hbm_bytes: must be >= 0 (0: unknown), got {self.hbm_bytes}")
        if not 0 <= self.host_link_gbps < math.inf:
            raise ConfigError(
                f"hardware.host_link_gbps: GB/s per direction, >= 0 and finite (0: unknown), got {self.host_link_gbps}"
            )

    @property
    def auto(self) -> bool:
        return self.name == AUTO_HARDWARE

    def link_gbps(self, direction: str) -> float:
        """GB/s of one direction of the host link ("to_device" or "to_host")."""
        own = self.host_to_device_gbps if direction == "to_device" else self.device_to_host_gbps
        return own if own is not None else self.host_link_gbps

    def capability(self) -> Optional[tuple[int, int]]:
        """The compute capability as (major, minor), None where not given."""
        if self.compute_capability is None:
            return None
        major, _, minor = str(self.compute_capability).partition(".")
        return int(major), int(minor)


AUTO_HARDWARE = "auto"
# Device kinds (jax.Device.device_kind) whose profile conf/hardware holds; hardware=auto takes it.
HARDWARE_OF_KIND = {
    "cpu": "cpu",
    "TPU v5 lite": "tpu_v5e",
    "NVIDIA H100 PCIe": "h100_pcie",
    "NVIDIA H200": "h200_pcie",
    "NVIDIA GH200 480GB": "gh200",
    "NVIDIA GB200": "gb200",
}


def check_hardware_platform(hw: HardwareConfig, platform: str) -> None:
    """A profile of another platform than the run's (a TPU's on a CPU): ConfigError. A run's MFU and
    its planner figures are read against its profile."""
    if hw.platform is not None and hw.platform != platform:
        raise ConfigError(
            f"hardware: {hw.name} is a profile of a {hw.platform}, and this run's devices are {platform}s; use "
            "hardware=auto "
            f"(this machine's profile) or one of its own; to plan for a {hw.platform} from here, "
            f"python -m zoo.tools.plan ... hardware={hw.name}"
        )
