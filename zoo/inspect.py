"""What went where: per tagged intermediate, read from the program JAX traced.

`inspect_placement(fn, *args)` traces `fn` (a gradient or a whole train step) with `jax.make_jaxpr`
and walks the program, sub-programs included (pjit, remat, custom derivatives, scans):

- forward scans are the `lax.scan`s that run forward (`reverse=False`) and tag intermediates with
  `checkpoint_name`; their per-layer outputs include the residuals the backward pass reads.
- a residual is attributed to a tag when it is the tag's value, possibly through value-preserving
  ops (`reduce_precision`, which JAX inserts for saved names, sharding constraints, copies); when it
  is a `device_put` of such a value, or has a host memory space, it went to `host`, else `device`.
  The layer input is special: the scan keeps its carry, so a residual that is the input of the
  `decoder_layer_input` tag is that tag's value.
- tags whose `checkpoint_name` shows up inside a backward scan (`reverse=True`) and that are not
  residuals were `recomputed`; tags found in neither place are `unread` (the backward pass does
  not read them, or reads a value derived from them that the forward pass kept).

Nothing here reads the offload config: placement is what the program does. `python -m zoo.inspect`
(see `main`) composes the same Hydra config as train.py, builds the same step and prints a table.
"""

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.extend import core

# Ops that pass a value through unchanged (as far as placement goes).
_ALIAS_OPS = ("reduce_precision", "sharding_constraint", "copy", "copy_p", "optimization_barrier")


class _PerLayerRecord:
    """Shared by the records below: bytes per layer times layers, and the JSON form."""

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_layer * self.layers

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["total_bytes"] = self.total_bytes
        return d


@dataclasses.dataclass
class TagRecord(_PerLayerRecord):
    """One tag in one forward scan (layer stack)."""

    tag: str
    stack: str
    shape: tuple[int, ...]  # per layer
    dtype: str
    bytes_per_layer: int
    layers: int
    placement: str  # host | device | recomputed | unread
    occurrences: int = 1  # checkpoint_name sites of this tag per scan step (layers of a repeating period)



@dataclasses.dataclass
class OtherResidual(_PerLayerRecord):
    """A per-layer output of a forward scan that no tag accounts for: an untagged residual the
    backward pass reads (kept by JAX whatever the policy), or a per-layer primal output."""

    stack: str
    shape: tuple[int, ...]  # per layer
    dtype: str
    memory: str  # host | device
    bytes_per_layer: int
    layers: int
    source: str  # the primitive that produced it inside the layer, or "layer input" / "constant"



@dataclasses.dataclass
class Placement:
    records: list[TagRecord]
    other: list[OtherResidual]
    stacks: list[dict]  # {"name", "layers"} per forward scan, in program order

    def by_tag(self) -> dict[str, str]:
        """tag -> placement; a tag placed differently in different stacks maps to "mixed"."""
        out: dict[str, str] = {}
        for r in self.records:
            out[r.tag] = r.placement if out.get(r.tag, r.placement) == r.placement else "mixed"
        return out

    def tags_with(self, placement: str) -> set[str]:
        return {t for t, p in self.by_tag().items() if p == placement}

    def bytes_on(self, placement: str) -> int:
        return sum(r.total_bytes for r in self.records if r.placement == placement)

    def other_bytes(self, memory: str) -> int:
        return sum(o.total_bytes for o in self.other if o.memory == memory)


# --- walking the program ----------------------------------------------------------------------


def _subjaxprs(eqn) -> list:
    return [j.jaxpr if isinstance(j, core.ClosedJaxpr) else j for j in core.jaxprs_in_params(eqn.params)]


def _walk(jaxpr, visit: Callable) -> None:
    for eqn in jaxpr.eqns:
        visit(eqn)
        for sub in _subjaxprs(eqn):
            _walk(sub, visit)


def _names_in(jaxpr) -> list:
    """checkpoint_name equations anywhere inside `jaxpr`, nested scans excluded."""
    found = []

    def rec(j):
        for eqn in j.eqns:
            if eqn.primitive.name == "name":
                found.append(eqn)
            if eqn.primitive.name != "scan":
                for sub in _subjaxprs(eqn):
                    rec(sub)

    rec(jaxpr)
    return found


