"""Checks of a loaded training config that need none of its classes (zoo.train.run_config holds those
and calls these): a mesh whose fixed axes cannot split the devices, an expert axis the model or the
batch cannot use, an offload.block_tags kind the model lacks; and the sizes of the dropless
expert-parallel exchange a run's config gives. Each bad input is one ConfigError line naming the key.
"""

import dataclasses
import math
import typing
from typing import Any, Optional, Union

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zoo.errors import ConfigError
from zoo.nn.expert_rounds import round_block
from zoo.nn.moe_dispatch import check_expert_parallel, exchanges_in_rounds
from zoo.sharding import logical_ways


def absent_block_line(message: str, model) -> Optional[str]:
    """For an offload.block_tags.<kind> key refused as it is: the line that matters first, when the
    model has no <kind> blocks (no fix of the tag's action would apply to it)."""
    from zoo.tags import OPTIONAL_KINDS, block_kinds

    parts = message.split(":", 1)[0].split(".")
    if parts[:2] != ["offload", "block_tags"] or len(parts) < 3 or parts[2] not in OPTIONAL_KINDS:
        return None
    kinds = [k for k in block_kinds(model) if k in OPTIONAL_KINDS]
    if parts[2] in kinds:
        return None
    return (
        f"offload.block_tags.{parts[2]}: the {model.family} model has no {parts[2]} blocks (its optional blocks: "
        f"{', '.join(kinds) or 'none'}), so this would be ignored; drop it"
    )


def check_mesh_fits(mesh, devices: int) -> None:
    """A mesh whose fixed axes cannot split the devices: name the option and the axes it fixes (the
    -1 axis only fills what they leave), and how to get enough devices."""
    axes = mesh.axes
    fill = [a for a, n in axes.items() if n == -1]
    fixed = {a: n for a, n in axes.items() if n > 1}
    ways = math.prod(fixed.values())
    if len(fill) != 1 or not fixed or devices % ways == 0:
        return  # resolve_mesh_shape reports the other cases
    import jax

    shown = str(ways) if len(fixed) == 1 else "*".join(f"{a}={n}" for a, n in fixed.items())
    are = f"{devices} is" if devices == 1 else f"{devices} are"
    simulate = -(-8 // ways) * ways  # the smallest multiple of the fixed axes from 8 up
    more = (
        f"on CPU add xla.cpu_devices={simulate} to simulate {simulate} devices"
        if jax.default_backend() == "cpu"
        else f"run on a multiple of {ways} devices"
    )
    other = (
        "use mesh=fsdp, which fits any device count"
        if mesh.name != "fsdp"
        else f"make {' and '.join(f'mesh.{a}' for a in fixed)} divide {devices}"
    )
    raise ConfigError(
        f"mesh.{next(iter(fixed))}: {shown} (mesh={mesh.name}) needs a multiple of {ways} devices, and {are} available "
        f"(mesh.{fill[0]}=-1 only fills what the other axes leave); {more}, or {other}"
    )


def routed_tokens_per_device(c, sizes: dict, microbatch: int) -> int:
    """Tokens one device routes per microbatch: its batch shard's sequences, its context chunk of each."""
    rules, cp = c.mesh.rules, c.mesh.context_parallel
    batch_ways = logical_ways(rules, sizes, "batch")
    context_ways = math.prod(sizes.get(a, 1) for a in ([cp] if isinstance(cp, str) else list(cp or [])))
    return max(1, microbatch // max(1, batch_ways)) * c.data.seq_len // max(1, context_ways)


def exchange_rounds_block(c, sizes: dict, microbatch: int) -> Optional[int]:
    """Rows one device sends one expert shard per round of the dropless expert-parallel exchange
    (zoo.nn.expert_rounds.round_block); None unless the run is dropless and expert-parallel."""
    m = c.model
    if not m.num_moe_layers or not exchanges_in_rounds(m.moe.impl, c.mesh.rules, sizes):
        return None
    ep = logical_ways(c.mesh.rules, sizes, "experts")
    k, experts = m.moe.num_experts_per_tok, m.moe.n_routed_experts
    return round_block(routed_tokens_per_device(c, sizes, microbatch), k, ep, experts // ep, m.moe.exchange_factor)


def check_expert_parallel_line(c, shape, batch_ways: int) -> None:
    """An expert axis the model or the batch cannot use: one line naming the key (see zoo.nn.moe_dispatch)."""
    m, rules = c.model, c.mesh.rules
    try:
        if not m.num_moe_layers:
            check_expert_parallel(0, shape.expert, c.data.batch_size, batch_ways)  # an expert axis > 1 raises
            return
        ep = logical_ways(rules, shape.sizes, "experts")
        check_expert_parallel(
            m.moe.n_routed_experts,
            ep,
            c.data.batch_size,
            batch_ways,
            grad_accum=c.trainer.grad_accum,
            batch_includes_expert=all(
                a in rules.get("batch", []) for a in rules.get("experts", []) if shape.sizes.get(a, 1) > 1
            ),
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def number_as_bool_line(schema: type, node: Any, prefix: str) -> Optional[str]:
    """One line for a boolean field of `schema` that `node` (a group's values, a tool's options) gives a number
    other than 0 or 1: OmegaConf would take `trainer.progress=2` or `inspect.strict=-1` as true, silently;
    None where there is none. Nested sections are walked too."""
    if isinstance(node, DictConfig):
        try:  # the values as given: interpolations unresolved (they are resolved, and checked, by the merge)
            node = OmegaConf.to_container(node, resolve=False)
        except OmegaConfBaseException:
            return None
    if not dataclasses.is_dataclass(schema) or not isinstance(node, dict):
        return None
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in node:
            continue
        value = node[f.name]
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is Union else [hint]
        key = f"{prefix}.{f.name}" if prefix else f.name
        if args == [bool] and isinstance(value, (int, float)) and not isinstance(value, bool) and value not in (0, 1):
            return f"{key}: {value!r} is not a boolean; give true or false"
        nested = next((a for a in args if dataclasses.is_dataclass(a)), None)
        line = number_as_bool_line(nested, value, key) if nested is not None else None
        if line:
            return line
    return None


def known_keys(schema: type, full_key: str) -> list[str]:
    """The field names of the section of `schema` that `full_key` (a dotted key) ends in; [] where no
    section of it has that path."""
    cls = schema
    for part in full_key.split(".")[:-1]:
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if part not in fields:
            return []
        t = fields[part].type
        args = [a for a in getattr(t, "__args__", ()) if dataclasses.is_dataclass(a)]
        cls = args[0] if args else t
    return [f.name for f in dataclasses.fields(cls)] if dataclasses.is_dataclass(cls) else []
