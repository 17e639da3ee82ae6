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
batch k depends on k alone (zoo.train.batches, zoo.data), so the step number is the data position.

Before anything compiles, `open()` writes (and deletes) a probe file in the directory, so one that
cannot be written is refused now rather than at the first save, and takes the directory's lock
(`zoo.lock`, zoo.train.run_lock: the owner's host, process id and start time; process 0 of a multi-process
run takes it), so a second run on the same directory stops at once naming the first. A lock whose process is
gone (same host) is stale and taken over with a note. Then `check()` reads the newest complete
step's metadata and refuses, in one line naming the file and the key, a checkpoint of another model
(any model field but the compute-only ones below) or of a state with other leaves (another
optimizer setup). Another mesh, device count or process count is fine: the arrays are read straight
into this run's shardings (memory kinds included, so `offload.params=pinned_host` restores into
pinned host memory).

A step that cannot be read (a truncated array file, deleted data files, a deleted manifest or
metadata file) is skipped with one line saying why, and the newest older step that restores is
used; the skipped directories are renamed `<step>.unreadable` (nothing is deleted) so that the run
can save those steps again. When no step restores, the run stops with one line naming the step and
the fix, before compiling (zoo.train.checkpoint_errors says why a step does not read, in one clause). A save
is not interrupted by Ctrl-C midway (zoo.train.stop.ctrl_c_deferred).
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import pathlib
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np

from zoo import lora
from zoo import model as zoo_model
from zoo._compat import orbax_array_metadata_store
from zoo.hf import CheckpointError, load_sharded
from zoo.lora import LoraConfig
from zoo.model import abstract
from zoo.train.checkpoint_errors import (
    Unreadable,
    missing_orbax_files,
    quiet_closed_loop_callbacks,
    require_orbax_files,
    unreadable_reason,
    why_save_failed,
)
from zoo.train.run_config import ConfigError, TrainConfig, TrainingStopped, load_group
from zoo.train.run_lock import DirLock, probe_writable
from zoo.train.stop import ctrl_c_deferred

# Model fields that change how the step computes, not what the state holds: a checkpoint may be
# resumed with other values (the losses then differ from the uninterrupted run's).
COMPUTE_ONLY = ("compute_dtype", "attention_impl", "moe.impl", "moe.capacity_factor")
META_FILE = "meta/metadata"
UNREADABLE_SUFFIX = ".unreadable"  # a skipped step's new name: orbax no longer takes it for a step


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
    return [
        (k, a.get(k, "absent"), b.get(k, "absent"))
        for k in keys
        if k not in skip and a.get(k, "absent") != b.get(k, "absent")
    ]


def _leaf(sig) -> str:
    shape, dtype = sig
    return f"{dtype}[{', '.join(map(str, shape))}]"