def _names_by_devices(jaxpr, devices: int = 1) -> list:
    """`(checkpoint_name equation, devices)` for the sites of `_names_in`: a site inside a shard_map
    body holds one device's share, so its value over the mesh is `devices` of them stacked."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.append((eqn, devices))
        if eqn.primitive.name != "scan":
            inner = devices * (int(eqn.params["mesh"].size) if eqn.primitive.name == "shard_map" else 1)
            for sub in _subjaxprs(eqn):
                found += _names_by_devices(sub, inner)
    return found


def _tag_vars(jaxpr) -> dict:
    """Every var of `jaxpr` that holds a tag's value: the name's output, what aliases it, its input
    chain, host copies of it, and the outputs of shard_maps whose body returns a tag's value (the
    residuals of a checkpointed shard_map body leave it that way)."""
    producers = {v: e for e in jaxpr.eqns for v in e.outvars}
    tag_of_var: dict[Any, str] = {}
    for e in _names_in(jaxpr):
        tag = e.params["name"]
        tag_of_var.setdefault(e.outvars[0], tag)
        v = e.invars[0]
        # Walk up through aliasing ops to the value the name was put on (the carry for the layer input).
        while isinstance(v, core.Var):
            tag_of_var.setdefault(v, tag)
            p = producers.get(v)
            if p is None or p.primitive.name not in _ALIAS_OPS:
                break
            v = p.invars[0]
    # Forward closure through aliasing ops, host copies and shard_map boundaries.
    for e in jaxpr.eqns:
        if e.primitive.name in _ALIAS_OPS + ("device_put",) and e.invars and isinstance(e.invars[0], core.Var):
            src = tag_of_var.get(e.invars[0])
            if src is not None:
                for v in e.outvars:
                    tag_of_var.setdefault(v, src)
        elif e.primitive.name == "shard_map":
            body = e.params["jaxpr"]
            inner = _tag_vars(body)
            for outer, v in zip(e.outvars, body.outvars):
                if isinstance(v, core.Var) and v in inner:
                    tag_of_var.setdefault(outer, inner[v])
    return tag_of_var


def _is_host(aval) -> bool:
    space = getattr(aval, "memory_space", None)
    return space is not None and getattr(space, "name", str(space)).lower() == "host"


def _is_host_put(eqn) -> bool:
    if eqn.primitive.name != "device_put":
        return False
    return any(_is_host(v.aval) for v in eqn.outvars) or any("host" in str(d).lower() for d in eqn.params.get("devices", ()))


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _analyse_forward_scan(eqn, stack: str) -> tuple[list[TagRecord], list[OtherResidual], dict]:
    """Records for the tags of one forward scan (placement host/device, or None if not a residual)."""
    body = eqn.params["jaxpr"].jaxpr
    layers = int(eqn.params["length"])
    num_carry = int(eqn.params["num_carry"])
    num_consts = int(eqn.params["num_consts"])
    producers = {v: e for e in body.eqns for v in e.outvars}
    tag_of_var = _tag_vars(body)
    sites: dict[str, list] = defaultdict(list)
    for e, devices in _names_by_devices(body):
        sites[e.params["name"]].append((e.outvars[0].aval, devices))

    placement: dict[str, str] = {}
    other: list[OtherResidual] = []
    invars = body.invars
    carry_invars = set(invars[num_consts : num_consts + num_carry])
    for v in body.outvars[num_carry:]:
        if not isinstance(v, core.Var):
            continue  # a literal: a constant per-layer output
        tag = tag_of_var.get(v)
        p = producers.get(v)
        on_host = _is_host(v.aval) or (p is not None and _is_host_put(p))
        if tag is not None:
            new = "host" if on_host else "device"
            placement[tag] = new if placement.get(tag, new) == new else "host+device"
            continue
        q = p
        while q is not None and q.primitive.name in _ALIAS_OPS and isinstance(q.invars[0], core.Var):
            q = producers.get(q.invars[0])  # name the op that computed it, not JAX's save marker
        source = q.primitive.name if q is not None else ("layer input" if v in carry_invars else "scan input")
        other.append(
            OtherResidual(stack, tuple(v.aval.shape), str(v.aval.dtype), "host" if on_host else "device", _nbytes(v.aval), layers, source)
        )

    records = []
    for tag, outs in sites.items():
        aval, devices = outs[0]
        shape = tuple(aval.shape)
        if devices > 1 and shape:
            shape = (devices * shape[0],) + shape[1:]  # the devices' shares stacked, as the residual leaves the shard_map
        # A scan step runs a period of layers (one block each), so each site is one layer's tag.
        records.append(
            TagRecord(
                tag=tag,
                stack=stack,
                shape=shape,
                dtype=str(aval.dtype),
                bytes_per_layer=sum(_nbytes(a) * n for a, n in outs) // len(outs),
                layers=layers * len(outs),
                placement=placement.get(tag, ""),
                occurrences=len(outs),
            )
        )
    period = max(1, len(sites.get("decoder_layer_input", ())))  # every decoder layer tags its input once
    return records, other, {"name": stack, "layers": layers * period, "scan_length": layers}


def placement_from_jaxpr(closed, stack_names: Optional[Sequence[str]] = None) -> Placement:
    """Placement of every tag in a traced program (a ClosedJaxpr of a gradient or a train step)."""
    forward, backward = [], []

    def visit(eqn):
        if eqn.primitive.name != "scan":
            return
        if not _names_in(eqn.params["jaxpr"].jaxpr):
            return
        (backward if eqn.params["reverse"] else forward).append(eqn)

    _walk(closed.jaxpr, visit)
    if stack_names is not None and len(stack_names) != len(forward):
        stack_names = None
    records, other, stacks = [], [], []
    for i, eqn in enumerate(forward):
        name = stack_names[i] if stack_names is not None else f"scan{i}"
        r, o, s = _analyse_forward_scan(eqn, name)
        records += r
        other += o
        stacks.append(s)
    recomputed = {e.params["name"] for b in backward for e in _names_in(b.params["jaxpr"].jaxpr)}
    # A model cut into pieces (a policy per layer range) names each piece's scans after it
    # (zoo.model.run_layers): the backward scans of a piece tell what that piece recomputes.
    per_scope: dict[str, set] = defaultdict(set)
    if stack_names is not None:
        for b in backward:
            scope = _scope_of(b, stack_names)
            if scope is not None:
                per_scope[scope] |= {e.params["name"] for e in _names_in(b.params["jaxpr"].jaxpr)}
    scopes = [_scope_of(eqn, stack_names) if stack_names is not None else None for eqn in forward]
    by_stack = {}
    if scopes and all(s is not None and s == stack_names[i] for i, s in enumerate(scopes)):
        by_stack = {n: per_scope.get(n, set()) for n in stack_names}
    for r in records:
        if not r.placement:
            found = by_stack.get(r.stack, recomputed)
            r.placement = "recomputed" if r.tag in found else "unread"
    return Placement(records, other, stacks)


def _scope_of(eqn, names: Sequence[str]) -> Optional[str]:
    """The longest of `names` in the equation's name stack (a `jax.named_scope` around it), or None."""
    text = str(eqn.source_info.name_stack)
    hits = [n for n in names if n in text]
    return max(hits, key=len) if hits else None


