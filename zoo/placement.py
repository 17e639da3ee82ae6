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

Nothing here reads the offload config: placement is what the program does. The tools read it through
this module: `python -m zoo.tools.inspect_step` (the table and the scale report), `zoo.tools.plan` (the placement a
plan's policy produces), `zoo.tools.gpu_lowering`. Also here: the optimizer update's buffers
(`update_buffers`) and the compiled program's memory (`memory_analysis`).
"""

import dataclasses
import math
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.extend import core

from zoo._compat import scan_counts
from zoo.offload import scan_policies
from zoo.train.update import UPDATE_SCOPE

# Ops that pass a value through unchanged (as far as placement goes).
_ALIAS_OPS = ("reduce_precision", "sharding_constraint", "copy", "copy_p", "optimization_barrier")
# Calls whose outputs are their body's outputs, one for one (a tag named inside leaves under its name).
_CALLS_RETURNING_TAGS = ("shard_map", "jit", "pjit")


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
        elif e.primitive.name in _CALLS_RETURNING_TAGS:
            # A shard_map's body, or a jitted function's (a kernel that names its own residuals
            # inside its jit: splash's output and softmax statistics under the attention output's tag).
            body = e.params["jaxpr"]
            body = getattr(body, "jaxpr", body)
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
    return any(_is_host(v.aval) for v in eqn.outvars) or any(
        "host" in str(d).lower() for d in eqn.params.get("devices", ())
    )


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _analyse_forward_scan(eqn, stack: str) -> tuple[list[TagRecord], list[OtherResidual], dict]:
    """Records for the tags of one forward scan (placement host/device, or None if not a residual)."""
    body = eqn.params["jaxpr"].jaxpr
    layers = int(eqn.params["length"])
    num_consts, num_carry = scan_counts(eqn.params)
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
            OtherResidual(
                stack,
                tuple(v.aval.shape),
                str(v.aval.dtype),
                "host" if on_host else "device",
                _nbytes(v.aval),
                layers,
                source,
            )
        )

    records = []
    period = max(1, len(sites.get("decoder_layer_input", ())))  # every decoder layer tags its input once
    for tag, outs in sites.items():
        aval, devices = outs[0]
        shape = tuple(aval.shape)
        if devices > 1 and shape:
            shape = (devices * shape[0],) + shape[
                1:
            ]  # the devices' shares stacked, as the residual leaves the shard_map
        # A scan step runs a period of layers (one block each); a kernel that names its own residuals
        # (splash: output and softmax statistics) gives one layer several sites of a tag.
        emitting = min(len(outs), period)
        records.append(
            TagRecord(
                tag=tag,
                stack=stack,
                shape=shape,
                dtype=str(aval.dtype),
                bytes_per_layer=sum(_nbytes(a) * n for a, n in outs) // emitting,
                layers=layers * emitting,
                placement=placement.get(tag, ""),
                occurrences=len(outs),
            )
        )
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
                if eqn.primitive.name == "device_put" and any(
                    _is_host(v.aval) for v in eqn.invars if hasattr(v, "aval")
                ):
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