def _show(v) -> str:
    return "null" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def all_processes_agree(ok: bool) -> bool:
    """True when `ok` holds in every process (a host collective: every process must call it)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.min(multihost_utils.process_allgather(np.int32(ok))))


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
        self.lock: Optional[DirLock] = None
        self.skipped: list[tuple[int, str]] = []  # (step, why): unreadable steps newer than the one resumed
        self.in_flight: Optional[int] = None  # the step whose save was started and not yet seen complete
        self.failed: Optional[TrainingStopped] = None  # a save that failed (reported once; the run stops)

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
            "pretrained": dataclasses.asdict(c.pretrained)
            if c.pretrained is not None
            else None,  # model=hf: the initial weights
            "lora": dataclasses.asdict(c.lora) if c.lora.enabled else None,  # the state's params are its adapters
            "state": state_signature(self.trainer.saved(self.trainer.abstract_state())),
        }
        return self._meta

    def complete_steps(self) -> list[int]:
        """Steps whose directory orbax finished (renamed from its temporary name), oldest first."""
        if not self.dir.is_dir():
            return []
        return sorted(int(p.name) for p in self.dir.iterdir() if p.name.isdigit() and p.is_dir())

    def open(self) -> None:
        """Before training: the directory exists (created if missing), every process can write in it,
        and this run holds its lock (process 0 takes it for all). ConfigError (one line) otherwise,
        in every process."""
        d = self.dir
        if d.exists() and not d.is_dir():
            raise ConfigError(f"checkpoint.dir: {d} is a file; give a directory (or null to disable checkpointing)")
        error = None
        try:
            self._create()
            probe_writable(d, "checkpoint.dir")
            if jax.process_index() == 0:
                self.lock = DirLock(d)
                self.lock.acquire(self.echo)
        except ConfigError as e:
            error = e
        if not all_processes_agree(error is None):
            self.release()
            raise error or ConfigError(
                f"checkpoint.dir: another process of this run cannot use {d} (see its error line); fix that first"
            )

    def _create(self) -> None:
        if not self.dir.exists():
            try:  # a new, empty directory: found unusable now rather than at the first save
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"checkpoint.dir: cannot create {self.dir} ({e.strerror}); choose a writable directory"
                ) from None

    def release(self) -> None:
        """Give up the directory's lock (at the end of the run, however it ended)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def check(self) -> Optional[int]:
        """The step to resume from (None: start afresh): the newest complete step whose metadata
        reads and fits. Creates the directory if it is missing, and otherwise only reads; a step whose
        metadata is unreadable is skipped with a note; ConfigError (one line) when the directory
        cannot be used, its newest readable checkpoint does not fit this run, or none is readable."""
        d, c = self.dir, self.c
        if d.exists() and not d.is_dir():
            raise ConfigError(f"checkpoint.dir: {d} is a file; give a directory (or null to disable checkpointing)")
        if (d / "config.json").is_file() and any(d.glob("*.safetensors")):  # its steps would go among the model's files
            raise ConfigError(
                f"checkpoint.dir: {d} holds a Hugging Face model (config.json, *.safetensors), not train.py's "
                f"checkpoints; to start from it, model=hf model.path={d}; give checkpoint.dir a directory of its own"
            )
        self._create()
        steps = self.complete_steps()
        if not steps:
            return None
        if not c.checkpoint.resume:
            raise ConfigError(
                f"checkpoint.dir: {d} already holds checkpoints (latest step {steps[-1]}); set checkpoint.resume=true "
                "to "
                "continue from it, or choose an empty directory"
            )
        for step in reversed(steps):
            try:
                there = self._read_meta(step)
            except Unreadable as e:
                self._skip(step, str(e), older=[s for s in steps if s < step])
                continue
            self._check_fits(step, there, notes=True)
            return step
        raise AssertionError("unreachable: _skip raises for the oldest step")  # pragma: no cover

    def _read_meta(self, step: int) -> dict:
        path = self.dir / str(step) / META_FILE
        try:
            there = json.loads(path.read_text())
            there["model"], there["state"]
        except FileNotFoundError:
            raise Unreadable(f"{META_FILE} is missing (damaged, or not written by zoo's train.py)") from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise Unreadable(f"{META_FILE} is unreadable ({type(e).__name__}: {e})") from None
        return there

    def _skip(self, step: int, reason: str, older: list[int]) -> None:
        """Note one unreadable step; with no older step left, stop in one line."""
        d = self.dir
        if not older:
            newer = [s for s, _ in self.skipped]
            also = f", as are the newer steps {', '.join(map(str, sorted(newer)))}" if newer else ""
            raise ConfigError(
                f"checkpoint.dir: step {step} in {d} is unreadable ({reason}){also}: no intact checkpoint is left; "
                f"move the step directories out of {d} to start from step 0, or give another checkpoint.dir"
            )
        self.skipped.append((step, reason))
        self.echo(
            f"note: checkpoint.dir: step {step} in {d} is unreadable ({reason}); skipped, trying step {older[-1]}"
        )

    def _check_fits(self, step: int, there: dict, notes: bool) -> None:
        """ConfigError when step's metadata is of another model or state, or past trainer.steps;
        with `notes`, one `note:` line for a new mesh and one for the settings that changed."""
        d, c = self.dir, self.c
        path = d / str(step) / META_FILE
        there_model, there_state = there["model"], there["state"]
        here = self.meta()
        model_diff = _diff(there_model, here["model"], COMPUTE_ONLY)
        if model_diff:
            k, a, b = model_diff[0]
            more = f", and {len(model_diff) - 1} other field(s)" if len(model_diff) > 1 else ""
            raise ConfigError(
                f"checkpoint.dir: {path} is from another model (model.{k}={_show(a)} there, {_show(b)} here{more}); "
                "train that model to resume it, or give this run a new checkpoint.dir"
            )
        if there.get("lora") != here["lora"]:  # adapters there and a whole model here, or other adapters

            def show(x):
                return "no adapters" if not x else f"lora.rank={x['rank']} lora.targets=[{','.join(x['targets'])}]"

            raise ConfigError(
                f"checkpoint.dir: {path} holds {show(there.get('lora'))}, this run trains {show(here['lora'])}; "
                "use the checkpoint's lora settings, or give this run a new checkpoint.dir"
            )
        sig_here = here["state"]
        for key in list(dict.fromkeys([*sig_here, *there_state])):
            a, b = there_state.get(key), sig_here.get(key)
            if a != b:
                what = (
                    f"absent there, {_leaf(b)} here"
                    if a is None
                    else f"{_leaf(a)} there, absent here"
                    if b is None
                    else f"{_leaf(a)} there, {_leaf(b)} here"
                )
                opt = _diff(there.get("optimizer", {}), here["optimizer"])
                hint = f" (optimizer.{opt[0][0]}={_show(opt[0][1])} there, {_show(opt[0][2])} here)" if opt else ""
                raise ConfigError(
                    f"checkpoint.dir: {path} holds a state leaf {key} that does not fit this run ({what}){hint}; "
                    "use the checkpoint's settings, or give this run a new checkpoint.dir"
                )
        if step > c.trainer.steps:
            raise ConfigError(
                f"trainer.steps: {c.trainer.steps}, but checkpoint.dir {d} already holds step {step}; "
                f"set trainer.steps above {step}, or give this run a new checkpoint.dir"
            )
        if not notes:
            return
        out = []
        if there.get("mesh") != here["mesh"] or there.get("process_count") != here["process_count"]:
            out.append(
                f"saved on mesh {there.get('mesh')} by {there.get('process_count')} process(es), restored onto mesh "
                f"{here['mesh']} by {here['process_count']} (resharded)"
            )
        changed = [
            f"{group}.{k}={_show(a)} -> {_show(b)}"
            for group in ("optimizer", "data", "trainer")
            for k, a, b in _diff(there.get(group, {}), here[group], ("log_every", "progress", "tensorboard"))
        ]
        changed += [
            f"model.{k}={_show(a)} -> {_show(b)}" for k, a, b in _diff(there_model, here["model"]) if k in COMPUTE_ONLY
        ]
        if changed:
            out.append("settings changed since the checkpoint: " + ", ".join(changed))
        for n in out:
            self.echo(f"note: checkpoint {d / str(step)}: {n}")

    # --- orbax ---------------------------------------------------------------------------------

    def _manager(self):
        if self.manager is None:
            import orbax.checkpoint as ocp
            from orbax.checkpoint import type_handlers

            store = orbax_array_metadata_store()  # what orbax's default jax.Array handler keeps per-array metadata in

            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(
                    f"checkpoint.dir: cannot create {self.dir} ({e.strerror}); choose a writable directory"
                ) from None
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
                item_handlers={
                    "state": ocp.PyTreeCheckpointHandler(type_handler_registry=registry),
                    "meta": ocp.JsonCheckpointHandler(),
                },
            )
        return self.manager

    def restore(self, step: int):
        """The state saved at `step`, read into this run's shardings and memory kinds."""
        import orbax.checkpoint as ocp

        require_orbax_files(self.dir / str(step))
        abstract = self.trainer.saved(self.trainer.abstract_state())  # LoRA: no frozen base on disk
        args = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract)
            )
        )
        state = self._manager().restore(step, args=args)["state"]
        return self._with_base(state)

    def _with_base(self, state):
        if self.trainer.lora is None:
            return state
        return self.trainer.with_base(state, self.trainer.fresh_base())

    def restore_newest(self, step: int) -> tuple[int, Any]:
        """`(step, state)`: the state saved at `step` (what `check()` chose), or, where that cannot be
        read, at the newest older step that can, each skipped step noted in one line. Skipped steps
        are then renamed `<step>.unreadable`, so this run can save those steps anew. ConfigError
        (one line) when none restores. Every process takes the same decisions."""
        older = [s for s in self.complete_steps() if s < step]
        first = step
        while True:
            reason, state = None, None
            # Before the restore, not after it fails: the abandoned reads' callbacks can run on
            # TensorStore's threads while the failure is still on its way here.
            quiet_closed_loop_callbacks()
            try:
                if step != first:  # check() has read the first one's metadata
                    self._check_fits(step, self._read_meta(step), notes=False)
                state = self.restore(step)
                jax.block_until_ready(state)
            except Unreadable as e:
                reason = str(e)
            except ConfigError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever TensorStore and orbax raise on damaged files
                if "RESOURCE_EXHAUSTED" in str(e):
                    raise  # out of memory: not the files' fault
                reason = unreadable_reason(e, self.dir / str(step))
            if not all_processes_agree(reason is None):
                reason = reason or "another process could not read it"
            if reason is None:
                break
            state = None
            self.close()  # a failed restore may leave the manager mid-way: the next try gets a fresh one
            self._skip(step, reason, older)
            step = older.pop()
        if self.skipped:
            self._move_aside()
        return step, state

    def _move_aside(self) -> None:
        """Rename the skipped (newer, unreadable) steps `<step>.unreadable[.n]`: kept for a look, no
        longer steps to orbax, which would otherwise refuse to save them again."""
        if jax.process_index() == 0:
            for step, _ in self.skipped:
                target = self.dir / f"{step}{UNREADABLE_SUFFIX}"
                n = 1
                while target.exists():
                    n += 1
                    target = self.dir / f"{step}{UNREADABLE_SUFFIX}.{n}"
                os.rename(self.dir / str(step), target)
        all_processes_agree(True)  # the others open their manager only once the names changed
        self.close()

    def save(self, step: int, state) -> None:
        """Start saving `state` (after `step` optimizer steps). Returns once the arrays are copied off
        the devices, so the next step may overwrite (donate) them; the files are written in the
        background with `checkpoint.async_save`."""
        import orbax.checkpoint as ocp

        if step in self.saved:  # (decided alike in every process: they must all call save, or none)
            return
        meta = {**self.meta(), "step": step}
        saved = {k: v for k, v in state.items() if k != "base"}  # LoRA's frozen base is rebuilt, not saved
        with (
            ctrl_c_deferred(),
            self._save_failures(step),
        ):  # a Ctrl-C here would abandon the copy half done, and with it this step
            # (orbax first waits for the save before: its failure is reported here, naming that step)
            self._manager().save(
                step,
                args=ocp.args.Composite(state=ocp.args.PyTreeSave(saved), meta=ocp.args.JsonSave(meta)),
                force=True,
            )
            self.saved.append(step)
            self.in_flight = step

    def check_saves(self) -> None:
        """Between steps: when the save in flight has ended, whether it failed (a full disk) is known;
        the run then stops at once with one line (TrainingStopped), not at the next save."""
        if self.in_flight is not None and self.manager is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        if self.manager is not None:
            with self._save_failures(None):
                self.manager.wait_until_finished()
            self.in_flight = None

    def close(self) -> None:
        """Wait for the save in flight (it completes even when training stopped on an error)."""
        if self.manager is None:
            return
        reported = self.failed is not None  # the run is already stopping on a failed save: said once
        try:
            self.wait()
            self.manager.close()
        except Exception:
            if not reported:
                raise
        finally:
            self.manager = None

    @contextlib.contextmanager
    def _save_failures(self, starting: Optional[int]):
        """A save that failed in orbax (its background thread, or `starting`'s own start): one line
        naming the step, why, and the last good checkpoint, instead of orbax's traceback."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - whatever the file system and orbax raise
            if self.failed is not None:
                raise self.failed from None
            # the save before, which orbax waits for first, unless that one completed
            step = (
                self.in_flight
                if self.in_flight is not None and self.in_flight not in self.complete_steps()
                else starting
            )
            self.failed = TrainingStopped(
                f"step {step}: saving its checkpoint failed ({why_save_failed(e)}), so the run stopped; last good "
                "checkpoint: "
                f"{self._last_good()}; free space in {self.dir} (or give another checkpoint.dir) and run the same "
                "command to resume"
            )
            raise self.failed from None

    def _last_good(self) -> str:
        last = self.latest()
        return (
            f"step {last} in {self.dir}"
            if last is not None
            else f"none in {self.dir} (the run starts again from step 0)"
        )

    def latest(self) -> Optional[int]:
        steps = self.complete_steps()
        return steps[-1] if steps else None


# --- a trained model out of a checkpoint directory ---------------------------------------------


def _child(tree, key):
    """One step of a jax key path into orbax's restored tree (nested dicts and lists)."""
    name = getattr(key, "name", getattr(key, "key", getattr(key, "idx", None)))
    if isinstance(tree, dict):
        return tree[name] if name in tree else tree[str(name)]
    return tree[int(name)]