def stack_names(model) -> list[str]:
    """Names of a CausalLM's layer stacks in program order."""
    return [s.name for s in model.stacks]


def scan_names(model, policy=None) -> list[str]:
    """Names of the forward scans the trainer's step runs, in program order: the stacks', or with a
    policy per layer range (`offload.ranges` of the OffloadConfig `policy`) the pieces' the stacks are
    cut into (`<stack>[<first>-<last>]`)."""
    from zoo.offload import scan_policies

    if policy is None or not policy.ranges:
        return stack_names(model)
    return [name for name, _ in scan_policies(policy, model)]


def inspect_placement(fn: Callable, *args, stacks: Optional[Sequence[str]] = None) -> Placement:
    """Trace `fn(*args)` (arrays or jax.ShapeDtypeStruct) and report where every tag went."""
    return placement_from_jaxpr(jax.make_jaxpr(fn)(*args), stacks)


# --- the optimizer update ---------------------------------------------------------------------


@dataclasses.dataclass
class Buffer:
    """One value of the traced program: its shape, dtype and bytes (per device for a sharded step)."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int

    def as_dict(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "bytes": self.bytes}


def _largest(avals) -> Optional[Buffer]:
    best = max(avals, key=_nbytes, default=None)
    return None if best is None else Buffer(tuple(best.shape), str(best.dtype), _nbytes(best))


_LOOPS = ("scan", "while")
_IN_PLACE = ("dynamic_update_slice",)  # writes a slice into the stacked array it is given


def update_buffers(closed, scope: Optional[str] = None) -> dict:
    """What the optimizer update holds in device memory, read from a traced train step: the ops
    under the step's `UPDATE_SCOPE` name (zoo.train.update) and everything inside them.

    - `layer_loops`: loops over a stack's layers (the streamed update has one per block position
      for the norm and one for the update; the whole-tree update has none);
    - `device_in_loops`: the largest device-space value made inside those loops, the in-place writes
      into the stacked arrays left out (for a streamed update: one layer's largest slice);
    - `device_outside_loops`: the largest device-space value made elsewhere in the update (the
      leaves outside the stacks, or every leaf of a whole-tree update);
    - `moved_to_device`: the largest host -> device transfer in the update.

    Sizes are of the traced values (per device under a sharded step's shardings they are global
    shapes: divide by the ways a leaf is split)."""
    from zoo.train.update import UPDATE_SCOPE

    scope = scope or UPDATE_SCOPE
    found = {"in_loops": [], "outside_loops": [], "moved": [], "loops": 0}

    def record(eqns, in_loop: bool, top: bool):
        for eqn in eqns:
            loop = eqn.primitive.name in _LOOPS
            if top and loop:
                found["loops"] += 1
            subs = _subjaxprs(eqn)
            # Ops with sub-programs (loops, jit, custom derivatives) are counted by what they run.
            if not subs and eqn.primitive.name not in _IN_PLACE:
                device = [v.aval for v in eqn.outvars if hasattr(v.aval, "shape") and not _is_host(v.aval)]
                found["in_loops" if in_loop else "outside_loops"].extend(device)
                if eqn.primitive.name == "device_put" and any(_is_host(v.aval) for v in eqn.invars if hasattr(v, "aval")):
                    found["moved"].extend(device)
            for sub in subs:
                record(sub.eqns, in_loop or loop, top and not loop)

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if scope in str(eqn.source_info.name_stack):
                record([eqn], False, True)
            else:
                for sub in _subjaxprs(eqn):
                    visit(sub)

    visit(closed.jaxpr)
    buffers = {
        "device_in_loops": _largest(found["in_loops"]),
        "device_outside_loops": _largest(found["outside_loops"]),
        "moved_to_device": _largest(found["moved"]),
    }
    return {"layer_loops": found["loops"], **{k: None if b is None else b.as_dict() for k, b in buffers.items()}}


# --- compiled memory --------------------------------------------------------------------------

MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_temp_size_in_bytes",
    "generated_code_size_in_bytes",
)


def memory_analysis(compiled) -> Optional[dict]:
    """The compiled executable's memory analysis as a dict (None where the backend gives none)."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    out = {f: int(getattr(stats, f)) for f in MEMORY_FIELDS if getattr(stats, f, None) is not None}
    peak = getattr(stats, "peak_memory_in_bytes", None)
    out["peak_memory_in_bytes"] = None if peak is None else int(peak)
    return out


def device_peak_bytes(device=None) -> Optional[int]:
    """The device's measured peak memory (bytes in use at the high-water mark), None where the
    backend reports no memory statistics (CPU)."""
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if not stats:
        return None
    return stats.get("peak_bytes_in_use")


# --- the command line -------------------------------------------------------------------------

from zoo.train.cli import EXIT_BAD_INPUT, check_writable  # noqa: E402
EXIT_MISMATCH = 1


@dataclasses.dataclass
class InspectOptions:
    """`inspect.*` keys of `python -m zoo.inspect` (the other arguments are train.py's overrides)."""

    out: Optional[str] = None  # null: outputs/inspect/<date>_<time>/inspect.json (under the current directory)
    # Run one real step to read the device's peak memory, where the backend reports it (not CPU).
    measure: bool = True
    # Exit 1 when a tag is not where the policy says it should be.
    strict: bool = True
    # Print who holds the HBM (the compiled step's largest buffers) even when XLA's estimated peak is
    # within hardware.hbm_bytes (it is printed whenever it is not).
    holders: bool = False


def output_path(explicit: Optional[str], key: str, tool: str, relative: str):
    """Where a tool writes: `explicit`, or `outputs/<tool>/<date>_<time>/<relative>` under the current
    directory (as train.py's Hydra runs go under outputs/). The folder is created and probed now
    (`zoo.train.cli.check_writable`), so an unwritable path is one line before anything compiles."""
    import pathlib
    import time

    path = pathlib.Path(explicit) if explicit else pathlib.Path("outputs") / tool / time.strftime("%Y-%m-%d_%H-%M-%S") / relative
    return check_writable(path, key)


def split_tool_args(argv: Sequence[str], prefix: str, schema: type):
    """Separate `prefix.key=value` arguments (parsed and type-checked into the dataclass `schema`
    through OmegaConf, as Hydra would) from the Hydra overrides."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

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
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from zoo.offload import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=list(overrides))


def run_tool(body: Callable[[], int], tool: str = "python -m zoo.inspect", argv: Sequence[str] = ()) -> int:
    """Run a command-line tool body; bad input -> one `error:` line naming `tool`'s key, exit 2 (zoo.train.cli)."""
    from zoo.train import cli

    return cli.run_tool(body, tool, argv)


def prepare_step(overrides: Sequence[str], cfg=None):
    """Compose (or take the composed `cfg`), validate (one-line errors, nothing compiled) and build
    train.py's Trainer."""
    from zoo.offload import dropped_block_tags, resolve
    from zoo.train.run import prepare
    from zoo.train.step import Trainer

    cfg = compose(overrides) if cfg is None else cfg
    c, plan, devices, _ = prepare(cfg)
    resolve(c.offload, c.model)
    notes = [
        f"offload.block_tags: {t}: this {c.model.family} configuration does not emit it; ignored"
        for t in dropped_block_tags(c.offload, c.model)
    ]
    return c, plan, devices, Trainer(c, plan, devices), notes


def _fmt(b) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b} B"


