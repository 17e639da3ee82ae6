"""The command-line edge of train.py: one Hydra job with failure capture, and one-line errors.

Bad input ends the process with `error: <key>: <what is wrong>; <fix>` on stderr and exit code 2;
a job that fails while training prints its traceback, then one `error:` line, exit code 1. In a
multirun (`-m`) a failed job is recorded in its summary.json (status "failed", its overrides, the
error), reported in one line, and the sweep goes on; the process exits 1 at the end if any failed.
Set ZOO_TRACEBACK=1 to see Python tracebacks for configuration errors too.
"""

import argparse
import contextlib
import datetime
import os
import pathlib
import re
import signal
import sys
import tempfile
import traceback
from typing import Callable, Optional

from omegaconf import DictConfig

from zoo.offload import ACTIONS, conf_dir, custom_tag_overrides, dropped_block_tags
from zoo.sharding import LOGICAL_AXES
from zoo.tags import OPTIONAL_KINDS, TAGS, block_kinds
from zoo.train import distributed, run_dir, stop
from zoo.train.command_line import slurm_number
from zoo.train.run_lock import DirLock
from zoo.train.xla_flags import environment_line as xla_environment_line
from zoo.train.metrics import write_json
from zoo.train.run import prepare, train
from zoo.train.config_checks import known_keys
from zoo.train.run_config import (
    GROUPS,
    ConfigError,
    RunInterrupted,
    TrainingStopped,
    foreign_data_key_line,
)

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a command Ctrl-C stopped

_FAILED_JOBS: list[str] = []


def _hydra_context():
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return (
        pathlib.Path(hc.runtime.output_dir),
        list(hc.overrides.task),
        hc.mode == RunMode.MULTIRUN,
        hc.job.get("num", None),
    )


def run_job(cfg: DictConfig, out_of_memory_line: Optional[Callable] = None) -> None:
    """The body of @hydra.main. `out_of_memory_line(c, trainer, error, overrides)`: the one line for a
    run that ran out of device memory (train.py gives zoo.plan.oom's; None: XLA's error as it is)."""
    import logging

    logging.getLogger("jax").setLevel(logging.WARNING)  # Hydra's logging config would show JAX's INFO lines
    logging.getLogger("absl").setLevel(logging.WARNING)  # and orbax's, one per save
    out_dir, overrides, multirun, num = _hydra_context()
    label = f"job {num} [{' '.join(overrides)}]" if multirun else "run"
    # A sweep's jobs run in this one process: a Ctrl-C as this job starts must not name the phase the
    # job before it ended in (its last save, say).
    stop.set_phase(
        f"starting {label}" if multirun else "starting",
        "no step of this job ran (the jobs before it are done)" if multirun else stop.PHASE_AFTER_START,
    )
    lock, refused = None, False
    earlier = run_dir.holds_record(out_dir)  # another run's record is there (this run may only continue it)
    try:
        c, plan, devices, flags = prepare(cfg)
        line = ignored_override_line(c, overrides)
        if line:
            raise ConfigError(line)
        try:  # after prepare: the processes of a multi-process run have joined, and only process 0 takes it
            lock = _hold_run_dir(out_dir)
        except ConfigError:
            refused = True  # a live run holds the directory: its summary.json is not ours to write
            raise
        try:
            train(c, plan, devices, out_dir, xla_flags=flags, overrides=overrides)
        except Exception as e:  # noqa: BLE001 - only XLA's out-of-memory is rewritten; the rest goes on as it was
            if out_of_memory_line is None or not is_out_of_memory(e):
                raise
            from zoo.train.step import Trainer

            raise ConfigError(out_of_memory_line(c, Trainer(c, plan, devices), e, overrides)) from None
    except Exception as e:  # noqa: BLE001 - every failure is reported, none stops a sweep
        bad_input = isinstance(e, ConfigError)
        stopped = isinstance(e, TrainingStopped)  # the run stopped itself and says why in one line
        # A live run's summary, or an earlier run's that bad input never got to continue, is not ours to replace.
        if distributed.is_main_process() and not refused and not (bad_input and earlier):
            write_json(
                out_dir / "summary.json",
                {
                    "status": "failed",
                    "overrides": overrides,
                    "error": one_line(e),
                    "error_type": type(e).__name__,
                    "bad_input": bad_input,
                },
            )
        if not (bad_input or stopped) or os.environ.get("ZOO_TRACEBACK"):
            traceback.print_exc()
        if not multirun:
            # Exit here: a raised exception would make Hydra log a second line about the job.
            what = one_line(e) if bad_input or stopped else f"training failed: {type(e).__name__}: {one_line(e)}"
            print(f"error: {what}", file=sys.stderr, flush=True)
            if stopped:
                # A run that stopped itself has said why in the line above; nothing after it is news (a failed
                # checkpoint save leaves orbax's threads reporting into a closing event loop at shutdown).
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
            raise SystemExit(
                EXIT_BAD_INPUT if bad_input else EXIT_INTERRUPTED if isinstance(e, RunInterrupted) else EXIT_FAILED
            ) from None
        print(f"error: {label} failed: {one_line(e)}", file=sys.stderr, flush=True)
        if isinstance(e, RunInterrupted):  # a Ctrl-C ends the sweep, not only its job
            raise SystemExit(EXIT_INTERRUPTED) from None
        _FAILED_JOBS.append(label)
    finally:
        if lock is not None:
            lock.release()
        import jax

        jax.clear_caches()  # the default launcher runs the next job in this same process