def spread_shardings(params, devices) -> Any:
    """A NamedSharding for every array leaf of `params` (abstract or concrete) over `devices` (one mesh
    axis): each leaf split along its largest dimension that the device count divides, so no leaf is
    whole on one device unless no dimension divides (then it is replicated). Not the training layout:
    a restore for export or sampling needs only that every device holds a slice, and this needs no
    mesh config and no divisibility of any particular axis."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.asarray(list(devices), dtype=object), ("devices",))
    n = mesh.size

    def one(leaf):
        dims = sorted(range(len(leaf.shape)), key=lambda d: -leaf.shape[d])
        split = next((d for d in dims if n > 1 and leaf.shape[d] % n == 0), None)
        spec = [None] * len(leaf.shape)
        if split is not None:
            spec[split] = "devices"
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree.map(one, params)


def restore_model(
    checkpoint_dir,
    step: Optional[int] = None,
    *,
    devices=None,
    echo: Optional[Callable[[str], None]] = None,
    lora_form: str = "merged",
):
    """`(model, metadata)`: the CausalLM saved by train.py in `checkpoint_dir` (a `checkpoint.dir`) at
    `step` (default: the newest complete step that reads), and that step's metadata (`model`,
    `optimizer`, ...).

    Only the parameters are read (not the optimizer state), whatever mesh wrote them, in the dtype they
    were trained in: onto the default device, or with `devices` (e.g. `jax.devices()`) each leaf read
    straight into its slices over them (`spread_shardings`), so a model larger than one device restores
    without ever being whole on one. Without `step`, a damaged newest step is skipped as train.py's
    resume skips it: `echo` (default: stderr) gets one line naming the step used and why the newer ones
    were skipped. Bad input raises ConfigError (one line).

    A LoRA run's checkpoint (adapters only) comes back by `lora_form`: "merged" (a plain model, each
    adapted weight plus alpha/r A@B), "attached" (the base with `zoo.lora.LoRAWeight`s, merged per layer
    in the scan) or "adapters" (LoRAWeights over the abstract model: the base is not read). With
    "adapters", a whole model's checkpoint comes back abstract (nothing read): check `meta["lora"]`."""
    if lora_form not in ("merged", "attached", "adapters"):
        raise ValueError(f"lora_form: {lora_form!r}; choose merged, attached or adapters")
    d = pathlib.Path(checkpoint_dir).expanduser().absolute()
    steps = sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir()) if d.is_dir() else []
    if not steps:
        what = "does not exist" if not d.exists() else "holds no complete checkpoint"
        raise ConfigError(f"{d}: {what}; give the checkpoint.dir of a train.py run that saved at least one step")
    if step is not None and step not in steps:
        raise ConfigError(f"{d}: no complete checkpoint of step {step}; it holds steps {', '.join(map(str, steps))}")
    if echo is None:
        echo = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731 - stdout may carry the tool's output
    skipped: list[tuple[int, str]] = []
    for s in [step] if step is not None else reversed(steps):
        quiet_closed_loop_callbacks()  # before the read: a failed one's abandoned reads report after it
        try:
            model, meta = _restore_params(d, s, devices, lora_form)
        except Unreadable as e:
            if step is not None:
                others = [o for o in steps if o != step]
                hint = (
                    f"give another step ({', '.join(map(str, others))})"
                    if others
                    else "train again to write an intact step"
                )
                raise ConfigError(f"{d / str(s)}: unreadable ({e}); {hint}") from None
            skipped.append((s, str(e)))
            continue
        if skipped:
            why = "; ".join(f"step {k}: {r}" for k, r in skipped)
            echo(f"note: {d}: using step {s}, the newest step that reads; skipped {why}")
        return model, meta
    first, why = skipped[-1]
    newer = f", as are steps {', '.join(str(k) for k, _ in reversed(skipped[:-1]))}" if len(skipped) > 1 else ""
    raise ConfigError(
        f"{d}: step {first} is unreadable ({why}){newer}: no intact checkpoint is left; give the checkpoint.dir of "
        "another run"
    )