def _table(rows: list[tuple]) -> str:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def report(c, trainer, placement: Placement, compiled_mem: Optional[dict], measured: Optional[dict], overrides=(), update: Optional[dict] = None) -> dict:
    """inspect.json's content (schema in docs/offload.md: "The inspector"); `update`: `update_buffers`
    of the traced step."""
    from zoo.config import count_params
    from zoo.offload import expected_placement, placement_matches, resolve

    from zoo import model as zoo_model
    from zoo.offload import scan_policies

    expected = expected_placement(c.offload, c.model)
    actions = resolve(c.offload, c.model)
    # Per forward scan, the policy its layers run under (a policy per layer range: offload.ranges).
    scans = dict(scan_policies(c.offload, zoo_model.abstract(c.model)))
    top = c.offload.without_ranges()

    def policy_of(stack: str):
        return scans[stack].config if stack in scans else top

    tags = []
    for r in placement.records:
        policy = policy_of(r.stack)
        want = expected_placement(policy, c.model).get(r.tag)
        d = r.as_dict()
        d["configured"] = resolve(policy, c.model).get(r.tag)
        d["expected"] = want
        d["ok"] = placement_matches(want or "", r.placement)
        tags.append(d)
    found = {r.tag for r in placement.records}
    missing = sorted(set(expected) - found)
    totals = {p: placement.bytes_on(p) for p in ("host", "device", "recomputed", "unread")}
    totals["untagged_device"] = placement.other_bytes("device")
    totals["untagged_host"] = placement.other_bytes("host")
    notes = []
    if any(r.tag == "decoder_layer_input" and t["configured"] == "remat" and r.placement == "device" for r, t in zip(placement.records, tags)):
        notes.append("decoder_layer_input: the checkpointed layer's input is kept by the scan, so remat leaves it on device (offload moves it to host)")
    checkpointed = [r for r in placement.records if policy_of(r.stack).checkpoint]
    if any(r.placement == "unread" for r in checkpointed):
        unread = sorted({r.tag for r in checkpointed if r.placement == "unread"})
        notes.append(f"{', '.join(unread)}: the backward pass never reads it, so there is nothing to keep or recompute")
    weights = sum(o.total_bytes for o in placement.other if o.source == "device_put" and o.memory == "device")
    if weights:
        notes.append(
            f"{_fmt(weights)} of per-layer values moved to the device inside the scan (parameters) are kept for the backward pass: "
            "without a checkpoint every layer's weights stay on device; with params on host use a checkpointing policy, "
            "e.g. offload=[full,params_host]"
        )
    kinds = {
        "params": sorted({s.memory_kind for s in jax.tree.leaves(trainer.param_shardings)}),
        "opt_state": sorted({s.memory_kind for s in jax.tree.leaves(trainer.opt_shardings)}),
    }
    if trainer.lora is not None:  # params are the adapters; the frozen base is state of its own
        kinds["frozen_base"] = sorted({s.memory_kind for s in jax.tree.leaves(trainer.base_shardings)})
    return {
        "schema": "zoo.inspect/1",
        "overrides": list(overrides),
        "model": {"family": c.model.family, "params": count_params(c.model), "num_layers": c.model.num_layers},
        "batch": {
            "batch_size": c.data.batch_size,
            "seq_len": c.data.seq_len,
            "grad_accum": c.trainer.grad_accum,
            "microbatch": trainer.plan.microbatch,
        },
        "policy": {
            "name": c.offload.name,
            "describe": c.offload.describe(),
            "checkpoint": c.offload.checkpoint,
            "actions": actions,
            "params": c.offload.params,
            "opt_state": c.offload.opt_state,
        },
        "state_memory_kinds": kinds,
        "stacks": placement.stacks,
        "ranges": range_sections(c, placement, scans) if c.offload.ranges else None,
        "tags": tags,
        "untagged_residuals": [o.as_dict() for o in placement.other],
        "totals_bytes": totals,
        "compiled_memory": compiled_mem,
        "measured": measured,
        **memory_sections(c, trainer, update),
        "mismatches": [t["tag"] + "@" + t["stack"] for t in tags if not t["ok"]] + [f"{t}: not found in the program" for t in missing],
        "notes": notes,
    }


