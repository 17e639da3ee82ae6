"""Train any zoo model on any mesh with any offload policy: `python train.py [group=option ...] [key=value ...]`.

Hydra composes conf/ (docs/training.md); `-m` sweeps. Bad input exits 2 with one `error:` line.
"""

import importlib.util
import os
import pathlib
import sys

if __name__ == "__main__":
    # Ctrl-C during the imports below (JAX's, Hydra's: seconds) is one line and exit code 130, as for the
    # tools, until zoo.tools.cli.main runs the command (zoo.tools is light: the package imports nothing heavy).
    import zoo.tools

    zoo.tools.take_ctrl_c_while_starting()
    zoo.tools.hold_ctrl_c_through_exit()  # and during the interpreter's shutdown, one line (take_ctrl_c_while_exiting)
    # glibc reads its malloc tunables only as a process starts: start again with large buffers on huge
    # pages (zoo/train/huge_pages.py), loaded by path so that this process, about to be replaced, does
    # not import JAX with the zoo package first.
    _spec = importlib.util.spec_from_file_location(
        "_zoo_huge_pages", pathlib.Path(__file__).resolve().parent / "zoo/train/huge_pages.py"
    )
    _huge_pages = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_huge_pages)
    try:
        _huge_pages.reexec_with_huge_pages()
    except ValueError as e:  # a bad ZOO_HUGE_PAGES, before anything else runs
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    zoo.tools.exit_on_bad_environment()  # a JAX_* variable JAX would refuse as it is imported below: one line

import hydra
from omegaconf import DictConfig

from zoo.tools.cli import EXIT_BAD_INPUT, EXIT_INTERRUPTED, run_job
from zoo.tools.cli import main as cli_main
from zoo.train import command_line

CONF = pathlib.Path(__file__).resolve().parent / "conf"


# An absolute config path: the same config whether this file runs as a script or is imported (tests
# call `cli_main(main, CONF)` in-process with sys.argv set).
@hydra.main(config_path=str(CONF), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    run_job(cfg, out_of_memory_line=_out_of_memory_line)


def _out_of_memory_line(*args) -> str:
    # The planner names who holds the memory; imported only when a run has run out of it.
    from zoo.plan.oom import out_of_memory_line

    return out_of_memory_line(*args)


def entry() -> int:
    """The command: its arguments and environment checked before Hydra reads them, then the job."""
    sys.argv = [sys.argv[0], *command_line.ordered(sys.argv[1:])]
    problem = command_line.line(sys.argv[1:], os.environ, CONF)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return cli_main(main, CONF)


if __name__ == "__main__":
    code = entry()
    if code == EXIT_INTERRUPTED:
        # Leave at once, as the tools do (zoo.tools.cli.run_tool): the interpreter's shutdown, with XLA's work
        # still running on its threads, crashed the process after the Ctrl-C line (exit -11, a Ctrl-C while the
        # parameters were initialised). What the run wrote is closed by now (its record, its saves waited for).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    zoo.tools.take_ctrl_c_while_exiting(code)
    sys.exit(code)
