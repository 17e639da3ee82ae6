"""train.py's command line and environment, checked before Hydra reads them.

What Hydra would turn into a traceback or into a wrong message is one line here, naming the argument
or variable and the fix: an override without a key (`=3`), a key with characters outside Hydra's
grammar, a `$NAME` the shell did not expand (Hydra would make a folder named `$HOME`), a launcher
without `-m` (Hydra ignores it and runs here), a group option whose file is not text, a SLURM
variable that is not a number, an XLA_FLAGS that XLA would abort on. `ordered` puts `-m` before the
overrides, where Hydra's parser wants it (after them it took the run directory train.py adds for a
flag's argument).
"""

import math
import os
import pathlib
import re
from typing import Mapping, Optional

from zoo.ranges import INT_MAX
from zoo.train import xla_flags

MULTIRUN_FLAGS = ("-m", "--multirun")
# Hydra's flags that print (the composed config, help) and run nothing: no job, no run directory.
PRINTS = ("--cfg", "-c", "--info", "-i")
PRINT_ONLY = (*PRINTS, "--help", "-h", "--hydra-help", "--shell-completion", "-sc")
# SLURM's variables that zoo (zoo.tools.cli, zoo.train.distributed) and JAX read as numbers.
SLURM_NUMBERS = ("SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NNODES", "SLURM_NODEID")
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-@/.]*$")  # Hydra's key grammar, ASCII letters only
_UNEXPANDED = re.compile(r"(?<![\\$])\$([A-Za-z_]\w*)")  # $NAME, not ${...} (an interpolation)


def ordered(argv: list[str]) -> list[str]:
    """`argv` with `-m` / `--multirun` first (Hydra reads flags before the overrides)."""
    flags = [a for a in argv if a in MULTIRUN_FLAGS]
    return [*flags, *(a for a in argv if a not in MULTIRUN_FLAGS)]


def _overrides(args: list[str]) -> list[str]:
    """The key=value arguments (Hydra's flags and their values left out)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = a in ("-cn", "--config-name", "-cp", "--config-path", "-cd", "--config-dir", "-p", "--package")
            skip = skip or a in PRINTS  # --cfg job|hydra|all, --info <topic>: its value is no override
        else:
            out.append(a)
    return out


def slurm_number_line(name: str, value: Optional[str]) -> Optional[str]:
    """The one line for SLURM's variable `name` holding `value` where it is not a number (None: unset, empty or
    a number)."""
    if value is not None and value.strip() and not value.strip().isdigit():
        return (
            f"{name}: {value!r} in the environment is not a number (SLURM sets it to a count or an index); unset "
            f"it, or run under srun"
        )
    if value is not None and value.strip() and int(value) > INT_MAX:  # JAX's runtime takes a 32-bit count
        return (
            f"{name}: {value.strip()} in the environment is beyond any count or index SLURM sets (at most {INT_MAX}); "
            "unset it, or run under srun"
        )
    return None


def slurm_number(name: str, default: Optional[int], environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """SLURM's variable `name` (one of `SLURM_NUMBERS`) as a number, `default` where unset or empty; a value
    that is not a number is a ConfigError of one line naming the variable and the fix (`slurm_number_line`),
    for every caller: train.py checks the environment first (`line`), the tools and library code do not."""
    value = (os.environ if environ is None else environ).get(name)
    problem = slurm_number_line(name, value)
    if problem:
        from zoo.train.run_config import ConfigError

        raise ConfigError(problem)
    return int(value) if value is not None and value.strip() else default


def line(args: list[str], environ: Mapping[str, str], conf: pathlib.Path) -> Optional[str]:
    """The one line for the first problem of the command line `args` or the environment (None: none)."""
    for name in SLURM_NUMBERS:
        problem = slurm_number_line(name, environ.get(name))
        if problem:
            return problem
    problem = xla_flags.environment_line(environ)  # XLA aborts the process on it as JAX starts
    if problem:
        return problem
    overrides = _overrides(args)
    for arg in overrides:
        found = _override_line(arg)
        if found:
            return found
    if any(a in MULTIRUN_FLAGS for a in args):
        found = _sweep_size_line(overrides)
        if found:
            return found
    launchers = [a.split("=", 1)[1] for a in overrides if a.lstrip("+").startswith("hydra/launcher=")]
    dirs = _search_dirs(overrides, conf)
    printing = any(a in PRINT_ONLY for a in args)
    if launchers and not printing and not any(a in MULTIRUN_FLAGS for a in args) and _submits(launchers[-1], dirs):
        return (
            f"hydra/launcher: {launchers[-1]} launches the jobs of a sweep, and without -m this command runs here, "
            "ignoring it; add -m (python train.py -m hydra/launcher=... ...), or drop it (srun python train.py ... "
            "inside an allocation)"
        )
    return _option_file_line(overrides, dirs) or (None if printing else _full_disk_line(args, overrides))


# Less free space than this where the run directory goes: Hydra's record of the config alone would not fit.
MIN_FREE_BYTES = 1 << 20


def _full_disk_line(args: list[str], overrides: list[str], statvfs=os.statvfs) -> Optional[str]:
    """The run (or sweep) directory's filesystem full: Hydra would fail writing its .hydra/ record."""
    key = "hydra.sweep.dir" if any(a in MULTIRUN_FLAGS for a in args) else "hydra.run.dir"
    given = [a.split("=", 1)[1] for a in overrides if a.lstrip("+").split("=", 1)[0] == key]
    where = pathlib.Path(given[-1].strip("'\"").split("${", 1)[0] or ".").expanduser() if given else pathlib.Path(".")
    where = where.absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = statvfs(where)
    except OSError:
        return None  # not a directory that exists: the run directory's own checks name it
    free = st.f_bavail * st.f_frsize
    if free >= MIN_FREE_BYTES or st.f_blocks == 0:
        return None  # room, or no disk at all (/proc, /sys: the run directory's own checks name those)
    return (
        f"{key}: no space left on the filesystem of {where} ({free} bytes free); free some space, or give {key}=<a "
        "directory on another disk>"
    )