def range_sections(c, placement: Placement, scans: dict) -> list[dict]:
    """inspect.json's `ranges` (with `offload.ranges`): per consecutive layer segment, where its
    policy comes from (`offload.ranges.<key>` or the top-level `offload`), its preset, its scans, and
    the tags found on host, kept on device, recomputed or unread there."""
    from zoo.offload import layer_policies

    out = []
    for seg in layer_policies(c.offload, c.model.num_layers):
        names = [n for n, p in scans.items() if (p.first, p.stop) == (seg.first, seg.stop)]
        found: dict[str, set] = {k: set() for k in ("host", "device", "recomputed", "unread")}
        for r in placement.records:
            if r.stack in names:
                found.setdefault(r.placement, set()).add(r.tag)
        out.append(
            {
                "layers": f"{seg.first}-{seg.stop - 1}",
                "source": seg.label,
                "preset": seg.config.name,
                "scans": names,
                **{k: sorted(v) for k, v in found.items()},
            }
        )
    return out


def render_ranges(ranges: Optional[list]) -> list[str]:
    """One line per layer segment of `range_sections`."""
    if not ranges:
        return []
    lines = ["per layer range (offload.ranges; the other layers run under the top-level policy):"]
    for r in ranges:
        where = "; ".join(f"{k} {', '.join(r[k])}" for k in ("host", "device", "recomputed", "unread") if r.get(k)) or "no tags found"
        lines.append(f"  layers {r['layers']} ({r['source']}: {r['preset']}, {len(r['scans'])} scan(s)): {where}")
    return lines


