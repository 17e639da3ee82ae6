"""zoo.train.huge_pages: when a process is started again with glibc's huge-page tunable, that doing so
keeps its pid and arguments, and that the tunable does cut the page faults of a large buffer. That
train.py does it is checked on a real run in tests/test_checkpoint.py (`uninterrupted`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.train import huge_pages
from zoo.train.huge_pages import STARTED_WITHOUT, SWITCH, TUNABLE, describe, plan

ROOT = Path(__file__).resolve().parent.parent
HERE = dict(mode="madvise", glibc=(2, 36))


def test_plan_adds_the_tunable_and_keeps_the_others():
    assert plan({}, **HERE) == (f"{TUNABLE}=1", False, STARTED_WITHOUT)
    tunables, on, _ = plan({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, **HERE)
    assert tunables == f"glibc.malloc.arena_max=2:{TUNABLE}=1" and not on


@pytest.mark.parametrize(
    "environ, mode, glibc, on, why",
    [
        ({"GLIBC_TUNABLES": f"{TUNABLE}=1"}, "madvise", (2, 36), True, f"GLIBC_TUNABLES={TUNABLE}=1"),
        (
            {"GLIBC_TUNABLES": f"{TUNABLE}=0"},
            "madvise",
            (2, 36),
            False,
            f"GLIBC_TUNABLES={TUNABLE}=0",
        ),  # the user's, kept
        ({SWITCH: "0"}, "madvise", (2, 36), False, f"{SWITCH}=0"),
        ({}, "always", (2, 36), True, "transparent_hugepage=always"),
        ({}, "never", (2, 36), False, "transparent huge pages are never"),
        ({}, "", (2, 36), False, "not available"),
        ({}, "madvise", (2, 31), False, "needs glibc >= 2.35 (glibc 2.31)"),
    ],
)
def test_plan_leaves_the_process_alone(environ, mode, glibc, on, why):
    tunables, got_on, got_why = plan(environ, mode=mode, glibc=glibc)
    assert tunables is None and got_on == on and why in got_why


def test_describe_names_the_state_and_the_switch():
    assert describe({"GLIBC_TUNABLES": f"{TUNABLE}=1"}).startswith(
        "host memory: large buffers on transparent huge pages ("
    )
    assert f"{SWITCH}=0 turns huge pages off" in describe({"GLIBC_TUNABLES": f"{TUNABLE}=1"})
    assert describe({SWITCH: "0"}) == f"host memory: large buffers on 4 KiB pages ({SWITCH}=0; docs/benchmarks.md)"


@pytest.mark.parametrize("value", ["false", "off", "2", ""])
def test_a_bad_switch_is_one_line_naming_it(value):
    with pytest.raises(ValueError, match=rf"^{SWITCH}: got '{value}'; give 0 \(large buffers on 4 KiB pages\) or 1 "):
        plan({SWITCH: value}, **HERE)


def test_train_py_refuses_a_bad_switch_in_one_line_before_anything_else():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    p = subprocess.run(
        [sys.executable, "train.py"], cwd=ROOT, env={**env, SWITCH: "off"}, capture_output=True, text=True, timeout=60
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and p.stdout == "" and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"error: {SWITCH}: got 'off'; give 0 ")


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(str(f)) == "madvise"
    assert huge_pages.thp_mode(str(tmp_path / "missing")) is None


_CHILD = """
import json, os, sys
from zoo.train.huge_pages import reexec_with_huge_pages
if os.environ.get("ZOO_TEST_PID") is None:
    os.environ["ZOO_TEST_PID"] = str(os.getpid())
reexec_with_huge_pages()
print(json.dumps({"first_pid": int(os.environ["ZOO_TEST_PID"]), "pid": os.getpid(), "argv": sys.argv[1:],
                  "tunables": os.environ.get("GLIBC_TUNABLES")}))
"""


needs_madvise = pytest.mark.skipif(plan({})[0] is None, reason=f"this machine does not need the tunable: {plan({})[2]}")


@needs_madvise
def test_reexec_keeps_pid_and_arguments_and_adds_the_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", SWITCH, "ZOO_TEST_PID")}
    p = subprocess.run(
        [sys.executable, "-c", _CHILD, "a", "b=c"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out == {"first_pid": out["pid"], "pid": out["pid"], "argv": ["a", "b=c"], "tunables": f"{TUNABLE}=1"}
    off = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, env={**env, SWITCH: "0"}, capture_output=True, text=True, timeout=60
    )
    assert json.loads(off.stdout.strip().splitlines()[-1])["tunables"] is None


# malloc itself (numpy would advise huge pages on its own large arrays), then every byte written.
_FAULTS = """
import ctypes, resource
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 256 * 2**20  # far above glibc's mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
libc.memset(ctypes.c_void_p(libc.malloc(size)), 1, ctypes.c_size_t(size))
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@needs_madvise
def test_the_tunable_cuts_the_page_faults_of_a_large_buffer():
    def faults(tunables):
        env = {**os.environ, "GLIBC_TUNABLES": tunables}
        p = subprocess.run(
            [sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout=60, check=True
        )
        return int(p.stdout.strip())

    small_pages, huge = faults(f"{TUNABLE}=0"), faults(f"{TUNABLE}=1")
    assert small_pages >= 60000  # one per 4 KiB page of the 256 MiB
    assert huge < small_pages / 4, (small_pages, huge)
