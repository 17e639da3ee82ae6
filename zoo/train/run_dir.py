"""One run's record per run directory (`hydra.run.dir`): its `metrics.jsonl`, `summary.json` and `.hydra/`.

A run started into a directory whose `metrics.jsonl` already holds steps (or, damaged, no longer reads beside the
`summary.json` of the run that wrote it) may only continue that record:
resume from a checkpoint (zoo.train.metrics.MetricsWriter keeps the records before the resumed step and
appends), or start the same command again after an attempt that did not finish (a Ctrl-C or a kill before
its first checkpoint: the same steps are computed again). Any other run from step 0 would replace the
earlier run's files, so it is refused (`RunDirTaken`, one line) before it writes anything; train.py
keeps Hydra from rewriting that directory's `.hydra/` (`holds_record`, zoo.tools.cli), and a run refused
for bad input there leaves the earlier `summary.json` alone.
"""

import json
import pathlib
from typing import Optional

from zoo.errors import ConfigError

METRICS = "metrics.jsonl"
SUMMARY = "summary.json"


class RunDirTaken(ConfigError):
    """The run directory holds another run's record, which this run would replace."""


def holds_steps(run_dir: pathlib.Path) -> bool:
    """Whether `run_dir/metrics.jsonl` holds at least one step record (read up to the first one)."""
    try:
        with open(run_dir / METRICS, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a kill, or damaged
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    return True
    except OSError:
        return False
    return False


def holds_record(run_dir: pathlib.Path) -> bool:
    """Whether `run_dir` holds an earlier run's record: a step in its metrics.jsonl (`holds_steps`), or a
    metrics.jsonl that no longer reads (binary, cut short) beside the summary.json of the run that wrote it."""
    if holds_steps(run_dir):
        return True
    try:
        damaged = (run_dir / METRICS).stat().st_size > 0
    except OSError:
        return False
    return damaged and "status" in _earlier_summary(run_dir)


def _is_step(d: pathlib.Path) -> bool:
    """A step directory of a train.py checkpoint.dir: `<step>/` holding orbax's `meta/` and `state/`."""
    return d.name.isdigit() and (d / "meta").is_dir() and (d / "state").is_dir()


def checkpoint_around(path: pathlib.Path) -> Optional[pathlib.Path]:
    """The train.py checkpoint.dir that `path` lies in (in one of its steps, or beside them), None where none:
    a tool's output there would change a saved checkpoint (a step's files are orbax's alone)."""
    here = pathlib.Path(path).expanduser().absolute()
    for d in list(here.parents)[:5]:  # a step's files lie at most four folders below its checkpoint.dir
        if _is_step(d):
            return d.parent
        try:
            if d.is_dir() and any(_is_step(c) for c in d.iterdir() if c.name.isdigit()):
                return d
        except OSError:
            continue
    return None


def _earlier_summary(run_dir: pathlib.Path) -> dict:
    try:
        summary = json.loads((run_dir / SUMMARY).read_bytes())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _earlier_overrides(run_dir: pathlib.Path, summary: dict) -> Optional[list[str]]:
    """The command line (Hydra's task overrides) of the run that wrote the record: its summary.json's,
    else the `.hydra/overrides.yaml` Hydra wrote when it started; None when neither reads."""
    if isinstance(summary.get("overrides"), list):
        return summary["overrides"]
    try:
        from omegaconf import OmegaConf

        return list(OmegaConf.load(run_dir / ".hydra" / "overrides.yaml"))
    except Exception:  # noqa: BLE001 - missing or damaged: unknown
        return None


def finished(run_dir: pathlib.Path) -> bool:
    """Whether the directory holds a run that trained to its end (summary.json's status "ok")."""
    return _earlier_summary(run_dir).get("status") == "ok"


def taken_line(run_dir: pathlib.Path, start: int, overrides) -> Optional[str]:
    """The one line refusing a run that starts at step `start` with these overrides into `run_dir`, when
    it would replace an earlier run's record there; None when it continues that record or there is none."""
    if start > 0 or not holds_record(run_dir):
        return None
    summary = _earlier_summary(run_dir)
    done = summary.get("status") == "ok"
    if not done and _earlier_overrides(run_dir, summary) == list(overrides):
        return None  # the same command again after an attempt that stopped before its first checkpoint
    what = (
        "a finished run"
        if done
        else "an earlier run"
        if _earlier_overrides(run_dir, summary) is None
        else "a run of another command"
    )
    files = " and ".join(f for f in (METRICS, SUMMARY) if (run_dir / f).exists())
    return (
        f"hydra.run.dir: {run_dir} holds the {files} of {what}, which this run would replace (it starts from step 0); "
        f"give this run another hydra.run.dir, or move {run_dir} away (a run that resumes a checkpoint continues the "
        "record there)"
    )