def memory_sections(c, trainer, update: Optional[dict]) -> dict:
    """inspect.json's `kernels` (what this machine runs: attention implementation, routed-expert
    kernel, loss chunk) and `update` (`update_buffers`, with whether the update is streamed)."""
    from zoo.train.run import kernels

    out = {"kernels": kernels(c, trainer.plan)}
    if update is not None:
        out["update"] = {"streamed": trainer.layerwise_update, **update}
    return out


def render_memory_sections(rep: dict) -> list[str]:
    k = rep.get("kernels")
    lines = []
    if k:
        lines.append(
            f"kernels: attention {k['attention']}"
            + (f", routed experts {k['moe']}" if k.get("moe") else "")
            + (f", loss over chunks of {k['loss_chunk_size']} positions" if k.get("loss_chunk_size") else ", loss over the whole logits")
        )
    u = rep.get("update")
    if u:

        def buf(b):
            return "none" if b is None else f"{_fmt(b['bytes'])} ({'x'.join(map(str, b['shape']))} {b['dtype']})"

        if u["streamed"]:
            lines.append(
                f"update: streamed over {u['layer_loops']} layer loops; largest device value inside them {buf(u['device_in_loops'])}, "
                f"outside them {buf(u['device_outside_loops'])}; largest host->device move {buf(u['moved_to_device'])}"
            )
        else:
            lines.append(f"update: whole tree on device; largest device value {buf(u['device_outside_loops'])}")
    return lines


