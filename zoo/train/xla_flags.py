"""Which XLA flags the installed jaxlib (and libtpu) knows, read from its library without starting XLA.

XLA parses XLA_FLAGS once, when the first backend starts, and aborts the process on a flag it does not know
(`Unknown flag in XLA_FLAGS`), after Python has printed nothing useful. Every flag name XLA registers is a
NUL-terminated string in jaxlib's shared library (GPU flags included, on a CPU-only jaxlib), so an exact
search there answers "would XLA accept this name?" in ~0.2 s, before JAX starts. The TPU compiler's own
flags (LIBTPU_INIT_ARGS: `--xla_tpu_*`, its scheduler's) live in libtpu's library, searched the same way
where libtpu is installed.
"""

import functools
import mmap
import pathlib
from typing import Optional

# XLA:GPU's rematerialization counts host-resident buffers as device memory unless this is on, and then
# recomputes to make room that offloading already made (a public GB200 run: 143 extra clones, 0.63 s/step).
GPU_HOST_OFFLOAD_FLAG = "--xla_gpu_enable_host_memory_offloading"
# Without the latency hiding scheduler XLA:GPU does not schedule host copies under compute: on an H200
# (docs/benchmarks.md, "GPU") llama_1b's Q/K/V offload left 92% of its transfer time exposed, 1.225x
# the step of full remat, where the planner (which assumes the overlap) expected it to hide.
GPU_SCHEDULER_FLAG = "--xla_gpu_enable_latency_hiding_scheduler"
# What a run that keeps anything in pinned host memory gets, unless XLA_FLAGS or xla.flags set the flag.
GPU_HOST_OFFLOAD_FLAGS = (GPU_HOST_OFFLOAD_FLAG, GPU_SCHEDULER_FLAG)


# Simulated CPU devices beyond this take minutes to start (XLA builds each device's runtime), and no
# mesh of conf/mesh needs more (xla.cpu_devices, and the count XLA_FLAGS or JAX_NUM_CPU_DEVICES asks for).
MAX_CPU_DEVICES = 1024
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def flag_name(flag: str) -> str:
    """`--xla_foo=1` -> `--xla_foo`."""
    return flag.split("=", 1)[0]


@functools.lru_cache(maxsize=None)
def _flag_library() -> Optional[pathlib.Path]:
    try:
        import jaxlib
    except ImportError:
        return None
    root = pathlib.Path(jaxlib.__file__).parent
    # The library that holds XLA's DebugOptions flag table (libjax_common.so since jaxlib 0.5; older
    # releases linked it into xla_extension.so).
    for name in ("libjax_common.so", "xla_extension.so"):
        if (root / name).is_file():
            return root / name
    return None


@functools.lru_cache(maxsize=None)
def known_flag(name: str) -> Optional[bool]:
    """True/False: whether the installed jaxlib registers `--<name>`; None when it cannot be told (no
    library found), in which case callers let XLA decide."""
    library = _flag_library()
    if library is None:
        return None
    needle = b"\0" + name.removeprefix("--").encode() + b"\0"
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(needle) >= 0


def unknown_flags(flags: list[str]) -> list[str]:
    """The flags of `flags` that the installed jaxlib does not know (XLA would refuse to start)."""
    return [f for f in flags if known_flag(flag_name(f)) is False]


def _libtpu_library() -> Optional[pathlib.Path]:
    import importlib.util
    import os

    if os.environ.get("TPU_LIBRARY_PATH") and pathlib.Path(os.environ["TPU_LIBRARY_PATH"]).is_file():
        return pathlib.Path(os.environ["TPU_LIBRARY_PATH"])
    spec = importlib.util.find_spec("libtpu")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = pathlib.Path(next(iter(spec.submodule_search_locations))) / "libtpu.so"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def known_tpu_flag(name: str, library: Optional[pathlib.Path] = None) -> Optional[bool]:
    """True/False: whether libtpu (the installed one, or `library`) registers `--<name>`; None where
    no libtpu is installed (the TPU backend cannot start here anyway)."""
    library = library or _libtpu_library()
    if library is None:
        return None
    needle = b"\0" + name.removeprefix("--").encode() + b"\0"
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        return data.find(needle) >= 0


def unknown_tpu_flags(flags: list[str], library: Optional[pathlib.Path] = None) -> list[str]:
    """The flags of `flags` that libtpu does not know (the TPU backend would refuse to start)."""
    return [f for f in flags if known_tpu_flag(flag_name(f), library) is False]


def environment_line(environ) -> Optional[str]:
    """One line for an XLA_FLAGS in the environment that XLA would abort the process on as JAX starts (its
    fatal log line, or its whole flag table for a bad value), or that would take minutes to start; None
    where it is fine. XLA reads a value that does not start with `-` as a file of flags."""
    value = environ.get("XLA_FLAGS", "")
    tokens = value.split()
    if not tokens or (not tokens[0].startswith("-") and pathlib.Path(tokens[0]).is_file()):
        return None
    for token in tokens:
        name, _, given = token.partition("=")
        if not token.startswith("--"):
            what = "neither a flag nor a file of flags" if token == tokens[0] and token[0] != "-" else "not a flag"
            return (
                f"XLA_FLAGS: {token!r} in the environment is {what}, and XLA would abort as JAX starts; write "
                "--xla_<name>=<value>, or unset XLA_FLAGS"
            )
        if known_flag(name) is False:
            return (
                f"XLA_FLAGS: {name} in the environment is not a flag this jaxlib knows, and XLA would abort as JAX "
                "starts; remove it from XLA_FLAGS or check its spelling"
            )
        if name == DEVICE_COUNT_FLAG and not (given.isdigit() and 1 <= int(given) <= MAX_CPU_DEVICES):
            return (
                f"XLA_FLAGS: {token} in the environment must be a count in [1, {MAX_CPU_DEVICES}] (simulated devices "
                "beyond that take minutes to start); fix it, or unset XLA_FLAGS (xla.cpu_devices=<n> sets it for a run)"
            )
    return None
