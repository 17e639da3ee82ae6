"""The kit the command-line tools share (zoo.tools.inspect_step, zoo.tools.plan, zoo.tools.scale,
zoo.tools.gpu_lowering, zoo.tools.measure_hardware): compose train.py's Hydra config and build its step without
training, split a tool's own `<tool>.key=value` options from the Hydra overrides, choose and probe where a tool writes,
format bytes and tables. With `zoo.tools.cli` (one-line errors, exit codes, `run_tool`), which
train.py shares. Library modules never import this: it sits above them.
"""

import dataclasses
import json
import pathlib
import time
from typing import Callable, Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.offload import conf_dir, custom_tag_overrides, dropped_block_tags, resolve
from zoo.tools.cli import (  # noqa: F401 (the kit's other half)
    EXIT_BAD_INPUT,
    check_writable,
    claim_dir,
    output_dir_line,
    run_tool,
)
from zoo.train import run_dir as run_record
from zoo.train.command_line import option_files_line
from zoo.train.run import prepare
from zoo.train.config_checks import number_as_bool_line
from zoo.train.run_config import ConfigError
from zoo.train.step import Trainer


# How each tool's files begin, by (tool, key): the same command run again may replace its own earlier output, and
# nothing else (a profile shipped in conf/, a run's summary.json, a user's file) without `<tool>.overwrite=true`.
def _text_starts(prefix: str) -> Callable[[bytes], bool]:
    return lambda data: data.startswith(prefix.encode())


def _json_with(**fields) -> Callable[[bytes], bool]:
    """A JSON object with these keys (a value of None: any value; else that value)."""

    def matches(data: bytes) -> bool:
        try:
            obj = json.loads(data)
        except ValueError:
            return False
        return isinstance(obj, dict) and all(k in obj and (v is None or obj[k] == v) for k, v in fields.items())

    return matches


WRITTEN_BY = {
    ("plan", "plan.out"): _text_starts("# Planned by: python -m zoo.tools.plan"),
    ("plan", "plan.json"): _json_with(info=None, estimate=None, candidates=None, policy=None),
    ("inspect", "inspect.out"): _json_with(schema="zoo.inspect/1"),
    ("measure_hardware", "out"): _text_starts("# Measured by python -m zoo.tools.measure_hardware"),
    ("measure_hardware", "name"): _text_starts("# Measured by python -m zoo.tools.measure_hardware"),
    # zoo.tools.report's files, by name (its key is dir or --out): the table, and the plots matplotlib wrote
    ("report", "report.md"): _text_starts("# Sweep report: "),
    ("report", "report.png"): lambda data: b"Matplotlib" in data[:4096],
    ("report", "expert_load.png"): lambda data: b"Matplotlib" in data[:4096],
}
RUN_DIR_KEY = "hydra.run.dir"
OVERWRITE = "overwrite"


def overwrite_asked(argv: Sequence[str], prefix: str) -> bool:
    """Whether `<prefix>.overwrite=true` is given (the last one wins); ValueError (one line) for a value that is
    not a boolean. `split_tool_args` leaves the key to this."""
    values = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0] == f"{prefix}.{OVERWRITE}" and "=" in a]
    if not values:
        return False
    value = values[-1].strip().lower()
    if value not in ("true", "false"):
        raise ValueError(f"{prefix}.{OVERWRITE}: {values[-1]!r} is not a boolean; give true or false")
    return value == "true"


def given_run_dir(argv: Sequence[str]) -> Optional[str]:
    """The `hydra.run.dir=` given (the last one wins), or None."""
    values = [a.split("=", 1)[1] for a in argv if a.lstrip("+").split("=", 1)[0] == RUN_DIR_KEY and "=" in a]
    return values[-1].strip("'\"") if values else None


def run_dir_for_tool(value: str) -> pathlib.Path:
    """`hydra.run.dir` as a tool's output folder, checked as train.py checks its run directory
    (`zoo.tools.cli.output_dir_line`: not empty, not a file, writable, no live run's) before anything compiles;
    ConfigError (one line) otherwise. The files a tool writes there are checked one by one (`check_output`)."""
    if "${" in value:
        raise ConfigError(
            f"{RUN_DIR_KEY}: {value!r} holds an interpolation, which Hydra resolves for train.py and no tool does; "
            "give a plain directory"
        )
    line = output_dir_line([f"{RUN_DIR_KEY}={value}"])
    if line:
        raise ConfigError(line)
    return pathlib.Path(value).expanduser()