def _restore_params(d: pathlib.Path, step: int, devices, lora_form: str = "merged"):
    """`(model, metadata)` of one step; Unreadable (one clause) when its files are damaged or missing."""
    import logging

    import equinox as eqx
    import orbax.checkpoint as ocp

    step_dir = d / str(step)
    path = step_dir / META_FILE
    try:
        meta = json.loads(path.read_text())
        config = load_group("model", meta["model"])
    except FileNotFoundError:
        raise Unreadable(f"{META_FILE} is missing, so it was not written by zoo's train.py") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise Unreadable(f"{META_FILE} is unreadable ({type(e).__name__}: {e})") from None
    params, static = eqx.partition(abstract(config), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    adapters_config = _lora_config(meta, path)
    if adapters_config is not None:  # the state's params are the adapters (zoo.lora), not the model
        wanted = lora.init_shapes(abstract(config), adapters_config)
    elif lora_form == "adapters":  # no adapters to read, and the caller wants nothing else
        return abstract(config), meta
    else:
        wanted = params
    require_orbax_files(step_dir)
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)  # orbax warns that a bare item directory has no step metadata
    try:
        ckptr = ocp.PyTreeCheckpointer()
        try:
            saved = ckptr.metadata(step_dir / "state").item_metadata
            if saved is None:  # orbax returns no tree, rather than raising (its files were there a moment ago)
                raise Unreadable(
                    missing_orbax_files(step_dir) or "orbax cannot read its state metadata (damaged files)"
                )
            saved = saved.tree["params"]
            # Orbax restores its own nested dicts here (a partial restore cannot rebuild Equinox modules);
            # the arrays are put back into the model by their key paths below.
            if devices is None:
                device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
                shardings = jax.tree.map(lambda m: device, saved)
            else:
                shardings = spread_shardings(saved, devices)
            args = jax.tree.map(
                lambda m, sh: ocp.ArrayRestoreArgs(sharding=sh, global_shape=m.shape, dtype=m.dtype), saved, shardings
            )
            restored = ckptr.restore(
                step_dir / "state",
                args=ocp.args.PyTreeRestore(
                    item={"params": saved}, restore_args={"params": args}, partial_restore=True
                ),
            )["params"]
            jax.block_until_ready(restored)
        except Unreadable:
            raise
        except Exception as e:  # noqa: BLE001 - whatever TensorStore and orbax raise on damaged files
            if "RESOURCE_EXHAUSTED" in str(e):
                raise  # out of memory: not the files' fault
            raise Unreadable(unreadable_reason(e, step_dir)) from None
        finally:
            ckptr.close()
    finally:
        absl.setLevel(level)

    def take(key_path, want):
        node = restored
        for key in key_path:
            node = _child(node, key)
        if tuple(node.shape) != tuple(want.shape) or node.dtype != want.dtype:
            raise ConfigError(
                f"{path}: the saved leaf {jax.tree_util.keystr(key_path)} is {node.dtype}{list(node.shape)}, its "
                "model config "
                f"implies {want.dtype}{list(want.shape)}; the checkpoint is damaged"
            )
        return node

    if adapters_config is None:
        return eqx.combine(jax.tree_util.tree_map_with_path(take, params), static), meta
    adapters = jax.tree_util.tree_map_with_path(take, wanted)
    base = (
        abstract(config)
        if lora_form == "adapters"
        else eqx.combine(_lora_base(meta, config, params, devices, step_dir), static)
    )
    attached = lora.attach(base, adapters, adapters_config)
    return (lora.merge(attached) if lora_form == "merged" else attached), meta