def _submits(launcher: str, dirs: list[pathlib.Path]) -> bool:
    """Whether the launcher option exists and runs the jobs elsewhere (`basic`, Hydra's default, runs
    them here; an unknown option is Hydra's to name)."""
    files = (d / "hydra" / "launcher" / f"{launcher}.yaml" for d in dirs)
    return launcher != "basic" and (launcher.startswith("submitit") or any(f.is_file() for f in files))


def _override_line(arg: str) -> Optional[str]:
    key, eq, value = arg.partition("=")
    if key == "~model":  # conf/config.yaml's recipe is chosen by the model's name
        return "model: the group is missing (~model deletes it); choose an option, e.g. model=llama_tiny_a"
    key = key.lstrip("+~")
    if not eq:
        return None  # Hydra's own message names it (`no value`)
    if not key.strip():
        return f"command line: {arg!r} has no key before its '='; write <key>={value} (e.g. trainer.steps={value or 3})"
    if not _KEY.match(key):
        bad = next((c for c in key if not (c.isascii() and (c.isalnum() or c in "_-@/."))), key[0])
        return (
            f"{key}: {bad!r} cannot be in a key (keys are ASCII letters, digits, _ . / - and @); check the "
            "spelling of the key"
        )
    m = _UNEXPANDED.search(value)
    if m:
        name = m.group(1)
        return (
            f"{key}: {value!r} holds ${name}, which the shell did not expand (single quotes?), and Hydra would use "
            f'it as it is; write {key}="{value}" or give the value itself'
        )
    return None


def _search_dirs(overrides: list[str], conf: pathlib.Path) -> list[pathlib.Path]:
    dirs = [conf]
    for a in overrides:
        key, _, value = a.lstrip("+").partition("=")
        if key == "hydra.searchpath":
            for entry in value.strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if entry.startswith("file://"):
                    dirs.append(pathlib.Path(entry.removeprefix("file://")))
    return dirs


# Hydra's basic sweeper lists every job of a sweep before the first runs: a range of 1e8 values took minutes
# and gigabytes before any job, and then ran for ever.
MAX_SWEEP_JOBS = 10000
_RANGE = re.compile(r"^range\(\s*([^,()]+?)\s*(?:,\s*([^,()]+?)\s*)?(?:,\s*([^,()]+?)\s*)?\)$")


def _sweep_values(value: str) -> int:
    """How many values a sweep override's value stands for: `range(a, b[, step])`, or a comma list (1 for
    anything else, whatever Hydra makes of it)."""
    m = _RANGE.match(value.strip())
    if m:
        try:
            nums = [float(g) for g in m.groups() if g is not None]
        except ValueError:
            return 1
        start, stop, step = (
            (0.0, nums[0], 1.0) if len(nums) == 1 else (nums[0], nums[1], nums[2] if len(nums) > 2 else 1.0)
        )
        return max(0, math.ceil((stop - start) / step)) if step and math.isfinite(stop - start) else 1
    depth, count = 0, 1
    for ch in value:
        depth += ch in "[({"
        depth -= ch in "])}"
        count += ch == "," and depth == 0
    return count


def _sweep_size_line(overrides: list[str]) -> Optional[str]:
    """One line for a sweep (-m) of more than MAX_SWEEP_JOBS jobs, before Hydra lists them all."""
    sizes = [(a, _sweep_values(a.split("=", 1)[1])) for a in overrides if "=" in a and not a.startswith("hydra")]
    jobs = math.prod(n for _, n in sizes)
    if jobs <= MAX_SWEEP_JOBS:
        return None
    widest = max(sizes, key=lambda s: s[1])
    return (
        f"-m: the sweep has {jobs} jobs ({widest[0]}: {widest[1]} values), which Hydra would list before the first "
        f"runs; sweep at most {MAX_SWEEP_JOBS} jobs a command"
    )


def option_files_line(overrides: list[str], conf: pathlib.Path) -> Optional[str]:
    """`_option_file_line` over conf/ and the overrides' hydra.searchpath: what the tools, which compose
    train.py's config themselves (zoo.tools.kit.compose), check before Hydra reads the files."""
    return _option_file_line(overrides, _search_dirs(overrides, conf))


def _option_file_line(overrides: list[str], dirs: list[pathlib.Path]) -> Optional[str]:
    """A group option (`hardware=x`, `offload=[a,b]`) whose YAML file in `dirs` (conf/ and
    hydra.searchpath's) is not UTF-8 text: Hydra's reader would end in a UnicodeDecodeError."""
    for a in overrides:
        group, _, value = a.lstrip("+~").partition("=")
        if not group or "." in group or not value:
            continue
        for option in value.strip("[]").split(","):
            option = option.strip()
            for d in dirs:
                path = d / group / f"{option}.yaml"
                try:
                    path.read_bytes().decode("utf-8")
                except UnicodeDecodeError as e:
                    return (
                        f"{group}: option {option!r} is {path}, which is not UTF-8 text (byte "
                        f"0x{e.object[e.start]:02x} at offset {e.start}); fix or remove that file, or choose another "
                        f"{group}"
                    )
                except OSError:
                    continue
                break  # the first directory that has the option is the one Hydra reads
    return None