def render(rep: dict) -> str:
    rows = [("tag", "stack", "shape/layer", "dtype", "bytes/layer", "layers", "total", "configured", "found", "")]
    for t in rep["tags"]:
        rows.append(
            (
                t["tag"], t["stack"], "x".join(map(str, t["shape"])), t["dtype"], _fmt(t["bytes_per_layer"]), t["layers"],
                _fmt(t["total_bytes"]), t["configured"], t["placement"], "" if t["ok"] else f"MISMATCH (expected {t['expected']})",
            )
        )
    out = [f"policy {rep['policy']['describe']}; params in {', '.join(rep['state_memory_kinds']['params'])}, "
           f"optimizer state in {', '.join(rep['state_memory_kinds']['opt_state'])}"
           + (f"; LoRA: params are the adapters, the frozen base in {', '.join(rep['state_memory_kinds']['frozen_base'])}"
              if "frozen_base" in rep["state_memory_kinds"] else ""), _table(rows)]
    out += render_ranges(rep.get("ranges"))
    tot = rep["totals_bytes"]
    out.append(
        f"tags on host {_fmt(tot['host'])}, kept on device {_fmt(tot['device'])}, recomputed {_fmt(tot['recomputed'])}; "
        f"untagged residuals on device {_fmt(tot['untagged_device'])}, on host {_fmt(tot['untagged_host'])} "
        f"({len(rep['untagged_residuals'])} per-layer outputs)"
    )
    m = rep["compiled_memory"]
    if m:
        out.append(
            "compiled: argument {} output {} temp {} host temp {} (alias {}; estimated peak {})".format(
                _fmt(m.get("argument_size_in_bytes")), _fmt(m.get("output_size_in_bytes")), _fmt(m.get("temp_size_in_bytes")),
                _fmt(m.get("host_temp_size_in_bytes")), _fmt(m.get("alias_size_in_bytes")), _fmt(m.get("estimated_peak_bytes")),
            )
        )
    out += render_memory_sections(rep)
    meas = rep["measured"]
    out.append(
        f"measured peak device memory {_fmt(meas['peak_bytes_in_use'])} ({meas['source']})" if meas
        else "measured peak device memory: n/a (the backend reports no memory statistics)"
    )
    out += [f"note: {n}" for n in rep["notes"]]
    if rep["mismatches"]:
        out.append(f"placement differs from the policy: {', '.join(rep['mismatches'])}")
    return "\n".join(out)


def _state_kind(op_name: str) -> str:
    """`state['params'].embed` -> params; `state['opt_state']...` -> opt_state; `tokens` -> tokens."""
    m = re.match(r"^(\w+)(?:\['(\w+)'\])?", op_name)
    return (m.group(2) or m.group(1)) if m else "other"


def compiled_holders(buffers, compiled_mem: Optional[dict], hbm_bytes: int, top: int = 8) -> dict:
    """Who holds the compiled step's device memory: its arguments by kind (params, opt_state, tokens)
    and their largest leaves, and the largest values of the temp allocation; with XLA's estimated
    peak against `hardware.hbm_bytes` (0: none given)."""
    device = [b for b in buffers if b.memory_space == 0]
    args = sorted((b for b in device if b.kind == "argument"), key=lambda b: -b.bytes)
    by_kind: dict[str, int] = {}
    for b in args:
        k = _state_kind(b.op_name)
        by_kind[k] = by_kind.get(k, 0) + b.bytes
    temp = sorted((b for b in device if b.kind == "temp"), key=lambda b: -b.bytes)
    peak = (compiled_mem or {}).get("estimated_peak_bytes")

    def row(b):
        return {"name": b.name, "bytes": b.bytes, "shape": b.shape, "op_name": b.op_name}

    return {
        "estimated_peak_bytes": peak,
        "hbm_bytes": hbm_bytes,
        "over_budget": bool(hbm_bytes and peak is not None and peak > hbm_bytes),
        "arguments_by_kind": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "largest_arguments": [row(b) for b in args[:top]],
        "temp_bytes": (compiled_mem or {}).get("temp_size_in_bytes"),
        "largest_temp": [row(b) for b in temp[:top]],
    }


def render_holders(h: dict, overrides: Sequence[str] = ()) -> str:
    peak, hbm = h["estimated_peak_bytes"], h["hbm_bytes"]
    against = f"over hardware.hbm_bytes {_fmt(hbm)}" if h["over_budget"] else (f"within hardware.hbm_bytes {_fmt(hbm)}" if hbm else "no hardware.hbm_bytes")
    out = [f"who holds the HBM: the compiled step's buffers, XLA's estimated peak {_fmt(peak)} per device, {against}"]
    kinds = ", ".join(f"{k} {_fmt(v)}" for k, v in h["arguments_by_kind"].items())
    out.append(f"  arguments {_fmt(sum(h['arguments_by_kind'].values()))}: {kinds}")
    # optax's wrappers (inner_states['train'].inner_state[1][0]...) say nothing about the leaf.
    rows = [(re.sub(r"\]\..*?\.(mu|nu)\.", r"].\1.", b["op_name"]) or b["name"], _fmt(b["bytes"]), b["shape"]) for b in h["largest_arguments"]]
    if rows:
        out.append("  largest arguments:")
        out += ["    " + ln for ln in _table(rows).splitlines()]
    if h["largest_temp"]:
        out.append(f"  temporaries {_fmt(h['temp_bytes'])} in all; the largest values (they share that allocation over the step):")
        rows = [(b["name"], _fmt(b["bytes"]), b["shape"], b["op_name"]) for b in h["largest_temp"]]
        out += ["    " + ln for ln in _table(rows).splitlines()]
    if h["over_budget"]:
        args = " ".join(a for a in overrides if not a.startswith(("hydra.run.", "hydra.sweep.")))
        out.append(
            f"  to find what frees the most: python -m zoo.plan {args} plan.holders=true (per-tag offload / remat and state presets, "
            "with the saving of each)"
        )
    return "\n".join(out)


