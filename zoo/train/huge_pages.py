"""Large host buffers on transparent huge pages: glibc's `glibc.malloc.hugetlb=1`, set before the process starts.

XLA:CPU takes every buffer of a step (the float32 logits, activations, gradients) from malloc, and
glibc serves each one above 32 MiB with a fresh mmap that it unmaps again on free. So every step
faults each of those buffers in again, one 4 KiB page at a time: a 2048 x 32000 float32 logits
buffer is 64,000 page faults a step. With `GLIBC_TUNABLES=glibc.malloc.hugetlb=1` (glibc >= 2.35)
malloc asks the kernel for transparent huge pages (madvise), one fault per 2 MiB. That only applies
where the kernel's transparent huge pages are in `madvise` mode (with `always` every large mapping
gets them anyway; with `never`, none does).

glibc reads GLIBC_TUNABLES once, as the process starts, so train.py starts itself again with it
(`reexec_with_huge_pages`) before it does anything else: the same interpreter, arguments and process
id. `ZOO_HUGE_PAGES=0` keeps the process as it was started; a GLIBC_TUNABLES that already names
`glibc.malloc.hugetlb` is left as it is; any other value of the switch is refused in one line
(train.py: exit 2). The measured gain is in docs/benchmarks.md ("Host memory on
huge pages"). Code that imports zoo runs in a process it did not start: set the variable yourself,
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python my_script.py`.
"""

import os
import platform
import sys
from collections.abc import Mapping
from typing import Optional

TUNABLE = "glibc.malloc.hugetlb"
SWITCH = "ZOO_HUGE_PAGES"
THP_MODE_FILE = "/sys/kernel/mm/transparent_hugepage/enabled"
MIN_GLIBC = (2, 35)
# `plan`'s reason where the tunable would apply but this process did not start with it (an import).
STARTED_WITHOUT = f"this process started without GLIBC_TUNABLES={TUNABLE}=1"


def thp_mode(path: str = THP_MODE_FILE) -> Optional[str]:
    """The kernel's transparent huge page mode (`always`, `madvise`, `never`), None where unreadable."""
    try:
        text = open(path).read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> Optional[tuple[int, int]]:
    """(major, minor) of the C library this Python runs on if it is glibc, else None."""
    name, version = platform.libc_ver()
    if name != "glibc":
        return None
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def plan(
    environ: Mapping[str, str] = os.environ, mode: Optional[str] = None, glibc: Optional[tuple[int, int]] = None
) -> tuple[Optional[str], bool, str]:
    """(the GLIBC_TUNABLES a process should be started with, or None to leave it as it is; whether
    large buffers are on huge pages in a process started with `environ`; why, in a few words).

    `mode` and `glibc` default to this machine's."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    set_here = [t.split("=", 1)[-1] for t in tunables.split(":") if t.split("=", 1)[0] == TUNABLE]
    if set_here:
        return None, set_here[-1] not in ("0", ""), f"GLIBC_TUNABLES={tunables}"
    switch = environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(
            f"{SWITCH}: got {switch!r}; give 0 (large buffers on 4 KiB pages) or 1 (on huge pages, the default)"
        )
    if switch == "0":
        return None, False, f"{SWITCH}=0"
    if sys.platform != "linux":
        return None, False, f"glibc's malloc tunables are Linux only (platform {sys.platform})"
    glibc = glibc_version() if glibc is None else glibc
    if glibc is None or glibc < MIN_GLIBC:
        found = "no glibc" if glibc is None else f"glibc {glibc[0]}.{glibc[1]}"
        return None, False, f"needs glibc >= {MIN_GLIBC[0]}.{MIN_GLIBC[1]} ({found})"
    mode = thp_mode() if mode is None else mode
    if mode == "always":
        return None, True, "the kernel gives every large buffer huge pages (transparent_hugepage=always)"
    if mode != "madvise":
        return None, False, f"the kernel's transparent huge pages are {mode or 'not available'} (transparent_hugepage)"
    return ":".join(t for t in (tunables, f"{TUNABLE}=1") if t), False, STARTED_WITHOUT


def child_environ(environ: Mapping[str, str] = os.environ) -> dict:
    """`environ` with the GLIBC_TUNABLES that `plan` asks for: the environment to start a process of
    Zoo's with."""
    tunables = plan(environ)[0]
    return dict(environ) if tunables is None else {**environ, "GLIBC_TUNABLES": tunables}


def reexec_with_huge_pages() -> None:
    """Start this process again (same interpreter, arguments and pid) with huge pages for large
    buffers, where `plan` says so; otherwise return. Call it first thing, before any output."""
    tunables = plan()[0]
    if tunables is None or not sys.executable:  # (an embedded interpreter has nothing to start again)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, "GLIBC_TUNABLES": tunables})


def describe(environ: Mapping[str, str] = os.environ) -> str:
    """One line for a run's start: whether this process has its large buffers on huge pages, and why."""
    _, on, why = plan(environ)
    state = "on transparent huge pages" if on else "on 4 KiB pages"
    switch = f"; {SWITCH}=0 turns huge pages off" if on else ""
    return f"host memory: large buffers {state} ({why}{switch}; docs/benchmarks.md)"
