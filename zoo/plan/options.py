"""The planner's own settings (`PlanConfig`, the `plan.*` keys of python -m zoo.tools.plan) and the
host link they name (`resolve_link`: GB/s per direction from a number, a name of LINKS or a hardware
profile)."""

import dataclasses
import math
import re
from typing import Optional, Union


from zoo.plan.problem import GB, PlanError
from zoo.ranges import ranged

# Named host links, GB/s per direction (full duplex).
LINKS = {
    "pcie_gen4": 32.0,  # PCIe Gen4 x16
    "pcie_gen5": 64.0,  # PCIe Gen5 x16 (H100 / H200 PCIe)
    "pcie_gen6": 128.0,
    "nvlink_c2c": 450.0,  # Grace <-> Hopper/Blackwell, 900 GB/s both directions together (GH200, GB200)
    "nvlink_c2c_rubin": 900.0,  # Vera <-> Rubin, 1.8 TB/s both directions together
}


TRANSFERS = ("measured", "exposed", "overlapped")  # plan.transfers


@ranged(
    "plan",
    hbm_budget_gb="(0, inf): null takes the hardware profile's hbm_bytes",
    host_budget_gb="(0, inf): GB per device; null takes hardware.host_bytes_per_device",
    flops_efficiency="(0, 1]",
    transfer_latency_us="[0, inf)",
    compile="[0, inf): the number of candidates to compile",
    measure="[0, inf): timed steps per candidate",
    batch_limit="[1, inf): the largest per-device batch to try",
)
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
    # How a tag's host transfer is priced: `measured`, overlapping the share of its layer's compute the
    # hardware profile measured (hardware.transfer_overlap), the last layer's exposed whole, and exposed
    # whole everywhere where the profile measured none; `exposed`, every transfer whole; `overlapped`,
    # every transfer overlapping its layer's whole compute (the optimistic bound, for a link nobody has
    # measured yet).
    transfers: str = "measured"
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
    # Also search the per-device batch (zoo.plan.batch): 1, 2, 3, 4, 6, 8, ... up to the first that
    # nothing fits or `batch_limit`, each with its fastest policy; plan the one with the most tokens
    # per second per device (the command's data.batch_size is where the search starts its table).
    batch_search: bool = False
    batch_limit: int = 1024

    def __post_init__(self):  # the numbers' ranges: `ranged` above
        if self.transfers not in TRANSFERS:
            raise PlanError(
                f"plan.transfers: got {self.transfers!r}; choose {', '.join(TRANSFERS)} (measured: hidden behind the "
                "share of compute hardware.transfer_overlap says)"
            )
        if self.measure and self.compile == 0:
            raise PlanError(
                "plan.measure: it times the compiled candidates; drop plan.compile=0 or give plan.compile=4"
            )
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", self.name):  # a file stem and an offload option's name
            raise PlanError(
                f"plan.name: {self.name!r} is not a file stem (letters, digits, _, - and ., not first); e.g. "
                "plan.name=planned"
            )


def link_profile(link, hardware_dir):
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
    profile = link_profile(link, hardware_dir)
    return True if profile is None else bool(profile.get("host_link_duplex", True))


def transfer_pricing(opts: "PlanConfig", profile_overlap, hardware_dir=None) -> tuple[float, bool]:
    """(`Problem.transfer_overlap`, `Problem.turn_exposed`): plan.transfers=overlapped (1, False), every
    transfer hidden up to its layer's compute; exposed (0, True); measured, the share the hardware was
    measured to overlap (hardware.transfer_overlap of the run's profile, or, where plan.link names
    another profile, that one's) with the turn exposed, and (0, True) where nobody measured it (a link
    given as a number or a LINKS name, or a profile without the figure)."""
    if opts.transfers == "overlapped":
        return 1.0, False
    if opts.transfers == "measured":
        if opts.link is not None:
            profile = link_profile(opts.link, hardware_dir)
            profile_overlap = profile.get("transfer_overlap") if profile is not None else None
        if profile_overlap is not None:
            return float(profile_overlap), True
    return 0.0, True


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
        if not 0 < value < math.inf:  # NaN too
            raise PlanError(f"plan.link: must be positive and finite GB/s per direction, got {link}; e.g. plan.link=64")
        return value
    if link in LINKS:
        return LINKS[link]
    profile = link_profile(link, hardware_dir)
    if profile is not None:
        gbps = profile.get("host_link_gbps", 0)
        if gbps and gbps > 0:
            return float(gbps)
        raise PlanError(f"plan.link: hardware profile {link!r} has no host_link_gbps; give GB/s, e.g. plan.link=64")
    profiles = sorted(p.stem for p in hardware_dir.glob("*.yaml")) if hardware_dir is not None else []
    raise PlanError(
        f"plan.link: unknown link {link!r}; give GB/s per direction, or one of {', '.join([*LINKS, *profiles])}"
    )


def host_budget_bytes(opts: PlanConfig, hardware) -> float:
    """Pinned host bytes per device: `plan.host_budget_gb`, else the profile's; inf where neither gives one."""
    if opts.host_budget_gb is not None:
        return opts.host_budget_gb * GB
    return float(hardware.host_bytes_per_device) if hardware.host_bytes_per_device else math.inf
