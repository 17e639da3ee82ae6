"""Orbax checkpoints of the train state: every N steps and at the end, asynchronous, the last K kept,
resumed from the latest complete one.

A checkpoint is one orbax step directory `<checkpoint.dir>/<step>/` with two items:

- `state`: the train state `{"params", "opt_state", "step"}` as the step holds it (the MoE
  correction biases are leaves of `params`), each array written by the processes that hold it.
- `meta`: JSON (`<step>/meta/metadata`): zoo's version, the step, the model config, the mesh, the
  process count, the optimizer / data / trainer settings, and every state leaf's shape and dtype.

Orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to `<step>` only when every
item is complete, so a process killed mid-save leaves the previous steps as they were and a
half-written temporary directory that no restore picks. The data loader needs no state of its own:
batch k depends on k alone (zoo.train.data, zoo.data), so the step number is the data position.

Before anything compiles, `check()` reads the latest complete step's metadata and refuses, in one
line naming the file and the key, a checkpoint of another model (any model field but the
compute-only ones below) or of a state with other leaves (another optimizer setup). Another mesh,
device count or process count is fine: the arrays are read straight into this run's shardings
(memory kinds included, so `offload.params=pinned_host` restores into pinned host memory).
"""

import dataclasses
import importlib.metadata
import json
import pathlib
from typing import Any, Callable, Optional

import jax

from zoo.train.config import ConfigError, TrainConfig

# Model fields that change how the step computes, not what the state holds: a checkpoint may be
# resumed with other values (the losses then differ from the uninterrupted run's).
COMPUTE_ONLY = ("compute_dtype", "attention_impl", "moe.impl", "moe.capacity_factor")
META_FILE = "meta/metadata"


def zoo_version() -> str:
    try:
        return importlib.metadata.version("zoo")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "unknown"


def state_signature(state) -> dict[str, list]:
    """`{leaf path: [shape, dtype]}` of a (possibly abstract) state."""
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    return {jax.tree_util.keystr(p): [list(x.shape), str(x.dtype)] for p, x in leaves}


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def _diff(there: dict, here: dict, skip=()) -> list[tuple[str, Any, Any]]:
    a, b = _flat(there), _flat(here)
    keys = list(dict.fromkeys([*b, *a]))
    return [(k, a.get(k, "absent"), b.get(k, "absent")) for k in keys if k not in skip and a.get(k, "absent") != b.get(k, "absent")]


def _leaf(sig) -> str:
    shape, dtype = sig
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _show(v) -> str:
    return "null" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


