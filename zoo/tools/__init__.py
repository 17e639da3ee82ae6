"""The command-line tools and their shared kit, apart from the library.

Each module here with a `__main__` block is a command, `python -m zoo.tools.<name>`: the inspector
(`inspect_step`), the planner (`plan`, with `scale`, the per-device scale report it and the inspector
print), `report` (sweeps), `generate` (sampling from the command line, over zoo.sampling), `export` (a
checkpoint as a Hugging Face directory, over zoo.train.hf_export), `measure_hardware`, `gpu_lowering`
and `sizes`. `cli` is train.py's command-line edge (one-line errors, exit codes, `run_tool`), which
every tool shares; `kit` holds what the inspector, the planner and the hardware tools build a traced
step from.

The library (everything under `zoo` outside this package) never imports it, so a tool can be renamed
or removed without touching research code; tests/test_imports.py checks that, and that there is no
import cycle.

Started as a command (`python -m zoo.tools.<name>`), this package takes Ctrl-C first, before any import of the
tool's: one line and exit code 130 (`_interrupted_while_starting`) until `zoo.tools.cli.run_tool` runs the body.
train.py takes the same handler as its first statement (`take_ctrl_c_while_starting`), until `zoo.tools.cli.main`.
"""

import os
import signal
import sys

INTERRUPTED_STARTING = "error: interrupted (Ctrl-C) while starting; nothing was done; run the command again"


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C before the tool's body runs (JAX's, Hydra's, the tool's own imports: seconds): nothing was done, so
    the process ends here, in one line and exit code 130. A KeyboardInterrupt raised inside those imports instead
    printed a traceback, aborted the process inside a C extension's start, or was swallowed by a callback and the
    command went on (exit 0)."""
    os.write(2, (INTERRUPTED_STARTING + "\n").encode())
    os._exit(130)


def _started_as_a_tool() -> bool:
    """Whether this package is being imported because the process was started as `python -m zoo.tools.<name>`:
    Python then sets sys.argv[0] to "-m" until the module is found (and imports its packages meanwhile)."""
    argv = list(getattr(sys, "orig_argv", []))
    if sys.argv[:1] != ["-m"] or "-m" not in argv[:-1]:
        return False
    return argv[argv.index("-m") + 1].startswith(__name__ + ".")


def take_ctrl_c_while_starting() -> None:
    """Ctrl-C ends the process in `_interrupted_while_starting`'s line from now until the command's body runs
    (zoo.tools.cli's `run_tool` and, for train.py, `main` hand it back to Python's own handler): a tool's as this
    package is imported, train.py's as its first statement. Left alone where SIGINT is ignored (a shell's
    background job) or handled by someone else."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_starting)


def _ignore_ctrl_c_in_teardown() -> None:
    """The last atexit callback (registered before any import, so run after every other): from here Python tears
    the interpreter down in C, after restoring SIGINT's default action for a handler of its own, so a Ctrl-C
    would kill the process (exit -2, no line). Ignored instead: the command has ended and only freeing is left."""
    if signal.getsignal(signal.SIGINT) is _EXITING:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


_EXITING = None  # the handler take_ctrl_c_while_exiting installed


def take_ctrl_c_while_exiting(code: int) -> None:
    """After the command's body returned `code`, for the interpreter's shutdown: Ctrl-C while Python joins the
    threads and runs the atexit callbacks (JAX's, orbax's: they can take seconds) is one line and exit code 130,
    not a traceback Python ignores; after the last callback it is ignored (`_ignore_ctrl_c_in_teardown`, which
    `hold_ctrl_c_through_exit` registered). Left alone where SIGINT is ignored or handled by someone else."""
    global _EXITING

    def interrupted_while_exiting(signum, frame) -> None:
        os.write(
            2, f"error: interrupted (Ctrl-C) while exiting, after the command had ended (exit code {code})\n".encode()
        )
        os._exit(130)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _EXITING = interrupted_while_exiting
        signal.signal(signal.SIGINT, interrupted_while_exiting)


def hold_ctrl_c_through_exit() -> None:
    """Register `_ignore_ctrl_c_in_teardown` as the process's first atexit callback, so that it runs last: call it
    before importing anything that registers one (train.py's first statement)."""
    import atexit

    atexit.register(_ignore_ctrl_c_in_teardown)


def jax_environment_line() -> "str | None":
    """The one line for a JAX_* variable JAX refuses as it is imported (JAX_ENABLE_X64=maybe,
    JAX_DEFAULT_MATMUL_PRECISION=bogus: a ValueError from inside `import jax`, before any command's body could
    name it), or a JAX_NUM_CPU_DEVICES that would take minutes to start; None where JAX imports. JAX is imported
    here only where some JAX_* variable is set (every command imports it next anyway)."""
    if not any(k.startswith("JAX_") for k in os.environ):
        return None
    try:
        import jax  # noqa: F401
    except ValueError as e:
        import re

        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        m = re.search(r"for environment '(\w+)'", text) or re.search(r"for JAX flag (\w+)", text)
        if m is None:
            raise
        name = m.group(1).upper()
        fix = "true or false (1 or 0)" if "truth value" in text else "one of the values JAX documents for it"
        value = os.environ.get(name, "")
        return f"{name}: {value!r} in the environment is refused by JAX ({text}); give {fix}, or unset it"
    from zoo.train.xla_flags import MAX_CPU_DEVICES

    count = os.environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if count.lstrip("-").isdigit() and int(count) > MAX_CPU_DEVICES:
        return (
            f"JAX_NUM_CPU_DEVICES: {count} in the environment is beyond {MAX_CPU_DEVICES} (simulated devices beyond "
            "that take minutes to start); lower it, or unset it (xla.cpu_devices=<n> sets the count for a run)"
        )
    return None


def exit_on_bad_environment() -> None:
    """`jax_environment_line`'s line on stderr and exit code 2, before the command imports JAX itself."""
    line = jax_environment_line()
    if line:
        os.write(2, f"error: {line}\n".encode())
        sys.exit(2)


if _started_as_a_tool():
    take_ctrl_c_while_starting()
    exit_on_bad_environment()