def ignored_override_line(c, overrides) -> Optional[str]:
    """One line for a key given on the command line that the run would accept and never read (None:
    every one is read). The config alone cannot tell: the same values come from the options' files too
    (trainer.eval_every: 100 for every run, block_tags of every kind in the offload presets)."""
    for override in overrides:
        if override.startswith("~"):
            continue  # a deletion sets nothing
        key = override.lstrip("+").split("=", 1)[0]
        parts = key.split(".")
        if key in ("trainer.eval_every", "trainer.eval_batches") and not (c.data.eval_fraction or c.data.eval_path):
            if c.data.name != "text":
                return (
                    f"{key}: evaluates the held-out split, and data={c.data.name} has none (its synthetic tokens are "
                    "endless); "
                    "drop it, or train on text with a split (data=text data.eval_fraction=0.05)"
                )
            return (
                f"{key}: evaluates the held-out split, and this run has none; add data.eval_fraction=0.05 (or "
                "data.eval_path=<file>), or drop it"
            )
        if parts[:2] == ["offload", "block_tags"] and len(parts) > 2:
            kinds = [k for k in block_kinds(c.model) if k in OPTIONAL_KINDS]
            if parts[2] in OPTIONAL_KINDS and parts[2] not in kinds:
                return (
                    f"offload.block_tags.{parts[2]}: the {c.model.family} model has no {parts[2]} blocks (its "
                    "optional blocks: "
                    f"{', '.join(kinds) or 'none'}), so this would be ignored; drop it"
                )
            if len(parts) == 4 and parts[3] in dropped_block_tags(c.offload, c.model):
                return (
                    f"{key}: this {c.model.family} configuration does not emit {parts[3]}, so this would be ignored; "
                    "drop it "
                    f"(python -m zoo.tools.inspect_step lists the tags it emits)"
                )
    return None


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is XLA's out-of-memory (at compile time on a TPU, or when a step allocates)."""
    s = str(e)
    return "RESOURCE_EXHAUSTED" in s and ("memory" in s.lower() or "HBM" in s)


RUN_LOCK = "zoo.run.lock"


def _hold_run_dir(out_dir: pathlib.Path):
    """Take the run directory's lock (process 0), so that a second run started into the directory of a
    live one stops in one line instead of writing its summary.json over the live run's."""
    if not distributed.is_main_process():
        return None

    lock = DirLock(out_dir, RUN_LOCK, "hydra.run.dir")
    lock.acquire(print)
    return lock


def _writes_nothing(args: list[str]) -> bool:
    """Hydra's flags that print (help, the config, info) and run no job."""
    return any(
        a in ("-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info", "-sc", "--shell-completion")
        or a.startswith("--cfg")
        for a in args
    )