def _lora_config(meta: dict, path: pathlib.Path):
    """The LoraConfig a LoRA run saved in its metadata, or None for a whole model."""
    if not meta.get("lora"):
        return None

    try:
        return LoraConfig(**meta["lora"])
    except (TypeError, ValueError) as e:
        raise Unreadable(f"{META_FILE}'s lora entry is unreadable ({type(e).__name__}: {e})") from None


def _lora_base(meta: dict, config, params, devices, step_dir: pathlib.Path):
    """The frozen base a LoRA checkpoint's adapters were trained on (checkpoints leave it out): read
    again from the run's `model.path` (model=hf), or built from its `trainer.seed` as train.py built it."""
    import equinox as eqx

    source = meta.get("pretrained")
    if not source:
        return eqx.filter(zoo_model.build(config, key=jax.random.key(int(meta["trainer"]["seed"]))), eqx.is_array)

    base_dir = pathlib.Path(source["path"])
    if (
        not all((base_dir / f).is_file() for f in source.get("weight_files") or [])
        or not (base_dir / "config.json").is_file()
    ):
        raise ConfigError(
            f"{step_dir}: holds LoRA adapters over the base model {base_dir}, which is gone or incomplete; "
            "put the base checkpoint back at that path (checkpoints keep only the adapters)"
        )
    if devices is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, params)
    else:
        shardings = spread_shardings(params, devices)
    try:
        return load_sharded(base_dir, config, shardings)
    except (CheckpointError, ValueError, OSError) as e:
        raise ConfigError(f"{base_dir}: the LoRA base model does not load ({str(e).splitlines()[0]})") from None