def inspect_step(trainer, measure: bool = True, on_compiled: Optional[Callable] = None, on_buffers: Optional[Callable] = None):
    """Trace, compile and (optionally) run the train step: placement, compiled memory, measured peak.
    `on_compiled(compiled, partitioned_hlo_text)` sees the executable (the text is None on one device);
    `on_buffers(buffers)` its buffer assignment (`zoo.hlo.buffer_assignment`; None where XLA wrote none)."""
    from zoo import hlo
    from zoo import model as zoo_model
    from zoo.train.metrics import compiled_memory, device_memory

    state, tokens = trainer.abstract_state(), trainer.abstract_tokens()
    traced = trainer.jitted_step().trace(state, tokens)
    placement = placement_from_jaxpr(traced.jaxpr, scan_names(zoo_model.abstract(trainer.cfg.model), trainer.cfg.offload))
    compiled, partitioned, assignment = hlo.compile_with_dumps(traced.lower(), partitioned=trainer.mesh.devices.size > 1)
    if on_compiled is not None:
        on_compiled(compiled, partitioned)
    if on_buffers is not None:
        on_buffers(None if assignment is None else hlo.buffer_assignment(assignment, compiled.as_text()))
    compiled_mem = compiled_memory(compiled)
    devices = list(trainer.mesh.devices.flat)
    measured = None
    if measure and device_memory(devices) is not None:
        from zoo.train.data import SyntheticData

        data = SyntheticData(trainer.cfg.data, trainer.cfg.model.vocab_size)
        real_state = trainer.init()
        for step in range(2):
            real_state, m = compiled(real_state, trainer.shard_tokens(data.batch(step)))
            jax.block_until_ready(m)
        mem = device_memory(devices)
        measured = {"peak_bytes_in_use": mem["peak_bytes_in_use"], "bytes_limit": mem["bytes_limit"], "source": "device.memory_stats after 2 steps"}
    return placement, compiled_mem, measured


def main(argv: Optional[Sequence[str]] = None) -> int:
    import json
    import pathlib
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)

    def body() -> int:
        opts, overrides = split_tool_args(argv, "inspect", InspectOptions)
        out = output_path(opts.out, "inspect.out", "inspect", "inspect.json")
        c, plan, devices, trainer, notes = prepare_step(overrides)
        for n in notes:
            print(f"note: {n}")
        from zoo import scale

        seen = {}
        placement, compiled_mem, measured = inspect_step(
            trainer, opts.measure, on_compiled=lambda compiled, text: seen.update(scale=scale.scale_report(trainer, compiled, text)),
            on_buffers=lambda buffers: seen.update(buffers=buffers),
        )
        update = update_buffers(trainer.jitted_step().trace(trainer.abstract_state(), trainer.abstract_tokens()).jaxpr)
        rep = report(c, trainer, placement, compiled_mem, measured, overrides, update)
        rep["scale"] = seen["scale"]
        rep["holders"] = None if seen.get("buffers") is None else compiled_holders(seen["buffers"], compiled_mem, c.hardware.hbm_bytes)
        print(render(rep))
        print(scale.render(rep["scale"]))
        if rep["holders"] and (rep["holders"]["over_budget"] or opts.holders):
            print(render_holders(rep["holders"], overrides))
        out.write_text(json.dumps(rep, indent=2) + "\n")
        print(f"wrote {out}")
        if rep["mismatches"] and opts.strict:
            print(f"error: placement differs from the policy: {', '.join(rep['mismatches'])}", file=sys.stderr)
            return EXIT_MISMATCH
        return 0

    return run_tool(body, "python -m zoo.inspect", argv)


if __name__ == "__main__":
    raise SystemExit(main())