def check_output(path, key: str, tool: str, flag: str, overwrite: bool = False) -> pathlib.Path:
    """`path` as `tool`'s output for `key`, probed writable (`zoo.tools.cli.check_writable`). An existing file
    is replaced only when this tool wrote it (`WRITTEN_BY`), or with `flag` (the overwrite option, as the user
    writes it) given: anything else (a profile shipped in conf/, a run's metrics.jsonl or summary.json, a file of
    the user's) is ConfigError (one line naming `key` and the fix) before anything is measured or compiled."""
    out = pathlib.Path(path).expanduser()
    held = run_record.checkpoint_around(out)
    if held is not None:  # not even with overwrite: a step's files are orbax's alone
        raise ConfigError(
            f"{key}: {out} is inside the train.py checkpoint {held}, which this would change; give a path outside it"
        )
    if out.is_file() and not overwrite:
        ours = WRITTEN_BY.get((tool, key)) or WRITTEN_BY.get((tool, out.name))
        try:
            mine = ours is not None and ours(out.read_bytes())
        except OSError:
            mine = False
        if not mine:
            if out.resolve().is_relative_to(conf_dir().resolve()):
                what = f"is a file shipped with Zoo ({out.resolve().relative_to(conf_dir().resolve().parent)})"
            elif out.name in (run_record.METRICS, run_record.SUMMARY) or run_record.holds_record(out.parent):
                what = f"is a file of the train.py run in {out.parent}"
            else:
                what = f"exists and was not written by python -m zoo.tools.{tool}"
            raise ConfigError(
                f"{key}: {out} {what}, which this would replace; give another {key}, or add {flag} to replace it"
            )
    return check_writable(out, key)


def output_path(explicit: Optional[str], key: str, tool: str, relative: str, argv: Sequence[str] = ()):
    """Where a tool writes: `explicit`; or `<hydra.run.dir>/<relative>` when `argv` gives hydra.run.dir
    (`run_dir_for_tool`); or `outputs/<tool>/<date>_<time>/<relative>` under the current directory (as
    train.py's Hydra runs go under outputs/), that folder claimed for this command alone (`zoo.tools.cli.claim_dir`:
    `-1`, `-2`, ... when one started in the same second has it). The folder is created and the file probed now
    (`check_output`: writable, and no file but the tool's own replaced without `<tool>.overwrite=true`), so a bad
    path is one line before anything compiles."""
    overwrite = overwrite_asked(argv, tool)
    flag = f"{tool}.{OVERWRITE}=true"
    if explicit:
        return check_output(explicit, key, tool, flag, overwrite)
    run_dir = given_run_dir(argv)
    if run_dir is not None:
        return check_output(run_dir_for_tool(run_dir) / relative, key, tool, flag, overwrite)
    base = pathlib.Path("outputs") / tool / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        folder = claim_dir(base)[-1]
    except OSError as err:
        raise ConfigError(
            f"{key}: cannot create {base} ({err.strerror or err}); give a writable path, e.g. {key}=/tmp/{relative}"
        ) from None
    return check_output(folder / relative, key, tool, flag, overwrite)


def split_tool_args(argv: Sequence[str], prefix: str, schema: type):
    """Separate `prefix.key=value` arguments (parsed and type-checked into the dataclass `schema`
    through OmegaConf, as Hydra would) from the Hydra overrides. A tool whose schema has an `out` key also takes
    `prefix.overwrite=<bool>`, left to `output_path` (`overwrite_asked`)."""
    fields = [f.name for f in dataclasses.fields(schema)]
    writes = "out" in fields and OVERWRITE not in fields  # a tool that writes a file takes <prefix>.overwrite too
    keys = [*fields, OVERWRITE] if writes else fields
    dotlist, overrides = [], []
    for arg in argv:
        if arg.startswith(prefix + "."):
            key, sep, raw = arg[len(prefix) + 1 :].partition("=")
            if not sep:
                raise ValueError(f"{prefix}.{key}: give a value, e.g. {prefix}.{key}=...")
            if key == OVERWRITE and writes:
                continue  # whether its output may replace a file: read by output_path (overwrite_asked)
            if key not in fields:
                raise ValueError(f"{prefix}.{key}: unknown key; the keys are {', '.join(keys)}")
            if not raw.strip():  # OmegaConf reads `out=` as null: the default, silently
                raise ValueError(
                    f"{prefix}.{key}: empty (an unset shell variable?); give a value, or drop {prefix}.{key}= for its "
                    "default"
                )
            dotlist.append(f"{key}={raw}")
        else:
            overrides.append(arg)
    try:
        given = OmegaConf.from_dotlist(dotlist)
        line = number_as_bool_line(schema, given, prefix)
        if line:
            raise ValueError(line)
        merged = OmegaConf.merge(OmegaConf.structured(schema), given)
        return OmegaConf.to_object(merged), overrides
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"{prefix}.{key}: {str(e).splitlines()[0]}; give a value of the right type") from None


def compose(overrides: Sequence[str]):
    """train.py's config, composed from conf/ with these overrides (Hydra's compose API). A group option
    whose file is not text is one line naming the file, as for train.py (Hydra's reader: a UnicodeDecodeError)."""
    line = option_files_line(list(overrides), conf_dir())
    if line:
        raise ConfigError(line)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=custom_tag_overrides(overrides))


def prepare_step(overrides: Sequence[str], cfg=None):
    """Compose (or take the composed `cfg`), validate (one-line errors, nothing compiled) and build
    train.py's Trainer."""
    cfg = compose(overrides) if cfg is None else cfg
    c, plan, devices, _ = prepare(cfg)
    resolve(c.offload, c.model)
    notes = [
        f"offload.block_tags: {t}: this {c.model.family} configuration does not emit it; ignored"
        for t in dropped_block_tags(c.offload, c.model)
    ]
    return c, plan, devices, Trainer(c, plan, devices), notes


def fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def text_table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)