def _output_dir_arg(args: list[str]) -> tuple[str, list[str]]:
    """(`hydra.run.dir`, or `hydra.sweep.dir` with -m; the values given for it, last one wins)."""
    key = "hydra.sweep.dir" if any(a in ("-m", "--multirun") for a in args) else "hydra.run.dir"
    return key, [a.split("=", 1)[1] for a in args if a.lstrip("+").split("=", 1)[0] == key and "=" in a]


def _several_processes(args: list[str]) -> bool:
    """Whether this is one process of a multi-process run (they share one run directory)."""
    return any(a.lstrip("+").startswith("distributed.") for a in args) or slurm_number("SLURM_NTASKS", 1) > 1


def claim_dir(base: pathlib.Path) -> list[pathlib.Path]:
    """`base`, or `base-1`, `base-2`, ... where it is taken, created with `os.mkdir` (which one process
    wins) for one run alone: directories named by the second are otherwise shared by two commands
    started in the same second, and the second rewrites what the first wrote. Returns the directories
    created, the claimed one last."""
    made = [d for d in reversed(base.parents) if str(d) != "." and not d.exists()]
    base.parent.mkdir(parents=True, exist_ok=True)
    for i in range(1000):
        candidate = base if i == 0 else base.with_name(f"{base.name}-{i}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return [*made, candidate]
    raise ConfigError(f"{base} and its next 999 suffixes are all taken; name an output directory")


def _fresh_run_dir(args: list[str], now: Optional[datetime.datetime] = None) -> list[pathlib.Path]:
    """Hydra's default run directory (outputs/<date>/<time>, by the second), or with -m its sweep
    directory (multirun/<date>/<time>), claimed for this command alone (`claim_dir`). Two runs started
    in the same second otherwise share it, and Hydra rewrites the first one's `.hydra/` (its config and
    overrides) before the second is refused; two sweeps would share their jobs' directories. Returns
    the directories it created, the claimed one last; none where the command gives its own directory,
    writes nothing, or is one of several processes of one run (those share the directory: process 0
    locks it)."""
    key, given = _output_dir_arg(args)
    if given or _writes_nothing(args) or _several_processes(args):
        return []
    now = now or datetime.datetime.now()
    # Relative, as Hydra's own default: digits and dashes only, nothing its override grammar reads.
    root = "multirun" if key == "hydra.sweep.dir" else "outputs"
    try:
        return claim_dir(pathlib.Path(root) / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S"))
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}".replace("name an output directory", f"give {key}=<dir>")) from None


def _keep_earlier_hydra_record(args: list[str]) -> list[str]:
    """`hydra.output_subdir=null` when the output directory given already holds a run's steps (a sweep:
    one of its jobs'): Hydra would rewrite the `.hydra/` there (the config and the overrides of the run
    that wrote those steps) before train.py can tell whether this run continues that record or is
    refused (zoo.train.run_dir). A run that continues it keeps the `.hydra/` of the run that began it."""
    key, given = _output_dir_arg(args)
    text = given[-1].strip("'\"") if given else ""
    if (
        _writes_nothing(args)
        or not text.strip()
        or "${" in text
        or any(a.lstrip("+").startswith("hydra.output_subdir=") for a in args)
    ):
        # Hydra's default directory is new (it is named by the time), and interpolations are Hydra's to resolve
        return []
    d = pathlib.Path(text).expanduser()
    runs = [d] if key == "hydra.run.dir" else [j for j in d.iterdir() if j.is_dir()] if d.is_dir() else []
    return ["hydra.output_subdir=null"] if any(run_dir.holds_record(r) for r in runs) else []


def output_dir_line(args: list[str]) -> Optional[str]:
    """Before Hydra creates the output directory (and configures logging, writes .hydra/ into it):
    one line when it cannot be created or written, or a live run holds it; None when it is fine."""
    if _writes_nothing(args):
        return None
    key, given = _output_dir_arg(args)
    multirun = key == "hydra.sweep.dir"
    cwd = pathlib.Path.cwd()
    if given:
        text = given[-1].strip("'\"")
        if not text.strip():  # Hydra would run in the working directory itself
            return (
                f"{key}: empty (an unset shell variable?); give a directory, e.g. {key}=runs/1, or leave it out "
                f"for Hydra's default ({'multirun' if multirun else 'outputs'}/<date>/<time>)"
            )
        fixed = text.split("${", 1)[0]  # the part without interpolations (${now:...}) is checked
        if fixed != text:
            fixed = fixed.rsplit("/", 1)[0] if "/" in fixed else "."
        target = (cwd / pathlib.Path(fixed).expanduser()) if fixed else cwd
        fix = f"choose a writable directory ({key}=<dir>)"
    else:  # Hydra's default: outputs/<date>/<time> (multirun/... for -m) under the working directory
        target = cwd / ("multirun" if multirun else "outputs")
        fix = f"run from a writable directory or set {key}=<a writable directory>"
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return f"{key}: {existing} is a file, not a directory; {fix}"
    held = run_dir.checkpoint_around(target / ".hydra") if given else None
    if held is not None:  # its .hydra/, metrics.jsonl and summary.json would go among the saved steps
        inside = "a train.py checkpoint.dir" if held == target.absolute() else f"inside the train.py checkpoint {held}"
        return f"{key}: {target} is {inside}, which this would change; {fix}"
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".zoo-write-probe-"):
            pass
    except OSError as e:
        what = f"cannot write in {existing}" if existing == target else f"cannot create {target} in {existing}"
        where = f" (the working directory: Hydra's default {key} is under it)" if not given and existing == cwd else ""
        return f"{key}: {what} ({e.strerror or e}){where}; {fix}"
    # The processes of one multi-process run share the run directory, and process 0 holds its lock.
    if given and not _several_processes(args) and target.is_dir() and (target / RUN_LOCK).exists():
        lock = DirLock(target, RUN_LOCK, key)
        owner = lock.held_by_another()
        if owner:
            return lock.in_use_line(owner)
    return None