class Checkpoints:
    """The checkpoints of one run. `check()` (read-only) -> the step to resume from; `restore`,
    `save`, `close`. Every process of a multi-process run makes the same calls."""

    def __init__(self, c: TrainConfig, plan, trainer, echo: Callable = print):
        self.c = c
        self.plan = plan
        self.trainer = trainer
        self.echo = echo
        self.dir = pathlib.Path(str(c.checkpoint.dir)).expanduser().absolute()
        self.manager = None
        self.saved: list[int] = []

    # --- before compiling: what is there, and does it fit ----------------------------------------

    def meta(self) -> dict:
        """This run's metadata (the step is added when saving)."""
        if getattr(self, "_meta", None) is not None:
            return self._meta
        c = self.c
        self._meta = {
            "zoo_version": zoo_version(),
            "model": dataclasses.asdict(c.model),
            "mesh": dict(self.plan.mesh.sizes),
            "num_devices": self.plan.num_devices,
            "process_count": jax.process_count(),
            "offload": {"params": c.offload.params, "opt_state": c.offload.opt_state},
            "optimizer": dataclasses.asdict(c.optimizer),
            "data": dataclasses.asdict(c.data),
            "trainer": dataclasses.asdict(c.trainer),
            "state": state_signature(self.trainer.abstract_state()),
        }
        return self._meta

    def complete_steps(self) -> list[int]:
        """Steps whose directory orbax finished (renamed from its temporary name), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and p.is_dir())

    def check(self) -> Optional[int]:
        """The step to resume from (None: start afresh). Creates the directory if it is missing, and
        otherwise only reads; ConfigError (one line) when the directory cannot be used or its latest
        checkpoint does not fit this run."""
        d, c = self.dir, self.c
        if d.exists() and not d.is_dir():
            raise ConfigError(f"checkpoint.dir: {d} is a file; give a directory (or null to disable checkpointing)")
        if not d.exists():
            try:  # a new, empty directory: found unusable now rather than at the first save
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"checkpoint.dir: cannot create {d} ({e.strerror}); choose a writable directory") from None
        steps = self.complete_steps()
        if not steps:
            return None
        latest = steps[-1]
        if not c.checkpoint.resume:
            raise ConfigError(
                f"checkpoint.dir: {d} already holds checkpoints (latest step {latest}); set checkpoint.resume=true to "
                "continue from it, or choose an empty directory"
            )
        path = d / str(latest) / META_FILE
        try:
            there = json.loads(path.read_text())
            there_model, there_state = there["model"], there["state"]
        except FileNotFoundError:
            raise ConfigError(
                f"checkpoint.dir: {path} is missing, so {d / str(latest)} was not written by zoo's train.py; "
                "choose another checkpoint.dir"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"checkpoint.dir: {path} is unreadable ({type(e).__name__}: {e}); choose another checkpoint.dir") from None
        here = self.meta()
        model_diff = _diff(there_model, here["model"], COMPUTE_ONLY)
        if model_diff:
            k, a, b = model_diff[0]
            more = f", and {len(model_diff) - 1} other field(s)" if len(model_diff) > 1 else ""
            raise ConfigError(
                f"checkpoint.dir: {path} is from another model (model.{k}={_show(a)} there, {_show(b)} here{more}); "
                "train that model to resume it, or give this run a new checkpoint.dir"
            )
        sig_here = here["state"]
        for key in list(dict.fromkeys([*sig_here, *there_state])):
            a, b = there_state.get(key), sig_here.get(key)
            if a != b:
                what = f"absent there, {_leaf(b)} here" if a is None else f"{_leaf(a)} there, absent here" if b is None else f"{_leaf(a)} there, {_leaf(b)} here"
                opt = _diff(there.get("optimizer", {}), here["optimizer"])
                hint = f" (optimizer.{opt[0][0]}={_show(opt[0][1])} there, {_show(opt[0][2])} here)" if opt else ""
                raise ConfigError(
                    f"checkpoint.dir: {path} holds a state leaf {key} that does not fit this run ({what}){hint}; "
                    "use the checkpoint's settings, or give this run a new checkpoint.dir"
                )
        if latest > c.trainer.steps:
            raise ConfigError(
                f"trainer.steps: {c.trainer.steps}, but checkpoint.dir {d} already holds step {latest}; "
                f"set trainer.steps above {latest}, or give this run a new checkpoint.dir"
            )
        notes = []
        if there.get("mesh") != here["mesh"] or there.get("process_count") != here["process_count"]:
            notes.append(
                f"saved on mesh {there.get('mesh')} by {there.get('process_count')} process(es), restored onto mesh "
                f"{here['mesh']} by {here['process_count']} (resharded)"
            )
        changed = [
            f"{group}.{k}={_show(a)} -> {_show(b)}"
            for group in ("optimizer", "data", "trainer")
            for k, a, b in _diff(there.get(group, {}), here[group], ("log_every", "progress", "tensorboard"))
        ]
        changed += [f"model.{k}={_show(a)} -> {_show(b)}" for k, a, b in _diff(there_model, here["model"]) if k in COMPUTE_ONLY]
        if changed:
            notes.append("settings changed since the checkpoint: " + ", ".join(changed))
        for n in notes:
            self.echo(f"note: checkpoint {d / str(latest)}: {n}")
        return latest

    # --- orbax ---------------------------------------------------------------------------------

    def _manager(self):
        if self.manager is None:
            import orbax.checkpoint as ocp
            from orbax.checkpoint import type_handlers

            from zoo._compat import orbax_array_metadata_store

            store = orbax_array_metadata_store()  # what orbax's default jax.Array handler keeps per-array metadata in

            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"checkpoint.dir: cannot create {self.dir} ({e.strerror}); choose a writable directory") from None
            # Orbax's default for CPU hosts splits replicated arrays across replicas, slicing them with
            # one small jitted op per shape: tens of seconds of compiling on the first save, for nothing
            # here (replicated leaves are small). Each shard is written by its first replica instead.
            registry = type_handlers.create_type_handler_registry(
                (jax.Array, type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=store))
            )
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.c.checkpoint.keep_last,
                enable_async_checkpointing=self.c.checkpoint.async_save,
                create=True,
            )
            self.manager = ocp.CheckpointManager(
                self.dir,
                options=options,
                item_handlers={"state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry), "meta": ocp.JsonCheckpointHandler()},
            )
        return self.manager

    def restore(self, step: int):
        """The state saved at `step`, read into this run's shardings and memory kinds."""
        import orbax.checkpoint as ocp

        abstract = self.trainer.abstract_state()
        args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))
        )
        return self._manager().restore(step, args=args)["state"]

    def save(self, step: int, state) -> None:
        """Start saving `state` (after `step` optimizer steps). Returns once the arrays are copied off
        the devices, so the next step may overwrite (donate) them; the files are written in the
        background with `checkpoint.async_save`."""
        import orbax.checkpoint as ocp

        if step in self.saved:  # (decided alike in every process: they must all call save, or none)
            return
        meta = {**self.meta(), "step": step}
        self._manager().save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.saved.append(step)

    def wait(self) -> None:
        if self.manager is not None:
            self.manager.wait_until_finished()

    def close(self) -> None:
        """Wait for the save in flight (it completes even when training stopped on an error)."""
        if self.manager is not None:
            self.manager.wait_until_finished()
            self.manager.close()
            self.manager = None

    def latest(self) -> Optional[int]:
        steps = self.complete_steps()
        return steps[-1] if steps else None
