"""Command-line cases run in one pytest process through the commands' entry points, not a process each.

A test that runs `python train.py ...` or `python -m zoo.tools.X ...` and checks what it printed pays a
Python start and JAX's and Hydra's imports (3-5 s) for a command that, on bad input, ends in well under
a second. Such a test is marked `in_process` (a parametrized test may mark some cases) and starts with

    if not in_process.INNER:
        return in_process.outcome(request, env)

The first marked test of a module to get there runs every selected marked test of that module in one
pytest process of its own (`INNER` true there), which runs each command with `run`, in that process;
each marked test here then ends as it ended there: passed, failed with the message it failed with
there, or skipped. A process of their own, not this one: an entry point composes Hydra and starts JAX
(with the command's XLA flags: `xla_flags`), and leaves logging handlers, signal handlers and imported
modules behind; what earlier tests of a shared worker left must not decide a case, nor a case them.

Only for a command whose checks hold in any process: not one that is sent a signal, runs with a module
patched as it starts, or whose process's exit is checked (what background threads print then).
"""

import importlib
import os
import pathlib
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ElementTree

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INNER = os.environ.get("ZOO_TEST_IN_PROCESS") == "1"
MARK = pytest.mark.in_process
_RUNS: dict = {}  # module path -> ({test name: (outcome, text)}, the end of that process's output)
# The in-process run's pytest: one process (-n0), the marked tests whatever their tier (-m ""), and none of
# pyproject's addopts: without --jaxtyping-packages the commands run unchecked by jaxtyping, as in a process
# of their own (the zoo functions they call are shape-checked in the suite's own tests), and the run starts
# without instrumenting every zoo module first (~6 s of CPU per run).
INNER_OPTIONS = ("-o", "addopts=", "-q", "-n0", "-p", "no:cacheprovider", "-m", "")


def xla_flags(cpu_devices: int) -> str:
    """XLA_FLAGS for a process that starts JAX as a command with `xla.cpu_devices=<cpu_devices>` starts
    it here (conftest.py's flags, that many devices), so the command finds JAX started as it would start it."""
    from zoo.train.run import merged_xla_flags
    from zoo.train.run_config import XlaConfig

    return merged_xla_flags(XlaConfig(cpu_devices=cpu_devices, cpu_ynn_fusions=None), os.environ.get("XLA_FLAGS"))


def outcome(request, env=None) -> None:
    """(In the test's own process.) End this marked test as it ended in the module's in-process run,
    starting that run if this is the first marked test of the module to ask. `env`: the variables that
    run gets besides this process's (a dict, or a function of `request` that returns one)."""
    assert not INNER and request.node.get_closest_marker("in_process"), request.node.nodeid
    path = request.node.path
    if path not in _RUNS:
        _RUNS[path] = _run_module(request, env(request) if callable(env) else env or {})
    results, log = _RUNS[path]
    result = results.get(request.node.name)
    if result is None:
        pytest.fail(f"the in-process run did not report {request.node.name}; its output ends:\n{log}", pytrace=False)
    what, text = result
    if what == "skipped":
        pytest.skip(text)
    if what == "failed":
        pytest.fail(f"in the in-process run:\n{text}", pytrace=False)


def _run_module(request, env: dict):
    marked = [
        it.nodeid
        for it in request.session.items
        if it.path == request.node.path and it.get_closest_marker("in_process")
    ]
    d = request.getfixturevalue("tmp_path_factory").mktemp("in_process")
    xml = d / "results.xml"
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *INNER_OPTIONS, f"--basetemp={d / 'tmp'}", f"--junitxml={xml}", *marked],
        env={**os.environ, **env, "ZOO_TEST_IN_PROCESS": "1"}, cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    log = p.stdout[-6000:] + p.stderr[-2000:]
    results = {}
    if xml.exists():
        for case in ElementTree.parse(xml).getroot().iter("testcase"):
            failed = [e for e in case if e.tag in ("failure", "error")]
            skipped = case.find("skipped")
            if failed:
                results[case.get("name")] = ("failed", "\n".join(e.text or e.get("message", "") for e in failed))
            elif skipped is not None:
                results[case.get("name")] = ("skipped", skipped.get("message", ""))
            else:
                results[case.get("name")] = ("passed", "")
    return results, log


def run(cmd: list[str], cwd, capfd, monkeypatch) -> subprocess.CompletedProcess:
    """(In the in-process run.) `cmd` (`[sys.executable, <train.py>, ...]` or `[sys.executable, "-m",
    <module>, ...]`) through its entry point in this process, from `cwd`, without ZOO_TRACEBACK: its
    exit code, stdout and stderr, as a process of its own returns them (a Python warning is written to
    stderr, under Python's default filters)."""
    monkeypatch.delenv("ZOO_TRACEBACK", raising=False)
    monkeypatch.chdir(cwd)
    capfd.readouterr()
    absl_logging = sys.modules.get("absl.logging")
    if absl_logging is not None:
        # absl's handler writes to the sys.stderr it found when absl was imported: where a test module
        # imported it as pytest collected (orbax does, through zoo.train.run), pytest's own capture file,
        # which the next command's logging setup (Hydra's dictConfig) closes, as absl closes any stream
        # but the current sys.stderr. This command's stderr, as in a process of its own.
        absl_logging.get_absl_handler().python_handler.setStream(sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)  # what Python ignores by default
        code = main(cmd)
    out, err = capfd.readouterr()
    err += "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught)
    return subprocess.CompletedProcess(cmd, code, out, err)


def main(cmd: list[str]) -> int:
    """The exit code of `cmd`, run in this process through its entry point: train.py's is
    train.entry (zoo.tools.cli.main around its @hydra.main function), a tool's (`-m zoo.tools.X`) its main."""
    assert cmd[0] == sys.executable, cmd
    if pathlib.Path(cmd[1]).name == "train.py":
        sys.path.insert(0, str(pathlib.Path(cmd[1]).parent))
        try:
            import train
        finally:
            sys.path.pop(0)
        saved = sys.argv
        sys.argv = cmd[1:]
        try:
            return train.entry()
        finally:
            sys.argv = saved
    assert cmd[1] == "-m", cmd
    try:
        return importlib.import_module(cmd[2]).main(cmd[3:])
    except SystemExit as e:  # argparse-based tools exit through SystemExit
        return e.code