def one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


TRAIN = "python train.py"


def _group_options(conf_dir: pathlib.Path, group: str) -> list[str]:
    """The group's YAML files and the options Python registers (zoo.train.run_config), base nodes left out."""
    from hydra.core.config_store import ConfigStore

    try:
        stored = [name.removesuffix(".yaml") for name in ConfigStore.instance().list(group)]
    except OSError:  # no such group in the store
        stored = []
    return sorted({p.stem for p in (conf_dir / group).glob("*.yaml")} | {n for n in stored if not n.startswith("_")})


def _closest(word: str, choices) -> str:
    """` (did you mean X?)` for a near miss, else ''."""
    import difflib

    near = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {near[0]}?)" if near else ""


def _override_value(text: str, key: str) -> Optional[str]:
    """The value of `key=value` as Hydra's message quotes it (`To append to your config use +key=value`)."""
    m = re.search(rf"\+{re.escape(key)}=(.*)", text)
    return m.group(1).strip() if m else None


def _unparsable(args) -> Optional[tuple[str, str]]:
    """The first argument Hydra's override grammar rejects, and why."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for arg in args:
        try:
            parser.parse_override(arg)
        except Exception as e:  # noqa: BLE001 - Hydra raises its own and ANTLR's errors here
            return arg, one_line(e)
    return None


def _parse_error_line(args, tool: str) -> str:
    bad = _unparsable(args)
    if bad is None:
        return (
            "command line: an argument is not an override; arguments are key=value (e.g. trainer.steps=20); "
            f"see {tool} --help"
        )
    arg, why = bad
    if arg.startswith("-"):
        return (
            f"{arg}: not a flag of {tool} nor an override; arguments are key=value (e.g. trainer.steps=20); "
            f"see {tool} --help"
        )
    if "=" not in arg:
        return f"{arg}: no value; write {arg}=<value> (+{arg}=<value> adds a key, ~{arg} deletes one)"
    key, value = arg.split("=", 1)
    key = key.lstrip("+~")
    if value.startswith("~"):  # bash leaves ~ unexpanded after `key=`, and Hydra's grammar has no ~
        if value[1:2] in ("", "/"):
            return (
                f"{key}: {value!r} starts with ~, which neither bash (after key=) nor Hydra expands; write "
                f"{key}=$HOME{value[1:]} (the shell expands $HOME)"
            )
        return (
            f"{key}: {value!r} starts with ~, which neither bash (after key=) nor Hydra expands; write "
            f"{key}=<the absolute path>"
        )
    return f"{key}: cannot parse {arg!r} ({why}); quote the value, e.g. {key}='<value>', or see https://hydra.cc/docs/advanced/override_grammar/basic"


def _map_key_line(key: str, value: Optional[str]) -> Optional[str]:
    """A key of a map-valued field (offload.tags, offload.block_tags.<kind>, mesh.rules) that the chosen
    option does not list: adding it with `+` works exactly when the name and the value are valid."""
    parts = key.split(".")
    add = f"the chosen {parts[0]} option does not list it; add it with +{key}={value}"
    if (
        parts[:2] == ["offload", "tags"]
        and len(parts) == 3
        or parts[:2] == ["offload", "block_tags"]
        and len(parts) == 4
    ):
        if parts[1] == "block_tags" and parts[2] not in OPTIONAL_KINDS:
            return f"offload.block_tags.{parts[2]}: unknown block kind; choose one of {', '.join(OPTIONAL_KINDS)}"
        tag = parts[-1]
        if tag not in TAGS:
            return f"{key}: unknown tag{_closest(tag, TAGS)}; valid tags: {', '.join(TAGS)}"
        if value not in ACTIONS:
            return f"{key}: {value!r} is not an action; choose one of {', '.join(ACTIONS)}"
        return f"{key}: {add}"
    if parts[:2] == ["mesh", "rules"] and len(parts) == 3:
        if parts[2] not in LOGICAL_AXES:
            return (
                f"{key}: unknown logical axis{_closest(parts[2], LOGICAL_AXES)}; the logical axes are "
                f"{', '.join(LOGICAL_AXES)}"
            )
        return f"{key}: {add}"
    return None


def _unknown_key_line(key: str, value: Optional[str]) -> str:
    group, _, rest = key.partition(".")
    if group not in GROUPS:
        what = "not a config group" if not rest else "unknown group"
        return (
            f"{key}: {what}{_closest(group, GROUPS)}; the groups are {', '.join(GROUPS)} (choose an option with "
            f"<group>=<option>, set a key with <group>.<key>=<value>)"
        )
    if group == "data" and "." not in rest:
        # The chosen option does not list the key: it does not read it, so `+` would be silently ignored.
        line = foreign_data_key_line(rest, value)
        if line:
            return line
    mapped = _map_key_line(key, value)
    if mapped:
        return mapped
    known = known_keys(GROUPS[group], rest)
    leaf = key.rsplit(".", 1)[-1]
    parent = key.rsplit(".", 1)[0]
    if leaf in known and parent != group:  # a real key whose section is null in the chosen option (llama's moe)
        return f"{key}: {parent} is null in the chosen {group} option; choose a {group} that has it"
    if leaf in known:  # a key the option's file leaves out (e.g. a modifier preset that sets one key)
        return f"{key}: the chosen {group} option does not list it; add it with +{key}={value}"
    if known:
        return f"{key}: unknown key{_closest(leaf, known)}; known keys here: {', '.join(known)}"
    return f"{key}: unknown key; check the spelling ({parent} has no such key)"


def hydra_error_line(e: BaseException, conf_dir: pathlib.Path, tool: str = TRAIN, args=None) -> str:
    """Hydra / OmegaConf composition errors -> `<key>: <what is wrong>; <fix>`. `args`: the overrides
    given (default: this process's arguments), to find the one Hydra could not parse."""
    from hydra.errors import OverrideParseException

    text = str(e)
    args = list(sys.argv[1:] if args is None else args)
    if isinstance(e, OverrideParseException):
        return _parse_error_line(args, tool)
    m = re.search(r"Could not (find|load) '([^']*)/([^'/]*)'", text)
    if m:
        how, group, option = m.groups()
        listed = re.search(r"Available options in '[^']*':\n((?:\t.*\n?)*)", text)
        options = (
            [o.strip() for o in listed.group(1).splitlines() if o.strip()]
            if listed
            else _group_options(conf_dir, group)
        )
        options = [
            o for o in options if not o.startswith("_")
        ]  # a group's base values (e.g. mesh/_defaults), not a choice
        if how == "load" and (conf_dir / group / f"{option}.yaml").is_file():
            cause = one_line(e.__cause__) if e.__cause__ else "see the file"
            return f"{group}: option {option!r} failed to load ({cause}); fix conf/{group}/{option}.yaml"
        if not option:
            return f"{group}: no option given; choose one of {', '.join(options)}"
        return f"{group}: unknown option {option!r}{_closest(option, options)}; choose one of {', '.join(options)}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        key = m.group(1)
        cause = e.__cause__
        cause_text = one_line(cause) if cause else ""
        if "not in struct" in cause_text or "Key '" in cause_text:
            return _unknown_key_line(key, _override_value(text, key))
        return f"{key}: {cause_text or 'cannot be overridden'}; check the value"
    m = re.search(r"Could not append to config. An item is already at '([^']+)'", text)
    if m:
        return f"{m.group(1)}: already set; drop the + to change it ({m.group(1)}=<value>)"
    m = re.search(r"Could not delete from config. (?:The value of )?'([^']+)'", text)
    if m:
        return f"{m.group(1)}: cannot delete it (~ works on keys that exist); check the spelling"
    key = getattr(e, "full_key", None) or getattr(e.__cause__, "full_key", None)
    if key:
        return f"{key}: {one_line(e.__cause__ or e)}; fix this value"
    return f"command line: {one_line(e)}; see {tool} --help"


def bad_input_line(
    e: BaseException, conf_dir: pathlib.Path, also: tuple[type, ...] = (), tool: str = TRAIN, args=None
) -> Optional[str]:
    """The one line for an error that is bad input (config, Hydra, OmegaConf, or `also`), else None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(e, (ConfigError, UsageError, *also)):
        line = one_line(e)
    elif isinstance(e, (HydraException, OmegaConfBaseException)):
        line = hydra_error_line(e, conf_dir, tool, args)
    else:
        return None
    if os.environ.get("ZOO_TRACEBACK"):
        traceback.print_exc()
    return line


class UsageError(ValueError):
    """A command line argparse refused (an unknown flag, a missing argument): one line."""


@contextlib.contextmanager
def _argparse_one_line(tool: str):
    """Hydra's own argparse parser prints its usage and exits; make its complaint one `error:` line."""
    error = argparse.ArgumentParser.error

    def one_line_error(parser, message):
        raise UsageError(
            f"command line: {message}; overrides are key=value (e.g. trainer.steps=20), flags are Hydra's; see {tool} "
            "--help"
        )

    argparse.ArgumentParser.error = one_line_error
    try:
        yield
    finally:
        argparse.ArgumentParser.error = error


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the tools: a bad command line is one `error:` line and exit code 2, not a usage block."""

    def error(self, message):
        print(f"error: command line: {message}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def check_writable(path, key: str) -> pathlib.Path:
    """Probe, before any long compile, that a file can be written at `path` (creating its folder);
    ConfigError naming `key` otherwise. For tools' output keys (inspect.out, plan.out, ...)."""
    out = pathlib.Path(path).expanduser()
    if out.is_dir():
        raise ConfigError(f"{key}: {out} is a directory; give a file path, e.g. {key}={out / 'out.json'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            with open(out, "a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", suffix=".probe"):
                pass
    except OSError as err:
        raise ConfigError(f"{key}: cannot write {out} ({err.strerror or err}); choose a writable path") from None
    return out


# The tools that write into `hydra.run.dir` when it is given (zoo.tools.kit.output_path); the others refuse it.
RUN_DIR_TOOLS = ("python -m zoo.tools.plan", "python -m zoo.tools.inspect_step")


def hydra_dir_line(argv, tool: str) -> Optional[str]:
    """One line for Hydra's output-directory options given to a tool that would not honour them: a tool runs
    once (no sweep directory), and only `RUN_DIR_TOOLS` write into `hydra.run.dir`; None when all is well."""
    for arg in argv:
        key = str(arg).lstrip("+").split("=", 1)[0]
        if key in ("-m", "--multirun", "hydra.sweep.dir", "hydra.sweep.subdir"):
            return f"{key}: {tool} runs once, not a sweep (Hydra's multirun is train.py's); drop it"
        if key == "hydra.run.dir" and tool not in RUN_DIR_TOOLS:
            return (
                f"hydra.run.dir: {tool} does not write into a run directory (where it writes, if anywhere, its own "
                "options say); drop it"
            )
    return None


def run_tool(body: Callable[[], int], tool: str, argv=(), doc: Optional[str] = None) -> int:
    """A command-line tool's body (`python -m zoo.<tool> ...`): `--help` prints `doc`; bad input ->
    one `error:` line naming the key or file and exit code 2, before any compile; Ctrl-C -> one line
    saying what was being done (the body's `zoo.train.stop.set_phase`) and what is left, exit code 130."""
    if any(a in ("-h", "--help") for a in argv):
        if doc is None and tool.startswith("python -m "):
            import importlib

            doc = importlib.import_module(tool.removeprefix("python -m ")).__doc__
        print(f"usage: {tool} [key=value ...]  (docs/training.md describes the keys)\n\n{doc or ''}".rstrip())
        return 0
    try:
        _take_ctrl_c_from_starting()
        with stop.ctrl_c_noted(again_at_once=True):
            stop.set_phase("starting", "nothing was done; run the command again")
            # XLA_FLAGS that XLA aborts the process on, before the body starts JAX's backend
            line = hydra_dir_line(argv, tool) or xla_environment_line(os.environ)
            if line:
                raise ConfigError(line)
            code = body()
            stop.raise_if_interrupted()  # one a library swallowed (no unraisable report) still ends the command
            return code
    except KeyboardInterrupt:
        print(interrupted_line(), file=sys.stderr, flush=True)
        if _is_this_process(tool):
            # Leave at once: the interpreter's shutdown, with XLA's compile still running on its threads, crashed
            # the process after this line (exit -11, 3 of 4 Ctrl-C during zoo.tools.generate's compile).
            sys.stdout.flush()
            os._exit(EXIT_INTERRUPTED)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001
        line = bad_input_line(e, _conf_dir(), also=(ValueError,), tool=tool, args=argv)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _take_ctrl_c_from_starting() -> None:
    """Python's own Ctrl-C handler back in place of the one zoo.tools set for the tool's imports, so that
    `stop.ctrl_c_noted` installs the body's."""
    import zoo.tools

    if signal.getsignal(signal.SIGINT) is zoo.tools._interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _is_this_process(tool: str) -> bool:
    """Whether `tool` ("python -m zoo.tools.<name>") is what this process was started as, not a call of its
    entry point from other code (a test's)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == tool.removeprefix("python -m ")


def interrupted_line() -> str:
    """The one line a Ctrl-C ends a command with: what it was doing (zoo.train.stop.set_phase) and what is left."""
    return f"error: interrupted (Ctrl-C) while {stop.PHASE}; {stop.PHASE_AFTER}"


def _conf_dir() -> pathlib.Path:
    return conf_dir()


def main(hydra_main: Callable, conf_dir: pathlib.Path) -> int:
    """Run the @hydra.main function; turn every error into one line and an exit code."""
    os.environ["HYDRA_FULL_ERROR"] = "1"  # let errors reach us instead of Hydra's multi-line report
    try:
        _take_ctrl_c_from_starting()  # train.py's handler for its imports (zoo.tools.take_ctrl_c_while_starting)
        line = output_dir_line(sys.argv[1:])
        if line:
            print(f"error: {line}", file=sys.stderr)
            return EXIT_BAD_INPUT
        argv = sys.argv
        made = _fresh_run_dir(argv[1:])
        key = _output_dir_arg(argv[1:])[0]
        sys.argv = [
            argv[0],
            *custom_tag_overrides(argv[1:]),  # offload=custom takes any tag without `+`
            *_keep_earlier_hydra_record(argv[1:]),
            *([f"{key}={made[-1]}"] if made else []),
        ]
        try:
            # As for the tools (run_tool): a Ctrl-C Python swallows (in JAX's garbage-collector callback,
            # say) is raised again at the run's next phase or step (zoo.train.run), not lost.
            with _argparse_one_line(TRAIN), stop.ctrl_c_noted():
                hydra_main()
        finally:
            sys.argv = argv
            for d in reversed(made):
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()  # stopped before Hydra wrote anything (a bad override): no empty directory left
    except KeyboardInterrupt:
        print(interrupted_line(), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
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
