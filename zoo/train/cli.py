"""The command-line edge of train.py: one Hydra job with failure capture, and one-line errors.

Bad input ends the process with `error: <key>: <what is wrong>; <fix>` on stderr and exit code 2;
a job that fails while training prints its traceback, then one `error:` line, exit code 1. In a
multirun (`-m`) a failed job is recorded in its summary.json (status "failed", its overrides, the
error), reported in one line, and the sweep goes on; the process exits 1 at the end if any failed.
Set ZOO_TRACEBACK=1 to see Python tracebacks for configuration errors too.
"""

import os
import pathlib
import re
import sys
import traceback
from typing import Callable, Optional

from omegaconf import DictConfig

from zoo.train.config import GROUPS, ConfigError, TrainingStopped, _known_keys

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

_FAILED_JOBS: list[str] = []


def _hydra_context():
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return pathlib.Path(hc.runtime.output_dir), list(hc.overrides.task), hc.mode == RunMode.MULTIRUN, hc.job.get("num", None)


def run_job(cfg: DictConfig) -> None:
    """The body of @hydra.main."""
    from zoo.train.metrics import write_json
    from zoo.train.run import prepare, train

    import logging

    logging.getLogger("jax").setLevel(logging.WARNING)  # Hydra's logging config would show JAX's INFO lines
    logging.getLogger("absl").setLevel(logging.WARNING)  # and orbax's, one per save
    out_dir, overrides, multirun, num = _hydra_context()
    label = f"job {num} [{' '.join(overrides)}]" if multirun else "run"
    try:
        c, plan, devices, flags = prepare(cfg)
        train(c, plan, devices, out_dir, xla_flags=flags, overrides=overrides)
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops a sweep
        bad_input = isinstance(e, ConfigError)
        stopped = isinstance(e, TrainingStopped)  # the run stopped itself and says why in one line
        if _is_main_process():
            write_json(
                out_dir / "summary.json",
                {"status": "failed", "overrides": overrides, "error": one_line(e), "error_type": type(e).__name__, "bad_input": bad_input},
            )
        if not (bad_input or stopped) or os.environ.get("ZOO_TRACEBACK"):
            traceback.print_exc()
        if not multirun:
            # Exit here: a raised exception would make Hydra log a second line about the job.
            what = one_line(e) if bad_input or stopped else f"training failed: {type(e).__name__}: {one_line(e)}"
            print(f"error: {what}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_BAD_INPUT if bad_input else EXIT_FAILED) from None
        print(f"error: {label} failed: {one_line(e)}", file=sys.stderr, flush=True)
        _FAILED_JOBS.append(label)
    finally:
        import jax

        jax.clear_caches()  # the default launcher runs the next job in this same process


def _is_main_process() -> bool:
    """False only in a process other than 0 of a joined cluster (which writes no files)."""
    from zoo.train import distributed

    return distributed._JOINED is None or distributed._JOINED.process_id == 0


def one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _group_options(conf_dir: pathlib.Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml"))


def hydra_error_line(e: BaseException, conf_dir: pathlib.Path) -> str:
    """Hydra / OmegaConf composition errors -> `<key>: <what is wrong>; <fix>`."""
    text = str(e)
    m = re.search(r"Could not find '([^'/]+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        return f"{group}: unknown option {option!r}; choose one of {', '.join(_group_options(conf_dir, group))}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        cause = e.__cause__
        cause_text = one_line(cause) if cause else ""
        group, _, rest = key.partition(".")
        if "not in struct" in cause_text or "Key '" in cause_text:
            known = _known_keys(GROUPS[group], rest) if group in GROUPS and rest else []
            leaf = key.rsplit(".", 1)[-1]
            if leaf in known:  # a real key whose section is null in the chosen option (llama's moe)
                parent = key.rsplit(".", 1)[0]
                return f"{key}: {parent} is null in the chosen {group} option; choose a {group} that has it"
            hint = f"known keys here: {', '.join(known)}" if known else f"add it with +{key}=... only if it is meant to be new"
            return f"{key}: unknown key; {hint}"
        return f"{key}: {cause_text or 'cannot be overridden'}; check the value"
    m = re.search(r"Could not load '([^'/]+)/([^']+)'", text)
    if m:
        group, option = m.groups()
        return f"{group}: option {option!r} failed to load ({one_line(e.__cause__) if e.__cause__ else 'see the file'}); fix conf/{group}/{option}.yaml"
    key = getattr(e, "full_key", None) or getattr(e.__cause__, "full_key", None)
    if key:
        return f"{key}: {one_line(e.__cause__ or e)}; fix this value"
    return f"command line: {one_line(e)}; see python train.py --help"


def bad_input_line(e: BaseException, conf_dir: pathlib.Path, also: tuple[type, ...] = ()) -> Optional[str]:
    """The one line for an error that is bad input (config, Hydra, OmegaConf, or `also`), else None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, (ConfigError, *also)):
        line = one_line(e)
    elif isinstance(e, (HydraException, OmegaConfBaseException)):
        line = hydra_error_line(e, conf_dir)
    else:
        return None
    if os.environ.get("ZOO_TRACEBACK"):
        traceback.print_exc()
    return line


def main(hydra_main: Callable, conf_dir: pathlib.Path) -> int:
    """Run the @hydra.main function; turn every error into one line and an exit code."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's multi-line report
    try:
        hydra_main()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_FAILED)
    except Exception as e:  # noqa: BLE001
        line = bad_input_line(e, conf_dir)
        if line is not None:
            print(f"error: {line}", file=sys.stderr)
            return EXIT_BAD_INPUT
        traceback.print_exc()
        print(f"error: training failed: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return EXIT_FAILED
    if _FAILED_JOBS:
        print(f"error: {len(_FAILED_JOBS)} job(s) of the sweep failed: {'; '.join(_FAILED_JOBS)}", file=sys.stderr)
        return EXIT_FAILED
    return 0
