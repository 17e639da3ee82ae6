"""The kit the command-line tools share (zoo.tools.inspect_step, zoo.tools.plan, zoo.tools.scale,
zoo.tools.gpu_lowering, zoo.tools.measure_hardware): compose train.py's Hydra config and build its step without
training, split a tool's own `<tool>.key=value` options from the Hydra overrides, choose and probe where a tool writes,
format bytes and tables. With `zoo.tools.cli` (one-line errors, exit codes, `run_tool`), which
train.py shares. Library modules never import this: it sits above them.
"""

import dataclasses
import pathlib
import time
from typing import Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.offload import conf_dir, dropped_block_tags, resolve
from zoo.tools.cli import EXIT_BAD_INPUT, check_writable, claim_dir, run_tool  # noqa: F401 (the kit's other half)
from zoo.train.run import prepare
from zoo.train.run_config import ConfigError
from zoo.train.step import Trainer


def output_path(explicit: Optional[str], key: str, tool: str, relative: str):
    """Where a tool writes: `explicit`, or `outputs/<tool>/<date>_<time>/<relative>` under the current
    directory (as train.py's Hydra runs go under outputs/), that folder claimed for this command alone
    (`zoo.tools.cli.claim_dir`: `-1`, `-2`, ... when one started in the same second has it). The folder
    is created and probed now (`zoo.tools.cli.check_writable`), so an unwritable path is one line
    before anything compiles."""
    if explicit:
        return check_writable(pathlib.Path(explicit), key)
    base = pathlib.Path("outputs") / tool / time.strftime("%Y-%m-%d_%H-%M-%S")
    try:
        folder = claim_dir(base)[-1]
    except OSError as err:
        raise ConfigError(
            f"{key}: cannot create {base} ({err.strerror or err}); give a writable path, e.g. {key}=/tmp/{relative}"
        ) from None
    return check_writable(folder / relative, key)


def split_tool_args(argv: Sequence[str], prefix: str, schema: type):
    """Separate `prefix.key=value` arguments (parsed and type-checked into the dataclass `schema`
    through OmegaConf, as Hydra would) from the Hydra overrides."""
    fields = [f.name for f in dataclasses.fields(schema)]
    dotlist, overrides = [], []
    for arg in argv:
        if arg.startswith(prefix + "."):
            key, sep, raw = arg[len(prefix) + 1 :].partition("=")
            if not sep:
                raise ValueError(f"{prefix}.{key}: give a value, e.g. {prefix}.{key}=...")
            if key not in fields:
                raise ValueError(f"{prefix}.{key}: unknown key; the keys are {', '.join(fields)}")
            dotlist.append(f"{key}={raw}")
        else:
            overrides.append(arg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.from_dotlist(dotlist))
        return OmegaConf.to_object(merged), overrides
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ValueError(f"{prefix}.{key}: {str(e).splitlines()[0]}; give a value of the right type") from None


def compose(overrides: Sequence[str]):
    """train.py's config, composed from conf/ with these overrides (Hydra's compose API)."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


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
