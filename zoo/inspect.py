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
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax._src import core

# Ops that pass a value through unchanged (as far as placement goes).
_ALIAS_OPS = ("reduce_precision", "sharding_constraint", "copy", "copy_p", "optimization_barrier")


@dataclasses.dataclass
class TagRecord:
    """One tag in one forward scan (layer stack)."""

    tag: str
    stack: str
    shape: tuple[int, ...]  # per layer
    dtype: str
    bytes_per_layer: int
    layers: int
    placement: str  # host | device | recomputed | unread
    occurrences: int = 1  # checkpoint_name sites of this tag per layer

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_layer * self.layers

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["total_bytes"] = self.total_bytes
        return d


@dataclasses.dataclass
class OtherResidual:
    """A per-layer output of a forward scan that no tag accounts for: an untagged residual the
    backward pass reads (kept by JAX whatever the policy), or a per-layer primal output."""

    stack: str
    shape: tuple[int, ...]  # per layer
    dtype: str
    memory: str  # host | device
    bytes_per_layer: int
    layers: int
    source: str  # the primitive that produced it inside the layer, or "layer input" / "constant"

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_layer * self.layers

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        d["total_bytes"] = self.total_bytes
        return d


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


def _is_host(aval) -> bool:
    space = getattr(aval, "memory_space", None)
    return space is not None and getattr(space, "name", str(space)).lower() == "host"


def _is_host_put(eqn) -> bool:
    if eqn.primitive.name != "device_put":
        return False
    return any(_is_host(v.aval) for v in eqn.outvars) or any("host" in str(d).lower() for d in eqn.params.get("devices", ()))


def _nbytes(aval) -> int:
    return int(math.prod(aval.shape)) * np.dtype(aval.dtype).itemsize


def _analyse_forward_scan(eqn, stack: str) -> tuple[list[TagRecord], list[OtherResidual], dict[str, int]]:
    """Records for the tags of one forward scan (placement host/device, or None if not a residual)."""
    body = eqn.params["jaxpr"].jaxpr
    layers = int(eqn.params["length"])
    num_carry = int(eqn.params["num_carry"])
    num_consts = int(eqn.params["num_consts"])
    producers = {}
    for e in body.eqns:
        for v in e.outvars:
            producers[v] = e

    # Every var that holds a tag's value: the name's output, what aliases it, and its input chain.
    tag_of_var: dict[Any, str] = {}
    names = _names_in(body)
    sites: dict[str, list] = defaultdict(list)
    for e in names:
        tag = e.params["name"]
        sites[tag].append(e.outvars[0])
        tag_of_var.setdefault(e.outvars[0], tag)
        v = e.invars[0]
        # Walk up through aliasing ops to the value the name was put on (the carry for the layer input).
        while isinstance(v, core.Var):
            tag_of_var.setdefault(v, tag)
            p = producers.get(v)
            if p is None or p.primitive.name not in _ALIAS_OPS:
                break
            v = p.invars[0]
    # Forward closure through aliasing ops and host copies.
    for e in body.eqns:
        if e.primitive.name in _ALIAS_OPS + ("device_put",) and e.invars and isinstance(e.invars[0], core.Var):
            src = tag_of_var.get(e.invars[0])
            if src is not None:
                for v in e.outvars:
                    tag_of_var.setdefault(v, src)

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
        source = p.primitive.name if p is not None else ("layer input" if v in carry_invars else "scan input")
        other.append(
            OtherResidual(stack, tuple(v.aval.shape), str(v.aval.dtype), "host" if on_host else "device", _nbytes(v.aval), layers, source)
        )

    records = []
    for tag, outs in sites.items():
        aval = outs[0].aval
        records.append(
            TagRecord(
                tag=tag,
                stack=stack,
                shape=tuple(aval.shape),
                dtype=str(aval.dtype),
                bytes_per_layer=sum(_nbytes(o.aval) for o in outs),
                layers=layers,
                placement=placement.get(tag, ""),
                occurrences=len(outs),
            )
        )
    return records, other, {"name": stack, "layers": layers}


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
    for r in records:
        if not r.placement:
            r.placement = "recomputed" if r.tag in recomputed else "unread"
    return Placement(records, other, stacks)


def stack_names(model) -> list[str]:
    """Names of a CausalLM's layer stacks in program order (dense prefix, then MoE)."""
    return [n for n in ("dense_layers", "moe_layers") if getattr(model, n, None) is not None]


def inspect_placement(fn: Callable, *args, stacks: Optional[Sequence[str]] = None) -> Placement:
    """Trace `fn(*args)` (arrays or jax.ShapeDtypeStruct) and report where every tag went."""
    return placement_from_jaxpr(jax.make_jaxpr(fn)(*args), stacks)


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
